"""Params of the plugin's components, in a module that imports no torch: `wde validate` and `wde plugins` read
them without importing the components themselves (they are registered as `LazyComponent`s)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from wde.api import Params


class DensePoolerParams(Params):
    pooling: Literal["auto", "mean", "cls", "max"] = Field(
        "auto", description="auto: the mode in the model's sentence-transformers Pooling config")
    normalize: bool | Literal["auto"] = Field(
        "auto", description="auto: true when the model's modules.json has a Normalize module")
