"""int8 linear layers for CPU models (`model.params.quantization: int8`).

Weights are quantized once at load, symmetric, one scale per output channel; activations per token, dynamically
(symmetric: each token's largest magnitude maps to 127). The GEMM is oneDNN's x86 int8 kernel as inductor's x86
quantizer calls it (`torch.ops.onednn.qlinear_pointwise`, u8 x s8 on VNNI): a token's int8 values are shifted to
u8 with zero point 128 (oneDNN's s8-activation path ran at 0.1 GOP/s, a reference kernel), the kernel applies the
weight scales, and the output is scaled per token and the bias added in float32. Measured against the other
candidates in benchmarks/int8_gemm.py (docs/int8.md): per-token `qlinear_pointwise` 2.5-2.7x the float32 oneDNN
linear, `torch._int_mm` 1.9-2.6x, the per-tensor dynamic `quantized.linear_dynamic` 2.8-2.9x at twice the error.

Only the linear layers inside a model's repeated blocks (its `nn.ModuleList`s: attention projections and MLPs) are
quantized; embeddings, norms, attention itself, the pooler and any head stay float32 (`quantize_linears`). Layer
kinds the fidelity gate keeps out of int8 run in bfloat16 where the CPU has it natively (`Bf16Linear`), else float32.

Which CPUs: those whose int8 dot products oneDNN can use, AVX-512 VNNI or AVX-VNNI (and AMX), as PyTorch detected
them (`cpu_capabilities`, which honours `ATEN_CPU_CAPABILITY`) and under oneDNN's own cap (`ONEDNN_MAX_CPU_ISA`),
never /proc/cpuinfo; and, as a measured fallback, CPUs with AVX2 but no VNNI, where oneDNN's u8 x s8 GEMM sums each
adjacent pair of products in 16 bits with saturation (`vpmaddubsw`): there the weights are quantized with each
adjacent pair of input channels bounded to 128 levels together (`int8_dot_products` "pairs", `quantize_weight`), so
no pair can saturate, and the fidelity gate measures what that costs. Elsewhere int8 is refused in one line
(`int8_unsupported`), and probe GEMMs must match before a model is quantized.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from torch import nn

from wde.components.attention.base import AttentionBackend, AttentionMetadata
from wde.components.models.cpu_linear import ROW_MULTIPLE, cpu_capabilities, onednn_linear, padded_rows
from wde.components.models.fused import AddNormLinear, add_layer_norm, cpu_fusable

log = logging.getLogger("wde.models")

SCALE_CORRUPTION = 1.0
"""Test hook: every weight scale is multiplied by this (1.0: none); a test sets it to prove the fidelity gate
refuses a model whose int8 vectors are wrong (tests/test_int8.py)."""

_ONEDNN_BELOW_VNNI = {"SSE41", "AVX", "AVX2", "AVX512_CORE", "DEFAULT_NO_VNNI"}
"""`ONEDNN_MAX_CPU_ISA` values under which oneDNN takes no int8 dot-product instructions."""
_ONEDNN_BELOW_AVX2 = {"SSE41", "AVX"}
"""`ONEDNN_MAX_CPU_ISA` values under which oneDNN's int8 GEMM has not even AVX2's pair sums: int8 is refused."""

PAIR_LEVELS = 128
"""Without VNNI: the most levels two adjacent weights of an output channel take together, |q[2j]| + |q[2j+1]| (255 x
128 = 32,640 fits the 16-bit pair sums of `vpmaddubsw`; 255 x 129 would not)."""


def quantize_weight(w: torch.Tensor, pairs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 weight, float32 scale per row). With `pairs` (CPUs without VNNI:
    `int8_dot_products`), each row's scale is set by its largest adjacent pair, |w[2j]| + |w[2j+1]|, at 127 levels,
    so every rounded pair holds at most `PAIR_LEVELS` (each rounding adds at most half a level) and a u8 activation
    row times it cannot saturate oneDNN's 16-bit pair sums."""
    w = w.detach().float()
    if pairs:
        a = torch.nn.functional.pad(w.abs(), (0, w.shape[1] % 2))
        scale = (a[:, 0::2] + a[:, 1::2]).amax(dim=1).clamp_min(1e-12) / (PAIR_LEVELS - 1)
    else:
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


