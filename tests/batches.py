"""Packed batches built straight from sequence lengths, for tests of the components that read a `ModelInput`."""

from __future__ import annotations

import torch

from wde.components.attention.base import AttentionBackend, AttentionParams
from wde.components.model_input_builder import ModelInput
from wde.request import PoolingParams


def packed_batch(lens: list[int], input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                 pooling_params: list[PoolingParams] | None = None) -> ModelInput:
    """A `ModelInput` of sequences with these lengths (token ids 0 unless given; positions restart per sequence)."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lens])
    ids = torch.zeros(sum(lens), dtype=torch.long) if input_ids is None else input_ids
    return ModelInput(ids, positions, cu, list(lens), max(lens), token_type_ids, pooling_params or [])


def bare_backend(cls: type[AttentionBackend]) -> AttentionBackend:
    """An attention backend of class `cls` with default params, built without a model folder (its `__init__` reads
    the model's config)."""
    backend = cls.__new__(cls)
    backend.params = AttentionParams()
    return backend
