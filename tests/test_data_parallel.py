"""The data-parallel executor: N worker processes, one engine each, writing the same shards as one process."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from tests import tiny_models
from wde.corpus import CorpusError, EmbedJob, run_embed
from wde.corpus.data_parallel import plan_devices

pq = pytest.importorskip("pyarrow.parquet")

MEAN = "pooler.params.pooling=mean"


def read(out: Path) -> tuple[list[str], np.ndarray]:
    table = pq.read_table(out)
    col = table.column("embedding").combine_chunks()
    return table.column("id").to_pylist(), col.values.to_numpy().reshape(len(col), col.type.list_size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3000 lines; line 2500 is too long for the tiny model (128 tokens) unless truncated."""
    rng = random.Random(3)
    lines = [" ".join(rng.choice(tiny_models.WORDS) for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    lines[2499] = "word " * 200
    path = tmp_path_factory.mktemp("dp") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def job(src: Path, out: Path, model: Path, truncate: bool = True) -> EmbedJob:
    return EmbedJob(inputs=(str(src),), output=str(out), model=str(model), workflow="bert", overrides=(MEAN,),
                    truncate=truncate, shard_size=250)


def test_two_cpu_workers_equal_one(tmp_path: Path, tiny_bert: Path, corpus: Path) -> None:
    one = run_embed(job(corpus, tmp_path / "one.parquet", tiny_bert))
    two = run_embed(job(corpus, tmp_path / "two.parquet", tiny_bert), workers=2)
    assert (one.rows, two.rows, two.shards_written) == (3000, 3000, 12)
    ids1, v1 = read(tmp_path / "one.parquet")
    ids2, v2 = read(tmp_path / "two.parquet")
    assert ids2 == ids1 == [f"corpus.txt:{i}" for i in range(1, 3001)]
    assert np.abs(v2 - v1).max() <= 1e-6


def test_a_worker_error_names_file_and_line_and_keeps_finished_shards(tmp_path: Path, tiny_bert: Path,
                                                                       corpus: Path) -> None:
    out = tmp_path / "out.parquet"
    with pytest.raises(CorpusError, match=rf"{corpus}:2500: input has \d+ tokens, .* pass --truncate"):
        run_embed(job(corpus, out, tiny_bert, truncate=False), workers=2)
    assert not out.exists()  # an unfinished run never appears under the final name
    partial = out.with_name(out.name + ".partial")
    kept = {p.name for p in partial.glob("part-*.parquet")}
    assert kept and "part-000009.parquet" not in kept  # finished shards kept; the one holding line 2500 not written
    assert not list(partial.glob(".*"))


def test_plan_devices() -> None:
    assert plan_devices(2, ["cuda:0", "cuda:1"]) == ["cuda:0", "cuda:1"]
    assert plan_devices(1, ["cuda:1"]) == ["cuda:1"]
    with pytest.raises(CorpusError, match="--workers 3 and --devices cuda:0,cuda:1 disagree"):
        plan_devices(3, ["cuda:0", "cuda:1"])
    import torch

    if not torch.cuda.is_available():
        assert plan_devices(2, None) == ["cpu", "cpu"]


@pytest.mark.gpu
def test_one_worker_per_gpu_equals_one_process(tmp_path: Path, tiny_bert: Path, corpus: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    base = job(corpus, tmp_path / "one.parquet", tiny_bert)
    base = base.model_copy(update={"overrides": (MEAN, "model.params.dtype=float32")})
    run_embed(base, devices=["cuda:0"])
    run_embed(base.model_copy(update={"output": str(tmp_path / "two.parquet")}), devices=["cuda:0", "cuda:1"])
    ids1, v1 = read(tmp_path / "one.parquet")
    ids2, v2 = read(tmp_path / "two.parquet")
    assert ids1 == ids2 and np.abs(v1 - v2).max() <= 1e-4
