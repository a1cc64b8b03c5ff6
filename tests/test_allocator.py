"""`wde serve` and `wde embed` start again with tcmalloc preloaded where the host has it (wde/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wde import allocator
from wde.allocator import find_tcmalloc, restart_env

FAKE = "/opt/fake/libtcmalloc_minimal.so.4"


@pytest.fixture
def fake_tcmalloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: FAKE)


def test_engine_commands_restart_with_tcmalloc_first_in_ld_preload(fake_tcmalloc: None) -> None:
    for command in ("serve", "embed"):
        env = restart_env({"PATH": "/bin", "LD_PRELOAD": "/lib/other.so"}, ["wde", command, "--model", "m"])
        assert env is not None
        assert env["LD_PRELOAD"] == f"{FAKE} /lib/other.so" and env["PATH"] == "/bin"
        assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no stderr line per large tensor
    assert restart_env({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, ["wde", "serve"])[
        "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"  # the user's own setting stays


@pytest.mark.parametrize("environ, argv", [
    ({}, ["wde", "validate", "serve"]),  # not an engine command (serve is an argument here)
    ({}, ["wde"]),
    ({"WDE_ALLOCATOR": "system"}, ["wde", "serve"]),  # asked for glibc's malloc
    ({"WDE_ALLOCATOR": " System "}, ["wde", "serve"]),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, ["wde", "serve"]),  # preloaded already
    ({"_WDE_ALLOCATOR_STARTED": "1"}, ["wde", "serve"]),  # restarted once: never again
], ids=["validate", "no-command", "system", "system-spaced", "preloaded", "restarted"])
def test_no_restart(environ: dict[str, str], argv: list[str], fake_tcmalloc: None) -> None:
    assert restart_env(environ, argv) is None


def test_no_restart_without_tcmalloc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert restart_env({}, ["wde", "serve"]) is None


def test_an_unknown_allocator_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="WDE_ALLOCATOR must be one of tcmalloc, system, got 'jemalloc'"):
        restart_env({"WDE_ALLOCATOR": "jemalloc"}, ["wde", "serve"])
    code = "import sys; sys.argv = ['wde', 'serve']; from wde.allocator import restart_with_tcmalloc; " \
           "restart_with_tcmalloc()"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WDE_ALLOCATOR": "jemalloc"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "Error: WDE_ALLOCATOR must be one of tcmalloc, system, got 'jemalloc'"]


PROBE = ("import sys; sys.argv = ['wde', 'serve']; from wde.allocator import restart_with_tcmalloc, in_use; "
         "restart_with_tcmalloc(); maps = open('/proc/self/maps').read(); print(in_use(), 'libtcmalloc' in maps)")


@pytest.mark.skipif(find_tcmalloc() is None or not os.path.exists("/proc/self/maps"),
                    reason="no tcmalloc on this host (libgoogle-perftools4): the engine runs on glibc's malloc")
@pytest.mark.parametrize("choice, want", [("", "tcmalloc True"), ("system", "system False")])
def test_the_restarted_process_runs_on_tcmalloc(choice: str, want: str) -> None:
    """The process really restarts (same command line, `-c` here) with tcmalloc mapped, once; `system` keeps
    glibc's malloc."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_WDE_ALLOCATOR_STARTED")}
    env["WDE_ALLOCATOR"] = choice
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == want
