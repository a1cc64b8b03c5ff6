"""Building WDE's C++ CPU kernels (`kernels/*.cpp`, installed as `wde/kernels/`) on the host that runs them.

`build(source, prefix)` compiles one source with the host's C++ compiler (`CXX`, default `c++`; nothing downloaded)
against the running torch's headers into a cache folder (`WDE_KERNEL_CACHE`, default `~/.cache/wde/kernels`), keyed
by the source and the headers beside it (`kernels/*.h`), torch's version and where it is installed (each Python
environment has its own build, so two environments never rebuild each other's), the compiler, the instruction set it
targets and the CPU's flags. Each host and environment compiles each kernel once; later starts load it.

- The instruction set is the host's own (`-march=native`), or AVX2 when `ATEN_CPU_CAPABILITY` caps torch at avx2
  (plain x86-64 for `default`); `-fopenmp`, because `at::parallel_for` is inline: without OpenMP a kernel's tasks all
  run on the calling thread.
- The sources include only the headers they use (ATen's tensor, `at::parallel_for`, torch's pybind11 casters), not
  `torch/extension.h`: parsing that header was most of a build's time.
- `start_builds(names)` starts those kernels' builds in the background (an engine placed on CPU calls it first with
  the kernels its components name, so the compiles run beside each other and beside the model's load); `build`
  waits for the one under way.
- A build holds an OS lock on its folder (`fcntl.flock`): a second process waits for it and then loads what it
  built, and a process killed mid-build leaves nothing that blocks the next (the lock goes with the process; the
  library is written under a temporary name and renamed into place when complete).
- Where a kernel cannot be built (no compiler, no headers, a failed compile) `build` returns None and why, and its
  caller says so in one warning line and takes its pure-PyTorch path.
- `build_kernels()` builds every kernel ahead of a first start, and `kernel_states()` says which are built: the
  `wde kernels build` and `wde kernels status` commands (a container image's build step, a deployment's check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from importlib import resources
from pathlib import Path
from types import ModuleType

import torch

from wde.device import HOST_CPUINFO, cpu_flags

log = logging.getLogger(__name__)

AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
_ISA_FLAGS = {"avx2": AVX2_FLAGS, "default": []}

KERNELS = {
    "cpu_ops": ("cpu_ops.cpp", "wde_cpu_ops", "WDE_CPU_OPS"),
    "cpu_flash": ("cpu_flash_attention.cpp", "wde_cpu_flash", "WDE_CPU_FLASH"),
}
"""Each kernel WDE builds: (source, module prefix, the environment variable that switches it off)."""


def isa_flags() -> list[str]:
    """Compiler flags for the instruction set the kernel targets: the host's own, or torch's cap when one is set."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return _ISA_FLAGS.get(cap, ["-march=native"])


def host_cpu() -> str:
    """The CPU `-march=native` compiles for, as the build key sees it: its flags, else what `platform` says."""
    return " ".join(sorted(cpu_flags(HOST_CPUINFO))) or platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("WDE_KERNEL_CACHE") or Path.home() / ".cache" / "wde" / "kernels")


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def switched_off(switch: str) -> bool:
    return os.environ.get(switch, "1").strip().lower() in ("0", "false", "off", "no")


