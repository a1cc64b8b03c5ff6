"""A sentence-transformers SparseEncoder folder of the SPLADE kind, read and checked without torch (the
architecture rule that picks the `splade` workflow runs it, and so does the `splade` pooler).

sentence-transformers saves SPLADE models (naver/splade-cocondenser-ensembledistil, naver/splade-v3,
prithivida/Splade_PP_en_v1, ...) as two modules: the masked-LM Transformer (`MLMTransformer`, or since 5.4 a
`Transformer` with `transformer_task: fill-mask`) in the folder itself, then `SpladePooling`
(`pooling_strategy` max or sum, `activation_function` relu or log1p_relu). `config_sentence_transformers.json`
may cap the active dimensions (`max_active_dims`). Anything else (a SparseAutoEncoder after pooling, a Router, a
static embedding) is refused by name: it would change the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wde.errors import ModelLoadError

if TYPE_CHECKING:
    from wde.model_source import ModelSource

POOLING_STRATEGIES = ("max", "sum")
ACTIVATIONS = ("relu", "log1p_relu")
_POOLING_KEYS = {"pooling_strategy", "activation_function", "embedding_dimension", "word_embedding_dimension",
                 "chunk_size"}
_TRANSFORMERS = ("MLMTransformer", "Transformer")


@dataclass(frozen=True)
class SpladeConfig:
    """What the folder's SpladePooling and config_sentence_transformers.json say."""

    pooling_strategy: str = "max"
    activation_function: str = "relu"
    embedding_dimension: int | None = None
    """The vocabulary width the pooling was saved with (checked against the model's), when written."""
    max_active_dims: int | None = None
    """Keep only this many largest weights per input (sentence-transformers' `max_active_dims`); None: all."""


def _class(module: dict) -> str:
    type_name = str(module.get("type", ""))
    return type_name.rsplit(".", 1)[-1] if type_name.startswith("sentence_transformers.") else type_name


def sparse_encoder_problem(source: "ModelSource") -> str | None:
    """None when the folder is a SPLADE SparseEncoder (see the module docstring); else what it lacks, as a clause
    ("it has no modules.json", ...). Never raises for a folder that is merely something else."""
    try:
        modules = source.read_json("modules.json")
    except ModelLoadError as e:
        return f"its modules.json is unreadable ({e})"
    if modules is None:
        return "it has no sentence-transformers modules.json"
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        return "its modules.json is not a list of modules"
    ordered = sorted(modules, key=lambda m: int(m.get("idx", 0)) if str(m.get("idx", 0)).isdigit() else 0)
    kinds = [_class(m) for m in ordered]
    if len(kinds) != 2 or kinds[0] not in _TRANSFORMERS or kinds[1] != "SpladePooling":
        return f"its modules.json is {kinds}, not a masked-LM Transformer followed by SpladePooling"
    if ordered[0].get("path"):
        return f"its Transformer lives in the subfolder {ordered[0]['path']!r} (point --model at that subfolder)"
    try:
        bert_cfg = source.read_json("sentence_bert_config.json") or {}
    except ModelLoadError as e:
        return f"its sentence_bert_config.json is unreadable ({e})"
    task = bert_cfg.get("transformer_task", "fill-mask" if kinds[0] == "MLMTransformer" else "feature-extraction")
    if task != "fill-mask":
        return (f"its Transformer module's transformer_task is {task!r}, not 'fill-mask' (SPLADE pools vocabulary"
                " logits)")
    return None


def read_splade_config(source: "ModelSource") -> SpladeConfig | None:
    """The folder's SPLADE settings; None when it has no modules.json (the `splade` workflow's defaults then
    apply: max pooling, relu). A modules.json that is not a SPLADE pipeline, or a setting WDE does not implement,
    is a `ModelLoadError` naming the file."""
    if source.read_json("modules.json") is None:
        return None
    problem = sparse_encoder_problem(source)
    if problem is not None:
        raise ModelLoadError(f"{source.path}: the splade pooler runs sentence-transformers SparseEncoder folders of the"
                             " SPLADE kind (MLMTransformer or a fill-mask Transformer, then SpladePooling), and"
                             f" {problem}")
    modules = sorted(source.read_json("modules.json"), key=lambda m: int(m.get("idx", 0)))
    rel = str(modules[1].get("path", ""))
    where = source.path / rel / "config.json"
    cfg: Any = source.read_json(f"{rel}/config.json") if rel else None
    cfg = cfg if isinstance(cfg, dict) else {}
    unknown = sorted(set(cfg) - _POOLING_KEYS)
    if unknown:
        raise ModelLoadError(f"{where}: SpladePooling settings {unknown} are not implemented by WDE")
    strategy = cfg.get("pooling_strategy", "max")
    if strategy not in POOLING_STRATEGIES:
        raise ModelLoadError(f"{where}: pooling_strategy must be one of {POOLING_STRATEGIES}, got {strategy!r}")
    activation = cfg.get("activation_function", "relu")
    if activation not in ACTIVATIONS:
        raise ModelLoadError(f"{where}: activation_function must be one of {ACTIVATIONS}, got {activation!r}")
    dim = cfg.get("embedding_dimension", cfg.get("word_embedding_dimension"))
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 1):
        raise ModelLoadError(f"{where}: embedding_dimension must be a positive integer or null, got {dim!r}")
    st = source.read_json("config_sentence_transformers.json") or {}
    top = st.get("max_active_dims") if isinstance(st, dict) else None
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or top < 1):
        raise ModelLoadError(f"{source.path / 'config_sentence_transformers.json'}: max_active_dims must be a positive"
                             f" integer or null, got {top!r}")
    return SpladeConfig(strategy, activation, dim, top)
