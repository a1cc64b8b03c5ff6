"""The key mask (`ModelInput.key_mask`): every backend equals a dense per-sequence softmax over the masked scores,
with the causal mask, a window and an additive bias where the backend takes them, GQA, mixed lengths and sequences
with no masked key (the Triton kernel in the interpreter on small shapes); a query left with no key outputs zeros;
a batch without a mask builds what it built before; backends and heads that cannot honour a mask refuse it by
name; a tiny BERT with a key mask equals transformers' BertModel with `attention_mask` zeros at the same tokens on
every backend, and DeBERTa-v2 (relative attention, convolution) does on the tokens transformers leaves unmasked."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.batches import bare_backend, packed_batch
from wde import Engine
from wde.components.attention import cpu_varlen
from wde.components.attention.auto import AutoBackend
from wde.components.attention.base import AttentionBackend, window_keys
from wde.components.attention.cpu_flash import CpuFlashVarlenBackend, prefer_cpu_flash
from wde.components.attention.cpu_varlen import CpuVarlenBackend
from wde.components.attention.torch_sdpa import TorchSDPABackend
from wde.components.model_input_builder import ModelInput

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXED = [5, 1, 17, 9, 3, 9, 9]
"""Padded groups in torch_sdpa, runs of one length in cpu_varlen, a one-token sequence."""
UNIFORM = [6, 6, 6, 6]
"""One length: torch_sdpa's unpadded fast path, were there no mask."""
LONG = [300, 40, 133]
"""Longer than cpu_varlen's WINDOW_BLOCK: a window splits them into query blocks; auto sends them to cpu_varlen."""
WINDOW = (4, 2)


