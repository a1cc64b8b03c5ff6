"""The `mean_max` pooler's params, in a module without torch: `wde validate` and `wde plugins` read them
without importing the pooler (registered lazily in plugin.py)."""

from __future__ import annotations

from pydantic import Field

from wde.components.base import Params


class MeanMaxParams(Params):
    normalize: bool = Field(True, description="L2-normalize the concatenated vector (per-request override wins)")
    max_weight: float = Field(1.0, gt=0, description="scale of the max half relative to the mean half")
