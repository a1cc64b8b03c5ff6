"""`wde embed` as a corpus pipeline: parity with `Engine.embed`, resume after SIGKILL, formats, errors, progress.

Each friction point of issue 17 has a test here: the output suffix is honoured (or refused), blank .txt lines
cannot shift rows, bad .jsonl lines and too-long texts name file:line and the `--truncate` flag, and the progress
bar is on by default on a terminal.
"""

from __future__ import annotations

import json
import os
import pty
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests import tiny_heads, tiny_models
from wde import Engine
from wde.cli import main
from wde.request import PoolingParams

pq = pytest.importorskip("pyarrow.parquet")

MEAN = ("--set", "pooler.params.pooling=mean")  # tiny models carry no sentence-transformers Pooling config
N = 20_000


def run(*args: str):
    result = CliRunner().invoke(main, ["embed", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def read(out: Path) -> tuple[list[str], np.ndarray]:
    table = pq.read_table(out)
    col = table.column("embedding").combine_chunks()
    return table.column("id").to_pylist(), col.values.to_numpy().reshape(len(col), col.type.list_size)


@pytest.fixture(scope="module")
def engine(tiny_bert: Path):
    with Engine.from_workflow("bert", tiny_bert, overrides=[MEAN[1]]) as e:
        yield e


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, engine: Engine) -> tuple[Path, list[str], np.ndarray]:
    """20k short texts as JSONL objects with ids, and what `Engine.embed` makes of them."""
    rng = random.Random(0)
    texts = [" ".join(rng.choice(tiny_models.WORDS) for _ in range(rng.randint(1, 4))) for _ in range(N)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"doc": f"d{i}", "body": t}, ensure_ascii=False) + "\n")
    return path, [f"d{i}" for i in range(N)], engine.embed(texts)


def test_20k_jsonl_equals_engine_embed(tmp_path: Path, tiny_bert: Path, corpus) -> None:
    src, ids, expected = corpus
    out = tmp_path / "out.parquet"
    result = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--text-field", "body", "--id-field", "doc",
                 "--output", str(out), "--shard-size", "6000")
    assert result.exit_code == 0, result.output
    assert f"wrote {N} x 64 embeddings to {out}" in result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "_wde_manifest.json", "part-000000.parquet", "part-000001.parquet", "part-000002.parquet",
        "part-000003.parquet"]
    got_ids, got = read(out)
    assert got_ids == ids
    assert np.abs(got - expected).max() <= 1e-5


