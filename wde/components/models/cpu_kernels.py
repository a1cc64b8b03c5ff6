"""Which dtype a mixed-precision CPU model's GEMMs and attention run in: the model's low dtype, or float32 where this
CPU runs float32 faster. Measured once per host on the model's own shapes, then cached.

A CPU that reports native bfloat16 does not always run it faster than float32. On an Intel Xeon with avx512_bf16
and no AMX (family 6 model 207 under KVM, one thread), all-MiniLM-L6-v2's GEMMs ran 84 GFLOP/s in bfloat16 through
oneDNN and 160 in float32 through MKL, and PyTorch's flash attention ran 1.8x faster in float32 than in bfloat16
at 225 tokens (docs/benchmarks.md); on AMX hosts, and on AMD Zen 5 whose avx512_bf16 runs at full width, bfloat16
is 1.7-5x faster. The flags cannot tell these apart, so `auto` times both on the model's shapes: float32 is taken
only when it is clearly faster (`MARGIN`), and it only ever makes the result closer to the float32 model.

- linear layers: the model's distinct (in, out) shapes, `ROWS` tokens, through the path each dtype would take
  (oneDNN prepacked or PyTorch's, `resolve_cpu_linear`). float32 linear layers keep float32 weights, so a model
  whose linear weights would pass `MAX_FLOAT32_BYTES` in float32 keeps its low dtype without measuring.
- attention: the model's own attention backend (`auto`: WDE's packed CPU kernel where it runs) at the model's heads
  and head size, on a short and a long packed sequence group, q/k/v in the low dtype; float32 attention casts q/k/v
  up and its output back (`Float32Attention`), both timed.

Timings run single-threaded (the engine's CPU streams run one thread each), alternated, best of `ROUNDS`, so a
busy neighbour slows both sides alike. The verdict is cached in `$WDE_CACHE_DIR` (default `~/.cache/wde`)
`/cpu_kernels.json`, keyed by CPU model, PyTorch version, the ISA caps in force and the shapes: later starts on
the host read it (no timing, the same numerics every start). `model.params.mixed_precision_kernels` overrides
(`low` or `float32`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from wde.components.cpu_streams import intra_op_threads
from wde.device import cpu_model_name

log = logging.getLogger("wde.models")

MixedKernels = Literal["auto", "low", "float32"]

MARGIN = 1.15
"""float32 is chosen only when the low dtype takes at least this many times float32's time."""

ROWS = 1024
"""Tokens in a timed GEMM (a CPU stream's share of a batch)."""

ROUNDS = 3

MAX_FLOAT32_BYTES = 2 << 30
"""Linear weights above this size in float32 keep the low dtype (a 7B model would need 28 GB in float32)."""

ATTENTION_LENGTHS = ((64, 32), (4, 224))
"""(sequences, length) of the timed attention groups: many short texts, a few long ones."""


def cache_file() -> Path:
    return Path(os.environ.get("WDE_CACHE_DIR") or Path.home() / ".cache" / "wde") / "cpu_kernels.json"


def host_key() -> str:
    """What the verdict depends on besides the shapes: the CPU, PyTorch, and the ISA caps in force."""
    caps = (torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            os.environ.get("ATEN_CPU_CAPABILITY", ""))
    return f"{cpu_model_name()}|torch {torch.__version__}|{'/'.join(caps)}"


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, value: dict[str, Any]) -> None:
    """Best effort: a read-only home only means measuring again next start."""
    path = cache_file()
    try:
        data = _read_cache()
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        log.debug("cannot write %s: %s", path, e)