@functools.cache
def int8_dot_products() -> str | None:
    """How oneDNN's u8 x s8 GEMM takes its dot products here: "vnni" (AVX-512 VNNI, AVX-VNNI or AMX: 32-bit sums),
    "pairs" (AVX2, or AVX-512 without VNNI: adjacent pairs of products summed in 16 bits with saturation), or None
    (neither: oneDNN capped below AVX2, or an older CPU)."""
    caps = cpu_capabilities()
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if (caps.get("avx512_vnni") or caps.get("avx_vnni") or caps.get("amx_int8")) and isa_cap not in _ONEDNN_BELOW_VNNI:
        return "vnni"
    if caps.get("avx2") and isa_cap not in _ONEDNN_BELOW_AVX2:
        return "pairs"
    return None


@functools.cache
def int8_unsupported() -> str | None:
    """None when this CPU runs oneDNN's int8 GEMM (`int8_dot_products`) and its probes match, else why not (one
    clause, for a one-line error)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        return "this PyTorch build has no oneDNN int8 kernels"
    dots = int8_dot_products()
    if dots is None:
        isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
        capped = f", ONEDNN_MAX_CPU_ISA={isa_cap}" if isa_cap else ""
        return (f"PyTorch/oneDNN report neither int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI or AMX) nor"
                f" AVX2 on this CPU (PyTorch kernels: {torch.backends.cpu.get_cpu_capability()}{capped})")
    g = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(8, 64, generator=g)
    try:
        got = Int8Linear(linear, rows=8)(x)
        saturated = pair_saturation() if dots == "pairs" else 0.0
    except RuntimeError as e:
        return f"oneDNN's int8 linear failed on this CPU ({str(e).strip().splitlines()[0] if str(e).strip() else e})"
    want = linear(x).detach()
    if not torch.allclose(got, want, atol=0.05 * float(want.abs().max()), rtol=0):
        return f"oneDNN's int8 linear gave wrong results on this CPU (max abs diff {(got - want).abs().max():.3g})"
    if saturated:
        return (f"oneDNN's int8 GEMM on this CPU (no VNNI) saturates sums that weights bounded per adjacent pair"
                f" keep exact elsewhere (max abs diff {saturated:.0f})")
    return None


def fallback_note() -> str | None:
    """The one line start-up logs where int8 runs without VNNI (`int8_dot_products` "pairs"), else None."""
    if int8_dot_products() != "pairs":
        return None
    return (f"quantization=int8 without int8 dot-product instructions (no VNNI; PyTorch kernels:"
            f" {torch.backends.cpu.get_cpu_capability()}): oneDNN sums adjacent pairs of u8 x s8 products in 16 bits,"
            f" so each adjacent pair of weights is bounded to {PAIR_LEVELS} levels together; the fidelity gate"
            " measures the vectors as on any CPU")


def pair_saturation(k: int = 64) -> float:
    """The largest error of oneDNN's int8 GEMM against exact integer arithmetic on the worst cases `quantize_weight`
    with `pairs` allows: u8 rows of 255 (and of random values) times weights whose adjacent pairs, same-signed, hold
    `PAIR_LEVELS` levels together (split unevenly, and evenly at 64 + 64). 0: none saturated; a kernel that summed
    more than one adjacent pair in 16 bits, or other pairs, would show here."""
    n = 16
    g = torch.Generator().manual_seed(0)
    first = torch.randint(PAIR_LEVELS // 2, 128, (n, k // 2), generator=g)
    first[n // 2:] = PAIR_LEVELS // 2
    sign = torch.where(torch.rand(n, 1, generator=g) < 0.5, -1, 1)
    w = (torch.stack([first, PAIR_LEVELS - first], dim=2).reshape(n, k) * sign).to(torch.int8)
    x = torch.cat([torch.full((4, k), 255, dtype=torch.uint8),
                   torch.randint(0, 256, (12, k), generator=g, dtype=torch.uint8)])
    return gemm_error(x, w)


def gemm_error(x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest difference between oneDNN's int8 GEMM of u8 rows `x` [m, k] and s8 weights `w` [n, k] (unit
    scales, zero points 0) and the exact integer product x @ w^T."""
    n = len(w)
    packed = torch.ops.onednn.qlinear_prepack(w, [len(x), w.shape[1]])
    y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 0, packed, torch.ones(n), torch.zeros(n, dtype=torch.int64), None,
                                           1.0, 0, torch.float32, "none", [], "")
    return float((y.double() - x.double() @ w.double().T).abs().max())


