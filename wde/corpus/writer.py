"""Sharded parquet output, written under `<output>.partial` and published under `<output>` only when complete.

    out.parquet.partial/            while the run goes on (and after a kill, for --resume)
        _wde_manifest.json          the job; "complete": false
        _wde_shards.jsonl           the journal: one line per finished shard (rows, bytes, sha256, input sha256)
        part-000000.parquet …
    out.parquet/                    renamed from out.parquet.partial/ once every shard is written; the manifest
                                    then lists every shard ("parts") and says "complete": true

Each shard is written to a hidden temporary file and renamed into place, then recorded in the journal; a resumed
run keeps a shard only if its file still has the recorded size and sha256, and its input rows still hash the same.
Readers (pyarrow, pandas, Ray, DuckDB) ignore files whose names start with `_` or `.`, so
`pd.read_parquet("out.parquet")` reads the rows in input order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from wde.corpus.job import CorpusError

MANIFEST = "_wde_manifest.json"
JOURNAL = "_wde_shards.jsonl"
FORMAT_VERSION = 3
"""3: integer ids are written as integers (an int64 `id` column) and hash apart from string ids; a partial run
of format 2 (integer ids written as strings) is refused by --resume, naming both formats."""
ROW_DIGESTS_KEY = b"wde.input_row_digests"
"""Parquet key-value metadata of each shard: the hex per-row digests of its input (see `input_digests`)."""


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard as the journal (and, at the end, the manifest's "parts") records it."""

    index: int
    file: str
    rows: int
    bytes: int
    sha256: str
    input_sha256: str | None = None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of a directory `wde embed` wrote, or None; an unreadable one is a `CorpusError`."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path}: unreadable manifest ({e}); pass --overwrite to start over") from None


def job_differs(manifest: dict[str, Any], fingerprint: dict[str, Any]) -> list[str]:
    job = manifest.get("job", {})
    return sorted(k for k in set(job) | set(fingerprint) if job.get(k) != fingerprint.get(k))


