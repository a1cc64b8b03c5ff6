"""Stanford-NLP ColBERT folders (config.json: `HF_ColBERT`, the projection `linear.weight` inline in the checkpoint,
`artifact.metadata`) in the built-in multi_vector workflows, against sentence-transformers 6.2's reading of them
(`MultiVectorEncoder(folder)`): each token matrix of `encode_query` / `encode_document` (same rows, <= 1e-4) with
the defaults (no artifact.metadata, the weights in pytorch_model.bin), a colbertv2.0-style metadata file full of training and indexing settings,
`attend_to_mask_tokens`, `mask_punctuation: false`, `doc_maxlen`, other marker tokens; queries and documents in one
engine step and through a split engine's API server and core; MaxSim against `similarity`; BERT, XLM-R and ModernBERT backbones, each workflow picked from the folder;
and what is refused, by name. The folders are written as Stanford's `colbert` library saves them
(`HF_ColBERT.save_pretrained`: the backbone's weights under its prefix plus `linear.weight`, config.json naming
HF_ColBERT, the tokenizer, artifact.metadata)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests import test_modernbert, tiny_models
from tests.test_multi_vector import DOCUMENT, QUERY, TOL, assert_one_step, assert_parity, st_model, tiny_backbone
from wde import Engine
from wde.components.multi_vector import maxsim
from wde.engine import resolve
from wde.errors import ModelLoadError, RegistryError

DIM = 16
TEXTS = ["what is the capital of france?", "hi", "Paris is the capital of France. It has, many museums!",
         "berlin, bonn; and hamburg? " * 4, "naïve café: größe, 東京!", "[unused0] in the text"]
COLBERTV2 = {  # artifact.metadata as colbert-ir/colbertv2.0 ships it (its paths shortened)
    "query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_token": "[Q]", "doc_token": "[D]",
    "ncells": None, "centroid_score_threshold": None, "ndocs": None, "index_path": None, "nbits": 1,
    "kmeans_niters": 20, "resume": False, "similarity": "cosine", "bsize": 32, "accumsteps": 1, "lr": 1e-05,
    "maxsteps": 400000, "save_every": None, "warmup": 20000, "warmup_bert": None, "relu": False, "nway": 64,
    "use_ib_negatives": True, "reranker": False, "distillation_alpha": 1.0, "ignore_scores": False,
    "query_maxlen": 12, "attend_to_mask_tokens": False, "interaction": "colbert", "dim": DIM, "doc_maxlen": 40,
    "mask_punctuation": True, "checkpoint": "colbert-ir/colbertv1.9", "triples": "triples.jsonl",
    "collection": "collection.tsv", "queries": "queries.tsv", "index_name": None, "overwrite": False,
    "root": "experiments", "experiment": "msmarco", "index_root": None, "name": "kldR2.nway64.ib", "rank": 0,
    "nranks": 4, "amp": True, "gpus": 8,
    "meta": {"hostname": "host", "git_branch": "main", "git_hash": "0" * 40, "version": "colbert-v0.4"}}


def stanford(base: Path, out: Path, metadata: dict | None, *, dim: int = DIM, seed: int = 2,
             binary: bool = False) -> Path:
    """`base` (a saved backbone and its tokenizer) rewritten as `HF_ColBERT.save_pretrained` writes it: the
    backbone's weights under its `base_model_prefix` (`bert.`, `roberta.`, `model.`) and a random `linear.weight`
    [dim, hidden] in one model.safetensors (pytorch_model.bin with `binary`, as older checkpoints ship),
    config.json naming HF_ColBERT, the tokenizer files, and `metadata` as artifact.metadata (none when None)."""
    from safetensors.torch import save_file
    from transformers import AutoModel

    out.mkdir(parents=True)
    model = AutoModel.from_pretrained(base).eval()
    weights = {f"{model.base_model_prefix}.{k}": v.contiguous() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    weights["linear.weight"] = torch.randn(dim, model.config.hidden_size) / 4
    if binary:
        torch.save(weights, out / "pytorch_model.bin")
    else:
        save_file(weights, str(out / "model.safetensors"))
    model.config.architectures = ["HF_ColBERT"]
    model.config.save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "sentencepiece")):
            shutil.copy(f, out / f.name)
    if metadata is not None:
        (out / "artifact.metadata").write_text(json.dumps(metadata, indent=4))
    return out


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    return tiny_backbone(minilm_path, tmp_path_factory.mktemp("stanford-backbone") / "bert")


VARIANTS = {
    "no-metadata-binary": None,
    "colbertv2-metadata": COLBERTV2,
    "attend-no-punctuation-mask": {"query_maxlen": 10, "attend_to_mask_tokens": True, "mask_punctuation": False},
    "other-markers-doc-maxlen": {"query_token_id": "[unused2]", "doc_token_id": "[unused3]", "doc_maxlen": 20,
                                 "dim": DIM},
    "unknown-marker-stays-text": {"query_token_id": "[QRY]", "doc_token_id": "[DOC]", "mask_punctuation": None},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_sentence_transformers(variant: str, backbone: Path, tmp_path: Path) -> None:
    folder = stanford(backbone, tmp_path / variant, VARIANTS[variant], binary=variant.endswith("binary"))
    st = st_model(folder)
    # the reference really read the Stanford layout: the inline projection, the mask and normalize appended
    assert [type(m).__name__ for m in st] == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
    assert resolve(None, folder)[0].name == "multi_vector"
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == "multi_vector"
        assert engine.components["pooler"].vector_size == DIM
        assert_parity(engine, st, TEXTS)
        assert_one_step(engine, st, TEXTS[:4])


def test_maxsim_matches_similarity(backbone: Path, tmp_path: Path) -> None:
    folder = stanford(backbone, tmp_path / "v2", COLBERTV2)
    st = st_model(folder)
    with Engine.from_workflow(None, folder) as engine:
        assert engine.components["pooler"].similarity_fn_name == "maxsim"
        queries = [torch.from_numpy(o.outputs["colbert"]) for o in engine.encode(TEXTS[:2], QUERY)]
        documents = [torch.from_numpy(o.outputs["colbert"]) for o in engine.encode(TEXTS, DOCUMENT)]
        scores = engine.score([(q, d) for q in TEXTS[:2] for d in TEXTS])
    expected = st.similarity(queries, documents)
    for i, q in enumerate(queries):
        assert torch.allclose(maxsim(q, documents), expected[i].float(), rtol=TOL, atol=0)
    assert torch.allclose(torch.as_tensor(scores).reshape(2, -1).float(), expected.float(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("backbone_kind, workflow", [("xlm_roberta", "multi_vector_xlm_roberta"),
                                                     ("modernbert", "multi_vector_modernbert")])
def test_other_backbones(backbone_kind: str, workflow: str, tmp_path: Path) -> None:
    if backbone_kind == "xlm_roberta":  # its vocabulary has no [unused0]: the markers stay text, as there
        base = tiny_models.build_xlmr(tmp_path / "base")
    else:
        base = test_modernbert.build(tmp_path / "base", local_attention=8)
    folder = stanford(base, tmp_path / "colbert", {**COLBERTV2, "doc_maxlen": 48})
    assert resolve(None, folder)[0].name == workflow
    st = st_model(folder)
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == workflow
        assert_parity(engine, st, TEXTS)
        assert_one_step(engine, st, TEXTS[:3])


def test_split_engine_serves_queries_as_one_engine_does(backbone: Path, tmp_path: Path) -> None:
    """A split engine's API server registers the marker and expands a query, and its core, receiving the token ids,
    gives one engine's vectors."""
    from wde.core.frontend import Frontend, core_request

    folder = stanford(backbone, tmp_path / "split", COLBERTV2)
    with Engine.from_workflow(None, folder) as engine:
        frontend = Frontend(*resolve(None, folder), engine.info)
        for i, (text, query) in enumerate(zip(TEXTS, engine.encode(TEXTS, QUERY))):
            ready, = frontend.tokenize([frontend.make_request(text, QUERY, f"r{i}", "input")])
            assert ready.token_ids == query.prompt_token_ids, text
            done = engine.run([core_request(f"r{i}", ready.token_ids, ready.token_type_ids, QUERY)])
            assert abs(done[f"r{i}"].outputs["colbert"] - query.outputs["colbert"]).max() <= 1e-6, text


