"""Stanford-NLP ColBERT folders (`colbert-ir/colbertv2.0` and what Stanford's `colbert` library saves): config.json
naming `HF_ColBERT`, the backbone's weights under its prefix (`bert.`, `roberta.`) with the projection `linear.weight`
beside them in the same checkpoint, the tokenizer, and the ColBERTConfig in `artifact.metadata` (JSON). Read without
torch, as sentence-transformers 6.2's `MultiVectorEncoder` reads one (`_maybe_load_stanford_metadata`,
`_build_stanford_projection`, `_load_default_modules`):

- the markers `query_token_id` / `doc_token_id` (token strings despite the name; `[unused0]` / `[unused1]` when unset)
  followed by a space are the `query` / `document` prompts, each registered as one piece where the tokenizer knows it;
- a query is expanded with the mask token to `query_maxlen` (32 when unset), `fixed`, attending to the expansion
  tokens only with `attend_to_mask_tokens`; a document has at most `doc_maxlen` tokens;
- `linear.weight` projects each token (no bias), then the punctuation (`mask_punctuation`, on when unset) of a
  document is not scored, then each vector is L2-normalized; MaxSim scores them.

A setting that changes the vectors and is not implemented (`similarity: l2`, `interaction: flipr`, `pool_factor` > 1,
`relu`, an unknown key) is refused by name; the training, indexing, search and run settings Stanford's library
keeps in the same file (`lr`, `nbits`, `ncells`, `root`, ...) do not change how text is encoded and are not read.
"""

from __future__ import annotations

import logging
import string
from typing import TYPE_CHECKING, Any

from wde.errors import ModelLoadError

if TYPE_CHECKING:
    from wde.components.multi_vector_config import MultiVectorConfig
    from wde.model_source import ModelSource

log = logging.getLogger(__name__)

ARCHITECTURE = "HF_ColBERT"
METADATA = "artifact.metadata"
PROJECTION = "linear.weight"
"""The checkpoint tensor holding the projection ([dim, hidden]), as `HF_ColBERT.save_pretrained` writes it."""
MARKERS = {"query": ("query_token_id", "[unused0]"), "document": ("doc_token_id", "[unused1]")}
"""Per task: the metadata key naming the marker token and sentence-transformers' default for it."""
_READ = {"query_token_id", "doc_token_id", "query_maxlen", "doc_maxlen", "attend_to_mask_tokens", "mask_punctuation",
         "dim"}
_ONLY = {"similarity": ("cosine",), "interaction": ("colbert",), "relu": (False,), "pool_factor": (1,),
         "query_token": None, "doc_token": None, "clustering_mode": None, "protected_tokens": None}
"""Settings served with these values only (None: any value; `query_token` / `doc_token` are the markers' display
names, `clustering_mode` / `protected_tokens` matter only with `pool_factor` > 1). `similarity: cosine` is MaxSim of
the normalized vectors; `pool_factor` pools tokens when an index is built, which sentence-transformers does not
apply to these folders either."""
_NOT_ENCODING = {
    # training
    "bsize", "accumsteps", "lr", "maxsteps", "save_every", "resume", "warmup", "warmup_bert", "nway",
    "use_ib_negatives", "reranker", "distillation_alpha", "ignore_scores", "model_name", "schedule",
    # resources, indexing and search
    "checkpoint", "triples", "collection", "queries", "index_name", "index_path", "index_bsize", "nbits",
    "kmeans_niters", "ncells", "centroid_score_threshold", "ndocs", "load_index_with_mmap",
    # the run and where the file came from
    "overwrite", "root", "experiment", "index_root", "name", "rank", "nranks", "amp", "gpus",
    "avoid_fork_if_possible", "meta"}
"""ColBERTConfig's settings that do not change how a text is encoded (amp: WDE's dtype is the server's choice)."""


