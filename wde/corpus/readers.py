"""Stream records out of .jsonl / .parquet / .txt files, each with its (file, 1-based line) provenance.

Readers hold one line (or one parquet batch) at a time, so memory stays flat however large the input is. Lines
are read in bounded pieces: a line longer than `max_line_bytes` is refused (naming `file:line`) after reading at
most that many bytes of it, never held whole. A bad record is a `CorpusError` naming `file:line`; for parquet the
"line" is the 1-based row number (parquet bounds its rows itself).

A record is a text or, with `--image-field`, an image: a local file path (relative to the input file's folder), a
`data:image/...` URI, or (parquet) the encoded bytes. Readers never open an image file: the engine reads each one
when it admits it and decodes it when it is scheduled (docs/images.md), so a shard holds paths, not pixels. URLs
are refused here, naming `file:line`: `wde embed` never fetches.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from wde.corpus.job import INPUT_SUFFIXES, CorpusError
from wde.errors import shown

PARQUET_BATCH = 4096
IMAGE_PARQUET_BATCH = 64
"""Rows per parquet read when an image column is read: encoded images are large (a batch of 64 photos of 300 KB
is about 20 MB), so a read never holds thousands of them beyond what the shard being cut needs."""
MAX_LINE_BYTES = 16 * 1024 * 1024
"""The default longest .jsonl / .txt line (`--max-line-bytes`): a text at the engine's default limit of 1,000,000
characters takes at most 4 MB in UTF-8 and about 6 MB JSON-escaped."""
_PIECE = 1 << 16


Id = str | int
"""A record's id: a string (`FILE:LINE`, or a string --id-field), or an integer as the input gave it."""


@dataclass(frozen=True, slots=True)
class Record:
    id: Id
    text: str
    file: str
    line: int
    image: str | bytes | None = None
    """An image record's image (its `text` is then ""): an absolute file path, a `data:` URI, or encoded bytes."""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def is_data_uri(image: str | bytes) -> bool:
    """Whether an image record's `image` is a `data:` URI (else a string is an absolute file path)."""
    return isinstance(image, str) and image[:5].lower() == "data:"


ROW_DIGEST_BYTES = 4
"""Per-row digests only locate a changed row (the shard's sha256 decides whether anything changed): 4 bytes do."""


_IMAGE_FLAG = 1 << 63
"""Set in an image row's length field, so an image row never hashes like a text row with the same bytes."""
_INT_ID_FLAG = 1 << 62
"""Set in the id's length field of an integer id, so id 7 never hashes like id "7": a run resumed on an input whose
ids changed type is refused (its finished shards hold the other type), not mixed."""


def input_digests(records: Sequence[Record]) -> tuple[str, bytes]:
    """What a shard was embedded from: the sha256 (hex) of its records' ids and texts (or images) as read, and a
    short digest per row (`ROW_DIGEST_BYTES` each, concatenated) that finds the first changed row when the sha256
    differs. An image given inline (parquet bytes, a data: URI) is hashed whole; an image file is identified by its
    path, size and modification time (one `stat`, not a read: its content is not hashed)."""
    whole = hashlib.sha256()
    rows = bytearray()
    for r in records:
        rid = str(r.id).encode("utf-8", "surrogatepass")
        rid_field = len(rid) | (_INT_ID_FLAG if isinstance(r.id, int) else 0)
        if r.image is None:
            text = r.text.encode("utf-8", "surrogatepass")
            data = struct.pack("<QQ", rid_field, len(text)) + rid + text
        else:
            image = _image_identity(r.image)
            data = struct.pack("<QQ", rid_field, len(image) | _IMAGE_FLAG) + rid + image
        whole.update(data)
        rows += hashlib.blake2b(data, digest_size=ROW_DIGEST_BYTES).digest()
    return whole.hexdigest(), bytes(rows)


