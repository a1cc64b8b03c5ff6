"""The additive attention bias: torch_sdpa and the Triton kernel (interpreted on CPU) against per-sequence
SDPA with a float mask; bias validation; the loader's name mapping; the position-table guard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.batches import bare_backend, packed_batch
from tests.tiny_models import build_bert
from wde import Engine
from wde.components.attention.base import AttentionBackend
from wde.components.attention.torch_sdpa import TorchSDPABackend
from wde.components.model_input_builder import ModelInput
from wde.components.models.bert import BertEmbeddings, BertModel
from wde.components.models.loader import rename
from wde.errors import ModelLoadError
from wde.registry import get_registry

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENS = [5, 1, 17, 9, 3]


def _batch(lens: list[int], device: str = "cpu") -> ModelInput:
    return packed_batch(lens).to(device)


def _inputs(lens: list[int], hq: int, hkv: int, d: int = 16, device: str = "cpu"):
    g = torch.Generator().manual_seed(len(lens) + hq)
    t = sum(lens)
    return tuple(torch.randn(t, h, d, generator=g).to(device) for h in (hq, hkv, hkv))


def _reference(q, k, v, lens, causal, scale, bias):
    """Per-sequence SDPA in float32 with the bias sliced to the sequence as a float mask."""
    out, start, rep = [], 0, q.shape[1] // k.shape[1]
    for i, n in enumerate(lens):
        qs, ks, vs = (x[start:start + n].float().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        b = (bias if bias.dim() == 3 else bias[i])[:, :n, :n].float()
        if causal:
            b = b.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=b.device).tril(), float("-inf"))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=b, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


def _bias(per_seq: bool, heads: int, length: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    shape = (len(LENS), heads, length, length) if per_seq else (heads, length, length)
    return (3 * torch.randn(shape, generator=g)).to(device)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("per_seq", [False, True], ids=["shared", "per-sequence"])
@pytest.mark.parametrize("lens", [LENS, [6, 6, 6, 6, 6]], ids=["mixed", "uniform"])
def test_sdpa_bias_matches_per_sequence(lens: list[int], per_seq: bool, causal: bool) -> None:
    q, k, v = _inputs(lens, 4, 2)
    bias = _bias(per_seq, 4, max(lens) + 3)
    backend = bare_backend(TorchSDPABackend)
    meta = backend.build_metadata(_batch(lens), causal, bias=bias)
    out = backend.forward(q, k, v, meta, 1.0)
    torch.testing.assert_close(out, _reference(q, k, v, lens, causal, 1.0, bias), atol=1e-5, rtol=1e-5)
    plain = backend.forward(q, k, v, backend.build_metadata(_batch(lens), causal), 1.0)
    assert (plain - out).abs().max() > 1e-2  # the bias changed the result


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("per_seq", [False, True], ids=["shared", "per-sequence"])
def test_triton_kernel_bias_matches_per_sequence(per_seq: bool, causal: bool) -> None:
    from wde.kernels.varlen_attention import varlen_attention

    q, k, v = _inputs(LENS, 4, 2, device=DEVICE)
    bias = _bias(per_seq, 4, max(LENS) + 2, DEVICE)
    cu = _batch(LENS, DEVICE).cu_seqlens
    out = varlen_attention(q, k, v, cu, max(LENS), causal, scale=1.0, bias=bias)
    assert (out - _reference(q, k, v, LENS, causal, 1.0, bias)).abs().max().item() < 1e-5


def test_triton_kernel_bias_half_precision_and_strided() -> None:
    """A half-precision bias that is a strided view (a relative bias permuted from [L, L, heads])."""
    from wde.kernels.varlen_attention import varlen_attention

    q, k, v = (x.half() for x in _inputs(LENS, 2, 2, device=DEVICE))
    bias = _bias(False, 2, 17, DEVICE).permute(1, 2, 0).contiguous().permute(2, 0, 1).half()
    assert not bias.is_contiguous()
    out = varlen_attention(q, k, v, _batch(LENS, DEVICE).cu_seqlens, 17, False, scale=0.5, bias=bias)
    assert (out.float() - _reference(q, k, v, LENS, False, 0.5, bias)).abs().max().item() < 2e-3


@pytest.mark.parametrize("bias,message", [
    (torch.zeros(4, 16, 16), "covers"),
    (torch.zeros(2, 4, 17, 17), "2 rows for 5 sequences"),
    (torch.zeros(17, 17), r"\[heads, L, L\]"),
    (torch.zeros(4, 17, 17, dtype=torch.long), "floating-point"),
])
def test_bad_bias_is_refused(bias: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bare_backend(TorchSDPABackend).build_metadata(_batch(LENS), False, bias=bias)


def test_wrong_head_count_is_refused_by_both_backends() -> None:
    from wde.kernels.varlen_attention import varlen_attention

    q, k, v = _inputs(LENS, 4, 4)
    bias = torch.zeros(3, 17, 17)
    backend = bare_backend(TorchSDPABackend)
    with pytest.raises(ValueError, match="3 heads, the queries have 4"):
        backend.forward(q, k, v, backend.build_metadata(_batch(LENS), False, bias=bias), 1.0)
    with pytest.raises(ValueError, match="bias must be"):
        varlen_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), _batch(LENS, DEVICE).cu_seqlens, 17, False,
                         bias=bias.to(DEVICE))


def test_backend_without_bias_support_refuses_one() -> None:
    class Plain(AttentionBackend):
        name = "plain"

    assert AttentionBackend.supports_bias is False and TorchSDPABackend.supports_bias is True
    with pytest.raises(ValueError, match="'plain' does not support an attention bias"):
        bare_backend(Plain).build_metadata(_batch(LENS), False, bias=torch.zeros(4, 17, 17))
    assert bare_backend(Plain).build_metadata(_batch(LENS), False).bias is None


def test_rename_matches_whole_name_parts_in_order() -> None:
    rules = {"block.0.attn.rel": "rel", "block": "encoder.layer", "layer.0.attn.o": "attention.output.dense"}
    assert rename("block.3.layer.0.attn.o.weight", rules) == "encoder.layer.3.attention.output.dense.weight"
    assert rename("block.0.attn.rel.weight", rules) == "rel.weight"
    assert rename("blocks.0.attn.o.weight", rules) == "blocks.0.attn.o.weight"


def test_embeddings_parts_are_optional() -> None:
    from transformers import BertConfig

    cfg = BertConfig(vocab_size=50, hidden_size=8, num_attention_heads=2)
    plain = BertEmbeddings(cfg, positions=False, token_types=False, layer_norm=False)
    assert [n for n, _ in plain.named_parameters()] == ["word_embeddings.weight"]
    batch = _batch([3, 2])
    torch.testing.assert_close(plain(batch), plain.word_embeddings(batch.input_ids))


class OffsetBert(BertModel):
    """A family whose position table starts at 2 while its config's model_type says plain BERT."""

    name = "offset_bert"
    position_offset = 2


def test_a_model_declared_offset_is_checked_against_the_tokenizer(tmp_path: Path) -> None:
    """Instead of an IndexError mid-batch, the model refuses a tokenizer limit that overruns its table; the
    tokenizer's `position_offset` param brings the limit within it."""
    from wde.workflow import load_workflow

    model = build_bert(tmp_path / "bert", max_position_embeddings=128)  # tokenizer model_max_length is 128
    reg = get_registry()
    reg.add_component(OffsetBert, plugin="test")
    try:
        wf = tmp_path / "offset.yaml"
        wf.write_text("name: offset_bert\nextends: bert\nmodel: {name: offset_bert}\n"
                      "pooler: {name: sentence, params: {pooling: mean}}\n")
        load_workflow(wf, registry=reg)
        with pytest.raises(ModelLoadError, match=r"max_length <= 126 \(or tokenizer.params.position_offset: 2\)"):
            Engine.from_workflow(wf, model, device="cpu")
        with Engine.from_workflow(wf, model, device="cpu", tokenizer={"params": {"position_offset": 2}}) as engine:
            assert engine.max_length == 126
            assert engine.embed(["word " * 500], truncate=True).shape == (1, 64)
    finally:
        del reg.components["model"]["offset_bert"]