def is_stanford_folder(source: "ModelSource") -> bool:
    """Whether config.json names `HF_ColBERT` and the folder has no modules.json (one with modules.json is a
    sentence-transformers folder, read from its modules, as sentence-transformers reads it). Never raises for a
    folder that is merely something else."""
    try:
        config = source.read_json("config.json")
        modules = source.read_json("modules.json")
    except ModelLoadError:
        return False
    return isinstance(config, dict) and ARCHITECTURE in (config.get("architectures") or []) and modules is None


def read_stanford(source: "ModelSource") -> "MultiVectorConfig":
    """The folder's multi-vector settings; a `ModelLoadError` naming artifact.metadata and the setting for anything
    WDE does not implement."""
    from wde.components.multi_vector_config import (TOKENS, MultiVectorConfig, Projection, Stage, positive,
                                                    read_transformer)

    where = source.path / METADATA
    if source.read_json("config_sentence_transformers.json") is not None:
        raise ModelLoadError(f"{source.path / 'config_sentence_transformers.json'}: a Stanford ColBERT folder"
                             " (HF_ColBERT, no modules.json) with sentence-transformers settings beside"
                             f" {METADATA} is not implemented by WDE (its prompts and similarity would override the"
                             " markers); save it with sentence-transformers (modules.json) or remove the file")
    meta = source.read_json(METADATA)
    if meta is None:
        log.warning("%s: no %s; the Stanford ColBERT defaults apply, as sentence-transformers applies them",
                    source.path, METADATA)
        meta = {}
    if not isinstance(meta, dict):
        raise ModelLoadError(f"{where} must hold a JSON object (Stanford ColBERT's ColBERTConfig), not"
                             f" {type(meta).__name__}")
    unknown = sorted(set(meta) - _READ - set(_ONLY) - _NOT_ENCODING)
    if unknown:
        raise ModelLoadError(f"{where}: settings {unknown} are not implemented by WDE (it reads"
                             f" {', '.join(sorted(_READ | {k for k, v in _ONLY.items() if v}))})")
    for key, allowed in _ONLY.items():
        if allowed and key in meta and meta[key] is not None and meta[key] not in allowed:
            raise ModelLoadError(f"{where}: {key} {meta[key]!r} is not implemented by WDE (it serves {key}"
                                 f" {' or '.join(repr(a) for a in allowed)}, as sentence-transformers reads these"
                                 " folders)")
    markers = {}
    for task, (key, default) in MARKERS.items():
        marker = meta.get(key) or default
        if not isinstance(marker, str):
            raise ModelLoadError(f"{where}: {key} must be a token string (e.g. {default!r}), got {marker!r}")
        markers[task] = marker + " "
    for key in ("attend_to_mask_tokens", "mask_punctuation"):
        if meta.get(key) is not None and not isinstance(meta[key], bool):
            raise ModelLoadError(f"{where}: {key} must be true or false, got {meta[key]!r}")
    knobs: dict[str, Any] = {"query_expansion": {"strategy": "fixed", "attend": bool(meta.get("attend_to_mask_tokens")),
                                                 "length": positive(meta.get("query_maxlen") or 32, "query_maxlen",
                                                                    where)}}
    if meta.get("doc_maxlen") is not None:
        knobs["document_length"] = positive(meta["doc_maxlen"], "doc_maxlen", where)
    dim = None if meta.get("dim") is None else positive(meta["dim"], "dim", where)
    # sentence-transformers builds the Transformer from these alone: a sentence_bert_config.json is not read
    _, document_length, expansion = read_transformer(source, knobs, from_file=False)
    words = list(string.punctuation) if meta.get("mask_punctuation", True) else []  # null: none, as there
    return MultiVectorConfig((Stage("Normalize", source.path, {"module_input_name": TOKENS}),), None,
                             document_length, expansion, tuple(words), ("document",), None,
                             similarity_fn_name="maxsim", prompts=markers, prefix_tokens=tuple(markers.values()),
                             projection=Projection(PROJECTION, dim, source.path / METADATA))
