"""benchmarks/cpu_ceiling.py's ISA report and FMA loops: every variant compiles with gcc on any x86 host, the ones
this CPU has run, and the compiler keeps every accumulator chain (it once merged them into one)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cpu_ceiling  # noqa: E402

from wde.device import cpu_flags  # noqa: E402

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or platform.machine() not in ("x86_64", "AMD64"),
                               reason="needs gcc on x86-64")


def test_isa_summary() -> None:
    avx2 = frozenset("sse4_2 avx avx2 fma f16c".split())
    assert cpu_ceiling.isa_summary(avx2) == "AVX2+FMA; AVX-512: no; AMX: no"
    spr = avx2 | {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert cpu_ceiling.isa_summary(spr) == "AVX2+FMA; AVX-512: avx512_bf16 avx512bw avx512f; AMX: amx_bf16 amx_tile"


@needs_gcc
@pytest.mark.parametrize("variant", sorted(cpu_ceiling.FMA_VARIANTS))
def test_fma_variant_compiles_and_keeps_every_chain(variant: str, tmp_path: Path) -> None:
    exe = cpu_ceiling.compile_fma(variant, tmp_path, iters=1000)
    assert exe is not None, f"gcc could not build the {variant} loop"
    _, gcc_flags, macros = cpu_ceiling.FMA_VARIANTS[variant]
    asm = tmp_path / "fma.s"
    subprocess.run(["gcc", "-O2", *gcc_flags, "-fopenmp", *[f"-D{k}={v}" for k, v in macros.items()], "-DITERS=1000",
                    "-S", str(tmp_path / f"fma_{variant}.c"), "-o", str(asm)], check=True)
    op = "vdpbf16ps" if variant == "avx512_bf16" else "vfmadd"
    loops = re.findall(rf"((?:\t{op}[^\n]*\n)+)\t(?:sub|dec|add)", asm.read_text())
    assert loops and max(block.count("\n") for block in loops) == int(macros["CHAINS"]), "chains were merged"
    needs = set(cpu_ceiling.FMA_VARIANTS[variant][0])
    if needs <= cpu_flags():
        out = subprocess.run([str(exe)], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0 and float(out.stdout.split()[0]) > 0
