"""A sentence-transformers 6 `MultiVectorEncoder` folder (ColBERT-style late interaction), read and checked without
torch: the architecture rule that picks the `multi_vector` workflow runs `is_multi_vector_folder`, and the workflow's
components read `read_multi_vector_config`.

sentence-transformers saves such a model as a Transformer (whose `sentence_bert_config.json` holds `query_length`,
`document_length` and `query_expansion`), per-token Dense modules, a `MultiVectorMask` (which tokens are scored:
skiplist words, `keep_only_token_ids`) and a per-token Normalize; `config_sentence_transformers.json` holds the
`query` / `document` prompts and `similarity_fn_name`. WDE serves exactly that. A module, a setting or a layout it
does not implement (token pooling, a Normalize on sentence embeddings, PyLate's top-level keys, ...) is refused by
name when the model is loaded, never skipped: each would change the vectors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from wde.errors import ModelLoadError

if TYPE_CHECKING:
    from wde.model_source import ModelSource

TASKS: tuple[str, ...] = ("document", "query")
"""The values of the per-request option `task` (the default first), as every multi-vector component declares them."""
SIMILARITIES = ("maxsim", "meanmaxsim")
TOKENS = "token_embeddings"
_MODULES = ("Transformer", "Dense", "Normalize", "MultiVectorMask")
_ST_KEYS = {"model_type", "__version__", "prompts", "default_prompt_name", "similarity_fn_name"}
_TRANSFORMER_KEYS = {"transformer_task", "modality_config", "module_output_name", "processing_kwargs", "unpad_inputs",
                     "query_length", "document_length", "query_expansion", "max_seq_length", "do_lower_case"}
"""`max_seq_length` is the tokenizer's limit (read by it); `unpad_inputs` only changes how sentence-transformers runs
attention, not the vectors; `do_lower_case` is refused by `st_modules.transformer_config`'s rule, below."""
_MASK_KEYS = {"skiplist_words", "skiplist_tasks", "keep_only_token_ids"}
_EXPANSION_KEYS = {"strategy", "attend", "token", "length"}


@dataclass(frozen=True)
class QueryExpansion:
    """sentence-transformers' `query_expansion`: a query shorter than `length` tokens is padded up to it with
    `token` (None: the tokenizer's mask token, else its EOS token). `fixed`: `length` is also the most tokens a query
    has; `min`: only the floor (`query_length`, else the model's limit, is the ceiling). Without `attend`, no token
    attends to the expansion tokens (they still get vectors, which are scored)."""

    strategy: Literal["fixed", "min"]
    length: int
    attend: bool = False
    token: str | None = None


@dataclass(frozen=True)
class Stage:
    """A module after the Transformer: its class name (Dense, Normalize), folder and config."""

    kind: str
    path: Path
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MultiVectorConfig:
    """What a MultiVectorEncoder folder says, checked."""

    stages: tuple[Stage, ...]
    """The Dense and Normalize modules in order (each per token; the mask is applied around them, which is the
    same since none mixes tokens)."""
    query_length: int | None = None
    document_length: int | None = None
    expansion: QueryExpansion | None = None
    skiplist_words: tuple[str, ...] = ()
    skiplist_tasks: tuple[str, ...] = ("document",)
    keep_only_token_ids: tuple[int, ...] | None = None
    similarity_fn_name: str = "maxsim"


def _class(module: dict) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def is_multi_vector_folder(source: "ModelSource") -> bool:
    """Whether the folder is a sentence-transformers MultiVectorEncoder: its config_sentence_transformers.json says
    `model_type: MultiVectorEncoder`, or its modules.json has a MultiVectorMask. Never raises for a folder that is
    merely something else (an unreadable file is left for the workflow's components to report)."""
    try:
        st = source.read_json("config_sentence_transformers.json")
        modules = source.read_json("modules.json")
    except ModelLoadError:
        return False
    if isinstance(st, dict) and st.get("model_type") == "MultiVectorEncoder":
        return True
    return isinstance(modules, list) and any(isinstance(m, dict) and _class(m) == "MultiVectorMask" for m in modules)