def test_sigkill_then_resume_writes_every_id_once(tmp_path: Path, tiny_bert: Path, corpus) -> None:
    """The first run (stderr on a terminal, so it shows the bar unasked) is SIGKILLed after two shards."""
    full, ids, expected = corpus
    n = 6000  # 30 shards of 200
    src = tmp_path / "part.jsonl"
    src.write_text("".join(full.read_text(encoding="utf-8").splitlines(keepends=True)[:n]), encoding="utf-8")
    ids, expected = ids[:n], expected[:n]
    out = tmp_path / "out.parquet"
    partial = tmp_path / "out.parquet.partial"  # where the run writes until it is complete
    args = ["-m", str(tiny_bert), *MEAN, "--input", str(src), "--text-field", "body", "--id-field", "doc",
            "--output", str(out), "--shard-size", "200"]
    journal = partial / "_wde_shards.jsonl"

    def journaled() -> list[str]:
        """The shards the journal records. A shard's file is renamed into place before its line is written, so a
        kill can leave a file without a line, which --resume redoes: only journaled shards count as kept."""
        lines = journal.read_text(encoding="utf-8").splitlines(keepends=True) if journal.exists() else []
        return [json.loads(line)["file"] for line in lines if line.endswith("\n")]

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "wde.cli", "embed", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    terminal = b""
    try:
        deadline = time.monotonic() + 120
        while len(journaled()) < 2:
            assert proc.poll() is None, terminal.decode(errors="replace")
            assert time.monotonic() < deadline, "no shard written in 120 s"
            if select.select([master], [], [], 0.01)[0]:
                terminal += os.read(master, 65536)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
        os.close(master)
    assert b"wde embed" in terminal and b"row" in terminal  # tqdm bar, on by default on a terminal
    kept = {name: (partial / name).stat().st_mtime_ns for name in journaled()}
    assert 2 <= len(kept) < n // 200
    assert not out.exists()  # nothing under the final name until the run is complete
    assert json.loads((partial / "_wde_manifest.json").read_text())["complete"] is False

    refused = run(*args)
    assert refused.exit_code == 1 and "pass --resume" in refused.output
    resumed = run(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert f"{len(kept)} shard(s) kept from an earlier run" in resumed.output
    assert {p: (out / p).stat().st_mtime_ns for p in kept} == kept  # finished shards were not redone
    assert not list(out.glob(".*")) and not partial.exists()  # no temporary file left behind
    got_ids, got = read(out)
    assert got_ids == ids  # every id exactly once, in input order
    assert np.abs(got - expected).max() <= 1e-5
    again = run(*args, "--resume", "--shard-size", "300")
    assert again.exit_code == 1 and "different job (shard_size differ)" in again.output
    same = run(*args, "--resume")  # a complete output: nothing to do
    assert same.exit_code == 0 and f"nothing to do: {out} is complete ({n} x 64 embeddings)" in same.output


def test_output_suffix_is_honoured_or_refused(tmp_path: Path, tiny_bert: Path, engine: Engine) -> None:
    src = tmp_path / "in.txt"
    src.write_text("hello world\nthe café\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    ok = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(out))
    assert ok.exit_code == 0, ok.output
    assert f"wrote 2 x 64 embeddings to {out}" in ok.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.npy"]  # no out.npy.npy, no leftovers
    assert np.abs(np.load(out) - engine.embed(["hello world", "the café"])).max() <= 1e-6
    exists = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(out))
    assert exists.exit_code == 1 and "--overwrite" in exists.output
    csv = run("-m", str(tiny_bert), "--input", str(src), "--output", str(tmp_path / "out.csv"))
    assert csv.exit_code == 1
    assert "unsupported suffix '.csv'" in csv.output and ".parquet" in csv.output and ".npy" in csv.output
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "out.csv.npy").exists()
    ids = run("-m", str(tiny_bert), "--input", str(src), "--output", str(tmp_path / "x.npy"), "--id-field", "id")
    assert ids.exit_code == 1 and "--id-field" in ids.output and ".parquet" in ids.output


def test_txt_blank_line_is_an_error_unless_skip_blank(tmp_path: Path, tiny_bert: Path, engine: Engine) -> None:
    src = tmp_path / "in.txt"
    src.write_text("first\nsecond\n\nfourth\n", encoding="utf-8")
    out = tmp_path / "out.parquet"
    refused = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(out))
    assert refused.exit_code == 1
    assert f"{src}:3: blank line" in refused.output and "--skip-blank" in refused.output
    assert not out.exists()  # a run that wrote no shard leaves nothing behind
    ok = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(out), "--skip-blank", "--overwrite")
    assert ok.exit_code == 0, ok.output
    ids, got = read(out)
    assert ids == ["in.txt:1", "in.txt:2", "in.txt:4"]  # default ids say which line each row came from
    assert np.abs(got - engine.embed(["first", "second", "fourth"])).max() <= 1e-6


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"', "not valid JSON: Expecting ',' delimiter (column 14)"),
    ('{"body": "no text key"}', "no 'text' field (--text-field); the object has ['body']"),
    ('{"text": 5}', "field 'text' (--text-field) must be a string, got int"),
    ('[1, 2]', "expected a JSON object or string, got list"),
    ('{"text": "   "}', "text is empty"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path: Path, tiny_bert: Path, line: str, message: str) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('"fine"\n{"text": "also fine"}\n' + line + "\n", encoding="utf-8")
    result = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(tmp_path / "o.parquet"))
    assert result.exit_code == 1
    assert f"Error: {src}:3: {message}" in result.output
    assert "Traceback" not in result.output


