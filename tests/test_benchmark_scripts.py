"""The benchmark scripts run: `benchmarks/throughput.py` on a tiny workload, with a `--variant`, prints every
side's line, the ratios, and vectors that agree with sentence-transformers (the figures themselves are for
docs/benchmarks.md, not for a test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_runs_with_a_variant() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--n", "40", "--repeats", "1",
         "--variant", "runner.params.cpu_streams=1", "--set", "runner.params.cpu_stream_min_tokens=32"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"wde\[runner\.params\.cpu_streams=1\]: .* tokens/s  \(max abs diff to wde \S+\)", text), text
    assert "ratio wde / sentence-transformers:" in text
    assert "ratio wde[runner.params.cpu_streams=1] / sentence-transformers:" in text
    agreements = re.findall(r"^agreement of (\S+) .* max abs diff (\S+)$", text, re.MULTILINE)
    assert [name for name, _ in agreements] == ["wde", "wde[runner.params.cpu_streams=1]"], text
    assert all(float(diff) <= 1e-4 for _, diff in agreements), text


def test_peers_runs_offline_and_serving_with_the_isa_cap() -> None:
    """`benchmarks/peers.py` (issue 27's comparison) end to end with the peers this venv has: WDE and
    sentence-transformers offline, WDE serving, every engine capped to AVX2; the vLLM and OpenVINO engines need
    their own venvs (docs/benchmarks.md) and are not run here."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--engines", "wde,st", "--dtype", "float32",
         "--rounds", "1", "--short", "24", "--long", "6", "--serve", "--clients", "4", "--requests", "40",
         "--isa", "avx2"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout
    assert "engines capped to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2" in text, text
    assert re.search(r"workload: 24 short texts \(\d+ tokens\), 6 long \(\d+ tokens\)", text), text
    rows = dict(re.findall(r"^(wde|st) +[\d,]+ \(.*\) +[\d,]+ \(.*\) +(\S+)  \S+$", text, re.MULTILINE))
    assert set(rows) == {"wde", "st"}, text
    assert float(rows["wde"]) >= 0.9999 and float(rows["st"]) >= 0.9999  # min cosine to sentence-transformers fp32
    assert re.search(r"^wde +[\d.]+ req/s  p50 +[\d.]+ ms  p99 +[\d.]+ ms  errors 0", text, re.MULTILINE), text
    assert re.search(r"^WDE / st: offline short [\d.]+x, long [\d.]+x$", text, re.MULTILINE), text


def test_multi_vector_runs_and_agrees() -> None:
    """`benchmarks/multi_vector.py` (issue 35's side-by-side with MultiVectorEncoder) on a tiny workload: both sides'
    lines, the ratio, and token vectors that agree before anything is timed."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_vector.py"), "--n", "40", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    agreements = re.findall(r"^(documents|queries): agreement on 40 inputs, max abs diff (\S+)$", out.stdout, re.M)
    assert [side for side, _ in agreements] == ["documents", "queries"], out.stdout
    assert all(float(diff) <= 1e-4 for _, diff in agreements), out.stdout
    assert len(re.findall(r"\| ratio \S+x \(best of 1\)$", out.stdout, re.M)) == 2, out.stdout


def test_multi_model_load_runs_both_sides_and_they_agree() -> None:
    """`benchmarks/multi_model_load.py` (issue 36: three models in one server against one server per model) on a
    tiny load: each model's answers agree across the two sides before timing, every round's line for each side, the
    side-by-side medians with a ratio per model and for all."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_model_load.py"), "--models",
                          "embedder,reranker,classifier", "--clients", "3", "--requests", "12", "--rounds", "1"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    text = out.stdout
    agreements = re.findall(r"^(\w+): combined vs separate, max abs diff (\S+)$", text, re.M)
    assert [name for name, _ in agreements] == ["embedder", "reranker", "classifier"], text
    assert all(float(diff) <= 1e-4 for _, diff in agreements), text
    for side in ("combined", "separate"):
        assert re.search(rf"^round 1 +{side}: embedder .* classifier .* failures 0$", text, re.M), text
    rows = re.findall(r"^ *(\w+) +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +([\d.]+)x$", text, re.M)
    assert [name for name, _ in rows] == ["embedder", "reranker", "classifier"], text
    assert re.search(r"^ +all +[\d.]+ +[\d.]+ +[\d.]+x$", text, re.M), text
    paired = r"^paired ratio combined / separate, all kinds, per round: [\d.]+x; median [\d.]+x$"
    assert re.search(paired, text, re.M), text
