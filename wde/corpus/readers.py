"""Stream records out of .jsonl / .parquet / .txt files, each with its (file, 1-based line) provenance.

Readers hold one line (or one parquet batch) at a time, so memory stays flat however large the input is. Lines
are read in bounded pieces: a line longer than `max_line_bytes` is refused (naming `file:line`) after reading at
most that many bytes of it, never held whole. A bad record is a `CorpusError` naming `file:line`; for parquet the
"line" is the 1-based row number (parquet bounds its rows itself).
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from wde.corpus.job import INPUT_SUFFIXES, CorpusError

PARQUET_BATCH = 4096
MAX_LINE_BYTES = 16 * 1024 * 1024
"""The default longest .jsonl / .txt line (`--max-line-bytes`): a text at the engine's default limit of 1,000,000
characters takes at most 4 MB in UTF-8 and about 6 MB JSON-escaped."""
_PIECE = 1 << 16


@dataclass(frozen=True, slots=True)
class Record:
    id: str
    text: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


ROW_DIGEST_BYTES = 4
"""Per-row digests only locate a changed row (the shard's sha256 decides whether anything changed): 4 bytes do."""


def input_digests(records: Sequence[Record]) -> tuple[str, bytes]:
    """What a shard was embedded from: the sha256 (hex) of its records' ids and texts as read, and a short digest
    per row (`ROW_DIGEST_BYTES` each, concatenated) that finds the first changed row when the sha256 differs."""
    whole = hashlib.sha256()
    rows = bytearray()
    for r in records:
        rid, text = r.id.encode("utf-8", "surrogatepass"), r.text.encode("utf-8", "surrogatepass")
        data = struct.pack("<QQ", len(rid), len(text)) + rid + text
        whole.update(data)
        rows += hashlib.blake2b(data, digest_size=ROW_DIGEST_BYTES).digest()
    return whole.hexdigest(), bytes(rows)


def _id(value: Any, where: str, id_field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise CorpusError(f"{where}: field {id_field!r} (--id-field) must be a string or an integer,"
                          f" got {type(value).__name__}")
    return str(value)


def _text(value: Any, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise CorpusError(f"{where}: field {text_field!r} (--text-field) must be a string, got {got}")
    return value


def bounded_lines(path: str, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | bytearray]]:
    """(1-based number, raw bytes with the line break) of each line of `path`, read in pieces of at most 64 KiB:
    a line longer than `max_line_bytes` (not counting its line break) is a `CorpusError` naming `path:line`, raised
    after at most `max_line_bytes` + 64 KiB of it were read, so a huge line never sits in memory whole."""
    with open(path, "rb") as f:
        n = 0
        while piece := f.readline(_PIECE):
            n += 1
            if piece.endswith(b"\n") or len(piece) < _PIECE:  # the common case: a whole line in one piece
                line: bytes | bytearray = piece
            else:
                line = bytearray(piece)
                while not line.endswith(b"\n") and len(line) <= max_line_bytes + 2:
                    if not (piece := f.readline(_PIECE)):
                        break
                    line += piece
            if len(line) - _line_break(line) > max_line_bytes:
                raise CorpusError(f"{path}:{n}: line longer than {max_line_bytes:,} bytes (--max-line-bytes); refused"
                                  " without reading it whole: split the text, or raise --max-line-bytes")
            yield n, line


def _line_break(line: bytes | bytearray) -> int:
    return 2 if line.endswith(b"\r\n") else 1 if line.endswith(b"\n") else 0


def read_jsonl(path: str, text_field: str = "text", id_field: str | None = None,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Record]:
    """One record per non-blank line: a JSON string, or an object with `text_field` (and `id_field`)."""
    name = Path(path).name
    for n, raw in bounded_lines(path, max_line_bytes):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            raise CorpusError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
        if isinstance(obj, str):
            if id_field is not None:
                raise CorpusError(f"{where}: a bare JSON string has no {id_field!r} field (--id-field);"
                                  " write objects like {" f'"{id_field}": ..., "{text_field}": ...' "}")
            yield Record(f"{name}:{n}", obj, path, n)
            continue
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: expected a JSON object or string, got {type(obj).__name__}")
        if text_field not in obj:
            raise CorpusError(f"{where}: no {text_field!r} field (--text-field); the object has"
                              f" {sorted(obj)[:10]}")
        text = _text(obj[text_field], where, text_field)
        if id_field is None:
            rid = f"{name}:{n}"
        elif id_field not in obj:
            raise CorpusError(f"{where}: no {id_field!r} field (--id-field); the object has {sorted(obj)[:10]}")
        else:
            rid = _id(obj[id_field], where, id_field)
        yield Record(rid, text, path, n)


def read_txt(path: str, skip_blank: bool = False, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Record]:
    """One text per line, so output rows line up with input lines: a blank line is an error unless
    `skip_blank` (then it is skipped, and ids, `file:line`, still say where each row came from)."""
    name = Path(path).name
    for n, raw in bounded_lines(path, max_line_bytes):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise CorpusError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        if not line.strip():
            if skip_blank:
                continue
            raise CorpusError(f"{where}: blank line; each line is one text and output rows line up with"
                              " lines: remove it, or pass --skip-blank to skip blank lines")
        yield Record(f"{name}:{n}", line, path, n)


def read_parquet(path: str, text_field: str = "text", id_field: str | None = None) -> Iterator[Record]:
    """One record per row, read a batch at a time; the row's 1-based number stands for the line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = Path(path).name
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise CorpusError(f"{path}: not a readable parquet file: {e}") from None
    columns = pf.schema_arrow.names
    for field, flag in ((text_field, "--text-field"), (id_field, "--id-field")):
        if field is not None and field not in columns:
            raise CorpusError(f"{path}: no column {field!r} ({flag}); columns: {columns}")
    wanted = [text_field] + ([id_field] if id_field is not None and id_field != text_field else [])
    row = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=wanted):
        texts = batch.column(text_field).to_pylist()
        ids = batch.column(id_field).to_pylist() if id_field is not None else None
        for i, text in enumerate(texts):
            n = row + i + 1
            where = f"{path}:{n}"
            rid = f"{name}:{n}" if ids is None else _id(ids[i], where, id_field)  # type: ignore[arg-type]
            yield Record(rid, _text(text, where, text_field), path, n)
        row += len(texts)


def check_inputs(paths: Sequence[str], text_field: str = "text", id_field: str | None = None) -> None:
    """What can be checked without reading the data (parquet columns), so a wrong flag fails before the model
    loads and before any output is made."""
    for path in paths:
        if Path(path).suffix.lower() == ".parquet":
            next(iter(read_parquet(path, text_field, id_field)), None)


def read_records(paths: Sequence[str], text_field: str = "text", id_field: str | None = None,
                 skip_blank: bool = False, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[Record]:
    """Every record of every file, in order."""
    for path in paths:
        suffix = Path(path).suffix.lower()
        if suffix == ".jsonl":
            yield from read_jsonl(path, text_field, id_field, max_line_bytes)
        elif suffix == ".txt":
            yield from read_txt(path, skip_blank, max_line_bytes)
        elif suffix == ".parquet":
            yield from read_parquet(path, text_field, id_field)
        else:
            raise CorpusError(f"--input {path}: unsupported suffix {suffix!r}; supported: {', '.join(INPUT_SUFFIXES)}")


def count_records(paths: Sequence[str]) -> int:
    """About how many records the inputs hold (lines, or parquet rows), for a progress bar's total and ETA."""
    total = 0
    for path in paths:
        if Path(path).suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
            continue
        last = b"\n"
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                total += chunk.count(b"\n")
                last = chunk[-1:]
        total += last != b"\n"
    return total


def shards(records: Iterable[Record], size: int) -> Iterator[tuple[int, list[Record]]]:
    """Consecutive runs of `size` records, numbered from 0: shard k always holds records [k*size, (k+1)*size)."""
    it = iter(records)
    index = 0
    while chunk := list(islice(it, size)):
        yield index, chunk
        index += 1
