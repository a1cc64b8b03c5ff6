"""PyLate v3 (1.x) ColBERT folders in the multi_vector workflows, against sentence-transformers 6.2's reading of them
(`MultiVectorEncoder(folder)`: prefixes composed into the prompts, the flat expansion settings translated, a
MultiVectorMask with the skiplist and a per-token Normalize appended, "[Q] " / "[D] " registered as one piece): each
token matrix of `encode_query` / `encode_document` (same rows, <= 1e-4) with and without
`attend_to_expansion_tokens`, with the default punctuation skiplist and an explicit one, without query expansion,
queries and documents in one engine step; the workflow picked from the folder; and what is refused, by name. The folders are saved by sentence-transformers and
rewritten into PyLate's layout, as PyLate 1.x saves one (its tokenizer with `add_tokens(["[Q] ", "[D] "])` and the
embeddings resized)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_multi_vector import TEXTS, assert_one_step, assert_parity, build, st_model, tiny_backbone
from wde import Engine
from wde.engine import resolve
from wde.errors import ModelLoadError

PUNCTUATED = TEXTS + ["[Q] not a prefix here", "Q: [D] x", "... !!! ???"]


@pytest.fixture(scope="module")
def backbone(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    return tiny_backbone(minilm_path, tmp_path_factory.mktemp("pylate-backbone"))


def pylate(backbone: Path, out: Path, *, query_length: int = 12, document_length: int = 24,
           attend: bool = False, skiplist: list[str] | None = None, expansion: bool | None = None,
           prefixes: tuple[str, str] = ("[Q] ", "[D] "), extra: dict | None = None) -> Path:
    """A folder in PyLate 1.x's layout: modules.json with the Transformer and a `pylate.models.Dense.Dense` (its
    config without module IO names), no MultiVectorMask / Normalize, the settings at the top of
    config_sentence_transformers.json (`model_type: ColBERT`), and the prefixes added to the tokenizer unless it
    has them (answerai-colbert style `[unused0]` / `[unused1]`)."""
    from transformers import AutoTokenizer, BertModel

    build(backbone, out, dims=(16,))
    tok = AutoTokenizer.from_pretrained(out)
    new = [p for p in prefixes if p not in tok.get_vocab()]
    if new:
        tok.add_tokens(new)
        tok.save_pretrained(out)
        model = BertModel.from_pretrained(out)
        model.resize_token_embeddings(len(tok))
        model.save_pretrained(out)
    modules = json.loads((out / "modules.json").read_text())
    kept = []
    for m in modules:
        kind = m["type"].rsplit(".", 1)[-1]
        if kind in ("MultiVectorMask", "Normalize"):
            shutil.rmtree(out / m["path"])
            continue
        if kind == "Dense":
            m = {**m, "type": "pylate.models.Dense.Dense"}
            cfg_path = out / m["path"] / "config.json"
            cfg = json.loads(cfg_path.read_text())
            for key in ("module_input_name", "module_output_name"):
                cfg.pop(key, None)
            cfg_path.write_text(json.dumps(cfg))
        if kind == "Transformer":
            m = {**m, "type": "sentence_transformers.models.Transformer"}
        kept.append({**m, "idx": len(kept)})
    (out / "modules.json").write_text(json.dumps(kept))
    sbert = json.loads((out / "sentence_bert_config.json").read_text())
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": sbert.get("max_seq_length", 512),
                                                               "do_lower_case": False}))
    st = {"__version__": {"sentence_transformers": "3.4.1", "pylate": "1.2.0"}, "model_type": "ColBERT",
          "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "cosine", "query_prefix": prefixes[0],
          "document_prefix": prefixes[1], "query_length": query_length, "document_length": document_length,
          "attend_to_expansion_tokens": attend, "skiplist_words": skiplist}
    if expansion is not None:
        st["do_query_expansion"] = expansion
    (out / "config_sentence_transformers.json").write_text(json.dumps({**st, **(extra or {})}))
    return out


VARIANTS = {
    "masked-default-skiplist": dict(),
    "attend-default-skiplist": dict(attend=True),
    "masked-explicit-skiplist": dict(skiplist=[",", "?", "notaword"]),
    "attend-explicit-skiplist": dict(attend=True, skiplist=["!", "."], query_length=10, document_length=30),
    "no-expansion": dict(expansion=False, query_length=8),
    # in-vocabulary markers that the tokenizer splits as text: registered as one piece, as sentence-transformers does
    "unused-markers": dict(prefixes=("[unused0]", "[unused1]"), skiplist=["."]),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_sentence_transformers(variant: str, backbone: Path, tmp_path: Path) -> None:
    folder = pylate(backbone, tmp_path / variant, **VARIANTS[variant])
    st = st_model(folder)
    # the reference really is PyLate's reading: the appended mask and normalize, "[Q] " as one special token
    assert [type(m).__name__ for m in st] == ["Transformer", "Dense", "MultiVectorMask", "Normalize"]
    prefix = st.prompts["query"]
    assert st.tokenizer.tokenize(prefix + "hello") == [prefix, "hello"]
    with Engine.from_workflow(None, folder) as engine:
        assert engine.workflow.name == "multi_vector"
        assert_parity(engine, st, PUNCTUATED)
        assert_one_step(engine, st, PUNCTUATED[:4])
        hf = engine.tokenizer.hf_tokenizer if hasattr(engine, "tokenizer") else None
        if hf is not None:
            assert hf.tokenize(prefix + "hello") == [prefix, "hello"]


def test_workflow_picked_from_the_folder(backbone: Path, tmp_path: Path) -> None:
    assert resolve(None, pylate(backbone, tmp_path / "p"))[0].name == "multi_vector"


@pytest.mark.parametrize("case", ["unknown-key", "mask-module", "other-module", "bad-skiplist"])
def test_refused_by_name(case: str, backbone: Path, tmp_path: Path) -> None:
    extra = {"unknown-key": {"attend_to_mask_tokens": True}, "bad-skiplist": {"skiplist_words": "punct"}}.get(case)
    folder = pylate(backbone, tmp_path / case, extra=extra)
    expected = {"unknown-key": "attend_to_mask_tokens", "bad-skiplist": "skiplist_words"}.get(case)
    if case in ("mask-module", "other-module"):
        modules = json.loads((folder / "modules.json").read_text())
        kind = ("sentence_transformers.multi_vector_encoder.modules.MultiVectorMask" if case == "mask-module"
                else "pylate.models.Pooling")
        modules.append({"idx": len(modules), "name": "2", "path": "", "type": kind})
        (folder / "modules.json").write_text(json.dumps(modules))
        expected = kind
    with pytest.raises(ModelLoadError, match=expected):
        Engine.from_workflow("multi_vector", folder)