def test_too_long_names_line_and_truncate_flag(tmp_path: Path, tiny_bert: Path, engine: Engine) -> None:
    src = tmp_path / "in.txt"
    long_text = "word " * 300
    src.write_text("short\n" + long_text + "\n", encoding="utf-8")
    out = tmp_path / "out.parquet"
    refused = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(out))
    assert refused.exit_code == 1
    assert f"{src}:2: input has" in refused.output and "pass --truncate" in refused.output
    assert "truncate=true" not in refused.output and "input[" not in refused.output
    ok = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(out), "--truncate", "--overwrite")
    assert ok.exit_code == 0, ok.output
    assert np.abs(read(out)[1][1] - engine.embed(long_text, truncate=True)).max() <= 1e-6


def test_progress_flag_and_default_off_when_not_a_terminal(tmp_path: Path, tiny_bert: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("one\ntwo\n", encoding="utf-8")
    quiet = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(tmp_path / "a.parquet"))
    assert quiet.exit_code == 0 and "wde embed:" not in quiet.output  # the runner's stderr is no terminal
    shown = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(tmp_path / "b.parquet"),
                "--progress")
    assert shown.exit_code == 0 and "wde embed:" in shown.output and "100%" in shown.output
    assert "tok/s" in shown.output


def test_parquet_and_txt_inputs_together(tmp_path: Path, tiny_bert: Path, engine: Engine) -> None:
    import pyarrow as pa

    pq.write_table(pa.table({"pid": [7, 8, 9], "passage": ["alpha one", "beta two", "gamma"]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"pid": 10, "passage": "delta"}\n', encoding="utf-8")
    out = tmp_path / "out.parquet"
    result = run("-m", str(tiny_bert), *MEAN, "--input", f"{tmp_path / 'a.parquet'},{tmp_path / 'b.jsonl'}",
                 "--text-field", "passage", "--id-field", "pid", "--output", str(out), "--shard-size", "2")
    assert result.exit_code == 0, result.output
    ids, got = read(out)
    assert ids == [7, 8, 9, 10]  # integer ids stay integers (they came back as strings)
    assert pq.read_table(out).schema.field("id").type == "int64"
    assert np.abs(got - engine.embed(["alpha one", "beta two", "gamma", "delta"])).max() <= 1e-6
    missing = run("-m", str(tiny_bert), "--input", str(tmp_path / "a.parquet"), "--output", str(tmp_path / "x.parquet"))
    assert not (tmp_path / "x.parquet").exists()  # refused before any output (or model) is made
    assert missing.exit_code == 1 and "no column 'text' (--text-field); columns: ['pid', 'passage']" in missing.output


def test_bge_m3_sparse_and_colbert_columns(tmp_path: Path, tiny_bert: Path) -> None:
    model = tiny_heads.build_bge_m3(tmp_path / "m3")
    texts = ["the water", "paris berlin café", "a b c d e f"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "out.parquet"
    result = run("-w", "bge_m3", "-m", str(model), "--input", str(src), "--output", str(out),
                 "--outputs", "dense,sparse,colbert")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    with Engine.from_workflow("bge_m3", model) as m3:
        want = m3.encode(texts, PoolingParams(outputs=("dense", "sparse", "colbert")))
    refused = run("-m", str(tiny_bert), *MEAN, "--input", str(src), "--output", str(tmp_path / "x.parquet"),
                  "--outputs", "sparse")
    assert refused.exit_code == 1
    assert "--outputs sparse: workflow 'bert' produces ['dense', 'token_embeddings'], not ['sparse']" in refused.output
    for row, w in zip(table.to_pylist(), want):
        assert np.abs(np.array(row["embedding"]) - w.outputs["dense"]).max() <= 1e-6
        assert dict(row["sparse"]).keys() == w.outputs["sparse"].keys()
        assert max(abs(v - w.outputs["sparse"][k]) for k, v in row["sparse"]) <= 1e-6
        assert np.abs(np.array(row["colbert"]) - w.outputs["colbert"]).max() <= 1e-6


def test_readers_stream_in_constant_memory(tmp_path: Path) -> None:
    """Reading and sharding a file holds one shard, not the file: peak memory stays far below the file size."""
    import tracemalloc

    from wde.corpus.readers import read_records, shards

    src = tmp_path / "big.jsonl"
    line = json.dumps({"id": 0, "text": "the quick brown fox " * 10}) + "\n"
    src.write_text(line * 40_000, encoding="utf-8")  # ~9 MB
    tracemalloc.start()
    try:
        rows = sum(len(chunk) for _, chunk in shards(read_records([str(src)]), 200))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows == 40_000
    assert peak < src.stat().st_size / 10, f"peak {peak} bytes for a {src.stat().st_size}-byte file"


# --- integer ids ---------------------------------------------------------------------------------------------

def test_integer_ids_stay_integers_and_resume(tmp_path: Path, tiny_bert: Path, engine: Engine,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """JSONL `"id": 7` came back as the string "7". Interrupted after two shards and resumed, the output is the
    clean run's: int64 ids, every id once."""
    from tests.test_corpus_resume import interrupt_at

    texts = [f"text number {i}" for i in range(10)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": 100 + i, "text": t}) + "\n" for i, t in enumerate(texts)),
                   encoding="utf-8")
    args = ["-m", str(tiny_bert), *MEAN, "--input", str(src), "--id-field", "id", "--shard-size", "3"]
    with monkeypatch.context() as m:
        interrupt_at(m, 3)
        assert run(*args, "--output", str(tmp_path / "out.parquet")).exit_code == 143
    resumed = run(*args, "--output", str(tmp_path / "out.parquet"), "--resume")
    assert resumed.exit_code == 0 and "2 shard(s) kept from an earlier run" in resumed.output, resumed.output
    ids, got = read(tmp_path / "out.parquet")
    assert ids == list(range(100, 110)) and all(type(i) is int for i in ids)
    assert pq.read_table(tmp_path / "out.parquet").schema.field("id").type == "int64"
    assert np.abs(got - engine.embed(texts)).max() <= 1e-6
    workers = run(*args, "--output", str(tmp_path / "workers.parquet"), "--workers", "2")
    assert workers.exit_code == 0, workers.output
    assert read(tmp_path / "workers.parquet")[0] == ids


def test_the_first_id_decides_the_id_type(tmp_path: Path, tiny_bert: Path) -> None:
    """One run writes one id column type: after a string id an integer is written as its digits; after an integer
    a string is refused naming file:line (shards already written hold integers), as is an int beyond int64."""
    strings_first = tmp_path / "s.jsonl"
    strings_first.write_text('{"id": "a", "text": "one"}\n{"id": 2, "text": "two"}\n', encoding="utf-8")
    out = tmp_path / "s.parquet"
    assert run("-m", str(tiny_bert), *MEAN, "--input", str(strings_first), "--id-field", "id", "--output",
               str(out)).exit_code == 0
    assert read(out)[0] == ["a", "2"]
    ints_first = tmp_path / "i.jsonl"
    ints_first.write_text('{"id": 1, "text": "one"}\n{"id": "b", "text": "two"}\n', encoding="utf-8")
    refused = run("-m", str(tiny_bert), *MEAN, "--input", str(ints_first), "--id-field", "id", "--output",
                  str(tmp_path / "i.parquet"))
    assert refused.exit_code == 1 and f"{ints_first}:2: id 'b' is a string, but the first record's id is an" \
        " integer" in refused.output, refused.output
    huge = tmp_path / "h.jsonl"
    huge.write_text('{"id": 1, "text": "one"}\n{"id": 9223372036854775808, "text": "two"}\n', encoding="utf-8")
    refused = run("-m", str(tiny_bert), *MEAN, "--input", str(huge), "--id-field", "id", "--output",
                  str(tmp_path / "h.parquet"))
    assert refused.exit_code == 1 and f"{huge}:2: id 9223372036854775808 does not fit" in refused.output


def test_an_integer_id_hashes_apart_from_its_digits() -> None:
    """So --resume on an input whose ids changed type is refused, never mixes int and string shards; a string id
    hashes as it always did (format 2's digests of string ids are unchanged)."""
    import hashlib
    import struct

    from wde.corpus.readers import Record, input_digests

    as_int, as_str = input_digests([Record(7, "t", "f", 1)]), input_digests([Record("7", "t", "f", 1)])
    assert as_int[0] != as_str[0] and as_int[1] != as_str[1]
    assert as_str[0] == hashlib.sha256(struct.pack("<QQ", 1, 1) + b"7t").hexdigest()
