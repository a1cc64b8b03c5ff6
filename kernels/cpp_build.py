"""Building WDE's C++ CPU kernels (`kernels/*.cpp`, installed as `wde/kernels/`) on the host that runs them.

`build(source, what)` compiles one source with `torch.utils.cpp_extension` (gcc and ninja, nothing downloaded) into a
cache folder (`WDE_KERNEL_CACHE`, default `~/.cache/wde/kernels`), keyed by the source and the headers beside it
(`kernels/*.h`), torch's version, the instruction set it targets and the CPU's flags, with `-fopenmp`
(`at::parallel_for` is inline: without OpenMP a kernel's tasks all run on the calling thread), so each host compiles
each kernel once (about 30 s) and later starts load it. The instruction set is the host's own (`-march=native`), or
AVX2 when `ATEN_CPU_CAPABILITY` caps torch at avx2 (plain x86-64 for `default`). Where a kernel cannot be built (no
compiler, no headers) it returns None and its caller says so in one warning line and takes its pure-PyTorch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from importlib import resources
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_ISA_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"], "default": []}


def isa_flags() -> list[str]:
    """Compiler flags for the instruction set the kernel targets: the host's own, or torch's cap when one is set."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return _ISA_FLAGS.get(cap, ["-march=native"])


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("WDE_KERNEL_CACHE") or Path.home() / ".cache" / "wde" / "kernels")


def build(source: str, prefix: str) -> tuple[ModuleType | None, str]:
    """(module, "") with `source` (a file of `wde.kernels`) compiled for this host and loaded, or (None, why) where
    it cannot be built."""
    package = resources.files("wde.kernels")
    src = package.joinpath(source)
    # the headers the sources include (kernels/*.h, next to them) are part of what is built
    text = b"\0".join([src.read_bytes(), *(h.read_bytes() for h in sorted(package.iterdir(), key=lambda f: f.name)
                                           if h.name.endswith(".h"))])
    flags = ["-O3", "-fopenmp", *isa_flags()]  # -fopenmp: at::parallel_for (inline) runs on torch's OpenMP threads
    key = hashlib.sha256(b"\0".join([text, torch.__version__.encode(), " ".join(flags).encode(),
                                     cpu_flags().encode()])).hexdigest()[:16]
    name = f"{prefix}_{key}"
    folder = cache_dir() / name
    try:
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the ninja wheel (a dependency) when its venv's bin/ is not on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        folder.mkdir(parents=True, exist_ok=True)
        with resources.as_file(src) as path:
            return load(name, [str(path)], extra_cflags=flags, build_directory=str(folder), verbose=False), ""
    except Exception as exc:  # no compiler, no headers, a failed build: the caller's pure-torch path still serves
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {detail}"


def load(source: str, prefix: str, switch: str, what: str, instead: str) -> ModuleType | None:
    """`build(source, prefix)` unless the environment variable `switch` is 0/false/off/no; None, said in one
    warning line ("{what} switched off" / "{what} not built", then what runs `instead`), where it is switched off or
    cannot be built. Callers cache it (`functools.cache`) so the line comes once."""
    if os.environ.get(switch, "1").strip().lower() in ("0", "false", "off", "no"):
        log.warning("%s switched off (%s=0); %s", what, switch, instead)
        return None
    module, why = build(source, prefix)
    if module is None:
        log.warning("%s not built (%s); %s", what, why, instead)
    return module


@functools.cache
def cpu_ops() -> ModuleType | None:
    """`kernels/cpu_ops.cpp` (add + LayerNorm, the int8 layer's passes) built for this host; None (said once) where
    it cannot be built or `WDE_CPU_OPS=0` switches it off: its callers then take their PyTorch paths, which compute
    the same, slower."""
    return load("cpu_ops.cpp", "wde_cpu_ops", "WDE_CPU_OPS", "cpu_ops: C++ kernels", "PyTorch ops run instead")