def _write(folder: Path, name: str, change) -> None:  # noqa: ANN001
    path = folder / name
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def _drop_projection(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    weights.pop("linear.weight")
    save_file(weights, str(folder / "model.safetensors"))


REFUSALS = {
    "l2-similarity": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(similarity="l2")),
                      "similarity 'l2' is not implemented"),
    "flipr": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(interaction="flipr")),
              "interaction 'flipr' is not implemented"),
    "pool-factor": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(pool_factor=2)),
                    "pool_factor 2 is not implemented"),
    "relu": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(relu=True)), "relu True is not implemented"),
    "unknown-key": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(doc_pooling="mean")),
                    "settings \\['doc_pooling'\\] are not implemented"),
    "marker-id": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(query_token_id=1)),
                  "query_token_id must be a token string"),
    "bad-maxlen": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(doc_maxlen=-3)),
                   "doc_maxlen must be a positive integer"),
    "dim-mismatch": (lambda f: _write(f, "artifact.metadata", lambda m: m.update(dim=128)),
                     "dim 128 does not match linear.weight's 16 rows"),
    "no-projection": (_drop_projection, "the checkpoint has no 'linear.weight'"),
    "not-an-object": (lambda f: (f / "artifact.metadata").write_text("[1, 2]"), "must hold a JSON object"),
    "st-config-beside": (lambda f: (f / "config_sentence_transformers.json").write_text('{"prompts": {}}'),
                         "with sentence-transformers settings beside artifact.metadata is not implemented"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_by_name(case: str, backbone: Path, tmp_path: Path) -> None:
    folder = stanford(backbone, tmp_path / case, COLBERTV2)
    change, message = REFUSALS[case]
    change(folder)
    with pytest.raises(ModelLoadError, match=message):
        Engine.from_workflow(None, folder)


def test_backbone_not_served_is_refused_naming_the_choices(tmp_path: Path) -> None:
    folder = tmp_path / "distil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["HF_ColBERT"], "model_type": "distilbert"}))
    with pytest.raises(RegistryError, match="HF_ColBERT .* on model_type 'distilbert'; WDE serves it on bert"):
        resolve(None, folder)


def test_cli_refuses_a_setting_in_one_line(backbone: Path, tmp_path: Path) -> None:
    """`wde embed` on a folder with a setting WDE does not implement: exit 1, one line naming the file and the
    setting."""
    from click.testing import CliRunner

    from wde.cli import main

    folder = stanford(backbone, tmp_path / "l2", {**COLBERTV2, "similarity": "l2"})
    src = tmp_path / "in.txt"
    src.write_text("hello\n", encoding="utf-8")
    done = CliRunner().invoke(main, ["embed", "-m", str(folder), "--input", str(src), "--output",
                                     str(tmp_path / "out.parquet"), "--outputs", "colbert"])
    assert done.exit_code == 1
    lines = [line for line in done.output.splitlines() if "artifact.metadata" in line]
    assert len(lines) == 1 and "similarity 'l2' is not implemented" in lines[0], done.output
