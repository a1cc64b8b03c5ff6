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
