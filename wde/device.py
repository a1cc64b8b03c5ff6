"""The default device, decided once: components that size themselves for the hardware ask here."""

from __future__ import annotations

import functools
import logging
import os

import torch


@functools.cache
def default_device() -> torch.device:
    """`WDE_DEVICE` when set (e.g. "cpu" to keep a GPU machine's runs on CPU), else cuda when present, else cpu."""
    forced = os.environ.get("WDE_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


HOST_CPUINFO = "/proc/cpuinfo"
"""The host's own CPU description (Linux)."""
CPUINFO_PATH = HOST_CPUINFO
"""Where the CPU's feature flags are read from by default; tests point it at a fake file."""

FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 flags that give native bfloat16 dot products (AVX512-BF16 on Zen 4+ / Cooper Lake+, AMX on Sapphire Rapids+)."""


def _cpuinfo(*keys: str, path: str | None = None) -> str | None:
    """The value of the first line of /proc/cpuinfo (or `path`) whose key is one of `keys` (the first CPU's); None
    when absent or unreadable."""
    try:
        with open(path or CPUINFO_PATH, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in keys:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags(path: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in `path` (default `CPUINFO_PATH`): its `flags` line, or `Features` on
    ARM; empty when unreadable. The one reader of them, read once per path (a test's fake file is another path). What
    the compiler's `-march=native` targets (the kernels' build key, `auto` attention) asks for `HOST_CPUINFO`, the
    real CPU whatever a test pretends; the bf16 advice reads `CPUINFO_PATH`."""
    return _flags_in(path or CPUINFO_PATH)


@functools.cache
def _flags_in(path: str) -> frozenset[str]:
    return frozenset((_cpuinfo("flags", "Features", path=path) or "").split())


def cpu_model_name() -> str:
    """The first CPU's model name from /proc/cpuinfo, else what `platform.processor()` says (may be empty)."""
    import platform

    return _cpuinfo("model name") or platform.processor() or ""


def cpu_has_fast_bf16() -> bool:
    """True when this CPU computes bfloat16 dot products natively (avx512_bf16 or amx_bf16): a CPU model in
    bfloat16 then runs its GEMMs at up to twice the fp32 FMA rate (AMX: more) instead of emulating them."""
    return any(flag in cpu_flags() for flag in FAST_BF16_FLAGS)


_bf16_hint_logged = False


def suggest_cpu_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    """Log, once per process, an INFO line when a model is built in float32 on a CPU with native bfloat16.
    Returns whether it logged."""
    global _bf16_hint_logged
    if _bf16_hint_logged or device.type != "cpu" or dtype != torch.float32 or not cpu_has_fast_bf16():
        return False
    _bf16_hint_logged = True
    flags = "/".join(f for f in FAST_BF16_FLAGS if f in cpu_flags())
    logging.getLogger("wde.device").info(
        "this CPU has native bfloat16 (%s) and the model runs in float32: --set model.params.dtype=bfloat16"
        " (Python: dtype=\"bfloat16\") is usually much faster (pure bf16: 2.5x for all-MiniLM-L6-v2 on Zen 5); the"
        " CPU's default mixed precision keeps the vectors at a cosine of 0.9999 or more to float32 (docs/benchmarks.md)",
        flags)
    return True


_emulated_bf16_warned = False


def warn_emulated_cpu_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    """Log, once per process, a WARNING when a model is built in bfloat16 on an x86 CPU without native bfloat16,
    where PyTorch emulates the bf16 matmuls. Returns whether it logged."""
    global _emulated_bf16_warned
    if _emulated_bf16_warned or device.type != "cpu" or dtype != torch.bfloat16:
        return False  # checked first: every model build calls this, and only these read /proc/cpuinfo
    if "sse2" not in cpu_flags() or cpu_has_fast_bf16():
        return False  # ARM lists its bf16 support differently: no claim made there
    _emulated_bf16_warned = True
    logging.getLogger("wde.device").warning(
        "this CPU has no native bfloat16 (no %s): PyTorch emulates the model's bf16 matmuls, which is slower than"
        " float32 (all-MiniLM-L6-v2: 5.3x on an AVX2 Zen 3); drop model.params.dtype=bfloat16 here"
        " (docs/operations.md)", " or ".join(FAST_BF16_FLAGS))
    return True
