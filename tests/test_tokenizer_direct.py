"""The host path's shortcuts give what the long way gives: `HFTokenizer` calling the Rust tokenizer itself
(`_encode_direct`) against transformers' call, for the real tokenizers WDE's families use; a tokenizer whose class
or whose probes say otherwise keeps transformers' call; the packed batch's flat tensors; the garbage collector held
off inside `Engine.run` only (wde/collector.py)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import tiny_decoders
from wde import Engine
from wde.components import tokenizer as tokenizer_module
from wde.components.model_input_builder import PackedInputBuilder
from wde.components.scheduler import SchedulerOutput
from wde.request import PairPrompt, PoolingParams, Request, SchedulableRequest, TextPrompt

MEAN = {"params": {"pooling": "mean"}}
WORKFLOWS = {"minilm_path": None, "tiny_bert": "bert", "tiny_xlmr_realvocab": "xlm_roberta", "qwen3_folder": None}

TEXTS = [
    "Prefill only.", "  spaced   out  ", "MiXeD Case, numbers 3.14159 and 1,000,000!", "naïve café — 東京 😀 e\u0301",
    "tabs\tand\nnewlines\r\n", "[CLS] written out [SEP] <s> </s> <pad> <|endoftext|>", "x" * 700,
    "Don't stop believin'", "a", "The quick brown fox jumps over the lazy dog " * 20,
]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = tiny_decoders.qwen3_tokenizer(real=True, append_eos=True)
    return tiny_decoders.build_qwen3(tmp_path_factory.mktemp("qwen3"), tok)


@pytest.mark.parametrize("fixture", ["minilm_path", "tiny_bert", "tiny_xlmr_realvocab", "qwen3_folder"])
def test_direct_encoding_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    """Texts and pairs through the direct call give transformers' ids and token types (a single text's all-zero
    types as none: what every model reads them as), for BERT's WordPiece, XLM-R's SentencePiece and Qwen's BPE."""
    folder = request.getfixturevalue(fixture)
    workflow = WORKFLOWS[fixture]
    with Engine.from_workflow(workflow, folder, **({"pooler": MEAN} if workflow else {})) as engine:
        tok = engine.components["tokenizer"]
        assert tok._direct, f"{fixture}: the direct call was not taken"
        singles = [TextPrompt(t) for t in TEXTS]
        pairs = [PairPrompt(a, b) for a, b in zip(TEXTS, reversed(TEXTS))]
        hf = tok._hf()
        want = tok._encode_hf(hf, TEXTS, None, None, "right")
        got = tok.encode(singles)
        assert [ids for ids, _ in got] == [ids for ids, _ in want]
        for (_, types), (_, wanted) in zip(got, want):
            assert types == wanted or (types is None and not any(wanted or []))
        if tok._returns_types:
            assert tok.encode(pairs) == tok._encode_hf(hf, TEXTS, list(reversed(TEXTS)), None, "right")
        # truncating still goes through transformers' call, and leaves the direct call untruncated after it
        cut = tok.encode(singles[-1:], max_length=8)
        assert 0 < len(cut[0][0]) <= 8
        assert tok.encode(singles) == got


