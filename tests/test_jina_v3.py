"""Jina embeddings v3 (workflows/jina_embeddings_v3.yaml) against transformers' `JinaEmbeddingsV3Model` with each
task's PEFT adapter applied by peft's `PeftModel.from_pretrained(model, path/<task>)` (what transformers'
`load_adapter(path, adapter_name=t, adapter_kwargs={"subfolder": t})` does; transformers 5.24 asks for a peft newer
than the pinned one for it), mean-pooled and normalized as the model card does; every task and the bare backbone in one
engine step, on a tiny random config (rotary theta 20000, token types, five adapters on q/k/v/o, fc1/fc2 and the
word embeddings).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_models import varied_texts, xlmr_tokenizer
from wde import Engine
from wde.components.models.jina_v3 import TASKS, task_folder
from wde.errors import ModelLoadError, RequestError
from wde.request import PoolingParams

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "JinaEmbeddingsV3Model"):
    pytest.skip("this transformers has no JinaEmbeddingsV3Model", allow_module_level=True)

TOL = 1e-4
TEXTS = varied_texts(4, seed=21)
QUERY_PROMPT = "Represent the query for retrieving evidence documents: "


def build_jina(out: Path, tasks: tuple[str, ...] = TASKS) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import JinaEmbeddingsV3Config, JinaEmbeddingsV3Model

    torch.manual_seed(0)
    tok = xlmr_tokenizer()
    cfg = JinaEmbeddingsV3Config(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=514, pad_token_id=1, bos_token_id=0,
                                 eos_token_id=2)
    JinaEmbeddingsV3Model(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    for i, task in enumerate(tasks):
        torch.manual_seed(10 + i)
        base = JinaEmbeddingsV3Model.from_pretrained(out)
        lora = LoraConfig(r=4, lora_alpha=1 + i, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "word_embeddings"])
        get_peft_model(base, lora).save_pretrained(out / task_folder(task))
    return out


@pytest.fixture(scope="module")
def jina_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = build_jina(tmp_path_factory.mktemp("jina-v3") / "m")
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"retrieval.query": QUERY_PROMPT}, "default_prompt_name": None}))
    return path


def reference(path: Path, task: str | None, texts: list[str]) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    from peft import PeftModel

    model = AutoModel.from_pretrained(path).eval()
    if task is not None:  # what transformers' load_adapter(path, subfolder=...) does, through peft itself (the
        model = PeftModel.from_pretrained(model, str(path / task_folder(task))).eval()  # pinned peft predates it)
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**enc)[0]
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def run(engine: Engine, jobs: list[tuple[str, PoolingParams]]) -> tuple[list[np.ndarray], int]:
    batches = []
    engine.on_batch = batches.append
    ids = [engine.add_request(text, params) for text, params in jobs]
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.ok, o.error
            out[o.request_id] = o.outputs["dense"]
    return [out[i] for i in ids], len(batches)


def test_every_task_mixed_in_one_batch_matches_transformers(jina_path: Path) -> None:
    engine = Engine.from_workflow(None, jina_path)  # picked by architecture: JinaEmbeddingsV3Model
    try:
        assert engine.workflow.name == "jina_embeddings_v3"
        assert engine.info.options == {"task": ("none", *TASKS)}
        tasks: list[str | None] = [None, *TASKS]
        jobs = [(t, task) for i, t in enumerate(TEXTS) for task in tasks[i % 2:] + tasks[:i % 2]]
        got, batches = run(engine, [(t, PoolingParams(options=None if task is None else {"task": task}))
                                    for t, task in jobs])
        assert batches == 1
        by_job = dict(zip(jobs, got))
        for task in tasks:
            want = reference(jina_path, task, TEXTS)
            diff = np.abs(np.stack([by_job[(t, task)] for t in TEXTS]) - want).max()
            assert diff <= TOL, (task, diff)
        assert np.abs(by_job[(TEXTS[0], "retrieval.query")] - by_job[(TEXTS[0], "retrieval.passage")]).max() > 1e-3
    finally:
        engine.close()


def test_prompt_name_applies_the_folders_prompt_with_the_task(jina_path: Path) -> None:
    engine = Engine.from_workflow(None, jina_path)
    try:
        (got,), _ = run(engine, [(TEXTS[0], PoolingParams(prompt_name="retrieval.query",
                                                          options={"task": "retrieval.query"}))])
        want = reference(jina_path, "retrieval.query", [QUERY_PROMPT + TEXTS[0]])[0]
        assert np.abs(got - want).max() <= TOL
    finally:
        engine.close()


def test_an_unknown_task_is_refused_by_name(jina_path: Path) -> None:
    engine = Engine.from_workflow(None, jina_path)
    try:
        with pytest.raises(RequestError, match="retrieval.query") as e:
            engine.add_request("hi", PoolingParams(options={"task": "retrieval"}))
        assert e.value.field == "options.task"
    finally:
        engine.close()


def test_a_folder_without_task_adapters_is_refused(tmp_path: Path) -> None:
    path = build_jina(tmp_path / "m", tasks=())
    with pytest.raises(ModelLoadError, match="retrieval_query/"):
        Engine.from_workflow(None, path)


def test_only_the_tasks_present_are_served(tmp_path: Path) -> None:
    path = build_jina(tmp_path / "m", tasks=("text-matching",))
    with Engine.from_workflow(None, path) as engine:
        assert engine.info.options == {"task": ("none", "text-matching")}


def test_jina_and_cohere_bodies_pick_the_task_over_http(jina_path: Path) -> None:
    """Jina's `task` (/v1/embeddings) and Cohere's `input_type` (/v2/embed: search_query → retrieval.query,
    search_document → retrieval.passage, clustering → separation) select the task adapter."""
    import httpx

    from tests.test_server import serve

    engine = Engine.from_workflow(None, jina_path)
    try:
        with serve(engine) as (url, _):
            for task, input_type in (("retrieval.query", "search_query"), ("retrieval.passage", "search_document"),
                                     ("separation", "clustering"), ("classification", "classification")):
                want = reference(jina_path, task, TEXTS)
                jina = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "task": task}, timeout=60)
                assert jina.status_code == 200, jina.text
                got = np.array([d["embedding"] for d in jina.json()["data"]])
                assert np.abs(got - want).max() <= TOL, task
                cohere = httpx.post(f"{url}/v2/embed", timeout=60, json={"texts": TEXTS, "input_type": input_type,
                                                                         "embedding_types": ["float"]})
                assert cohere.status_code == 200, cohere.text
                assert np.abs(np.array(cohere.json()["embeddings"]["float"]) - want).max() <= TOL, input_type
            bad = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS, "task": "code.query"}, timeout=60)
            assert bad.status_code == 422 and "retrieval.query" in bad.text
    finally:
        engine.close()