class ShardWriter:
    """Writes one shard per input range into `directory`; many processes may write distinct shards at once, but
    only one (the run's own process) records them in the journal."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST

    @property
    def journal_path(self) -> Path:
        return self.directory / JOURNAL

    def open(self, fingerprint: dict[str, Any], *, resume: bool,
             overwrite: bool) -> tuple[bool, dict[int, ShardRecord]]:
        """Prepare the directory: (whether it was made afresh, the shards recorded by an earlier run, when resuming)."""
        d = self.directory
        if os.path.lexists(d) and overwrite:
            if d.is_dir() and not d.is_symlink() and read_manifest(d) is None and any(d.iterdir()):
                raise CorpusError(f"--overwrite: {d} is a directory that `wde embed` did not write (no {MANIFEST});"
                                  " remove it yourself or pick another --output")
            shutil.rmtree(d) if d.is_dir() and not d.is_symlink() else d.unlink()
        if os.path.lexists(d) and not d.is_dir():
            raise CorpusError(f"{d} exists and is not a directory; pass --overwrite to replace it")
        if d.exists() and (previous := read_manifest(d)) is not None:
            if not resume:
                raise CorpusError(f"--output: an interrupted run left {d}; pass --resume to finish it, or --overwrite"
                                  " to start over")
            if previous.get("version") != FORMAT_VERSION:
                raise CorpusError(f"--resume: {d} was written by another version of `wde embed` (format"
                                  f" {previous.get('version')}, this one writes {FORMAT_VERSION}); pass --overwrite")
            differ = job_differs(previous, fingerprint)
            if differ:
                raise CorpusError(f"--resume: {d} was written by a different job ({', '.join(differ)} differ);"
                                  " pass --overwrite to start over, or pick another --output")
            self.remove_temporaries()
            return False, self.recorded()
        if d.exists() and any(d.iterdir()):
            raise CorpusError(f"{d} is a non-empty directory that `wde embed` did not write (no {MANIFEST})")
        d.mkdir(parents=True, exist_ok=True)
        self._write_manifest({"version": FORMAT_VERSION, "complete": False, "job": fingerprint})
        return True, {}

    def write(self, index: int, table: Any, row_digests: bytes | None = None) -> dict[str, Any]:
        """Write one shard atomically (temporary file + rename); what the journal records of it, less the input
        hash (`ShardRecord` fields). `row_digests` go into the file's metadata, to locate a changed input row."""
        import pyarrow.parquet as pq

        if row_digests is not None:
            table = table.replace_schema_metadata({**(table.schema.metadata or {}), ROW_DIGESTS_KEY:
                                                   row_digests.hex().encode()})
        final = self.directory / part_name(index)
        tmp = self.directory / f".{part_name(index)}.{os.getpid()}.tmp"
        pq.write_table(table, tmp)
        info = {"index": index, "file": final.name, "rows": table.num_rows, "bytes": tmp.stat().st_size,
                "sha256": file_sha256(tmp)}
        os.replace(tmp, final)
        return info

    def record(self, record: ShardRecord) -> None:
        """Append a finished shard to the journal (one short line; a torn last line is ignored when read)."""
        with open(self.journal_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")

    def recorded(self) -> dict[int, ShardRecord]:
        """The journal's shards by index (a later line for the same shard wins)."""
        out: dict[int, ShardRecord] = {}
        try:
            text = self.journal_path.read_text(encoding="utf-8")
        except FileNotFoundError:  # finished (the manifest lists the parts), or nothing written yet
            manifest = read_manifest(self.directory) or {}
            for part in manifest.get("parts", []) if manifest.get("complete") else []:
                rec = ShardRecord(**part)
                out[rec.index] = rec
            return out
        for line in text.splitlines():
            try:
                rec = ShardRecord(**json.loads(line))
            except (ValueError, TypeError):
                continue  # a line torn by a kill mid-append
            out[rec.index] = rec
        return out

    def verify(self, rec: ShardRecord) -> str | None:
        """Why the shard file no longer matches its record (missing, truncated, corrupt), or None when it does."""
        path = self.directory / rec.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return "missing"
        if size != rec.bytes:
            return f"{size:,} bytes where {rec.bytes:,} were written (truncated or overwritten)"
        if file_sha256(path) != rec.sha256:
            return "its sha256 differs from the one recorded when it was written (corrupt)"
        return None

    def row_digests(self, rec: ShardRecord) -> bytes | None:
        """The per-row input digests stored in a shard file, or None if the file cannot tell."""
        import pyarrow.parquet as pq

        try:
            meta = pq.read_schema(self.directory / rec.file).metadata or {}
            return bytes.fromhex(meta[ROW_DIGESTS_KEY].decode())
        except Exception:  # noqa: BLE001 - a missing or corrupt file: the caller names the shard's range instead
            return None

    def remove_temporaries(self) -> None:
        """Drop half-written shards (left by a killed or terminated writer); call when no writer is running."""
        for stale in self.directory.glob(".part-*"):
            stale.unlink(missing_ok=True)

    def parts(self) -> list[Path]:
        """Every shard file (ours are part-NNNNNN.parquet; a Ray job writes its own names), in name order."""
        return sorted(p for p in self.directory.glob("*.parquet") if not p.name.startswith((".", "_")))

    def summary(self) -> tuple[int, int]:
        """(rows, embedding width) over every shard, from parquet metadata only."""
        import pyarrow.parquet as pq

        rows, dim = 0, 0
        for p in self.parts():
            pf = pq.ParquetFile(p)
            rows += pf.metadata.num_rows
            if "embedding" in pf.schema_arrow.names:
                dim = pf.schema_arrow.field("embedding").type.list_size
        return rows, dim

    def finish(self, rows: int, dim: int) -> None:
        """Mark the run complete: the manifest lists every shard with its rows and sha256 (from the journal, or
        computed for files written without one, e.g. by Ray); the journal goes."""
        import pyarrow.parquet as pq

        by_file = {rec.file: rec for rec in self.recorded().values() if rec.file}
        parts = []
        for p in self.parts():
            rec = by_file.get(p.name)
            if rec is None:
                rec = ShardRecord(index=len(parts), file=p.name, rows=pq.ParquetFile(p).metadata.num_rows,
                                  bytes=p.stat().st_size, sha256=file_sha256(p))
            parts.append(asdict(rec))
        manifest = read_manifest(self.directory) or {}
        manifest.update(complete=True, rows=rows, dim=dim, shards=len(parts), parts=parts)
        self._write_manifest(manifest)
        self.journal_path.unlink(missing_ok=True)

    def is_complete(self) -> bool:
        manifest = read_manifest(self.directory)
        return bool(manifest and manifest.get("complete"))

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        tmp = self.directory / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.manifest_path)


def publish(partial: Path, out: Path) -> None:
    """Rename the finished `partial` directory to `out`, replacing what `out` held (an --overwrite)."""
    if os.path.lexists(out):
        aside = out.with_name(f".{out.name}.replaced.{os.getpid()}")
        os.replace(out, aside)
        os.replace(partial, out)
        shutil.rmtree(aside) if aside.is_dir() and not aside.is_symlink() else aside.unlink()
    else:
        os.replace(partial, out)


def assemble_npy(writer: ShardWriter, out: Path) -> tuple[int, int]:
    """Stream the shards' embeddings into one .npy matrix (written to a temporary file, then renamed)."""
    import numpy as np
    import pyarrow.parquet as pq

    rows, dim = writer.summary()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.npy")
    try:
        matrix = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(rows, dim))
        at = 0
        for p in writer.parts():
            col = pq.read_table(p, columns=["embedding"]).column("embedding").combine_chunks()
            block = col.values.to_numpy(zero_copy_only=False).reshape(len(col), dim)
            matrix[at:at + len(block)] = block
            at += len(block)
        matrix.flush()
        del matrix
        os.replace(tmp, out)
    except BaseException:  # an interrupt or a full disk: no half-written matrix stays behind
        tmp.unlink(missing_ok=True)
        raise
    return rows, dim