def test_the_direct_call_skips_offsets_where_the_tokenizers_library_can(minilm_path: Path) -> None:
    """The direct call asks the Rust tokenizer for ids without character offsets (`encode_batch_fast`, tokenizers
    0.21 on: ~17% less tokenizing time on 30-word texts), the same ids and types as `encode_batch`; an older library
    without it keeps `encode_batch`."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(minilm_path))
    backend = hf.backend_tokenizer
    if hasattr(backend, "encode_batch_fast"):
        got = tokenizer_module._encode_direct(hf, list(TEXTS), None, True)
        slow = backend.encode_batch(list(TEXTS), add_special_tokens=True)
        assert got == [(e.ids, e.type_ids) for e in slow]

    calls: list[str] = []

    class Backend:  # the library's Tokenizer as a stub: which call the direct path makes
        truncation = padding = None
        encode_special_tokens = False

        def encode_batch(self, texts: list, add_special_tokens: bool) -> list:
            calls.append("encode_batch")
            return backend.encode_batch(texts, add_special_tokens=add_special_tokens)

    class Fast(Backend):
        def encode_batch_fast(self, texts: list, add_special_tokens: bool) -> list:
            calls.append("encode_batch_fast")
            return backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens) \
                if hasattr(backend, "encode_batch_fast") else backend.encode_batch(texts, add_special_tokens=True)

    class Tok:
        split_special_tokens = False

        def __init__(self, b: Backend) -> None:
            self.backend_tokenizer = b

    for stub, want in ((Fast(), "encode_batch_fast"), (Backend(), "encode_batch")):
        calls.clear()
        got = tokenizer_module._encode_direct(Tok(stub), ["Hello world."], None, False)
        assert calls == [want] and got == [(hf("Hello world.")["input_ids"], None)]


def test_a_tokenizer_class_with_its_own_call_keeps_transformers_call(tiny_bert: Path) -> None:
    with Engine.from_workflow("bert", tiny_bert, pooler=MEAN) as engine:
        tok = engine.components["tokenizer"]
        assert tok._direct_matches()
        hf = tok._tok
        own = type("OwnCall", (type(hf),), {"__call__": lambda self, *a, **k: type(hf).__call__(self, *a, **k)})
        hf.__class__ = own
        try:
            assert not tok._direct_matches()
        finally:
            hf.__class__ = own.__mro__[1]


def test_a_direct_call_that_differs_on_the_probes_is_not_taken(tiny_bert: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The probes decide: a direct call that loses a token of one of them is refused at load."""
    real = tokenizer_module._encode_direct

    def lossy(tok, texts, pairs, types):  # noqa: ANN001, ANN202
        out = real(tok, texts, pairs, types)
        return [(out[0][0][:-1], out[0][1]), *out[1:]]

    monkeypatch.setattr(tokenizer_module, "_encode_direct", lossy)
    with Engine.from_workflow("bert", tiny_bert, pooler=MEAN) as engine:
        assert not engine.components["tokenizer"]._direct
        # and the engine still gives transformers' ids
        ids = engine.encode([TEXTS[0]])[0].prompt_token_ids
        assert ids == engine.components["tokenizer"]._tok(TEXTS[0])["input_ids"]


def test_vectors_are_the_same_either_way(minilm_path: Path) -> None:
    texts = [*TEXTS, *[f"sentence {i} about embeddings" for i in range(40)]]
    with Engine.from_workflow(None, minilm_path) as engine:
        tok = engine.components["tokenizer"]
        assert tok._direct and not tok._single_types
        direct = engine.embed(texts, truncate=True)
        tok._direct, tok._single_types = False, True
        try:
            long_way = engine.embed(texts, truncate=True)
        finally:
            tok._direct, tok._single_types = True, False
    np.testing.assert_array_equal(direct, long_way)


def test_packed_batch_flat_tensors(tmp_path: Path) -> None:
    """Token ids one sequence after another; token types zero for a sequence without them in a mixed batch."""
    builder = PackedInputBuilder.__new__(PackedInputBuilder)
    builder._pin, builder._adapters = False, None
    seqs = [SchedulableRequest(Request(str(i), TextPrompt("x"), PoolingParams()), ids, types)
            for i, (ids, types) in enumerate([([101, 7, 102], [0, 0, 0]), ([101, 8, 9, 102], None),
                                              ([101, 5, 102, 6, 102], [0, 0, 0, 1, 1])])]
    mi = builder.build(SchedulerOutput(seqs))
    assert mi.input_ids.tolist() == [101, 7, 102, 101, 8, 9, 102, 101, 5, 102, 6, 102]
    assert mi.input_ids.dtype == torch.long
    assert mi.token_type_ids.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert mi.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert mi.cu_seqlens.tolist() == [0, 3, 7, 12]
    assert builder.build(SchedulerOutput(seqs[1:2])).token_type_ids is None


def test_collector_is_held_off_inside_run_only(tiny_bert: Path) -> None:
    seen: list[bool] = []
    with Engine.from_workflow("bert", tiny_bert, pooler=MEAN) as engine:
        engine.on_batch = lambda stats: seen.append(gc.isenabled())
        assert gc.isenabled()
        engine.embed(["one", "two"])
        assert seen and not any(seen) and gc.isenabled()
        # a caller that disabled it keeps it disabled
        gc.disable()
        try:
            engine.embed(["three"])
            assert not gc.isenabled()
        finally:
            gc.enable()
        # a failing call enables it again
        seen.clear()
        with pytest.raises(Exception):
            engine.embed([""])  # empty text: refused while the requests are made
        assert gc.isenabled()