def _image_identity(image: str | bytes) -> bytes:
    if isinstance(image, bytes):
        return b"bytes\0" + image
    if is_data_uri(image):
        return b"uri\0" + image.encode("utf-8", "surrogatepass")
    try:
        st = os.stat(image)
        stamp = f"{st.st_size}\0{st.st_mtime_ns}"
    except (OSError, ValueError):
        stamp = "missing"  # the engine refuses it, naming file:line, when the shard is embedded
    return b"path\0" + image.encode("utf-8", "surrogatepass") + b"\0" + stamp.encode()


def _id(value: Any, where: str, id_field: str) -> Id:
    """An --id-field value as it is written out: a string, or an integer kept an integer (`typed_ids`)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise CorpusError(f"{where}: field {id_field!r} (--id-field) must be a string or an integer,"
                          f" got {type(value).__name__}")
    return value


INT64 = range(-2**63, 2**63)
"""Integer ids are written as a parquet int64 column."""


def typed_ids(records: Iterable[Record], id_type: type | None = None) -> Iterator[Record]:
    """`records` with ids of one type, as the output's `id` column holds one: `id_type`, else the type of the
    first record's id. Integer ids stay integers (they came back as strings); with string ids, an integer id is
    written as its digits; with integer ids, a string id is refused naming `file:line` (shards already written
    hold integers), as is an integer outside int64."""
    for r in records:
        if id_type is None:
            id_type = type(r.id)
        if id_type is str:
            yield r if isinstance(r.id, str) else replace(r, id=str(r.id))
            continue
        if not isinstance(r.id, int):
            raise CorpusError(f"{r.where}: id {shown(r.id)} is a string, but the first record's id is an integer, so"
                              " the id column holds integers; give every record an integer id, or write them all as"
                              " strings")
        if r.id not in INT64:
            raise CorpusError(f"{r.where}: id {r.id} does not fit the id column's 64-bit integers; write the ids as"
                              " strings")
        yield r


def _text(value: Any, where: str, text_field: str) -> str:
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise CorpusError(f"{where}: field {text_field!r} (--text-field) must be a string, got {got}")
    return value


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _image(value: Any, where: str, image_field: str | None, folder: str) -> str | bytes:
    """An image field's value (`image_field` None: a .txt line) as a record holds it: bytes as they are, a `data:`
    URI as it is, a file path made absolute (a relative one is relative to the input file's folder); a URL or
    anything else is refused."""
    what = "the line" if image_field is None else f"field {image_field!r} (--image-field)"
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            raise CorpusError(f"{where}: {what} is empty: no image bytes")
        return bytes(value)
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise CorpusError(f"{where}: {what} must be an image file path or a data:image/... URI (or, in parquet, a"
                          f" binary column of image bytes), got {got}")
    if not value.strip():
        raise CorpusError(f"{where}: {what} is empty: no image file path")
    if is_data_uri(value):
        return value
    shown = value if len(value) <= 120 else value[:120] + "..."
    if _URL.match(value):
        raise CorpusError(f"{where}: {what} is a URL ({shown}); wde embed never fetches images: download them"
                          " and give their local file paths")
    if "\0" in value:
        raise CorpusError(f"{where}: {what} is not a file path (it holds a NUL character)")
    return os.path.abspath(os.path.join(folder, value))


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


@dataclass(frozen=True)
class Fields:
    """Which fields a record may take its content from: a text field, an image field, or both (a mixed corpus,
    where each record has exactly one of them; a null value counts as absent)."""

    text: str | None = "text"
    image: str | None = None

    @property
    def mixed(self) -> bool:
        return self.text is not None and self.image is not None

    def pick(self, where: str, has: Any, get: Any, keys: Any, folder: str) -> tuple[str, str | bytes | None]:
        """(text, image) of one record: `has(field)`, `get(field)` read it, `keys()` lists what it has instead."""
        text_field, image_field = self.text, self.image
        if image_field is None:
            if not has(text_field):
                raise CorpusError(f"{where}: no {text_field!r} field (--text-field); the object has {keys()}")
            return _text(get(text_field), where, text_field), None  # type: ignore[arg-type]
        if text_field is None:
            if not has(image_field):
                raise CorpusError(f"{where}: no {image_field!r} field (--image-field); the object has {keys()}")
            return "", _image(get(image_field), where, image_field, folder)
        is_text = has(text_field) and get(text_field) is not None
        is_image = has(image_field) and get(image_field) is not None
        if is_text and is_image:
            raise CorpusError(f"{where}: has both {text_field!r} (--text-field) and {image_field!r} (--image-field);"
                              " a record is a text or an image: give each record one of them")
        if not is_text and not is_image:
            raise CorpusError(f"{where}: has neither {text_field!r} (--text-field) nor {image_field!r}"
                              f" (--image-field); the object has {keys()}")
        if is_text:
            return _text(get(text_field), where, text_field), None
        return "", _image(get(image_field), where, image_field, folder)


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


def read_jsonl(path: str, text_field: str | None = "text", id_field: str | None = None,
               max_line_bytes: int = MAX_LINE_BYTES, image_field: str | None = None) -> Iterator[Record]:
    """One record per non-blank line: a JSON string (a text, or with `image_field` alone an image path or data:
    URI), or an object with `text_field` and/or `image_field` (and `id_field`)."""
    name = Path(path).name
    fields, folder = Fields(text_field, image_field), _folder(path)
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
            content = text_field or image_field
            if id_field is not None:
                raise CorpusError(f"{where}: a bare JSON string has no {id_field!r} field (--id-field);"
                                  " write objects like {" f'"{id_field}": ..., "{content}": ...' "}")
            if fields.mixed:
                raise CorpusError(f"{where}: a bare JSON string is neither a {text_field!r} (--text-field) nor an"
                                  f" {image_field!r} (--image-field) field; write objects like"
                                  " {" f'"{text_field}": ...' "} or {" f'"{image_field}": ...' "}")
            if text_field is None:
                yield Record(f"{name}:{n}", "", path, n, _image(obj, where, image_field, folder))
            else:
                yield Record(f"{name}:{n}", obj, path, n)
            continue
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: expected a JSON object or string, got {type(obj).__name__}")
        text, image = fields.pick(where, obj.__contains__, obj.get, lambda: sorted(obj)[:10], folder)
        if id_field is None:
            rid = f"{name}:{n}"
        elif id_field not in obj:
            raise CorpusError(f"{where}: no {id_field!r} field (--id-field); the object has {sorted(obj)[:10]}")
        else:
            rid = _id(obj[id_field], where, id_field)
        yield Record(rid, text, path, n, image)


def read_txt(path: str, skip_blank: bool = False, max_line_bytes: int = MAX_LINE_BYTES,
             images: bool = False) -> Iterator[Record]:
    """One text per line (with `images`: one image file path or data: URI per line), so output rows line up with
    input lines: a blank line is an error unless `skip_blank` (then it is skipped, and ids, `file:line`, still say
    where each row came from)."""
    name = Path(path).name
    folder = _folder(path)
    for n, raw in bounded_lines(path, max_line_bytes):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise CorpusError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        if not line.strip():
            if skip_blank:
                continue
            raise CorpusError(f"{where}: blank line; each line is one {'image' if images else 'text'} and output"
                              " rows line up with lines: remove it, or pass --skip-blank to skip blank lines")
        if images:
            yield Record(f"{name}:{n}", "", path, n, _image(line, where, None, folder))
        else:
            yield Record(f"{name}:{n}", line, path, n)


def _image_column_type(pa: Any, path: str, image_field: str, schema: Any) -> None:
    """Refuse an image column of any type but binary (encoded files) or string (paths, data URIs), before reading."""
    kind = schema.field(image_field).type
    if not (pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind)
            or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise CorpusError(f"{path}: column {image_field!r} (--image-field) is {kind}; it must hold image bytes"
                          " (binary) or image file paths / data:image/... URIs (string)")


def read_parquet(path: str, text_field: str | None = "text", id_field: str | None = None,
                 image_field: str | None = None) -> Iterator[Record]:
    """One record per row, read a batch at a time; the row's 1-based number stands for the line. With
    `image_field`, a binary column holds encoded images, a string column paths (relative to the file's folder) or
    data: URIs; with both fields, a column that is missing counts as null in every row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = Path(path).name
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise CorpusError(f"{path}: not a readable parquet file: {e}") from None
    schema = pf.schema_arrow
    columns = schema.names
    fields = Fields(text_field, image_field)
    content = [(f, flag) for f, flag in ((text_field, "--text-field"), (image_field, "--image-field")) if f is not None]
    if fields.mixed and not any(f in columns for f, _ in content):
        raise CorpusError(f"{path}: no column {text_field!r} (--text-field) nor {image_field!r} (--image-field);"
                          f" columns: {columns}")
    for field, flag in ([] if fields.mixed else content) + [(id_field, "--id-field")]:
        if field is not None and field not in columns:
            raise CorpusError(f"{path}: no column {field!r} ({flag}); columns: {columns}")
    present = [f for f, _ in content if f in columns]
    if image_field in present:
        _image_column_type(pa, path, image_field, schema)  # type: ignore[arg-type]
    wanted = list(dict.fromkeys(present + ([id_field] if id_field is not None else [])))
    folder = _folder(path)
    row = 0
    size = IMAGE_PARQUET_BATCH if image_field in present else PARQUET_BATCH
    for batch in pf.iter_batches(batch_size=size, columns=wanted):
        values = {f: batch.column(f).to_pylist() for f in present}
        ids = batch.column(id_field).to_pylist() if id_field is not None else None
        for i in range(batch.num_rows):
            n = row + i + 1
            where = f"{path}:{n}"
            rid = f"{name}:{n}" if ids is None else _id(ids[i], where, id_field)  # type: ignore[arg-type]
            text, image = fields.pick(where, values.__contains__, lambda f: values[f][i], lambda: present, folder)
            yield Record(rid, text, path, n, image)
        row += batch.num_rows


def check_inputs(paths: Sequence[str], text_field: str | None = "text", id_field: str | None = None,
                 image_field: str | None = None) -> None:
    """What can be checked without reading the data (parquet columns and their types), so a wrong flag fails
    before the model loads and before any output is made."""
    for path in paths:
        if Path(path).suffix.lower() == ".parquet":
            next(iter(read_parquet(path, text_field, id_field, image_field)), None)


def read_records(paths: Sequence[str], text_field: str | None = "text", id_field: str | None = None,
                 skip_blank: bool = False, max_line_bytes: int = MAX_LINE_BYTES,
                 image_field: str | None = None, id_type: type | None = None) -> Iterator[Record]:
    """Every record of every file, in order (a .txt file's lines are image paths when `image_field` is set), with
    ids of one type (`typed_ids`: `id_type`, else the first record's)."""
    return typed_ids(_records(paths, text_field, id_field, skip_blank, max_line_bytes, image_field), id_type)


def first_id_type(paths: Sequence[str], text_field: str | None = "text", id_field: str | None = None,
                  skip_blank: bool = False, max_line_bytes: int = MAX_LINE_BYTES,
                  image_field: str | None = None) -> type:
    """The type of the first record's id, which decides the id column's (str for an empty input): for readers
    that read the files apart (a Ray read task per file) and must agree on it."""
    first = next(_records(paths, text_field, id_field, skip_blank, max_line_bytes, image_field), None)
    return str if first is None else type(first.id)


def _records(paths: Sequence[str], text_field: str | None, id_field: str | None, skip_blank: bool,
             max_line_bytes: int, image_field: str | None) -> Iterator[Record]:
    for path in paths:
        suffix = Path(path).suffix.lower()
        if suffix == ".jsonl":
            yield from read_jsonl(path, text_field, id_field, max_line_bytes, image_field)
        elif suffix == ".txt":
            yield from read_txt(path, skip_blank, max_line_bytes, images=image_field is not None)
        elif suffix == ".parquet":
            yield from read_parquet(path, text_field, id_field, image_field)
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
