"""`wde embed` never misleads (issue 24): `<output>.partial` until complete, SIGTERM / SIGINT with a message and
130 / 143, shards checked against their recorded size and sha256 on `--resume`, the input rows checked against
their recorded hash, and over-long lines refused while streaming, in bounded memory.

Runs that must still be going when a signal arrives use `tests/embed_gate.py`: its input builder holds every batch
whose text says "gate" until a gate file exists, so the first shard is written and the run then waits for the test
(no sleeps, no dependence on the machine's speed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import embed_gate
from tests.test_corpus_embed import read, run

pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[1]
MEAN = ("--set", "pooler.params.pooling=mean")
INTERRUPTED = re.compile(r"interrupted after 1 (of 5 shards|shard \(4 rows\)); re-run with --resume")


def assert_same(out: Path, clean: Path) -> None:
    ids, got = read(out)
    want_ids, want = read(clean)
    assert ids == want_ids
    assert np.abs(got - want).max() <= 1e-6


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout:.0f} s"
        time.sleep(0.02)


@pytest.fixture()
def gated(tmp_path: Path, tiny_bert: Path) -> tuple[Path, list[str], Path]:
    """20 lines, shards of 4: shard 0 passes the gate, shards 1-4 wait for `gate` to exist."""
    embed_gate.register()  # for the in-process runs; the subprocesses register it themselves
    src = tmp_path / "in.txt"
    lines = [f"hello world {i}" for i in range(4)] + [f"the gate number {i}" for i in range(16)]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    gate = tmp_path / "gate-open"
    args = ["-m", str(tiny_bert), *MEAN, "--set", "model_input_builder.name=gated_packed", "--set",
            f"model_input_builder.params.gate_file={gate}", "--input", str(src), "--shard-size", "4"]
    return gate, args, src


def signalled_run(args: list[str], out: Path, sig: int, *, group: bool) -> tuple[int, str]:
    """Start `wde embed` (with the gate) in its own session, signal it once its first shard exists, and return
    (exit code, stderr). With `group`, the signal goes to the whole process group, as a terminal's Ctrl-C does."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "embed_gate.py"), "embed", *args,
                             "--output", str(out)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_for(out.with_name(out.name + ".partial") / "part-000000.parquet", proc)
        assert not out.exists()  # a reader never sees a partial run under the final name
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


def check_interrupted(out: Path, code: int, err: str, expected_code: int) -> Path:
    assert code == expected_code, err
    assert INTERRUPTED.search(err), err
    assert "Traceback" not in err and "Aborted!" not in err, err
    partial = out.with_name(out.name + ".partial")
    assert not out.exists()
    assert sorted(p.name for p in partial.iterdir()) == ["_wde_manifest.json", "_wde_shards.jsonl",
                                                          "part-000000.parquet"]  # the shard in flight was dropped
    assert json.loads((partial / "_wde_manifest.json").read_text())["complete"] is False
    return partial


