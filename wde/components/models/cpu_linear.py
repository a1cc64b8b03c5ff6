"""oneDNN linear layers with prepacked weights for CPU models, and GELU fused into the GEMM that feeds it.

PyTorch's CPU linear goes through MKL, which takes its AVX2 code path on some CPUs (AMD's among them) even where
AVX-512 is there; oneDNN with weights reordered once into its blocked layout runs the same fp32 GEMMs at over
twice the rate on such hosts (benchmarks/cpu_ceiling.py: 481 vs 206 GFLOP/s on a Zen 5; all-MiniLM-L6-v2
end to end 1.95x at a max abs diff of 3e-7). In bfloat16 (where the CPU has avx512_bf16 or AMX) the prepacked
weights save another ~1.2x over PyTorch's own bf16 linear. AVX2-only hosts: see `_ONEDNN_FP32_ON_AVX2`.

`auto` decides from what PyTorch itself detected on the CPU it runs on (`torch.cpu.get_capabilities()`, and
`mkldnn._is_mkldnn_bf16_supported()` for bf16), never from /proc/cpuinfo flags, and a tiny prepacked linear is
run once per dtype before a model is packed: if oneDNN refuses, the model keeps PyTorch's path and one warning
says why.

On AVX-512 hosts packing also fuses an activation into the linear layer before it (oneDNN post-op) where a
module is exactly `dense` + one activation of a kind listed in `_POST_OPS`, and only after the fused module
reproduced the unfused one on a probe input. On AVX2 the post-op is slower than a separate pass (MiniLM's
2000x384x1536 GEMM: 31 ms, 46 ms with the erf-GELU post-op, GELU alone 3 ms; one thread), so it stays off there.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from wde.components.models.activations import GELUActivation, GELUTanh, NewGELUActivation
from wde.components.models.mixed_precision import CastLinear
from wde.components.params import CpuLinear  # the choice lives with ModelParams, torch-free

# Packed batches have a new token count almost every batch, and oneDNN keeps a primitive per shape: with its
# default caches (1,024 entries) a server's RSS grew by ~1 MB per new count (a linear 384x384 over 1,500 random
# counts: 1,116 MiB; with these caps 528 MiB; measured with benchmarks/soak.py's findings). oneDNN and PyTorch read
# them when their first primitive is made, which comes after this import; a value set by the user wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

log = logging.getLogger("wde.models")

ROW_MULTIPLE = 32
"""Every oneDNN GEMM's input (`onednn_linear`, and int8's u8 rows) has its rows rounded up to a multiple of this
(zero rows past the last; their outputs are dropped). oneDNN builds (JIT-compiles) a primitive for each row count it
has not seen, and packed batches rarely repeat a token count. On AVX-512 that is 0.2-0.4 ms a layer (an int8 model's
first pass over a corpus ran 13% slower than its second; MiniLM, Zen 5); AMX's kernels take 2-14 ms to build,
3-6x the GEMM itself (MiniLM's shapes at ~2,000 rows; Intel Xeon with AMX), and with the cache capped at 64
primitives (below) 200 long texts in 21 distinct counts x 4 shapes rebuilt every primitive on every pass: 42% of a
bf16 run. Rounded (`padded_rows`: under 32 rows to 8, 16 or 32 (`SMALL_ROWS`), then to multiples of 32 up to 512,
then to 1/16-1/8 of the count: 1,900 -> 1,920), a (K, N)
shape has at most 8 row counts an octave, at under 1/8 extra rows a GEMM (3-6% on average). Measured there, MiniLM,
200 long texts, bf16, alternated three times: a first pass over them 939-963 ms with rows rounded to 32, 849-892 ms
so (fewer primitives to build); later passes 828-841 against 853-867 ms (the extra rows)."""


SMALL_ROWS = 8
"""Fewer rows than `ROW_MULTIPLE` are rounded up to a power of two from this: 8, 16 or 32 (two more primitives a
shape), so that one short query's GEMMs do not run 32 rows, 4 to 8 times its own (all-MiniLM-L6-v2, one 4-token
input, sync executor, best of 200: int8 4.9-6.4 -> 3.0-3.3 ms an `embed`, bf16 5.6 -> 4.1 ms; Zen 4,
docs/benchmarks.md)."""


def padded_rows(rows: int, multiple: int = ROW_MULTIPLE) -> int:
    """`rows` rounded up to a multiple of `multiple`, and above 16 multiples to 1/16-1/8 of `rows` (a power of two):
    at most 8 row counts an octave, at under 1/8 extra rows; below `multiple`, to a power of two from `SMALL_ROWS`;
    `multiple` 1: `rows`. The rule's one home: int8's kernels (kernels/cpu_ops.cpp) are handed the count it gives."""
    if multiple == 1:
        return rows
    if 0 < rows < multiple:
        return min(multiple, max(SMALL_ROWS, 1 << (rows - 1).bit_length()))
    step = max(multiple, 1 << max(0, rows.bit_length() - 4))
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, dtype: torch.dtype, packed: torch.Tensor, bias: torch.Tensor | None,
                  attr: str = "none", algorithm: str = "") -> torch.Tensor:
    """`x` (cast to `dtype`) times a weight packed by `mkldnn._reorder_linear_weight`, plus bias and a fused
    activation, with the rows rounded up by `padded_rows` for oneDNN and the result cut back to `x`'s rows. The
    cast and the padding are one copy (a cast copies anyway); a row count already rounded goes through as it is,
    and so does `x` whose storage already holds the padded rows past its own (`_padded_in_place`: the output of
    another `onednn_linear`, cut back, as BERT's MLP feeds its down projection), without a copy."""
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k)
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        whole = _padded_in_place(x, padded, dtype)
        if whole is not None:
            x = whole
        else:
            buf = x.new_empty((padded, k), dtype=dtype)
            buf[:rows].copy_(x)
            buf[rows:].zero_()
            x = buf
    out = torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, bias, attr, [], algorithm)
    return out[:rows].view(*lead, out.shape[-1])


