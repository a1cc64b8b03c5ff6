"""A text's vector does not depend on what it is batched with, on the token budget, or on the executor: within
BATCH_TOLERANCE (fp32 max abs diff 1e-5), not bit for bit, as docs/architecture.md promises: the GEMM kernels'
last bits follow the batch's shape and the CPU's instruction set (it holds on an AVX-512 host's own path and with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.ranking import BATCH_TOLERANCE
from tests.tiny_models import varied_texts
from wde import Engine, PoolingParams
from wde.components.models.int8_linear import int8_unsupported

TOLERANCE = BATCH_TOLERANCE
TEXTS = varied_texts(1000, seed=9)
POOLING = {"params": {"pooling": "mean", "normalize": True}}


@pytest.fixture(scope="module")
def batched(tiny_bert: Path) -> np.ndarray:
    """All 1,000 texts in one call (several 256-request batches), with the default token budget."""
    with Engine.from_workflow("bert", tiny_bert, pooler=POOLING) as engine:
        return engine.embed(TEXTS, truncate=True)


def test_alone_equals_inside_a_batch_of_1000(tiny_bert: Path, batched: np.ndarray) -> None:
    assert len(set(TEXTS)) > 900 and batched.shape[0] == 1000
    picks = [0, 1, 7, 99, 500, 998, 999] + list(range(13, 1000, 97))
    with Engine.from_workflow("bert", tiny_bert, pooler=POOLING) as engine:
        alone = np.stack([engine.embed(TEXTS[i], truncate=True) for i in picks])
    diff = np.abs(alone - batched[picks]).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.2e}"


def test_tiny_token_budget_gives_the_same_vectors(tiny_bert: Path, batched: np.ndarray) -> None:
    budget = 64
    with Engine.from_workflow("bert", tiny_bert, pooler=POOLING,
                              scheduler={"params": {"max_num_batched_tokens": budget}}) as engine:
        assert engine.scheduler.params.max_num_batched_tokens == budget
        outs = engine.encode(TEXTS[:300], PoolingParams(truncate=True), raise_on_error=False)
    fits = [i for i, o in enumerate(outs) if 0 < o.num_prompt_tokens < budget]
    assert len(fits) > 150, "most short texts must fit the budget"
    got = np.stack([outs[i].outputs["dense"] for i in fits])
    diff = np.abs(got - batched[fits]).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.2e}"
    truncated = [o for o in outs if o.num_prompt_tokens == budget]
    assert truncated, "long texts are truncated to the budget, not rejected"


def test_thread_executor_equals_sync(tiny_bert: Path, batched: np.ndarray) -> None:
    with Engine.from_workflow("bert", tiny_bert, pooler=POOLING, executor={"name": "thread"},
                              scheduler={"params": {"max_num_requests": 64}}) as engine:
        assert engine.executor.name == "thread" and engine.executor.max_inflight == 2
        threaded = engine.embed(TEXTS, truncate=True)
    diff = np.abs(threaded - batched).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.2e}"


def test_minilm_alone_equals_batched_under_a_tiny_budget(minilm_path: Path) -> None:
    texts = [t for t in varied_texts(40, seed=4) if len(t.split()) <= 20]
    with Engine.from_workflow("bert", minilm_path, scheduler={"params": {"max_num_batched_tokens": 64}}) as small:
        under_budget = small.embed(texts)
        alone = np.stack([small.embed(t) for t in texts[:5]])
    with Engine.from_workflow("bert", minilm_path) as big:
        together = big.embed(texts)
    assert np.abs(under_budget - together).max() <= TOLERANCE
    assert np.abs(alone - together[:5]).max() <= TOLERANCE


def test_auto_token_budget_admits_the_longest_input(minilm_engine) -> None:
    from wde.components.scheduler import CPU_TOKEN_BUDGET_MAX, GPU_TOKEN_BUDGET
    from wde.device import default_device

    # MiniLM is 384 wide: on CPU its batches hold the most tokens `auto` gives
    default = GPU_TOKEN_BUDGET if default_device().type == "cuda" else CPU_TOKEN_BUDGET_MAX
    assert minilm_engine.scheduler.params.max_num_batched_tokens == "auto"
    assert minilm_engine.scheduler.token_budget == default
    assert minilm_engine.longest_input == max(default, minilm_engine.max_length)


@pytest.mark.parametrize(("hidden", "budget"), [(32, 8192), (384, 8192), (385, 4096), (512, 4096), (543, 4096),
                                               (544, 2048), (768, 2048), (1024, 2048), (4096, 2048), (None, 2048),
                                               ("384", 2048), (True, 2048), (0, 2048), (-384, 2048)])
def test_cpu_token_budget_grows_as_the_width_shrinks(hidden: object, budget: int) -> None:
    """2,048 at BERT-base's width and wider (or where config.json says nothing usable); (768 / width)^2 times that,
    rounded down to a power of two, up to 8,192."""
    from wde.components.scheduler import cpu_token_budget

    assert cpu_token_budget(hidden) == budget


@pytest.mark.parametrize(("hidden", "budget"), [(384, 8192), (543, 8192), (544, 4096), (768, 4096), (769, 2048),
                                               (1024, 2048), (None, 2048)])
def test_an_int8_token_counts_half(hidden: object, budget: int) -> None:
    """With `quantization: int8` a token's GEMMs cost half: BERT-base's width gets 4,096, still at most 8,192."""
    from wde.components.scheduler import cpu_token_budget

    assert cpu_token_budget(hidden, int8=True) == budget


def test_auto_token_budget_reads_the_models_quantization(tmp_path: Path) -> None:
    """The scheduler is built before the model: it reads the model's resolved params from the build context, and a
    BERT-base-wide model asked for int8 gets 4,096 tokens a batch on CPU, in float 2,048."""
    from tests.tiny_models import build_bert
    from wde.components.base import BuildContext
    from wde.components.params import ModelParams
    from wde.components.scheduler import auto_token_budget
    from wde.device import default_device
    from wde.model_source import ModelSource

    if default_device().type == "cuda":
        pytest.skip("the CPU budget")
    source = ModelSource.from_model(build_bert(tmp_path / "w768", hidden_size=768, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=12))
    budgets = {q: auto_token_budget(BuildContext(source, "bert", params={"model": ModelParams(quantization=q)}))
               for q in ("none", "int8")}
    assert budgets == {"none": 2048, "int8": 4096}
    assert auto_token_budget(BuildContext(source, "bert")) == 2048  # no model params: float


@pytest.mark.skipif(int8_unsupported() is not None, reason="no int8 kernels here")
def test_an_int8_engine_batches_twice_the_tokens(tmp_path: Path) -> None:
    """Through `Engine.from_workflow(quantization="int8")`: the engine's scheduler holds the int8 budget."""
    from tests.tiny_models import build_bert

    folder = build_bert(tmp_path / "w768", hidden_size=768, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=12)
    gate = ["model.params.min_cosine=0.5", "model.params.min_mean_cosine=0.5"]  # random weights: not the gate's test
    with Engine.from_workflow("bert", folder, pooler=POOLING, quantization="int8", overrides=gate) as engine:
        assert engine.scheduler.token_budget == 4096