def test_sigterm_drops_the_shard_in_flight_exits_143_and_resume_finishes(tmp_path: Path, gated) -> None:
    gate, args, _ = gated
    out = tmp_path / "out.parquet"
    code, err = signalled_run(args, out, signal.SIGTERM, group=False)
    check_interrupted(out, code, err, 143)

    gate.touch()
    resumed = run(*args, "--output", str(out), "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "wrote 20 x 64 embeddings" in resumed.output and "1 shard(s) kept from an earlier run" in resumed.output
    assert not out.with_name("out.parquet.partial").exists()
    manifest = json.loads((out / "_wde_manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 20
    assert [(p["file"], p["rows"]) for p in manifest["parts"]] == [(f"part-{i:06d}.parquet", 4) for i in range(5)]
    assert all(len(p["sha256"]) == 64 and len(p["input_sha256"]) == 64 for p in manifest["parts"])
    clean = run(*args, "--output", str(tmp_path / "clean.parquet"))
    assert clean.exit_code == 0, clean.output
    assert_same(out, tmp_path / "clean.parquet")
    again = run(*args, "--output", str(out), "--resume")  # resuming a complete output is a no-op
    assert again.exit_code == 0 and "nothing to do: " in again.output and "(20 x 64 embeddings)" in again.output


def test_sigint_to_the_process_group_with_workers_exits_130(tmp_path: Path, gated) -> None:
    """Ctrl-C on a terminal signals the parent and both workers: the workers ignore it, the parent stops them."""
    gate, args, _ = gated
    out = tmp_path / "out.parquet"
    code, err = signalled_run([*args, "--workers", "2"], out, signal.SIGINT, group=True)
    check_interrupted(out, code, err, 130)
    refused = run(*args, "--output", str(out))
    assert refused.exit_code == 1 and "pass --resume to finish it" in refused.output


def interrupt_at(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    """Raise what SIGTERM raises under the CLI's signal guard while the `call`-th shard is being embedded."""
    from wde.corpus.embedder import ShardEmbedder
    from wde.corpus.signals import Interrupted

    embed = ShardEmbedder.embed
    calls = []

    def embed_until(self, records):
        calls.append(1)
        if len(calls) == call:
            raise Interrupted(signal.SIGTERM)
        return embed(self, records)

    monkeypatch.setattr(ShardEmbedder, "embed", embed_until)


@pytest.fixture()
def interrupted(tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Path, Path]:
    """A run of 5 shards interrupted while embedding the third: shards 0 and 1 are in out.parquet.partial."""
    src = tmp_path / "in.txt"
    src.write_text("".join(f"line number {i} of the corpus\n" for i in range(10)), encoding="utf-8")
    args = ["-m", str(tiny_bert), *MEAN, "--input", str(src), "--shard-size", "2", "--output",
            str(tmp_path / "out.parquet")]
    with monkeypatch.context() as m:
        interrupt_at(m, 3)
        first = run(*args)
    assert first.exit_code == 143
    assert "interrupted after 2 shards (4 rows); re-run with --resume" in first.output
    partial = tmp_path / "out.parquet.partial"
    assert not (tmp_path / "out.parquet").exists()
    assert sorted(p.name for p in partial.glob("part-*")) == ["part-000000.parquet", "part-000001.parquet"]
    return args, src, partial


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_shard_is_embedded_again_on_resume(tmp_path: Path, interrupted, damage: str) -> None:
    args, src, partial = interrupted
    shard = partial / "part-000001.parquet"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[:len(data) // 2])
    else:  # same size, bytes flipped in the middle (a torn page, a bad disk)
        mid = len(data) // 2
        shard.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 16]) + data[mid + 16:])
    resumed = run(*args, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "part-000001.parquet:" in resumed.output and "embedding shard 1 again" in resumed.output
    assert "1 shard(s) kept from an earlier run" in resumed.output
    assert "Traceback" not in resumed.output
    clean = run(*args[:-1], str(tmp_path / "clean.parquet"))
    assert clean.exit_code == 0, clean.output
    assert_same(tmp_path / "out.parquet", tmp_path / "clean.parquet")


def test_an_input_edited_in_place_is_refused_naming_shard_and_line(tmp_path: Path, interrupted) -> None:
    """Same size, same modification time: only the recorded hash of the rows can tell."""
    args, src, partial = interrupted
    before = src.stat()
    text = src.read_text(encoding="utf-8")
    src.write_text(text.replace("line number 1 of", "line number 1 on"), encoding="utf-8")
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (src.stat().st_size, src.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    refused = run(*args, "--resume")
    assert refused.exit_code == 1, refused.output
    assert "shard 0 (part-000000.parquet)" in refused.output and f"{src}:2 differs" in refused.output
    assert "--overwrite" in refused.output and not (tmp_path / "out.parquet").exists()
    src.write_text(text, encoding="utf-8")  # restored: the run finishes
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert run(*args, "--resume").exit_code == 0


def test_overwrite_keeps_the_old_output_readable_until_the_new_one_is_complete(
        tmp_path: Path, tiny_bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "in.txt"
    src.write_text("".join(f"text {i}\n" for i in range(6)), encoding="utf-8")
    out = tmp_path / "out.parquet"
    args = ["-m", str(tiny_bert), *MEAN, "--input", str(src), "--shard-size", "2", "--output", str(out)]
    assert run(*args).exit_code == 0
    old = pq.read_table(out)
    exists = run(*args)
    assert exists.exit_code == 1 and "already exists; pass --overwrite" in exists.output
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        assert run(*args, "--overwrite", "--shard-size", "3").exit_code == 143
    assert pq.read_table(out).equals(old)  # the old run is still whole under the final name
    finished = run(*args, "--shard-size", "3", "--resume")
    assert finished.exit_code == 0, finished.output
    assert json.loads((out / "_wde_manifest.json").read_text())["job"]["shard_size"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.parquet"]


def test_npy_output_appears_only_when_complete(tmp_path: Path, tiny_bert: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "in.txt"
    src.write_text("".join(f"text {i}\n" for i in range(6)), encoding="utf-8")
    out = tmp_path / "out.npy"
    args = ["-m", str(tiny_bert), *MEAN, "--input", str(src), "--shard-size", "2", "--output", str(out)]
    with monkeypatch.context() as m:
        interrupt_at(m, 2)
        assert run(*args).exit_code == 143
    assert not out.exists() and (tmp_path / "out.npy.partial" / "part-000000.parquet").exists()
    done = run(*args, "--resume")
    assert done.exit_code == 0 and "wrote 6 x 64 embeddings" in done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.npy"]
    assert np.load(out).shape == (6, 64)


def test_bounded_lines_refuse_a_long_line_naming_it(tmp_path: Path) -> None:
    """The reader itself: a line at the limit passes (CRLF or not, read in one piece or several, with or without a
    final line break), one byte more is refused naming file:line."""
    from wde.corpus import CorpusError
    from wde.corpus.readers import read_txt

    small = tmp_path / "small.txt"
    small.write_bytes(b"short\r\n" + b"x" * 100 + b"\r\n" + b"y" * 100 + b"\n" + b"z" * 101 + b"\n")
    got = []
    with pytest.raises(CorpusError, match=rf"{re.escape(str(small))}:4: line longer than 100 bytes"
                                          r" \(--max-line-bytes\)"):
        for r in read_txt(str(small), max_line_bytes=100):
            got.append(r.text)
    assert got == ["short", "x" * 100, "y" * 100]
    pieces = tmp_path / "pieces.txt"  # lines of several 64 KiB pieces
    pieces.write_bytes(b"a" * 150_000 + b"\r\n" + b"b" * 200_000)
    assert [len(r.text) for r in read_txt(str(pieces), max_line_bytes=200_000)] == [150_000, 200_000]
    with pytest.raises(CorpusError, match=rf"{re.escape(str(pieces))}:2: line longer than 199,999 bytes"):
        list(read_txt(str(pieces), max_line_bytes=199_999))


PEAK_AT_EXIT = (
    "import atexit, sys\n"
    "def peak():\n"
    "    with open('/proc/self/status') as f:\n"
    "        sys.stderr.write(next(l for l in f if l.startswith('VmHWM')))\n"
    "atexit.register(peak)\n"
    "from wde.cli import main\n"
    "main(sys.argv[1:], prog_name='wde')\n")
"""`wde` that writes its own peak RSS (VmHWM: this process image's high-water mark) to stderr when it exits. Not
`ru_maxrss` from wait4: Linux carries the parent's high-water mark over fork and exec into the child's, so a child
of a large pytest process would report at least the parent's size."""


def peak_rss_kb(args: list[str]) -> tuple[int, int, str]:
    """(exit code, peak RSS in KiB, stderr) of one `wde embed` process."""
    proc = subprocess.run([sys.executable, "-c", PEAK_AT_EXIT, "embed", *args], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    peak = re.search(r"^VmHWM:\s+(\d+) kB$", proc.stderr, re.M)
    assert peak is not None, proc.stderr
    return proc.returncode, int(peak.group(1)), proc.stderr


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_50mb_line_is_refused_in_bounded_memory(tmp_path: Path, tiny_bert: Path) -> None:
    small = tmp_path / "small.txt"  # the baseline stops at its line 2 as well (a blank line), with nothing written
    small.write_text("first line\n\nthird line\n", encoding="utf-8")
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.write(b"first line\n")
        for _ in range(50):  # one 50 MB line, written a megabyte at a time
            f.write(b"word " * 200_000)
        f.write(b"\nthird line\n")
    code, base, err = peak_rss_kb(["-m", str(tiny_bert), *MEAN, "--input", str(small), "--output",
                                   str(tmp_path / "a.parquet")])
    assert code == 1 and f"{small}:2: blank line" in err, err
    code, peak, err = peak_rss_kb(["-m", str(tiny_bert), *MEAN, "--input", str(big), "--output",
                                   str(tmp_path / "b.parquet")])
    assert code == 1, err
    assert peak - base < 50 * 1024, f"peak RSS {peak} KiB vs {base} KiB for a file of short lines"
    assert f"{big}:2: line longer than 16,777,216 bytes (--max-line-bytes)" in err and "Traceback" not in err
    assert not (tmp_path / "b.parquet").exists() and not (tmp_path / "b.parquet.partial").exists()