def _padded_in_place(x: torch.Tensor, padded: int, dtype: torch.dtype) -> torch.Tensor | None:
    """`x` [rows, k] as `padded` rows over its own storage, where that storage holds them right after `x`'s rows
    (a contiguous row prefix of a larger tensor, such as `onednn_linear`'s own output cut back); else None. What the
    extra rows hold does not matter: a GEMM's output row depends on its input row only, and those rows' outputs
    are dropped (a NaN there stays there). Saves a copy a layer: MiniLM's 2,000 x 1,536 bf16 intermediate took
    0.3 ms to copy, of a 1.5 ms down projection (1.39 -> 1.17 ms; Intel Xeon with AMX, both threads)."""
    if x.dtype != dtype or not x.is_contiguous() or x.dim() != 2:
        return None
    k = x.shape[1]
    if x.untyped_storage().nbytes() < (x.storage_offset() + padded * k) * x.element_size():
        return None
    return x.as_strided((padded, k), (k, 1))


_ONEDNN_FP32_ON_AVX2 = False
"""Whether `auto` prepacks fp32 linears on AVX2-only hosts: no. MiniLM end to end, one thread, CPU time (a
shared host): MKL 1.09x sentence-transformers, oneDNN 1.08x, oneDNN with fused GELU 0.99x (docs/benchmarks.md)."""

_POST_OPS: dict[type[nn.Module], tuple[str, str]] = {
    GELUActivation: ("gelu", "none"),  # erf GELU: hidden_act "gelu" (and "gelu_python", the same function)
    NewGELUActivation: ("gelu", "tanh"),  # "gelu_new": the tanh approximation
    GELUTanh: ("gelu", "tanh"),  # "gelu_pytorch_tanh"
    nn.ReLU: ("relu", ""),
}
"""Activation modules oneDNN can apply as a post-op of the linear before them: (attr, algorithm). `nn.GELU` is
mapped from its `approximate` attribute, and transformers' classes of the same names (a plugin's module may bring
them) by their names, so that this never imports transformers' activations module (wde/components/models/
activations.py says why)."""


_LINEARS = (nn.Linear, CastLinear)
"""The module types `pack_linears` replaces (exactly these: a subclass may compute something else)."""


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_capabilities() -> Mapping[str, Any]:
    """The CPU features PyTorch's kernels may use: what it detected on the CPU it runs on (cpuinfo), less the
    AVX-512 and AMX features when its kernels are capped below AVX-512 (`ATEN_CPU_CAPABILITY=avx2`; oneDNN's own
    cap is `ONEDNN_MAX_CPU_ISA`, read by `onednn_bf16_supported`), so a capped run decides as an AVX2 host does."""
    caps = dict(torch.cpu.get_capabilities())
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        caps.update({k: False for k, v in caps.items() if k.startswith(("avx512", "amx")) and isinstance(v, bool)})
    return caps


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 kernels on this CPU at all (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or ARM bf16)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _onednn_pays(dtype: torch.dtype) -> bool:
    caps = cpu_capabilities()
    if dtype == torch.float32:
        return bool(caps.get("avx512_f")) or (_ONEDNN_FP32_ON_AVX2 and bool(caps.get("avx2")))
    return onednn_bf16_supported() and bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