def scheme() -> str:
    """What the activations and weights are quantized as; part of the fidelity gate's cache key (a verdict on another
    scheme is not reused)."""
    pairs = f", s8 weights at {PAIR_LEVELS} levels an adjacent pair" if int8_dot_products() == "pairs" else ""
    return f"u8-asymmetric-per-token{pairs}"

ACTIVATIONS = {("none", ""): 0, ("gelu", "none"): 1, ("gelu", "tanh"): 2, ("relu", ""): 3}
"""The activations an `Int8Linear` applies in its dequantizing pass (`cpu_linear.post_op_for`'s names), by the
kernel's code for them."""


def int8_kernel() -> ModuleType | None:
    """The compiled elementwise kernels (`kernels/cpu_ops.cpp`, `wde.kernels.cpp_build.cpu_ops`), built once per
    host; None where they cannot be, and `Int8Linear` computes the same in PyTorch ops."""
    from wde.kernels.cpp_build import cpu_ops

    return cpu_ops()


def quantize_rows(x: torch.Tensor, factor: torch.Tensor | None, multiple: int = 1,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x * factor` quantized per row, asymmetric: (u8 values, scale, zero point) with `x * factor ~= scale * (q -
    zero)`; the row's range (always holding 0) maps onto 0..255. A row holding a NaN or an infinity gets scale NaN
    (u8 values 0), so the layer's output row is NaN and the engine's non-finite check sees it. The u8 values have
    their rows rounded up to `multiple`, zero past the last (`ROW_MULTIPLE`)."""
    kernel = int8_kernel()
    if kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
        return kernel.quantize_rows(x.contiguous(), factor, padded_rows(len(x), multiple))
    q, scale, zero = _quantize_rows_torch(x, factor)
    return torch.nn.functional.pad(q, (0, 0, 0, padded_rows(len(q), multiple) - len(q))), scale, zero


def _quantize_rows_torch(x: torch.Tensor, factor: torch.Tensor | None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.float() if factor is None else x.float() * factor
    lo, hi = x.amin(1).clamp_max(0), x.amax(1).clamp_min(0)
    scale = torch.where(hi > lo, (hi - lo) / 255, torch.ones_like(hi))
    finite = x.isfinite().all(1)  # a row holding a NaN or an infinity: scale NaN, zero point 0, its output row NaN
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    zero = torch.where(finite, torch.round(-lo / scale).clamp_(0, 255), torch.zeros_like(scale))
    q = torch.round(x / scale[:, None]).add_(zero[:, None]).clamp_(0, 255).nan_to_num_(0).to(torch.uint8)
    return q, scale, zero


def dequantize_rows_(y: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, colsum: torch.Tensor,
                     bias: torch.Tensor | None, act: int) -> torch.Tensor:
    """In place: `y = scale * (y - zero * colsum) + bias` row by row, then activation `act` (`ACTIVATIONS`)."""
    kernel = int8_kernel()
    if kernel is not None:
        return kernel.dequantize_rows_(y, scale, zero, colsum, bias, act)
    y = y.sub_(zero[:, None] * colsum).mul_(scale[:, None])
    if bias is not None:
        y = y.add_(bias)
    if act == 1:
        return torch.nn.functional.gelu(y)
    if act == 2:
        return torch.nn.functional.gelu(y, approximate="tanh")
    return torch.relu_(y) if act == 3 else y


class Int8Linear(AddNormLinear):
    """`nn.Linear`'s function (then, with `post_op`, an activation) with an int8 weight (per output channel)
    prepacked for oneDNN and activations quantized per token at each call; input float32 or bfloat16, output
    float32. Inference only.

    Per call: one pass quantizes the input rows to u8 (`quantize_rows`, SmoothQuant's factor folded in), oneDNN's u8
    x s8 GEMM applies the weight scales (zero point 0: its fast path), one pass in place applies each row's scale and
    zero point, the bias and the activation (`dequantize_rows_`). Asymmetric rows use all 256 levels where a row's
    values are one-sided (GELU's outputs), where symmetric ones would waste half."""

    def __init__(self, linear: nn.Linear, rows: int, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        self.smooth = None if smooth is None else (1 / smooth).float().contiguous()
        if smooth is not None:
            weight = weight * smooth
        qweight, scale = quantize_weight(weight, pairs=int8_dot_products() == "pairs")
        self.w_scale = scale * SCALE_CORRUPTION
        self.colsum = (qweight.sum(1, dtype=torch.int32).float() * self.w_scale).contiguous()
        self.w_zero = torch.zeros(self.out_features, dtype=torch.int64)
        self.packed = torch.ops.onednn.qlinear_prepack(qweight, [rows, self.in_features])
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.post_op: tuple[str, str] = ("none", "")
        self.feeds: Int8Linear | None = None
        """The int8 layer this one's output goes to unchanged (BERT's MLP: up, then down; with `add_layer_norm`, the
        norm's output: the next block's first projection; found by `chain_layers`, set with `feed`): the
        dequantizing pass then quantizes each output row for it too, while the row is in L1."""
        self.out_dtype = torch.float32
        """bfloat16 where `chain_layers` saw the output go straight to an attention with bf16 products (BERT's QKV):
        the dequantizing pass writes it rounded to bf16, as that attention would round it when it reads it."""
        self._handed = threading.local()  # per thread (CPU streams share the layers): the rows handed to this one

    def feed(self, layer: Int8Linear | None) -> None:
        """Set `feeds` (a reference, not a submodule: the layer stays where the model has it)."""
        object.__setattr__(self, "feeds", layer)

    def _gemm(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x's rows quantized (or taken as handed by the layer feeding this one), times the int8 weight: (the GEMM's
        float32 output with the weight scales applied, [rows, out_features], each row's scale and zero point)."""
        if _WATCHING:
            _WATCHING[-1][0](self, x)
        handed, self._handed.rows = getattr(self._handed, "rows", None), None
        if handed is not None and handed[0] is x and handed[1] == _version(x):  # the very tensor, unchanged since
            q, scale, zero = handed[2:]
        else:
            q, scale, zero = quantize_rows(x.reshape(-1, self.in_features), self.smooth, ROW_MULTIPLE)
        y = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, self.packed, self.w_scale, self.w_zero, None, 1.0, 0,
                                               torch.float32, "none", [], "")[:len(scale)]  # the padding's rows dropped
        return y, scale, zero

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
        """`norm(self(x) + residual)` (`AddNormLinear`): the dequantizing pass is the norm's first pass
        (`dequantize_add_layer_norm_`) where the kernel is built and the norm is one `add_layer_norm` fuses; when
        the norm's output goes to another int8 layer (`feeds`: the next block's first projection), that pass also
        quantizes each normed row for it."""
        if self.post_op != ("none", ""):
            return add_layer_norm(self(x), residual, norm)
        y, scale, zero = self._gemm(x)
        shape = (*x.shape[:-1], self.out_features)
        kernel = int8_kernel()
        flat = residual.reshape(-1, self.out_features)
        if kernel is None or not cpu_fusable(y, flat, norm):
            out = add_layer_norm(dequantize_rows_(y, scale, zero, self.colsum, self.bias, 0).view(shape), residual,
                                 norm)
        elif self.feeds is None:
            out = kernel.dequantize_add_layer_norm_(y, scale, zero, self.colsum, self.bias, flat.contiguous(),
                                                    norm.weight, norm.bias, norm.eps).view(shape)
        else:
            rows = kernel.dequantize_add_layer_norm_quantize_(y, scale, zero, self.colsum, self.bias,
                                                              flat.contiguous(), norm.weight, norm.bias, norm.eps,
                                                              self.feeds.smooth, padded_rows(len(y)))
            out = y.view(shape)
            self.feeds._handed.rows = (out, _version(out), *rows)
        if _WATCHING:
            _WATCHING[-1][1](self, out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y, scale, zero = self._gemm(x)
        act = ACTIVATIONS[self.post_op]
        kernel = int8_kernel() if self.feeds is not None or self.out_dtype != torch.float32 else None
        if kernel is None:
            out = dequantize_rows_(y, scale, zero, self.colsum, self.bias, act).reshape(*shape[:-1], self.out_features)
            out = out.to(self.out_dtype)
        elif self.feeds is None:
            out = kernel.dequantize_rows_bf16_(y, scale, zero, self.colsum, self.bias, act)
            out = out.reshape(*shape[:-1], self.out_features)
        else:
            rows = kernel.dequantize_quantize_rows_(y, scale, zero, self.colsum, self.bias, act, self.feeds.smooth,
                                                    padded_rows(len(y)))
            out = y.reshape(*shape[:-1], self.out_features)
            self.feeds._handed.rows = (out, _version(out), *rows)
        if _WATCHING:
            _WATCHING[-1][1](self, out)
        return out

    def extra_repr(self) -> str:
        fused = "" if self.post_op[0] == "none" else f", fused {'/'.join(p for p in self.post_op if p)}"
        out = "" if self.out_dtype == torch.float32 else ", bfloat16 out"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 onednn{fused}{out}"


_WATCHING: list[tuple[Callable[[Int8Linear, torch.Tensor], None], Callable[[Int8Linear, torch.Tensor], None]]] = []
"""While `chain_layers` watches a forward: its (input seen, output made) callbacks, which every int8 layer calls,
however the model calls it (`forward`, or `add_layer_norm`, which module hooks would not see)."""


def _version(x: torch.Tensor) -> int | None:
    """How many times `x` was changed in place (None for inference tensors, which do not count: there
    `chain_layers` has seen the model leave the tensor alone)."""
    return None if x.is_inference() else x._version


SMOOTHING_ALPHA = 0.5
"""SmoothQuant's migration strength: input channel j of a linear layer is divided by
`max|x_j| ** alpha / max|W_j| ** (1 - alpha)` and its weight column multiplied by it, so the outlier channels of
normed activations stop setting every token's scale (all-MiniLM-L6-v2, 300 texts: min cosine 0.980 -> 0.993)."""


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The `nn.Linear` layers inside `model`'s `nn.ModuleList`s (its repeated blocks), by qualified name."""
    found: dict[str, nn.Linear] = {}
    for prefix, blocks in model.named_modules():
        if isinstance(blocks, nn.ModuleList):
            for name, module in blocks.named_modules():
                if type(module) is nn.Linear:
                    found[f"{prefix}.{name}" if prefix else name] = module
    return found


def kind_of(name: str) -> str:
    """A linear layer's name with its block index replaced by `*` (`encoder.layer.*.output.dense`): its kind."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


@contextlib.contextmanager
def input_maxima(linears: dict[str, nn.Linear]) -> Iterator[dict[str, torch.Tensor]]:
    """Collects each layer's largest input magnitude per input channel over the forwards run inside."""
    maxima: dict[str, torch.Tensor] = {}

    def hook(name: str):  # noqa: ANN202
        def record(module: nn.Module, args: tuple, output: object) -> None:
            seen = args[0].detach().float().abs().reshape(-1, module.in_features).amax(0)
            maxima[name] = torch.maximum(maxima[name], seen) if name in maxima else seen
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        yield maxima
    finally:
        for h in handles:
            h.remove()


def smoothing(linear: nn.Linear, maxima: torch.Tensor | None) -> torch.Tensor | None:
    if maxima is None:
        return None
    w = linear.weight.detach().float().abs().amax(0).clamp_min(1e-5)
    return (maxima.clamp_min(1e-5) ** SMOOTHING_ALPHA / w ** (1 - SMOOTHING_ALPHA)).clamp_min(1e-5)


def set_linears(model: nn.Module, linears: dict[str, nn.Module]) -> None:
    """Put each module of `linears` at its qualified name in `model`."""
    for name, module in linears.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)


class Bf16Linear(nn.Module):
    """A layer int8 is too coarse for, in bfloat16 through oneDNN (on CPUs with native bfloat16): float32 in and
    out, bfloat16 weights and GEMM, float32 accumulation."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().bfloat16(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach().bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, torch.bfloat16, self.packed, self.bias).float()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 onednn"


def bf16_pays() -> bool:
    """Whether layers kept out of int8 run in bfloat16: where oneDNN runs bfloat16 natively (as `cpu_linear: auto`
    decides), else they stay float32."""
    from wde.components.models.cpu_linear import resolve_cpu_linear

    return resolve_cpu_linear("auto", torch.device("cpu"), torch.bfloat16) == "onednn"


Activation = tuple[str, nn.Module, tuple[str, str]]
"""A fusible activation after a block linear layer: (its attribute on the parent, the module, the post-op)."""


def fusible_activations(model: nn.Module, originals: dict[str, nn.Linear]) -> dict[str, Activation]:
    """By the qualified name of the linear layer (among `originals`) it follows: each activation an `Int8Linear`
    can apply in its dequantizing pass, where a module is exactly a linear `dense` and one activation (BERT's
    intermediate block, as `cpu_linear` fuses oneDNN post-ops). Found on the float model, before quantizing."""
    from wde.components.models.cpu_linear import dense_act_pair

    found: dict[str, Activation] = {}
    for name, module in model.named_modules():
        pair = dense_act_pair(module, (nn.Linear,))
        dense = f"{name}.dense" if name else "dense"
        if pair is not None and dense in originals and pair[1] in ACTIVATIONS:
            found[dense] = (pair[0], getattr(module, pair[0]), pair[1])
    return found


def chain_layers(model: nn.Module, forward: Callable[[], object], attention: AttentionBackend | None = None) -> int:
    """Set `Int8Linear.feeds` where one int8 layer's output is the next one's input, the same tensor and not changed
    in place in between, as seen in one `forward()` of the quantized model, run here with version counters on (no
    inference mode): BERT's MLP, whose up projection (its GELU fused) feeds the down projection, and each post-norm
    `add_layer_norm` whose output is the next int8 layer's input (the MLP's up projection, the next block's QKV).
    A model's forward takes the same path for every batch; each call still checks that it is handed that very
    tensor (and, outside inference mode, unchanged) and quantizes its input itself otherwise.

    With `attention` (the model's backend) taking bf16 products, a layer whose output is exactly what that backend
    is given as q, k and v (views of it, unchanged: BERT's fused QKV, no rotary in between), in a batch without an
    attention bias (DeBERTa's relative terms read q and k; a biased batch takes no bf16 products), gets `out_dtype`
    bfloat16: the values the attention computes with are the same. Returns how many layers feed another."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    outputs: dict[int, tuple[Int8Linear, torch.Tensor, int]] = {}
    fed: dict[Int8Linear, Int8Linear] = {}
    to_attention: set[Int8Linear] = set()

    def before(layer: Int8Linear, x: torch.Tensor) -> None:
        producer = outputs.get(id(x))
        if producer is not None and producer[1] is x and producer[2] == x._version:
            fed[producer[0]] = layer

    def after(layer: Int8Linear, output: torch.Tensor) -> None:
        outputs[id(output)] = (layer, output, output._version)

    def attended(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        if meta.bias is not None:  # a biased batch goes where bf16 products are not taken (and q/k fed the bias)
            return
        for layer, output, version in outputs.values():
            storage = output.untyped_storage().data_ptr()
            if (output.dtype == torch.float32 and output._version == version and all(
                    t.dtype == torch.float32 and t.untyped_storage().data_ptr() == storage for t in (q, k, v))):
                to_attention.add(layer)

    for layer in layers:
        layer.feed(None)
        layer.out_dtype = torch.float32
    _WATCHING.append((before, after))
    try:
        with torch.inference_mode(False), torch.no_grad(), _watching_attention(attention, attended):
            forward()
    finally:
        _WATCHING.pop()
    for producer, consumer in fed.items():
        producer.feed(consumer)
    for layer in to_attention - fed.keys():
        layer.out_dtype = torch.bfloat16
    return len(fed)


@contextlib.contextmanager
def _watching_attention(attention: AttentionBackend | None,
                        seen: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], None],
                        ) -> Iterator[None]:
    """While inside: `seen(q, k, v, meta)` on each call of `attention.forward` (when it takes bf16 products)."""
    if attention is None or not attention.bf16_products:
        yield
        return
    forward = attention.forward

    def watched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        seen(q, k, v, meta)
        return forward(q, k, v, meta, scale)

    attention.forward = watched  # type: ignore[method-assign]  # this instance only, for this forward
    try:
        yield
    finally:
        del attention.forward


def quantize_linears(model: nn.Module, originals: dict[str, nn.Linear], rows: int,
                     maxima: dict[str, torch.Tensor], keep_float: frozenset[str] = frozenset(),
                     activations: dict[str, Activation] | None = None,
                     built: dict[tuple[str, str], nn.Module] | None = None) -> int:
    """Put an `Int8Linear` of each of `originals` (smoothed by its input `maxima`) in `model`, except for the layers
    named in `keep_float`, which get a `Bf16Linear` where bfloat16 is native (`bf16_pays`), else their float32 layer
    back; an int8 layer followed by one of `activations` (`fusible_activations`) applies it itself, its module
    replaced by `nn.Identity` (and put back when the layer is float). `built`: the layers made by earlier calls
    (the gate's trials), reused rather than quantized and packed again. Returns how many are int8."""
    bf16 = bf16_pays()
    built = {} if built is None else built

    def layer(name: str, linear: nn.Linear) -> nn.Module:
        if name in keep_float and not bf16:
            return linear
        key = (name, "bf16" if name in keep_float else "int8")
        if key not in built:
            built[key] = (Bf16Linear(linear, rows) if key[1] == "bf16"
                          else Int8Linear(linear, rows, smoothing(linear, maxima.get(name))))
        return built[key]

    chosen: dict[str, nn.Module] = {n: layer(n, m) for n, m in originals.items()}
    set_linears(model, chosen)
    for name, (attr, act, post_op) in (activations or {}).items():
        layer = chosen[name]
        parent = model.get_submodule(name.rpartition(".")[0])
        if isinstance(layer, Int8Linear):
            layer.post_op = post_op
            setattr(parent, attr, nn.Identity())
        else:
            setattr(parent, attr, act)
    return sum(isinstance(m, Int8Linear) for m in chosen.values())
