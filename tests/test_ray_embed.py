"""`wde embed --ray`: the job as a Ray Data pipeline on a local 2-CPU cluster, 2 actors, equals one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests import tiny_models
from wde.cli import main
from wde.corpus import EmbedJob, run_embed

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'wde[ray]')")
pytest.importorskip("ray.data")
pq = pytest.importorskip("pyarrow.parquet")

MEAN = "pooler.params.pooling=mean"


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def by_id(out: Path) -> dict[str, np.ndarray]:
    table = pq.read_table(out)
    return dict(zip(table.column("id").to_pylist(), np.array(table.column("embedding").to_pylist(), np.float32)))


def test_ray_job_equals_single_process(tmp_path: Path, tiny_bert: Path, cluster: None) -> None:
    texts = tiny_models.corpus(300, seed=5)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(texts)),
                   encoding="utf-8")
    args = ["-m", str(tiny_bert), "--set", MEAN, "--input", str(src), "--id-field", "id", "--shard-size", "50"]
    result = CliRunner().invoke(main, ["embed", *args, "--output", str(tmp_path / "ray.parquet"), "--ray",
                                       "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "wrote 300 x 64 embeddings" in result.output
    run_embed(EmbedJob(inputs=(str(src),), output=str(tmp_path / "one.parquet"), model=str(tiny_bert),
                       overrides=(MEAN,), id_field="id", shard_size=50))
    got, want = by_id(tmp_path / "ray.parquet"), by_id(tmp_path / "one.parquet")
    assert pq.read_table(tmp_path / "ray.parquet").num_rows == 300  # every id exactly once
    assert got.keys() == want.keys() == {f"p{i}" for i in range(300)}
    assert max(np.abs(got[k] - want[k]).max() for k in want) <= 1e-5
    manifest = json.loads((tmp_path / "ray.parquet" / "_wde_manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 300

    (tmp_path / "bad.jsonl").write_text('{"id": 1, "text": "fine"}\n{"id": 2, "text": 3}\n', encoding="utf-8")
    bad = CliRunner().invoke(main, ["embed", "-m", str(tiny_bert), "--input", str(tmp_path / "bad.jsonl"),
                                    "--output", str(tmp_path / "bad.parquet"), "--ray"])
    assert bad.exit_code == 1
    assert "bad.jsonl:2: field 'text' (--text-field) must be a string, got int" in bad.output
    assert "Traceback" not in bad.output