def test_auto_cpu_token_budget_reads_the_configs_hidden_size(tmp_path: Path) -> None:
    """A 512-wide model gets 4,096 tokens a batch on CPU, and a set number is kept whatever the width."""
    from tests.tiny_models import build_bert
    from wde.device import default_device

    if default_device().type == "cuda":
        pytest.skip("the CPU budget")
    folder = build_bert(tmp_path / "w512", hidden_size=512, intermediate_size=64, num_hidden_layers=1)
    with Engine.from_workflow("bert", folder, pooler=POOLING) as engine:
        assert engine.scheduler.token_budget == 4096
    with Engine.from_workflow("bert", folder, pooler=POOLING,
                              overrides=["scheduler.params.max_num_batched_tokens=1024"]) as engine:
        assert engine.scheduler.token_budget == 1024


def test_a_long_context_model_keeps_the_batch_budget_and_runs_a_longer_input_alone(tmp_path: Path) -> None:
    """A model whose inputs may be longer than the default budget (Qwen3-Embedding: 32,768 tokens) keeps batches at
    the budget: an input longer than it runs in a batch of its own, the others around it in batches within it, and
    every vector is what the input gives alone."""
    import json

    from tests.tiny_models import build_bert

    # BERT-base's width, where the CPU budget (2,048) is below the model's max length (`cpu_token_budget`)
    folder = build_bert(tmp_path / "long", max_position_embeddings=4096, hidden_size=768)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    with Engine.from_workflow("bert", folder, pooler=POOLING) as engine:
        budget = engine.scheduler.token_budget
        assert engine.max_length == engine.longest_input == 4096 > budget
        batches: list[list[int]] = []
        schedule = engine.scheduler.schedule

        def recorded():  # noqa: ANN202
            out = schedule()
            if out.scheduled:
                batches.append([s.num_tokens for s in out.scheduled])
            return out

        engine.scheduler.schedule = recorded
        long_text = " ".join(TEXTS[:400])
        texts = TEXTS[:150] + [long_text] + TEXTS[150:300]
        together = engine.embed(texts, truncate=True)
        engine.scheduler.schedule = schedule
        assert any(len(b) == 1 and b[0] > budget for b in batches), batches
        assert all(sum(b) <= budget for b in batches if len(b) > 1), batches
        assert max(max(b) for b in batches) <= 4096
        picks = [0, 149, 150, 151, 300]
        alone = np.stack([engine.embed(texts[i], truncate=True) for i in picks])
    diff = np.abs(alone - together[picks]).max()
    assert diff <= TOLERANCE, f"max abs diff {diff:.2e}"


def test_requests_asking_different_dimensions_share_a_batch(minilm_engine: Engine) -> None:
    """One batch mixing `dimensions` (and none): each request gets its own width, as if it ran alone."""
    texts = ["a short text", "another one", "the third", "and a fourth"]
    dims = [None, 64, 128, 64]
    ids = [minilm_engine.add_request(t, PoolingParams(dimensions=d)) for t, d in zip(texts, dims)]
    outs = {}
    while minilm_engine.has_unfinished():
        outs.update({o.request_id: o for o in minilm_engine.step()})
    for rid, text, d in zip(ids, texts, dims):
        alone = minilm_engine.embed(text, dimensions=d)
        got = outs[rid].outputs["dense"]
        assert got.shape == (d or 384,) and np.abs(got - alone).max() <= TOLERANCE
