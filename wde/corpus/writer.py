"""Sharded parquet output: `out.parquet/` holds `part-NNNNNN.parquet` shards and a `_wde_manifest.json`.

Each shard is written to a hidden temporary file and renamed into place, so a shard either exists whole or not
at all: resuming means skipping the shards that exist. Readers (pyarrow, pandas, Ray, DuckDB) ignore files whose
names start with `_` or `.`, so `pd.read_parquet("out.parquet")` reads the rows in input order.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from wde.corpus.job import CorpusError

MANIFEST = "_wde_manifest.json"
FORMAT_VERSION = 1


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


class ShardWriter:
    """Writes one shard per input range into `directory`; many processes may write distinct shards at once."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST

    def open(self, fingerprint: dict[str, Any], *, resume: bool, overwrite: bool) -> set[int]:
        """Prepare the directory and return the shard indices already written (only when resuming)."""
        d = self.directory
        if d.exists() and overwrite:
            if d.is_dir() and not (d / MANIFEST).exists() and any(d.iterdir()):
                raise CorpusError(f"--overwrite: {d} is a directory that `wde embed` did not write (no {MANIFEST});"
                                  " remove it yourself or pick another --output")
            shutil.rmtree(d) if d.is_dir() else d.unlink()
        if d.exists() and not d.is_dir():
            raise CorpusError(f"--output {d} exists and is a file; pass --overwrite to replace it")
        if d.exists() and (d / MANIFEST).exists():
            if not resume:
                raise CorpusError(f"--output {d} already exists; pass --resume to finish an interrupted run, or"
                                  " --overwrite to replace it")
            previous = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
            differ = sorted(k for k in set(previous.get("job", {})) | set(fingerprint)
                            if previous.get("job", {}).get(k) != fingerprint.get(k))
            if differ:
                raise CorpusError(f"--resume: {d} was written by a different job ({', '.join(differ)} differ);"
                                  " pass --overwrite to start over, or pick another --output")
            self.remove_temporaries()
            return {int(p.name[5:11]) for p in d.glob("part-*.parquet")}
        if d.exists() and any(d.iterdir()):
            raise CorpusError(f"--output {d} is a non-empty directory that `wde embed` did not write (no {MANIFEST})")
        d.mkdir(parents=True, exist_ok=True)
        self._write_manifest({"version": FORMAT_VERSION, "complete": False, "job": fingerprint})
        return set()

    def write(self, index: int, table: Any) -> None:
        """Write one shard atomically (temporary file + rename)."""
        import pyarrow.parquet as pq

        final = self.directory / part_name(index)
        tmp = self.directory / f".{part_name(index)}.{os.getpid()}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, final)

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
        manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        manifest.update(complete=True, rows=rows, dim=dim, shards=len(self.parts()))
        self._write_manifest(manifest)

    def is_complete(self) -> bool:
        return self.manifest_path.exists() and json.loads(self.manifest_path.read_text(encoding="utf-8"))["complete"]

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        tmp = self.directory / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.manifest_path)


def assemble_npy(writer: ShardWriter, out: Path) -> tuple[int, int]:
    """Stream the shards' embeddings into one .npy matrix (written to a temporary file, then renamed)."""
    import numpy as np
    import pyarrow.parquet as pq

    rows, dim = writer.summary()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.npy")
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
    return rows, dim