class _Plan:
    """What one build of `source` is: its module name (prefix + key), folder, library and compile command."""

    def __init__(self, source: str, prefix: str) -> None:
        package = resources.files("wde.kernels")
        self.source = package.joinpath(source)  # (an absolute path stays itself: tests build small sources)
        # the headers the sources include (kernels/*.h, next to them) are part of what is built
        text = b"\0".join([self.source.read_bytes(),
                           *(h.read_bytes() for h in sorted(package.iterdir(), key=lambda f: f.name)
                             if h.name.endswith(".h"))])
        flags = ["-O3", "-fopenmp", *isa_flags()]  # -fopenmp: at::parallel_for (inline) runs on torch's OpenMP threads
        here = Path(torch.__file__).parent  # as torch.utils.cpp_extension's include_paths and library_paths
        includes = [str(here / "include"), str(here / "include" / "torch" / "csrc" / "api" / "include"),
                    sysconfig.get_paths()["include"]]
        self.environment = str(here)
        key = hashlib.sha256(b"\0".join(s.encode() if isinstance(s, str) else s for s in [
            text, torch.__version__, " ".join(flags), host_cpu(), compiler(), self.environment, *includes,
        ])).hexdigest()[:16]
        self.name = f"{prefix}_{key}"
        self.folder = cache_dir() / self.name
        self.library = self.folder / f"{self.name}.so"
        self.args = ["-shared", "-fPIC", "-std=c++20", *flags, f"-DTORCH_EXTENSION_NAME={self.name}",
                     *(a for p in includes for a in ("-isystem", p))]
        self.libs = [f"-L{here / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The folder's build lock, held by one process at a time; the OS releases it when its holder exits or dies."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(plan: _Plan) -> None:
    cxx = compiler()
    if shutil.which(cxx) is None:
        raise FileNotFoundError(f"no C++ compiler {cxx!r} (set CXX)")
    log.info("compiling %s for this CPU into %s: once per host and Python environment", plan.source.name, plan.folder)
    start = time.monotonic()
    for left in plan.folder.glob("*.partial.so"):  # a killed build's (this process holds the folder's lock)
        left.unlink(missing_ok=True)
    partial = plan.folder / f"{plan.name}.{os.getpid()}.partial.so"
    with resources.as_file(plan.source) as path:
        done = subprocess.run([cxx, *plan.args, str(path), "-o", str(partial), *plan.libs], capture_output=True,
                              text=True, errors="replace")
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        lines = [line for line in done.stderr.splitlines() if "error" in line.lower()] or done.stderr.splitlines()
        raise RuntimeError(f"{cxx} exited {done.returncode}: {lines[0].strip() if lines else 'no output'}")
    (plan.folder / "environment").write_text(plan.environment + "\n")  # whose build this is (`_prune`)
    os.replace(partial, plan.library)  # complete or absent: a build killed before this leaves no library
    log.info("compiled %s in %.0f s", plan.source.name, time.monotonic() - start)


def _import(plan: _Plan) -> ModuleType:
    if plan.name in sys.modules:
        return sys.modules[plan.name]
    spec = importlib.util.spec_from_file_location(plan.name, plan.library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[plan.name] = module
    return module


def _prune(plan: _Plan) -> None:
    """Remove the builds of this kernel for Python environments that no longer exist (a deleted venv's), and those
    of the earlier cache layout (no `environment` file), which nothing reads."""
    prefix = plan.name.rsplit("_", 1)[0] + "_"
    for folder in plan.folder.parent.glob(prefix + "*"):
        if folder == plan.folder or not folder.is_dir():
            continue
        recorded = folder / "environment"
        try:
            if recorded.exists() and Path(recorded.read_text().strip()).is_dir():
                continue
            with open(folder / "build.lock", "a") as f:  # not while a process is building it
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # unreadable, or locked by its build
            continue


def _build(plan: _Plan) -> ModuleType:
    with _locked(plan.folder):
        if not plan.library.exists():
            _compile(plan)
            _prune(plan)
    return _import(plan)


_under_way: dict[Path, Future[ModuleType]] = {}
_under_way_lock = threading.Lock()


def start(source: str, prefix: str) -> Future[ModuleType]:
    """The build of `source` (`build`'s arguments), started in a background thread unless one is under way; its
    result is the module, or the exception that stopped it."""
    future: Future[ModuleType] = Future()
    try:
        plan = _Plan(source, prefix)
    except Exception as exc:  # no torch headers, an unreadable source
        future.set_exception(exc)
        return future
    with _under_way_lock:
        if plan.folder in _under_way:
            return _under_way[plan.folder]
        _under_way[plan.folder] = future

    def run() -> None:
        try:
            future.set_result(_build(plan))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on it
            future.set_exception(exc)
        finally:
            with _under_way_lock:
                _under_way.pop(plan.folder, None)

    threading.Thread(target=run, name=f"wde-build-{prefix}", daemon=True).start()
    return future


def start_builds(names: Iterable[str]) -> None:
    """Start the builds of these kernels (`KERNELS` names) in the background, those not switched off: each waits on
    its folder's lock, so a build another process has under way is not repeated, and a built one is only loaded."""
    for name in dict.fromkeys(names):
        source, prefix, switch = KERNELS[name]
        if not switched_off(switch):
            start(source, prefix)


def build(source: str, prefix: str) -> tuple[ModuleType | None, str]:
    """(module, "") with `source` (a file of `wde.kernels`) compiled for this host and loaded, or (None, why) where
    it cannot be built."""
    try:
        return start(source, prefix).result(), ""
    except Exception as exc:  # no compiler, no headers, a failed build: the caller's pure-torch path still serves
        detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {detail}"


def load(source: str, prefix: str, switch: str, what: str, instead: str) -> ModuleType | None:
    """`build(source, prefix)` unless the environment variable `switch` is 0/false/off/no; None, said in one
    warning line ("{what} switched off" / "{what} not built", then what runs `instead`), where it is switched off or
    cannot be built. Callers cache it (`functools.cache`) so the line comes once."""
    if switched_off(switch):
        log.warning("%s switched off (%s=0); %s", what, switch, instead)
        return None
    module, why = build(source, prefix)
    if module is None:
        log.warning("%s not built (%s); %s", what, why, instead)
    return module


@dataclasses.dataclass(frozen=True)
class KernelState:
    """One kernel as this host and Python environment would load it (`wde kernels status`)."""

    name: str
    source: str
    built: bool
    """Its library is in the cache: a start loads it without compiling."""
    switched_off: bool
    """Its environment variable (`switch`) is 0/false/off/no: nothing loads or builds it."""
    switch: str
    folder: str
    compiler: str
    isa: str
    """The compiler's instruction-set flags (`-march=native`, or torch's cap)."""


def kernel_states() -> list[KernelState]:
    """Every kernel of `KERNELS`, and whether this host and environment have it built. Reads the cache only."""
    states = []
    for name, (source, prefix, switch) in KERNELS.items():
        plan = _Plan(source, prefix)
        states.append(KernelState(name, plan.source.name, plan.library.exists(), switched_off(switch), switch,
                                  str(plan.folder), compiler(), " ".join(isa_flags())))
    return states


@dataclasses.dataclass(frozen=True)
class Built:
    """What `build_kernels` did for one kernel."""

    state: KernelState
    seconds: float | None
    """How long this call waited for its build (compiling, or another process's build under way); None where it was
    built already, switched off or failed."""
    error: str = ""
    """Why it could not be built ("" where it was)."""


def build_kernels() -> list[Built]:
    """Build every kernel not switched off for this host and Python environment, all at once, as an engine's first
    start would (`wde kernels build`), so that start compiles nothing. A kernel already built is only loaded."""
    states = kernel_states()
    start_builds(s.name for s in states if not s.built)
    started = time.monotonic()
    done = []
    for state in states:
        if state.switched_off:
            done.append(Built(state, None))
            continue
        source, prefix, _ = KERNELS[state.name]
        module, why = build(source, prefix)
        seconds = None if state.built or module is None else time.monotonic() - started
        done.append(Built(dataclasses.replace(state, built=module is not None), seconds, why))
    return done


@functools.cache
def cpu_ops() -> ModuleType | None:
    """`kernels/cpu_ops.cpp` (add + LayerNorm, the int8 layer's passes) built for this host; None (said once) where
    it cannot be built or `WDE_CPU_OPS=0` switches it off: its callers then take their PyTorch paths, which compute
    the same, slower."""
    source, prefix, switch = KERNELS["cpu_ops"]
    return load(source, prefix, switch, "cpu_ops: C++ kernels", "PyTorch ops run instead")
