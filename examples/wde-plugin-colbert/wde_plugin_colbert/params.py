"""Params of the plugin's components, torch-free so `wde validate` and `wde plugins` read them without torch."""

from __future__ import annotations

from pydantic import Field

from wde.api import HFTokenizerParams, ModelParams


class ColbertTokenizerParams(HFTokenizerParams):
    query_length: int = Field(32, gt=2, description="queries are cut or [MASK]-padded to this many tokens")


class ColbertModelParams(ModelParams):
    dim: int = Field(128, gt=0, description="width of the checkpoint's `linear` projection (ColBERT's `dim`)")
