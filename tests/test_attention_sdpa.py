"""The torch_sdpa varlen backend equals per-sequence attention, whatever the length mix."""

from __future__ import annotations

import pytest
import torch

from tests.batches import bare_backend, packed_batch
from tests.test_attention_window import reference
from wde.components.attention.torch_sdpa import TorchSDPABackend, plan_groups


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[7], [4, 4, 4], [5, 1, 17, 9, 9, 3, 30], [1, 1, 2, 64, 3]])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_varlen_matches_per_sequence(causal: bool, lens: list[int], kv_heads: int) -> None:
    torch.manual_seed(0)
    t = sum(lens)
    q, k, v = torch.randn(t, 4, 16), torch.randn(t, kv_heads, 16), torch.randn(t, kv_heads, 16)
    backend = bare_backend(TorchSDPABackend)
    out = backend.forward(q, k, v, backend.build_metadata(packed_batch(lens), causal), 0.25)
    torch.testing.assert_close(out, reference(q, k, v, lens, None, causal, 0.25), atol=1e-5, rtol=1e-5)


def test_groups_bound_padding() -> None:
    lens = [3, 50, 4, 48, 5, 47, 2, 49]
    groups = plan_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        real = sum(lens[i] for i in g)
        assert len(g) * max(lens[i] for i in g) <= 1.25 * real or len(g) == 1
    assert len(groups) >= 2