def best_times(fns: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> dict[str, float]:
    """Each function's best time over `rounds`, the functions alternated, on one thread (the process-wide thread
    count is lowered under the lock CPU streams take for the same, so an engine serving in this process keeps its
    count)."""
    with intra_op_threads(1):
        for fn in fns.values():
            fn()
        best = {name: float("inf") for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        return best


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """An exclusive lock on the cache, across processes (best effort: none where the folder cannot be written)."""
    try:
        path = cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield


Timer = Callable[[dict[str, Callable[[], object]]], dict[str, float]]


def decide(kind: str, shapes: Iterable[tuple[int, ...]], low: torch.dtype,
           candidates: Callable[[], dict[str, Callable[[], object]]], timer: Timer = best_times) -> torch.dtype:
    """float32 when the cached or measured float32 time beats the low dtype's by `MARGIN`, else `low`."""
    key = f"{host_key()}|{kind}|{str(low).removeprefix('torch.')}|{sorted(set(shapes))}"
    with _host_lock():  # engines starting at once on a fresh host (wde embed --workers) measure once and agree
        cached = _read_cache().get(key)
        if isinstance(cached, dict) and {"low", "float32"} <= cached.keys():
            times = cached
        else:
            times = timer(candidates())
            _write_cache(key, {"low": times["low"], "float32": times["float32"]})
    use_float32 = times["low"] >= MARGIN * times["float32"]
    log.info("%s in %s took %.2fx the time of float32 on this CPU (%s): running them in %s", kind,
             str(low).removeprefix("torch."), times["low"] / times["float32"], cache_file(),
             "float32" if use_float32 else str(low).removeprefix("torch."))
    return torch.float32 if use_float32 else low


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    return sorted({(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)})


def linear_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() * size for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())


def linear_dtype(choice: MixedKernels, model: nn.Module, low: torch.dtype, timer: Timer = best_times) -> torch.dtype:
    """The dtype a mixed-precision CPU model's linear layers run in (see the module docstring)."""
    if choice == "low":
        return low
    if choice == "float32":
        return torch.float32
    shapes = linear_shapes(model)
    if not shapes or linear_bytes(model, torch.float32) > MAX_FLOAT32_BYTES:
        return low
    return decide("linear layers", shapes, low, lambda: _linear_candidates(shapes, low), timer)


def _linear_candidates(shapes: list[tuple[int, int]], low: torch.dtype) -> dict[str, Callable[[], object]]:
    from wde.components.models.cpu_linear import PackedLinear, resolve_cpu_linear

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    layers: dict[str, list[tuple[nn.Module, torch.Tensor]]] = {}
    for name, dtype in (("low", low), ("float32", torch.float32)):
        path = resolve_cpu_linear("auto", cpu, dtype)
        layers[name] = []
        for k, n in shapes:
            linear = nn.Linear(k, n, dtype=dtype)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(n, k, generator=g) / k ** 0.5)
            module = PackedLinear(linear, ROWS) if path == "onednn" else linear
            layers[name].append((module, torch.randn(ROWS, k, generator=g).to(dtype)))

    def run(pairs: list[tuple[nn.Module, torch.Tensor]]) -> Callable[[], object]:
        def fn() -> None:
            with torch.no_grad():
                for module, x in pairs:
                    module(x)
        return fn

    return {name: run(pairs) for name, pairs in layers.items()}


def attention_kind(backend: Any | None, causal: bool = False) -> str:
    """The cache's name for an attention timing: of the model's own backend (`attention (auto)`, `attention (auto,
    causal)`), or PyTorch's SDPA where none is given (`attention`)."""
    return "attention" if backend is None else f"attention ({backend.name}{', causal' if causal else ''})"


def attention_dtype(choice: MixedKernels, heads: int, head_dim: int, low: torch.dtype,
                    timer: Timer = best_times, backend: Any | None = None, causal: bool = False) -> torch.dtype:
    """The dtype a mixed-precision CPU model's attention runs in (see the module docstring): `backend` (the model's
    `AttentionBackend`) timed as the model would call it, in the low dtype and through `Float32Attention`; PyTorch's
    SDPA where none is given."""
    if choice == "low":
        return low
    if choice == "float32":
        return torch.float32
    shapes = [(n, heads, length, head_dim) for n, length in ATTENTION_LENGTHS]
    if backend is None:
        return decide(attention_kind(None), shapes, low, lambda: _attention_candidates(shapes, low), timer)
    return decide(attention_kind(backend, causal), shapes, low,
                  lambda: _backend_candidates(backend, shapes, low, causal), timer)


def _attention_candidates(shapes: list[tuple[int, int, int, int]],
                          low: torch.dtype) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(0)
    blocks = [[torch.randn(s, generator=g) for _ in range(3)] for s in shapes]

    def run(dtype: torch.dtype) -> Callable[[], object]:
        tensors = [[t.to(dtype) for t in qkv] for qkv in blocks]

        def fn() -> None:
            for q, k, v in tensors:
                F.scaled_dot_product_attention(q, k, v)
        return fn

    return {"low": run(low), "float32": run(torch.float32)}


def _backend_candidates(backend: Any, shapes: list[tuple[int, int, int, int]], low: torch.dtype,
                        causal: bool) -> dict[str, Callable[[], object]]:
    """The backend over packed groups of `shapes` ((sequences, heads, length, head_dim)): q/k/v in the low dtype,
    as the model's projections give them, run as is and through `Float32Attention` (cast up, output cast back)."""
    from wde.components.model_input_builder import ModelInput

    g = torch.Generator().manual_seed(0)
    groups = []
    for n, heads, length, head_dim in shapes:
        tokens = n * length
        batch = ModelInput(input_ids=torch.zeros(tokens, dtype=torch.long),
                           positions=torch.arange(length).repeat(n),
                           cu_seqlens=torch.arange(0, tokens + 1, length, dtype=torch.int32),
                           seq_lens=[length] * n, max_seqlen=length)
        qkv = [torch.randn(tokens, heads, head_dim, generator=g).to(low) for _ in range(3)]
        groups.append((qkv, backend.build_metadata(batch, causal), head_dim ** -0.5))

    def run(attention: Any) -> Callable[[], object]:
        def fn() -> None:
            with torch.no_grad():
                for (q, k, v), meta, scale in groups:
                    attention.forward(q, k, v, meta, scale)
        return fn

    return {"low": run(backend), "float32": run(Float32Attention(backend))}


class Float32Attention:
    """An attention backend run in float32: q/k/v cast up, the output cast back to their dtype. Everything else
    (metadata, capabilities, name) is the wrapped backend's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any, scale: float) -> torch.Tensor:
        return self.inner.forward(q.float(), k.float(), v.float(), meta, scale).to(q.dtype)

    def __repr__(self) -> str:
        return f"Float32Attention({self.inner!r})"