def _positive(value: Any, what: str, where: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def read_multi_vector_config(source: "ModelSource") -> MultiVectorConfig:
    """The folder's multi-vector settings; a `ModelLoadError` naming the file and the module or setting for
    anything WDE does not implement."""
    st = source.read_json("config_sentence_transformers.json") or {}
    st_where = source.path / "config_sentence_transformers.json"
    if not isinstance(st, dict) or st.get("model_type") != "MultiVectorEncoder":
        raise ModelLoadError(f"{st_where}: the multi_vector workflow serves sentence-transformers MultiVectorEncoder"
                             f" folders (model_type 'MultiVectorEncoder'); this one says"
                             f" {st.get('model_type') if isinstance(st, dict) else st!r}")
    unknown = sorted(set(st) - _ST_KEYS)
    if unknown:
        raise ModelLoadError(f"{st_where}: settings {unknown} are not implemented by WDE (PyLate's and Stanford"
                             " ColBERT's layouts are not served yet)")
    similarity = st.get("similarity_fn_name") or "maxsim"
    if similarity not in SIMILARITIES:
        raise ModelLoadError(f"{st_where}: similarity_fn_name {similarity!r} is not implemented by WDE (it implements"
                             f" {', '.join(SIMILARITIES)})")
    stages, mask = _read_modules(source)
    query_length, document_length, expansion = _read_transformer(source)
    return MultiVectorConfig(stages, query_length, document_length, expansion, *mask, similarity_fn_name=similarity)


def _read_modules(source: "ModelSource") -> tuple[tuple[Stage, ...], tuple]:
    raw = source.read_json("modules.json")
    where = source.path / "modules.json"
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ModelLoadError(f"{where}: a MultiVectorEncoder folder needs a modules.json listing its modules")
    ordered = sorted(raw, key=lambda m: int(m.get("idx", 0)))
    kinds = [_class(m) for m in ordered]
    for m, kind in zip(ordered, kinds):
        if not str(m.get("type", "")).startswith("sentence_transformers.") or kind not in _MODULES:
            hint = " (token pooling merges vectors; WDE does not implement it yet)" if "TokenPooling" in kind else ""
            raise ModelLoadError(f"{where}: module {m.get('type')!r} is not implemented by WDE for multi-vector models"
                                 f" (it implements {', '.join(_MODULES)}){hint}")
    if kinds[0] != "Transformer" or kinds.count("Transformer") != 1 or ordered[0].get("path"):
        raise ModelLoadError(f"{where}: WDE runs a Transformer in the folder itself followed by per-token modules;"
                             f" this pipeline is {kinds}")
    if kinds.count("MultiVectorMask") != 1:
        raise ModelLoadError(f"{where}: WDE needs exactly one MultiVectorMask (which tokens are scored); this pipeline"
                             f" is {kinds}")
    stages: list[Stage] = []
    mask: tuple = ()
    for m, kind in zip(ordered[1:], kinds[1:]):
        rel = str(m.get("path", ""))
        cfg = source.read_json(f"{rel}/config.json") if rel else None
        cfg = cfg if isinstance(cfg, dict) else {}
        folder = source.path / rel
        if kind == "MultiVectorMask":
            mask = _read_mask(cfg, folder / "config.json")
            continue
        name_in = cfg.get("module_input_name", "sentence_embedding")  # sentence-transformers' defaults
        names = {"module_input_name": name_in, "module_output_name": cfg.get("module_output_name") or name_in}
        for key, name in names.items():
            if name != TOKENS:
                raise ModelLoadError(
                    f"{folder / 'config.json'}: {kind} {key} is {name!r}; in a multi-vector pipeline only"
                    f" '{TOKENS}' exists (sentence-transformers skips a Normalize on 'sentence_embedding', so"
                    f" the vectors stay unnormalized: save it with module_input_name='{TOKENS}')")
        stages.append(Stage(kind, folder, cfg))
    return tuple(stages), mask


def _read_mask(cfg: dict, where: Path) -> tuple:
    unknown = sorted(set(cfg) - _MASK_KEYS)
    if unknown:
        raise ModelLoadError(f"{where}: MultiVectorMask settings {unknown} are not implemented by WDE")
    words = cfg.get("skiplist_words") or []
    tasks = cfg.get("skiplist_tasks", ["document"])
    tasks = [tasks] if isinstance(tasks, str) else tasks
    keep = cfg.get("keep_only_token_ids")
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ModelLoadError(f"{where}: skiplist_words must be a list of strings, got {words!r}")
    if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
        raise ModelLoadError(f"{where}: skiplist_tasks must be a list of task names, got {tasks!r}")
    if keep is not None and (not isinstance(keep, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                                       for i in keep)):
        raise ModelLoadError(f"{where}: keep_only_token_ids must be a list of token ids or null, got {keep!r}")
    # sentence-transformers restricts documents to keep_only_token_ids only when the list is non-empty
    return tuple(words), tuple(tasks), tuple(keep) if keep else None


def _read_transformer(source: "ModelSource") -> tuple[int | None, int | None, QueryExpansion | None]:
    cfg = source.read_json("sentence_bert_config.json") or {}
    where = source.path / "sentence_bert_config.json"
    unknown = sorted(set(cfg) - _TRANSFORMER_KEYS)
    if unknown:
        raise ModelLoadError(f"{where}: Transformer settings {unknown} are not implemented by WDE")
    if cfg.get("do_lower_case"):
        raise ModelLoadError(f"{where}: do_lower_case is true (the text is lower-cased before tokenizing), which WDE"
                             " does not implement")
    if cfg.get("processing_kwargs"):
        raise ModelLoadError(f"{where}: processing_kwargs {cfg['processing_kwargs']!r} are not implemented by WDE")
    task = cfg.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ModelLoadError(f"{where}: transformer_task {task!r} is not implemented for multi-vector models (WDE"
                             " serves 'feature-extraction' text encoders)")
    if cfg.get("module_output_name", TOKENS) != TOKENS:
        raise ModelLoadError(f"{where}: the Transformer writes {cfg['module_output_name']!r}; WDE's multi-vector"
                             f" pipeline reads '{TOKENS}'")
    modality = cfg.get("modality_config")
    if modality is not None and modality != {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}:
        raise ModelLoadError(f"{where}: modality_config {modality!r} is not implemented by WDE (it runs text through"
                             " the model's forward and reads last_hidden_state)")
    query_length = cfg.get("query_length")
    document_length = cfg.get("document_length")
    if query_length is not None:
        _positive(query_length, "query_length", where)
    if document_length is not None:
        _positive(document_length, "document_length", where)
    raw = cfg.get("query_expansion")
    if raw is None:
        return query_length, document_length, None
    if not isinstance(raw, dict) or set(raw) - _EXPANSION_KEYS:
        raise ModelLoadError(f"{where}: query_expansion must be a dict with keys {sorted(_EXPANSION_KEYS)}, got"
                             f" {raw!r}")
    strategy, attend, token = raw.get("strategy"), raw.get("attend", False), raw.get("token")
    if strategy not in ("fixed", "min"):
        raise ModelLoadError(f"{where}: query_expansion strategy {strategy!r} is not implemented by WDE (fixed, min)")
    if not isinstance(attend, bool) or not (token is None or isinstance(token, str)):
        raise ModelLoadError(f"{where}: query_expansion attend must be true or false and token a string or null,"
                             f" got {attend!r} and {token!r}")
    length = _positive(raw.get("length"), "query_expansion length", where)
    if query_length is not None and query_length < length:
        raise ModelLoadError(f"{where}: query_length {query_length} is smaller than query_expansion length {length}")
    return query_length, document_length, QueryExpansion(strategy, length, attend, token)
