"""tcmalloc under `wde serve` and `wde embed`: the `wde` command starts itself again with the host's tcmalloc in
`LD_PRELOAD` (as vLLM's CPU workers and Intel's PyTorch tuning guide do), once, before anything is imported.

Why: an engine allocates and frees tensors of a new size for every packed batch; glibc's malloc maps and unmaps the
large ones from the kernel each time (page faults on every first touch), tcmalloc keeps them. Measured on a 2-vCPU
Zen 5 (docs/operations.md, "The memory allocator"): int8 offline 5-15% faster, bf16 long texts ~4%, bf16 short texts
within the noise.

`WDE_ALLOCATOR=system` keeps glibc's malloc; `WDE_ALLOCATOR=tcmalloc` (the default) uses tcmalloc where the host has
it (`libtcmalloc_minimal.so.4` or `libtcmalloc.so.4`, e.g. Debian/Ubuntu's `libgoogle-perftools4`) and glibc's malloc
otherwise. A process that already preloads a tcmalloc is left as it is. The Python API (`wde.Engine`) runs in the
caller's process, which only its own `LD_PRELOAD` can change (docs/operations.md).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV = "WDE_ALLOCATOR"
CHOICES = ("tcmalloc", "system")
_STARTED = "_WDE_ALLOCATOR_STARTED"
"""Set in the environment of the restarted process, so it never restarts again (whatever it finds)."""
_COMMANDS = ("serve", "embed")
"""The subcommands that run an engine; `wde validate`, `wde inspect` ... start once, as they are."""
_SEARCHED = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


def find_tcmalloc() -> str | None:
    """The path of the host's tcmalloc (minimal first: no heap profiler), or None."""
    for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
        for folder in (Path(sys.prefix, "lib"), *map(Path, _SEARCHED)):
            if (folder / name).is_file():
                return str(folder / name)
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)  # the loader's cache (ldconfig -p), by soname
        if found:
            return found
    return None


def _preloaded(environ: Mapping[str, str]) -> bool:
    return "tcmalloc" in environ.get("LD_PRELOAD", "")


def in_use() -> str:
    """Which allocator this process runs with: 'tcmalloc' when one is preloaded, else 'system' (for the start-up
    log)."""
    return "tcmalloc" if _preloaded(os.environ) else "system"


def restart_env(environ: dict[str, str], argv: list[str]) -> dict[str, str] | None:
    """The environment to start `argv` (the command line, sys.argv) again with, tcmalloc preloaded; None to go on as
    is: not an engine command, `WDE_ALLOCATOR=system`, already restarted or preloaded, or no tcmalloc on the host.
    Raises ValueError for a `WDE_ALLOCATOR` that is neither choice."""
    choice = environ.get(ENV, "tcmalloc").strip().lower() or "tcmalloc"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {environ[ENV]!r}")
    if choice == "system" or _STARTED in environ or _preloaded(environ) or not any(a in _COMMANDS for a in argv[1:2]):
        return None
    lib = find_tcmalloc()
    if lib is None:
        return None
    preload = " ".join(p for p in (lib, environ.get("LD_PRELOAD", "")) if p)
    # tcmalloc reports each allocation over 1 GiB on stderr (a model's weights): not an event worth a line
    return {**environ, "LD_PRELOAD": preload, _STARTED: "1",
            "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": environ.get("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))}


def restart_with_tcmalloc() -> None:
    """Replace this process by the same command with tcmalloc preloaded, where `restart_env` says so. Called first
    by the `wde` command (`wde.cli.run`), never by the Python API or tests calling `wde.cli.main`."""
    try:
        env = restart_env(dict(os.environ), sys.argv)
    except ValueError as e:
        sys.exit(f"Error: {e}")
    if env is None:
        return
    args = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, args, env)
    except OSError:  # cannot start again (no exec on this platform): run with the system allocator
        return