@functools.cache
def onednn_error(dtype: torch.dtype) -> str | None:
    """None when a tiny prepacked oneDNN linear runs in `dtype` on this CPU, else the first line of its error."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), 4)
        torch.ops.mkldnn._linear_pointwise(torch.ones(4, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def resolve_cpu_linear(choice: CpuLinear, device: torch.device, dtype: torch.dtype) -> Literal["torch", "onednn"]:
    """Which linear path a model uses. `onednn` only for float32 or bfloat16 on a CPU; `auto` picks it for
    float32 on AVX-512 hosts and for bfloat16 on hosts with native bfloat16, as PyTorch detects them, and only
    when oneDNN runs a probe linear (else PyTorch's path, with one warning)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16) or choice == "torch":
        return "torch"
    if choice == "onednn":
        if not onednn_available():
            raise ValueError("model.params.cpu_linear=onednn: this PyTorch build has no oneDNN (mkldnn)")
        error = onednn_error(dtype)
        if error is not None:
            raise ValueError(f"model.params.cpu_linear=onednn: oneDNN cannot run {dtype} linear layers on this CPU"
                             f" ({error}); use cpu_linear: auto or torch")
        return "onednn"
    if not (onednn_available() and _onednn_pays(dtype)):
        return "torch"
    error = onednn_error(dtype)
    if error is not None:
        if (dtype, error) not in _warned:  # once per process: mixed precision's timing probe asks again
            _warned.add((dtype, error))
            log.warning("oneDNN prepacked %s linear layers failed on this CPU (%s); using PyTorch's linear layers",
                        dtype, error)
        return "torch"
    return "onednn"


_warned: set[tuple[torch.dtype, str]] = set()
"""The (dtype, error) pairs already reported by resolve_cpu_linear."""


class PackedLinear(nn.Module):
    """`nn.Linear`'s function with the weight reordered once for oneDNN (sized for `rows`-token batches; any
    number of rows works), optionally followed by a fused activation (`post_op`: oneDNN attr and algorithm).
    The input is cast to the weight's dtype, as `CastLinear` does (a no-op unless the model is mixed precision).
    Inference only: the packed weight is not a parameter."""

    def __init__(self, linear: nn.Linear, rows: int, post_op: tuple[str, str] = ("none", "")) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.post_op = post_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.dtype, self.packed, self.bias, *self.post_op)

    def extra_repr(self) -> str:
        fused = "" if self.post_op[0] == "none" else f", fused {'/'.join(p for p in self.post_op if p)}"
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn{fused}"


def post_op_for(act: nn.Module) -> tuple[str, str] | None:
    """The oneDNN post-op computing `act`, or None when it is not one we fuse."""
    kind = type(act)
    if kind is nn.GELU:
        return ("gelu", "tanh" if act.approximate == "tanh" else "none")
    if kind.__module__ == "transformers.activations":
        return next((op for ours, op in _POST_OPS.items() if ours.__name__ == kind.__name__), None)
    return _POST_OPS.get(kind)


def dense_act_pair(module: nn.Module, linears: tuple[type[nn.Module], ...] = _LINEARS,
                   ) -> tuple[str, tuple[str, str]] | None:
    """(activation attribute, post-op) when `module` is exactly a linear layer (of a type in `linears`) called
    `dense` and one fusible activation (BERT's intermediate block), else None."""
    children = dict(module.named_children())
    if len(children) != 2 or type(children.get("dense")) not in linears:
        return None
    (act_name, act), = ((n, c) for n, c in children.items() if n != "dense")
    post_op = post_op_for(act)
    return None if post_op is None else (act_name, post_op)


def _fuse_activation(module: nn.Module, rows: int) -> bool:
    """Replace `module.dense` + its activation by one `PackedLinear` with the activation as post-op, if the
    module's own forward then gives what it gave before on a probe input; otherwise leave it unfused."""
    pair = dense_act_pair(module)
    if pair is None:
        return False
    act_name, post_op = pair
    dense, act = module.dense, getattr(module, act_name)
    probe = torch.randn(4, dense.in_features, dtype=dense.weight.dtype, generator=torch.Generator().manual_seed(0))
    tol = 1e-4 if dense.weight.dtype == torch.float32 else 2e-2
    with torch.no_grad():
        try:
            before = module(probe)
        except Exception:  # noqa: BLE001 - a forward that is not `act(dense(x))` of one tensor: not ours to fuse
            return False
        module.dense, fused = PackedLinear(dense, rows, post_op), True
        setattr(module, act_name, nn.Identity())
        after = module(probe)
    if after.shape != before.shape or not torch.allclose(after, before, rtol=tol, atol=tol):
        module.dense, fused = dense, False
        setattr(module, act_name, act)
    return fused


def fusion_pays() -> bool:
    """Whether an activation post-op is worth fusing here: on AVX-512 (measured slower on AVX2)."""
    return bool(cpu_capabilities().get("avx512_f"))


def pack_linears(model: nn.Module, rows: int, fuse: bool | None = None) -> int:
    """Replace every `nn.Linear` (or `CastLinear`) under `model` with a `PackedLinear` (with `fuse`, default
    `fusion_pays()`, an activation that follows a `dense` layer becomes its post-op); returns how many linear layers
    were replaced."""
    fuse = fusion_pays() if fuse is None else fuse
    count = 0
    for module in list(model.modules()):
        if fuse and _fuse_activation(module, rows):
            count += 1
        for name, child in list(module.named_children()):
            if type(child) in _LINEARS:
                setattr(module, name, PackedLinear(child, rows))
                count += 1
    return count
