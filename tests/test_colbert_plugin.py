"""The Stanford ColBERT example plugin (examples/wde-plugin-colbert), the held-out check of issue 35: an outside
late-interaction variant written on `wde.api` alone, in under 100 lines of Python.

Registered without installing it (its folder on sys.path, its hook module on a plugin manager of its own), on a tiny
random `HF_ColBERT`-style checkpoint (BERT weights under `bert.` plus `linear.weight`) with all-MiniLM-L6-v2's
tokenizer; its query and document token vectors and MaxSim scores are checked against ColBERT's arithmetic redone
here with transformers' BertModel."""

from __future__ import annotations

import ast
import io
import json
import shutil
import string
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest
import torch

from wde import Engine, PoolingParams
from wde.api import Registry, make_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "examples/wde-plugin-colbert/wde_plugin_colbert"
TOL = 1e-4
DIM, QUERY_LENGTH = 16, 32
QUERY = PoolingParams(options={"task": "query"})
DOCUMENT = PoolingParams(options={"task": "document"})
QUERIES = ["what is the capital of france?", "hi", "berlin, bonn; and hamburg? " * 5]
DOCS = ["Paris is the capital of France. It has, many museums!", "a b c", "naïve café: größe, 東京!",
        "the water was hot " * 20]


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a docstring (a string statement)."""
    source = path.read_text(encoding="utf-8")
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


@pytest.fixture(scope="module")
def registry():
    sys.path.insert(0, str(PACKAGE.parent))
    try:
        from wde_plugin_colbert import plugin

        pm = make_plugin_manager(load_entrypoints=False)
        pm.register(plugin, name="wde_plugin_colbert")
        yield Registry.from_plugin_manager(pm)
    finally:
        sys.path.remove(str(PACKAGE.parent))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A folder as `HF_ColBERT.save_pretrained` writes it: config.json naming HF_ColBERT, the BertModel weights
    under `bert.` and the projection as `linear.weight`, and the tokenizer files."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    out = tmp_path_factory.mktemp("stanford-colbert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=512, architectures=["HF_ColBERT"])
    bert = BertModel(cfg, add_pooling_layer=False).eval()
    weights = {f"bert.{k}": v.contiguous() for k, v in bert.state_dict().items()}
    weights["linear.weight"] = torch.randn(DIM, 32) / 4
    save_file(weights, str(out / "model.safetensors"))
    cfg.save_pretrained(out)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (minilm_path / name).exists():
            shutil.copy(minilm_path / name, out / name)
    return out


def reference(folder: Path, texts: list[str], query: bool) -> list[np.ndarray]:
    """ColBERT's QueryTokenizer / DocTokenizer and ColBERT.query / .doc, redone: '. ' + text with the marker put
    at position 1; a query padded to 32 with [MASK] that its attention mask leaves out, all its vectors kept; a
    document's punctuation dropped; vectors normalize(linear(hidden))."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(str(folder))
    bert = BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval()
    linear = load_file(str(folder / "model.safetensors"))["linear.weight"]
    skip = {tok.encode(c, add_special_tokens=False)[0] for c in string.punctuation}
    out = []
    for text in texts:
        kwargs = dict(padding="max_length", truncation=True, max_length=QUERY_LENGTH) if query else {}
        ids = tok(". " + text, return_tensors="pt", **kwargs)["input_ids"]
        ids[0, 1] = tok.convert_tokens_to_ids("[unused0]" if query else "[unused1]")
        attend = ids != tok.pad_token_id
        ids[~attend] = tok.mask_token_id
        with torch.no_grad():
            hidden = bert(input_ids=ids, attention_mask=attend.long()).last_hidden_state[0]
        vectors = torch.nn.functional.normalize(hidden @ linear.T, dim=-1)
        out.append(vectors.numpy() if query else vectors[[i not in skip for i in ids[0].tolist()]].numpy())
    return out


def test_plugin_is_under_100_lines_of_wde_api_only() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else ["(relative import)"]
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] == "wde" and n != "wde.api" or n == "(relative import)"]
    assert offenders == []
    assert len(files) == 4 and sum(code_lines(p) for p in files) < 100


def test_vectors_and_scores_match_colbert(registry: Registry, checkpoint: Path) -> None:
    with Engine.from_workflow("stanford_colbert", checkpoint, registry=registry, dtype="float32", device="cpu",
                              overrides=[f"model.params.dim={DIM}"]) as engine:
        queries = [o.outputs["colbert"] for o in engine.encode(QUERIES, QUERY)]
        docs = [o.outputs["colbert"] for o in engine.encode(DOCS, DOCUMENT)]
        scores = engine.score([(q, d) for q in QUERIES for d in DOCS])
    want_q, want_d = reference(checkpoint, QUERIES, True), reference(checkpoint, DOCS, False)
    for got, want in zip(queries + docs, want_q + want_d):
        assert got.shape == want.shape and np.abs(got - want).max() <= TOL
    maxsim = [(q @ d.T).max(1).sum() for q in want_q for d in want_d]
    assert np.abs(scores - np.array(maxsim)).max() <= 1e-3


def test_builtin_workflow_serves_the_same_folder(registry: Registry, checkpoint: Path) -> None:
    """Without --workflow the folder gets WDE's built-in multi_vector workflow (the plugin registers no architecture,
    so the two do not compete for HF_ColBERT), and it gives the plugin's vectors."""
    sides = (PoolingParams(truncate=True, options={"task": "query"}), DOCUMENT)  # the plugin cuts queries itself
    with Engine.from_workflow(None, checkpoint, registry=registry) as builtin:
        assert builtin.workflow.name == "multi_vector"
        want = [o.outputs["colbert"] for p in sides for o in builtin.encode(QUERIES + DOCS, p)]
    with Engine.from_workflow("stanford_colbert", checkpoint, registry=registry,
                              overrides=[f"model.params.dim={DIM}"]) as plugin:
        got = [o.outputs["colbert"] for p in (QUERY, DOCUMENT) for o in plugin.encode(QUERIES + DOCS, p)]
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.abs(g - w).max() <= TOL
