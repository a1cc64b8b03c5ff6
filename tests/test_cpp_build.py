"""Building the C++ CPU kernels (`wde.kernels.cpp_build`): one build per host and Python environment, shared by the
processes that start together, never blocked by a build that was killed, and started by an engine for the kernels
its components call. The builds here compile a small module (one function, Python's C API only) into a temporary
cache, so they take about a second; the kernels' own builds are covered by tests/test_cpu_ops.py and
tests/test_cpu_flash_attention.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from wde import device
from wde.engine import cpu_kernels
from wde.kernels import cpp_build
from wde.workflow import load_workflow

ROOT = Path(__file__).resolve().parents[1]
SMALL = """
#include <Python.h>
#define NAME_(x) #x
#define NAME(x) NAME_(x)
#define INIT_(x) PyInit_##x
#define INIT(x) INIT_(x)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&def); }
"""
needs_compiler = pytest.mark.skipif(shutil.which(cpp_build.compiler()) is None, reason="no C++ compiler here")

BUILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from wde.kernels import cpp_build
module, why = cpp_build.build(sys.argv[1], "wde_test_small")
print("answer", module.answer() if module else why, flush=True)
"""


def builder(source: Path, cache: Path, cxx: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "WDE_KERNEL_CACHE": str(cache), "PYTHONPATH": str(ROOT), "CXX": cxx or cpp_build.compiler()}
    return subprocess.Popen([sys.executable, "-c", BUILD, str(source)], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    source = tmp_path / "small.cpp"
    source.write_text(SMALL)
    return source


@needs_compiler
def test_a_build_killed_midway_leaves_nothing_that_blocks_the_next(small: Path, tmp_path: Path) -> None:
    """The failure seen in CI with torch.utils.cpp_extension: a `wde serve` killed while it compiled left its lock
    file, and every later start waited on it for ever. Here the first build is killed (with its compiler) while the
    compiler runs; the next one builds and loads."""
    cache = tmp_path / "cache"
    cxx = tmp_path / "slow-c++"  # the compiler, started 3 s late: the kill lands while it runs
    cxx.write_text(f"#!/bin/sh\nsleep 3\nexec {shutil.which(cpp_build.compiler())} \"$@\"\n")
    cxx.chmod(0o755)
    first = builder(small, cache, str(cxx))
    deadline = time.monotonic() + 120
    while not any(cache.glob("*/build.lock")):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0]
        time.sleep(0.05)
    time.sleep(1.0)
    assert first.poll() is None, "the build ended before it could be killed"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    libraries = [p for p in cache.glob("*/*.so") if not p.name.endswith(".partial.so")]
    assert not libraries, "a library was in place before its compile completed"
    second = builder(small, cache, str(cxx))
    out = second.communicate(timeout=300)[0]
    assert second.returncode == 0 and "answer 42" in out, out
    assert "compiling small.cpp for this CPU" in out  # built anew: the killed one left no library
    assert [p.name for p in cache.glob("*/*.so")] == [f"{p.parent.name}.so" for p in cache.glob("*/*.so")]  # the
    # killed build's partial library removed by the next