def key_mask(lens: list[int], seed: int, dead: int | None = None) -> torch.Tensor:
    """About a third of the keys masked; sequence 0 has none masked, sequence `dead` all of them."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(sum(lens), generator=g) > 0.35
    mask[:lens[0]] = True
    if dead is not None:
        start = sum(lens[:dead])
        mask[start:start + lens[dead]] = False
    return mask


def masked_batch(lens: list[int], mask: torch.Tensor | None) -> ModelInput:
    return replace(packed_batch(lens), key_mask=mask)


def inputs(lens: list[int], kv_heads: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(len(lens) + kv_heads)
    t = sum(lens)
    return tuple(torch.randn(t, h, 16, generator=g).to(device) for h in (4, kv_heads, kv_heads))


def attention_bias(lens: list[int], device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return (2 * torch.randn(len(lens), 4, max(lens), max(lens), generator=g)).to(device)


def reference(q, k, v, lens, mask, causal, window, bias, scale) -> torch.Tensor:
    """Plain torch, per sequence, in float64: the scaled scores plus the bias, -inf wherever the key mask, the
    causal mask or the window says no, softmax over the keys (a row with no key left: zeros), times v."""
    out, start, rep = [], 0, q.shape[1] // k.shape[1]
    for i, n in enumerate(lens):
        qs, ks, vs = (x[start:start + n].cpu().double().transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        if bias is not None:
            scores = scores + bias[i, :, :n, :n].cpu().double()
        keep = mask[start:start + n].cpu()[None, :] & window_keys(n, window, causal)
        probs = scores.masked_fill(~keep, -math.inf).softmax(-1).nan_to_num(0.0)
        out.append((probs @ vs).transpose(0, 1).float())
        start += n
    return torch.cat(out)


def auto_backend() -> AttentionBackend:
    """`auto` over bare CPU backends (its `__init__` reads a model folder's config)."""
    auto = bare_backend(AutoBackend)
    auto._cpu = auto._cuda = bare_backend(TorchSDPABackend)  # type: ignore[attr-defined]
    auto._cpu_varlen = bare_backend(CpuVarlenBackend)  # type: ignore[attr-defined]
    auto._cpu_flash = bare_backend(CpuFlashVarlenBackend)  # type: ignore[attr-defined]
    return auto


CPU_BACKENDS = {"torch_sdpa": lambda: bare_backend(TorchSDPABackend), "cpu_varlen": lambda: bare_backend(
    CpuVarlenBackend), "auto": auto_backend}


@pytest.mark.parametrize(("name", "biased"), [("torch_sdpa", False), ("torch_sdpa", True), ("cpu_varlen", False),
                                              ("auto", False), ("auto", True)])  # cpu_varlen takes no bias
@pytest.mark.parametrize("lens", [MIXED, UNIFORM, LONG], ids=["mixed", "uniform", "long"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", [None, WINDOW], ids=["global", "window"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_cpu_backends_match_the_dense_reference(name: str, lens: list[int], causal: bool, window: tuple | None,
                                                biased: bool, kv_heads: int) -> None:
    backend = CPU_BACKENDS[name]()
    q, k, v = inputs(lens, kv_heads)
    mask = key_mask(lens, seed=len(lens) + causal, dead=1)
    bias = attention_bias(lens) if biased else None
    meta = backend.build_metadata(masked_batch(lens, mask), causal, bias, window)
    assert meta.key_mask is mask
    if name == "auto":  # unbiased: cpu_flash_varlen for short ones where its kernel is built, else a window or long go
        routed = CpuVarlenBackend if not biased and (window or lens is LONG) else TorchSDPABackend  # to cpu_varlen
        routed = CpuFlashVarlenBackend if not biased and prefer_cpu_flash(lens) else routed
        assert type(meta.extra[0]) is routed
    out = backend.forward(q, k, v, meta, 0.3)
    expected = reference(q, k, v, lens, mask, causal, window, bias, 0.3)
    assert (out - expected).abs().max().item() <= 1e-5
    unmasked = backend.forward(q, k, v, backend.build_metadata(packed_batch(lens), causal, bias, window), 0.3)
    assert (unmasked - out).abs().max().item() > 1e-2  # the mask changed the result


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("window", [None, WINDOW], ids=["global", "window"])
@pytest.mark.parametrize("biased", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_triton_kernel_matches_the_dense_reference(causal: bool, window: tuple | None, biased: bool,
                                                   kv_heads: int) -> None:
    from wde.kernels import varlen_attention

    if not varlen_attention.INTERPRETED and not torch.cuda.is_available():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    dev = "cpu" if varlen_attention.INTERPRETED else "cuda"  # compiled kernels (a GPU host) take CUDA tensors
    lens = MIXED
    q, k, v = inputs(lens, kv_heads, dev)
    mask = key_mask(lens, seed=5 + causal, dead=1)
    bias = attention_bias(lens, dev) if biased else None
    cu = packed_batch(lens).cu_seqlens.to(dev)
    out = varlen_attention.varlen_attention(q, k, v, cu, max(lens), causal, 0.3, bias=bias, window=window,
                                            key_mask=mask.to(dev))
    tol = 1e-5 if dev == "cpu" else 5e-3  # compiled float32 dots may run in TF32 on the GPU
    assert (out.cpu() - reference(q, k, v, lens, mask, causal, window, bias, 0.3)).abs().max().item() <= tol


def test_a_query_with_no_key_outputs_zeros_on_every_backend() -> None:
    """Sequence 1 has every key masked; with the causal mask, sequence 2's first query sees only its masked first
    key. Those rows are zeros (not NaN, not the unmasked attention), the other rows are untouched. On a GPU host
    the SDPA backends run on CUDA too, where SDPA's own kernels handle a fully masked row."""
    from wde.kernels import varlen_attention

    lens = [4, 3, 5]
    mask = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 0, 1], dtype=torch.bool)
    dead = torch.tensor([4, 5, 6, 7])  # with causal: and sequence 2's first query (token 7)
    expected = reference(*inputs(lens, 2), lens, mask, True, None, None, 0.5)
    for dev in dict.fromkeys(["cpu", DEVICE]):
        q, k, v = inputs(lens, 2, dev)
        batch = masked_batch(lens, mask).to(dev)
        outs = {name: make().forward(q, k, v, make().build_metadata(batch, True), 0.5)
                for name, make in CPU_BACKENDS.items()}
        if varlen_attention.INTERPRETED or dev == "cuda":
            outs["triton_varlen"] = varlen_attention.varlen_attention(q, k, v, batch.cu_seqlens, 5, True, 0.5,
                                                                      key_mask=batch.key_mask)
        for name, out in outs.items():
            assert torch.isfinite(out).all(), (name, dev)
            assert (out[dead.to(dev)] == 0).all(), (name, dev)
            assert (out.cpu() - expected).abs().max().item() <= (1e-5 if dev == "cpu" else 5e-3), (name, dev)


def test_cpu_varlen_reads_the_mask_as_a_view() -> None:
    """No copy of the key mask for a bidirectional run without a window: the run's [n, 1, 1, len] mask is a view."""
    lens = [8, 8, 5]
    mask = key_mask(lens, seed=2)
    meta = bare_backend(CpuVarlenBackend).build_metadata(masked_batch(lens, mask), False)
    runs, _, calls = meta.extra
    assert len(runs) == 2
    for (start, n, length), [(_, _, _, _, view, dead)] in zip(runs, calls):
        assert view.shape == (n, 1, 1, length) and view.data_ptr() == mask[start:].data_ptr() and dead is None


def test_a_batch_without_a_mask_builds_nothing_new(monkeypatch: pytest.MonkeyPatch) -> None:
    """No key mask: torch_sdpa keeps its mask-free fast path for one length, cpu_varlen its `is_causal` calls with
    no mask tensor; the kernel is launched with HAS_KEY_MASK off."""
    sdpa = bare_backend(TorchSDPABackend).build_metadata(packed_batch(UNIFORM), True)
    assert sdpa.key_mask is None and sdpa.extra is None
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append(kwargs)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(cpu_varlen.F, "scaled_dot_product_attention", spy)
    backend = bare_backend(CpuVarlenBackend)
    meta = backend.build_metadata(packed_batch(MIXED), True)
    assert meta.extra[2] is None
    q, k, v = inputs(MIXED, 4)
    backend.forward(q, k, v, meta, 0.3)
    assert seen and all("attn_mask" not in kwargs and kwargs["is_causal"] in (True, False) for kwargs in seen)


def test_a_backend_without_support_refuses_a_mask_by_name() -> None:
    class Plain(AttentionBackend):
        name = "plain"

    assert AttentionBackend.supports_key_mask is False
    assert all(make().supports_key_mask for make in CPU_BACKENDS.values())
    with pytest.raises(ValueError, match="'plain' does not support a key mask"):
        bare_backend(Plain).build_metadata(masked_batch(MIXED, key_mask(MIXED, 0)), False)
    assert bare_backend(Plain).build_metadata(packed_batch(MIXED), False).key_mask is None


@pytest.mark.parametrize(("mask", "message"), [
    (torch.ones(sum(MIXED)), "boolean"),
    (torch.ones(sum(MIXED) - 1, dtype=torch.bool), r"\[tokens\] = \[53\]"),
    (torch.ones(1, sum(MIXED), dtype=torch.bool), r"\[tokens\]"),
])
def test_bad_masks_are_refused(mask: torch.Tensor, message: str) -> None:
    from wde.kernels.varlen_attention import varlen_attention

    for make in CPU_BACKENDS.values():
        with pytest.raises(ValueError, match=message):
            make().build_metadata(masked_batch(MIXED, mask), False)
    q, k, v = inputs(MIXED, 4, DEVICE)
    with pytest.raises(ValueError, match="key_mask must be a boolean"):
        varlen_attention(q, k, v, packed_batch(MIXED).cu_seqlens.to(DEVICE), max(MIXED), False,
                         key_mask=mask.to(DEVICE))


def test_the_mask_travels_with_the_batch() -> None:
    """`to`, `select` (a copy in the new order) and `split` (views) carry each token's entry with the token."""
    batch = masked_batch(MIXED, key_mask(MIXED, 1))
    ids = torch.arange(batch.num_tokens)
    batch = replace(batch, input_ids=ids)
    assert batch.to("cpu").key_mask is not None
    picked = batch.select([3, 0, 2])
    assert torch.equal(picked.key_mask, batch.key_mask[picked.input_ids])
    pieces = batch.split(3)
    assert len(pieces) == 3 and torch.equal(torch.cat([p.key_mask for p in pieces]), batch.key_mask)
    assert all(p.key_mask.shape[0] == p.num_tokens for p in pieces)
    assert packed_batch(MIXED).select([1]).key_mask is None and packed_batch(MIXED).split(2)[0].key_mask is None


def test_siglip_pooling_head_refuses_a_mask() -> None:
    from wde.components.models.clip import ProbeAttention

    head = ProbeAttention(8, 2)
    batch = masked_batch([3, 3], torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention-pooling head does not support a key mask"):
        head(torch.zeros(8), torch.zeros(6, 8), batch)


def _attentions() -> list[str]:
    from wde.kernels import varlen_attention

    names = ["torch_sdpa", "cpu_varlen", "auto"]
    return names + ["triton_varlen"] if varlen_attention.INTERPRETED or torch.cuda.is_available() else names


def _token_ids(lens: list[int], vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(5, vocab, (sum(lens),), generator=g)


@pytest.mark.parametrize("attention", _attentions())
def test_bert_matches_transformers_attention_mask(tiny_bert: Path, attention: str) -> None:
    """WDE's BERT on a packed batch with a key mask equals transformers' BertModel run on each sequence with
    `attention_mask` zeros at the masked tokens (a key mask too), every token's state, masked ones included.
    The short lengths send `auto` to torch_sdpa and the long ones to cpu_varlen. triton_varlen runs in the
    interpreter on CPU, compiled on a GPU host (float32, IEEE dots)."""
    from transformers import BertModel

    from wde.kernels import varlen_attention

    dev = "cuda" if attention == "triton_varlen" and not varlen_attention.INTERPRETED else "cpu"
    hf = BertModel.from_pretrained(tiny_bert, attn_implementation="eager").eval()
    for lens in ([12, 7, 20, 7, 3], [70, 45, 45]):
        ids, mask = _token_ids(lens, hf.config.vocab_size), key_mask(lens, seed=sum(lens))
        with Engine.from_workflow("bert", tiny_bert, device=dev, dtype="float32", attention={"name": attention},
                                  overrides=["pooler.params.pooling=mean"]) as engine:
            model = engine.components["model"]
            with torch.inference_mode():
                got = model(replace(packed_batch(lens, input_ids=ids), key_mask=mask).to(dev)).cpu()
                plain = model(packed_batch(lens, input_ids=ids).to(dev)).cpu()
        start = 0
        for n in lens:
            with torch.inference_mode():
                ref = hf(input_ids=ids[None, start:start + n],
                         attention_mask=mask[None, start:start + n].long()).last_hidden_state[0]
            assert (got[start:start + n] - ref).abs().max().item() <= (1e-5 if dev == "cpu" else 1e-4)
            start += n
        assert (got - plain).abs().max().item() > 1e-3  # the mask changed the result (random weights: small)


@pytest.mark.parametrize("config", ["v3", "v2-xlarge-conv"])
def test_deberta_honours_the_mask(tmp_path: Path, config: str) -> None:
    """DeBERTa-v2 builds its own groups (relative attention bias) and a convolution: both honour the mask. On
    the tokens left unmasked its states equal transformers' with `attention_mask` zeros at the masked ones
    (transformers also zeroes the masked tokens' own states, which a key mask does not)."""
    from transformers import DebertaV2Model

    from tests.test_deberta_v2 import CONFIGS, TOL, build_deberta

    path = build_deberta(tmp_path / config, seed=3, **CONFIGS[config])
    hf = DebertaV2Model.from_pretrained(path).eval()
    lens = [30, 9, 31, 12, 2]  # groups of about one length, sorted apart from batch order
    ids, mask = _token_ids(lens, hf.config.vocab_size), key_mask(lens, seed=4)
    with Engine.from_workflow(None, path, device="cpu", dtype="float32", attention={"name": "auto"},
                              pooler={"name": "sentence", "params": {"pooling": "all", "normalize": False}}) as engine:
        with torch.inference_mode():
            got = engine.components["model"](replace(packed_batch(lens, input_ids=ids), key_mask=mask))
    start = 0
    for n in lens:
        keep = mask[start:start + n]
        with torch.inference_mode():
            ref = hf(input_ids=ids[None, start:start + n], attention_mask=keep[None].long()).last_hidden_state[0]
        np.testing.assert_allclose(got[start:start + n][keep].numpy(), ref[keep].numpy(), atol=TOL, rtol=0)
        start += n
