"""Quantized embeddings for the API (`embed_dtype`, Cohere's `embedding_types`), with sentence-transformers'
`quantize_embeddings` semantics.

- binary / ubinary: one bit per dimension, set where the value is > 0, packed 8 to a byte with
  `np.packbits` (the first dimension is the highest bit; a width not divisible by 8 is padded with 0 bits).
  ubinary is the packed byte (0..255); binary is that byte - 128 as int8.
- int8 / uint8: each dimension d has a range [start_d, stop_d] cut into 255 equal steps;
  uint8 = clip(floor((x_d - start_d) / step_d), 0, 255), int8 = uint8 - 128 (a zero-width range has step 1).

The int8/uint8 ranges:
- with calibration ranges (`wde serve --quantization-ranges ranges.npy`: a (2, dim) array of per-dimension
  minima and maxima, what `quantize_embeddings(..., calibration_embeddings=C)` derives from C), every vector
  is quantized exactly as `quantize_embeddings(x, precision, ranges=ranges)` does;
- without them, each vector uses its own symmetric range [-max|x|, +max|x|] in every dimension. The codes are
  then ~127.5 / max|x| times the vector (minus the 0.5 that floor costs), so cosine similarity on codes
  approximates it on floats, and a text's codes never depend on which other texts share its request.
  sentence-transformers' own default (ranges from the batch being quantized) is not used: a server's answer for
  a text would change with the texts sent beside it, and one text alone has no range at all.
"""

from __future__ import annotations

import base64
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np

Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]
PRECISIONS: tuple[str, ...] = ("float32", "int8", "uint8", "binary", "ubinary")


def quantize(embeddings: np.ndarray, precision: Precision, ranges: np.ndarray | None = None) -> np.ndarray:
    """`embeddings` [n, dim] (float) in `precision`; `ranges` [2, dim] for int8/uint8 (None: per-vector ranges)."""
    x = np.asarray(embeddings, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be [n, dim], got shape {x.shape}")
    if precision == "float32":
        return x
    if precision == "ubinary":
        return np.packbits(x > 0, axis=-1)
    if precision == "binary":
        return (np.packbits(x > 0, axis=-1).astype(np.int16) - 128).astype(np.int8)
    if precision not in ("int8", "uint8"):
        raise ValueError(f"precision {precision!r} is not one of {list(PRECISIONS)}")
    if ranges is None:
        bound = np.abs(x).max(axis=1, keepdims=True)
        starts, steps = -bound, 2 * bound / 255
    else:
        ranges = np.asarray(ranges, dtype=np.float32)
        if ranges.shape != (2, x.shape[1]):
            raise ValueError(f"ranges must have shape (2, {x.shape[1]}), got {ranges.shape}")
        starts, steps = ranges[0][None, :], ((ranges[1] - ranges[0]) / 255)[None, :]
    steps = np.where(steps == 0, 1, steps)
    codes = np.clip(np.floor((x - starts) / steps), 0, 255)
    return codes.astype(np.uint8) if precision == "uint8" else (codes - 128).astype(np.int8)


def to_base64(vector: np.ndarray) -> str:
    """The vector's bytes, base64: little-endian float32 for floats (OpenAI's and Cohere's format), the raw
    bytes for int8 / uint8 / packed bits."""
    v = np.ascontiguousarray(vector)
    if v.dtype.kind == "f":
        v = np.ascontiguousarray(v, dtype="<f4")
    return base64.b64encode(v.tobytes()).decode("ascii")


@lru_cache(maxsize=4)
def load_ranges(path: str) -> np.ndarray:
    """Calibration ranges from a `.npy` file: shape (2, dim), row 0 the minima, row 1 the maxima, finite."""
    file = Path(path).expanduser()
    try:
        ranges = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"quantization ranges {file}: cannot read a .npy array ({e})") from None
    if ranges.ndim != 2 or ranges.shape[0] != 2 or ranges.shape[1] < 1 or ranges.dtype.kind not in "fiu":
        raise ValueError(f"quantization ranges {file}: expected a numeric array of shape (2, dim) (minima, maxima),"
                         f" got {ranges.dtype} {ranges.shape}")
    ranges = ranges.astype(np.float32)
    if not np.isfinite(ranges).all() or (ranges[0] > ranges[1]).any():
        raise ValueError(f"quantization ranges {file}: values must be finite with row 0 (minima) <= row 1 (maxima)")
    ranges.setflags(write=False)
    return ranges


def calibration_ranges(calibration: np.ndarray) -> np.ndarray:
    """The (2, dim) ranges of a calibration set, as sentence-transformers derives them: per-dimension min, max."""
    c = np.asarray(calibration, dtype=np.float32)
    return np.vstack((c.min(axis=0), c.max(axis=0)))


def quantize_rows(vectors: list[np.ndarray], precision: Precision, ranges_path: str | None,
                  field: str) -> list[np.ndarray]:
    """A request's vectors in `precision`, with the server's calibration ranges (if any) for int8/uint8.

    Raises `ApiError` naming `field` when the ranges were calibrated for another width than these vectors.
    """
    from wde.server.errors import ApiError

    if precision == "float32":
        return [np.asarray(v, dtype=np.float32) for v in vectors]
    x = np.stack(vectors)
    ranges = None
    if precision in ("int8", "uint8") and ranges_path is not None:
        ranges = load_ranges(ranges_path)
        if ranges.shape[1] != x.shape[1]:
            raise ApiError("unsupported", f"{field}: the server's {precision} calibration ranges cover"
                           f" {ranges.shape[1]} dimensions but these embeddings have {x.shape[1]}; ask for"
                           f" {ranges.shape[1]} dimensions, or float32/binary/ubinary", field)
    return list(quantize(x, precision, ranges))