@needs_compiler
def test_processes_that_start_together_build_once(small: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    procs = [builder(small, cache) for _ in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 and "answer 42" in out for p, out in zip(procs, outs)), outs
    assert sum(out.count("compiling small.cpp") for out in outs) == 1, outs
    later = builder(small, cache).communicate(timeout=120)[0]
    assert "answer 42" in later and "compiling" not in later


def test_a_failed_compile_says_why_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("int f() { return missing_name; }\n")
    monkeypatch.setenv("WDE_KERNEL_CACHE", str(tmp_path / "cache"))
    if shutil.which(cpp_build.compiler()) is not None:
        module, why = cpp_build.build(str(broken), "wde_test_broken")
        assert module is None and why.startswith("RuntimeError: ") and "\n" not in why and "missing_name" in why
    missing = str(tmp_path / "no-such-c++")
    monkeypatch.setenv("CXX", missing)
    module, why = cpp_build.build(str(broken), "wde_test_broken")
    assert module is None and why == f"FileNotFoundError: no C++ compiler {missing!r} (set CXX)"


def test_each_python_environment_builds_its_own(small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two environments (two venvs' torch) never share a folder, so neither rebuilds the other's: torch's own
    builder rewrote one folder's build file with each venv's paths and recompiled (tens of times in one CI run)."""
    monkeypatch.setenv("WDE_KERNEL_CACHE", str(tmp_path))
    here = cpp_build._Plan(str(small), "wde_test_small")
    assert here.environment == str(Path(torch.__file__).parent)
    assert f"-L{Path(torch.__file__).parent / 'lib'}" in here.libs
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    there = cpp_build._Plan(str(small), "wde_test_small")
    assert there.folder != here.folder and there.folder.parent == here.folder.parent
    assert str(tmp_path / "other-venv" / "torch" / "include") in there.args
    other_isa = "default" if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" else "avx2"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", other_isa)  # and each instruction set its own
    assert cpp_build._Plan(str(small), "wde_test_small").folder not in (here.folder, there.folder)


def test_a_new_build_removes_those_of_environments_that_are_gone(small: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("WDE_KERNEL_CACHE", str(cache))
    plan = cpp_build._Plan(str(small), "wde_test_small")
    live, gone, old = (cache / f"wde_test_small_{n}" for n in ("live", "gone", "old"))
    other = cache / "wde_cpu_ops_gone"  # another kernel's: left to its own builds
    for folder, env in ((live, tmp_path), (gone, tmp_path / "deleted-venv"), (old, None), (other, tmp_path / "x")):
        folder.mkdir(parents=True)
        (folder / "lib.so").write_text("")
        if env is not None:
            (folder / "environment").write_text(f"{env}\n")
    cpp_build._prune(plan)
    assert sorted(p.name for p in cache.iterdir()) == ["wde_cpu_ops_gone", "wde_test_small_live"]


def test_an_engine_starts_the_builds_of_the_kernels_its_components_call() -> None:
    assert cpu_kernels(load_workflow("bert")) == ["cpu_flash", "cpu_ops"]  # auto attention; post-norm blocks
    assert cpu_kernels(load_workflow("bert", ["attention.name=torch_sdpa"])) == ["cpu_ops"]
    # a decoder: add + RMSNorm, rotary and SiLU * up
    assert cpu_kernels(load_workflow("gte_qwen2")) == ["cpu_flash", "cpu_ops"]
    assert cpu_kernels(load_workflow("gte_qwen2", ["model.params.quantization=int8"])) == ["cpu_flash", "cpu_ops"]
    assert cpu_kernels(load_workflow("gte_qwen2", ["attention.name=cpu_varlen"])) == ["cpu_ops"]


def test_start_builds_skips_what_is_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    monkeypatch.setattr(cpp_build, "start", lambda source, prefix: started.append(prefix))
    monkeypatch.setenv("WDE_CPU_OPS", "0")
    cpp_build.start_builds(["cpu_ops", "cpu_flash", "cpu_flash"])
    assert started == ["wde_cpu_flash"]


def test_the_kernels_include_only_the_headers_they_use() -> None:
    """torch/extension.h (the whole C++ frontend, then torch's Python bindings) took most of a build's time."""
    for source in ("cpu_ops.cpp", "cpu_flash_attention.cpp"):
        text = (ROOT / "kernels" / source).read_text()
        assert "#include <torch/extension.h>" not in text and "#include <torch/csrc/utils/pybind.h>" in text


def kernels_cli(*args: str) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from wde.cli import main

    result = CliRunner().invoke(main, ["kernels", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@needs_compiler
def test_wde_kernels_build_ahead_of_a_first_start_then_status(small: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`wde kernels build` compiles every kernel (here two small ones standing for cpu_ops and cpu_flash) into the
    cache a start loads from; a second run and `status` find them built; a switched-off kernel is said so."""
    monkeypatch.setenv("WDE_KERNEL_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other.cpp"
    other.write_text(SMALL.replace("42", "7"))
    monkeypatch.setattr(cpp_build, "KERNELS", {"one": (str(small), "wde_test_one", "WDE_TEST_ONE"),
                                               "two": (str(other), "wde_test_two", "WDE_TEST_TWO")})
    code, out, err = kernels_cli("status", "--check")
    assert code == 1 and "one (small.cpp): not built" in out and "two (other.cpp): not built" in out
    assert err.strip() == "wde kernels status: not built: one, two (run `wde kernels build`)"
    code, out, err = kernels_cli("build")
    assert code == 0, err
    assert err.strip() == "compiling one, two for this CPU (once per host and Python environment)..."
    lines = out.splitlines()
    assert len(lines) == 2 and all(re.fullmatch(r"(one \(small|two \(other)\.cpp\): built in \d+ s: .+", line)
                                   for line in lines), out
    for line, (source, prefix, _) in zip(lines, cpp_build.KERNELS.values()):
        module, why = cpp_build.build(source, prefix)  # what a start would load: the very folder built above
        assert module is not None and line.endswith(str(Path(module.__file__).parent)), (line, why)
    assert cpp_build.build(str(other), "wde_test_two")[0].answer() == 7
    code, out, err = kernels_cli("build", "--format", "json")
    report = json.loads(out)
    assert code == 0 and [(k["name"], k["built"], k["seconds"], k["error"]) for k in report] == [
        ("one", True, None, ""), ("two", True, None, "")] and err == ""  # already built: nothing compiled
    code, out, err = kernels_cli("status", "--check", "--format", "json")
    assert code == 0 and [k["built"] for k in json.loads(out)] == [True, True]
    monkeypatch.setenv("WDE_TEST_TWO", "0")
    code, out, _ = kernels_cli("status")
    assert code == 0 and "two (other.cpp): switched off (WDE_TEST_TWO=0)" in out


def test_wde_kernels_build_fails_in_one_line_a_kernel(small: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WDE_KERNEL_CACHE", str(tmp_path / "cache"))
    missing = str(tmp_path / "no-such-c++")
    monkeypatch.setenv("CXX", missing)
    monkeypatch.setattr(cpp_build, "KERNELS", {"one": (str(small), "wde_test_one", "WDE_TEST_ONE")})
    code, out, err = kernels_cli("build")
    assert code == 1 and out.startswith("one (small.cpp): not built: ")
    assert err.splitlines()[-1] == (f"wde kernels build: one not built: FileNotFoundError: no C++ compiler {missing!r}"
                                    " (set CXX)")


def test_wde_kernels_status_names_the_folder_the_engine_loads() -> None:
    """The real kernels: `status` reports built, at the folder the loaded module came from."""
    module = cpp_build.cpu_ops()
    if module is None:
        pytest.skip("cpu_ops cannot be built here")
    code, out, _ = kernels_cli("status", "--format", "json")
    states = {k["name"]: k for k in json.loads(out)}
    assert code == 0 and set(states) == set(cpp_build.KERNELS)
    assert states["cpu_ops"]["built"] and states["cpu_ops"]["folder"] == str(Path(module.__file__).parent)
    assert states["cpu_ops"]["isa"] == " ".join(cpp_build.isa_flags())


def test_the_build_key_reads_the_real_cpu_whatever_a_test_pretends(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`-march=native` compiles for the real CPU, so the build key reads `HOST_CPUINFO`, not the `CPUINFO_PATH` a
    test points at a fake file; each file's flags are read once (a rewritten file keeps its first flags)."""
    real = cpp_build.host_cpu()
    assert real == " ".join(sorted(device.cpu_flags(device.HOST_CPUINFO))) and "fpu" in real.split()
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse2 made_up_flag\n\n")
    monkeypatch.setattr(device, "CPUINFO_PATH", str(fake))
    assert device.cpu_flags() == {"fpu", "sse2", "made_up_flag"}
    assert cpp_build.host_cpu() == real
    fake.write_text("processor\t: 0\nflags\t\t: fpu\n\n")
    assert device.cpu_flags() == {"fpu", "sse2", "made_up_flag"}  # read once
