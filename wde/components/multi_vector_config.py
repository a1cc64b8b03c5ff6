"""A sentence-transformers 6 `MultiVectorEncoder` folder (ColBERT-style late interaction), read and checked without
torch: the architecture rule that picks the `multi_vector` workflow runs `is_multi_vector_folder`, and the workflow's
components read `read_multi_vector_config`.

sentence-transformers saves such a model as a Transformer (whose `sentence_bert_config.json` holds `query_length`,
`document_length` and `query_expansion`), per-token Dense modules, a `MultiVectorMask` (which tokens are scored:
skiplist words, `keep_only_token_ids`) and a per-token Normalize; `config_sentence_transformers.json` holds the
`query` / `document` prompts and `similarity_fn_name`; a last `HierarchicalTokenPooling` merges a document's
vectors (wde/components/token_pooling.py). WDE serves exactly that, PyLate v3 (1.x) ColBERT folders and Stanford-NLP
ColBERT folders (`HF_ColBERT`, wde/components/stanford_colbert.py) as sentence-transformers 6.2 reads them. A module,
a setting or a layout it does not implement (a Normalize on sentence embeddings, a token pooling other than the
hierarchical one, ...) is refused by name when the model is loaded, never skipped: each would change the vectors.
"""

from __future__ import annotations

import string
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
_MODULES = ("Transformer", "Dense", "Normalize", "MultiVectorMask", "HierarchicalTokenPooling")
_ST_KEYS = {"model_type", "__version__", "prompts", "default_prompt_name", "similarity_fn_name"}
_TRANSFORMER_KEYS = {"transformer_task", "modality_config", "module_output_name", "processing_kwargs", "unpad_inputs",
                     "query_length", "document_length", "query_expansion", "max_seq_length", "do_lower_case"}
"""`max_seq_length` is the tokenizer's limit (read by it); `unpad_inputs` only changes how sentence-transformers runs
attention, not the vectors; `do_lower_case` is refused by `st_modules.transformer_config`'s rule, below."""
_MASK_KEYS = {"skiplist_words", "skiplist_tasks", "keep_only_token_ids"}
_EXPANSION_KEYS = {"strategy", "attend", "token", "length"}
_POOLING_KEYS = {"pool_factor", "num_protected_tokens", "normalize_embeddings", "tasks"}
PYLATE = "ColBERT"
"""`model_type` of a PyLate v3 folder's config_sentence_transformers.json."""
_PYLATE_KEYS = {"query_prefix", "document_prefix", "query_length", "document_length", "do_query_expansion",
                "attend_to_expansion_tokens", "skiplist_words"}
"""PyLate's top-level settings that WDE translates as sentence-transformers 6.2's `_parse_model_config` does."""
_PYLATE_MODULES = {"sentence_transformers.models.Transformer", "sentence_transformers.base.modules.Transformer",
                   "sentence_transformers.base.modules.transformer.Transformer", "pylate.models.Dense.Dense",
                   "sentence_transformers.models.Dense", "sentence_transformers.base.modules.Dense",
                   "sentence_transformers.base.modules.dense.Dense"}


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
class TokenPooling:
    """sentence-transformers' `HierarchicalTokenPooling`: for the tasks in `tasks`, the vectors after the first
    `num_protected_tokens` are clustered (Ward linkage on cosine distance) into `count // pool_factor` groups (at
    least one), each replaced by its mean; with `normalize_embeddings` every output vector is L2-normalized
    (also when nothing merges). `pool_factor` 1 merges nothing."""

    pool_factor: float = 1.0
    num_protected_tokens: int = 1
    normalize_embeddings: bool = False
    """sentence-transformers' default for a saved config without the key (a new module's default is true)."""
    tasks: tuple[str, ...] = ("document",)


@dataclass(frozen=True)
class Projection:
    """A per-token linear projection (no bias) held in the model's own checkpoint as the tensor `tensor` (Stanford
    ColBERT's `linear.weight`, [dim, hidden]), applied before the stages; `dim` is the width the folder declares
    (checked against the tensor), `where` the file that declares it."""

    tensor: str
    dim: int | None
    where: Path


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
    prompts: dict[str, str] | None = None
    """For a PyLate folder, its prompts with `query_prefix` / `document_prefix` put in front (None: the folder's
    `prompts`, as text_input reads them)."""
    prefix_tokens: tuple[str, ...] = ()
    """PyLate's `query_prefix` / `document_prefix`, Stanford ColBERT's markers: registered on the tokenizer as one
    piece where it knows them (`register_prefix_tokens`), as sentence-transformers does."""
    projection: Projection | None = None
    """Stanford ColBERT's inline projection, before the stages (None: the stages hold every projection)."""
    token_pooling: TokenPooling | None = None
    """The folder's last module, a HierarchicalTokenPooling (None: every scored token keeps its vector)."""


def _class(module: dict) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def is_multi_vector_folder(source: "ModelSource") -> bool:
    """Whether the folder is a sentence-transformers MultiVectorEncoder: its config_sentence_transformers.json says
    `model_type: MultiVectorEncoder` (or PyLate v3's `model_type: ColBERT`), or its modules.json has a
    MultiVectorMask, or it is a Stanford ColBERT folder (`is_stanford_folder`). Never raises for a folder that is
    merely something else (an unreadable file is left for the workflow's components to report)."""
    from wde.components.stanford_colbert import is_stanford_folder

    if is_stanford_folder(source):
        return True
    try:
        st = source.read_json("config_sentence_transformers.json")
        modules = source.read_json("modules.json")
    except ModelLoadError:
        return False
    if isinstance(st, dict) and st.get("model_type") in ("MultiVectorEncoder", PYLATE):
        return True
    return isinstance(modules, list) and any(isinstance(m, dict) and _class(m) == "MultiVectorMask" for m in modules)


def positive(value: Any, what: str, where: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(f"{where}: {what} must be a positive integer, got {value!r}")
    return value


def read_multi_vector_config(source: "ModelSource") -> MultiVectorConfig:
    """The folder's multi-vector settings; a `ModelLoadError` naming the file and the module or setting for
    anything WDE does not implement."""
    from wde.components.stanford_colbert import is_stanford_folder, read_stanford

    if is_stanford_folder(source):
        return read_stanford(source)
    st = source.read_json("config_sentence_transformers.json") or {}
    st_where = source.path / "config_sentence_transformers.json"
    if isinstance(st, dict) and st.get("model_type") == PYLATE:
        return _read_pylate(source, st)
    if not isinstance(st, dict) or st.get("model_type") != "MultiVectorEncoder":
        raise ModelLoadError(f"{st_where}: the multi_vector workflow serves sentence-transformers MultiVectorEncoder"
                             f" folders (model_type 'MultiVectorEncoder'), PyLate v3 ColBERT folders (model_type"
                             f" 'ColBERT') and Stanford ColBERT folders (config.json: HF_ColBERT, no modules.json);"
                             f" this one says {st.get('model_type') if isinstance(st, dict) else st!r}")
    unknown = sorted(set(st) - _ST_KEYS)
    if unknown:
        raise ModelLoadError(f"{st_where}: settings {unknown} are not implemented by WDE (PyLate's top-level keys are"
                             " read only with model_type 'ColBERT')")
    similarity = st.get("similarity_fn_name") or "maxsim"
    if similarity not in SIMILARITIES:
        raise ModelLoadError(f"{st_where}: similarity_fn_name {similarity!r} is not implemented by WDE (it implements"
                             f" {', '.join(SIMILARITIES)})")
    stages, mask, pooling = _read_modules(source)
    query_length, document_length, expansion = read_transformer(source)
    return MultiVectorConfig(stages, query_length, document_length, expansion, *mask, similarity_fn_name=similarity,
                             token_pooling=pooling)


def _read_pylate(source: "ModelSource", st: dict) -> MultiVectorConfig:
    """A PyLate v3 (1.x) folder, translated as sentence-transformers 6.2 reads one (`_parse_model_config`,
    `_apply_legacy_fixups`): `query_prefix` / `document_prefix` put in front of the `query` / `document` prompts;
    `query_length`, `document_length`, `do_query_expansion` and `attend_to_expansion_tokens` turned into the
    Transformer's settings (expansion on unless `do_query_expansion` is false: `fixed` to `query_length`, else 32,
    attending as `attend_to_expansion_tokens` says), which the folder's sentence_bert_config.json overrides; the
    modules.json's Transformer and Dense modules (`pylate.models.Dense.Dense` is sentence-transformers' Dense, on
    token embeddings unless its config names its input) followed by a MultiVectorMask with `skiplist_words`
    (string.punctuation when unset) on documents and a per-token Normalize."""
    st_where = source.path / "config_sentence_transformers.json"
    unknown = sorted(set(st) - _ST_KEYS - _PYLATE_KEYS)
    if unknown:
        raise ModelLoadError(f"{st_where}: PyLate settings {unknown} are not implemented by WDE (it reads"
                             f" {', '.join(sorted(_PYLATE_KEYS))})")
    # sentence-transformers keeps a saved maxsim / meanmaxsim and falls back to maxsim for PyLate's cosine / dot
    similarity = st.get("similarity_fn_name")
    similarity = similarity if similarity in SIMILARITIES else "maxsim"
    prompts = dict(st.get("prompts") or {})
    prefixes: list[str] = []
    for key, name in (("query_prefix", "query"), ("document_prefix", "document")):
        if key in st:
            prefix = st[key] or ""
            if not isinstance(prefix, str):
                raise ModelLoadError(f"{st_where}: {key} must be a string, got {prefix!r}")
            prefixes.append(prefix)
            prompts[name] = prefix + (prompts.get(name) or "").removeprefix(prefix)
    knobs: dict[str, Any] = {k: st[k] for k in ("query_length", "document_length") if st.get(k) is not None}
    if st.get("do_query_expansion") is False:
        knobs["query_expansion"] = None
    else:
        attend = st.get("attend_to_expansion_tokens")
        knobs["query_expansion"] = {"strategy": "fixed", "attend": bool(attend),
                                    "length": knobs.pop("query_length", None) or 32}
    words = st.get("skiplist_words")
    if words is None:
        words = list(string.punctuation)
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ModelLoadError(f"{st_where}: skiplist_words must be a list of strings, got {words!r}")
    ordered, kinds, where = _ordered_modules(source, "PyLate")
    for m, kind in zip(ordered, kinds):
        if m.get("type") not in _PYLATE_MODULES:
            raise ModelLoadError(f"{where}: module {m.get('type')!r} is not implemented by WDE for PyLate folders (it"
                                 " implements a Transformer followed by Dense modules, as PyLate v3 saves them)")
    if kinds[0] != "Transformer" or kinds.count("Transformer") != 1 or ordered[0].get("path"):
        raise ModelLoadError(f"{where}: WDE runs a Transformer in the folder itself followed by per-token Dense"
                             f" modules; this pipeline is {kinds}")
    stages: list[Stage] = []
    for m in ordered[1:]:
        # PyLate's Dense predates module IO names: it reads token embeddings, as sentence-transformers loads it
        folder, cfg = _module_config(source, m)
        stages.append(_token_stage("Dense", folder, {"module_input_name": TOKENS, **cfg}))
    stages.append(Stage("Normalize", source.path, {"module_input_name": TOKENS}))
    query_length, document_length, expansion = read_transformer(source, knobs)
    return MultiVectorConfig(tuple(stages), query_length, document_length, expansion, tuple(words), ("document",),
                             None, similarity_fn_name=similarity, prompts=prompts, prefix_tokens=tuple(prefixes))


def register_prefix_tokens(tokenizer: Any, prefixes: tuple[str, ...]) -> list[str]:
    """Registers each prefix that the tokenizer knows (the whole value, as PyLate adds "[Q] " with its space, else
    its first word) but does not emit as one piece as a non-normalized special token, so that the prefix put in
    front of the text tokenizes as one piece, as sentence-transformers' `_register_prefix_tokens` does; a prefix it
    does not know stays text. Returns the tokens registered."""
    from transformers import AddedToken

    added = set(getattr(tokenizer, "added_tokens_encoder", None) or {})
    vocab = tokenizer.get_vocab()
    registered: list[str] = []
    for value in prefixes:
        if not value or not value.split():
            continue
        for prefix in (value, value.split(None, 1)[0]):
            if prefix not in added and prefix not in vocab:
                continue
            if tokenizer.tokenize(prefix) != [prefix]:
                registered.append(prefix)
            break
    if registered:
        tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(p, normalized=False, special=True)
                                                                    for p in registered]})
    return registered


def _ordered_modules(source: "ModelSource", what: str) -> tuple[list[dict], list[str], Path]:
    """The folder's modules.json entries in order, their class names, and the file (for errors)."""
    raw = source.read_json("modules.json")
    where = source.path / "modules.json"
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ModelLoadError(f"{where}: a {what} folder needs a modules.json listing its modules")
    ordered = sorted(raw, key=lambda m: int(m.get("idx", 0)))
    return ordered, [_class(m) for m in ordered], where


def _module_config(source: "ModelSource", module: dict) -> tuple[Path, dict]:
    """A module's folder and its config.json ({} when it has none)."""
    rel = str(module.get("path", ""))
    cfg = source.read_json(f"{rel}/config.json") if rel else None
    return source.path / rel, cfg if isinstance(cfg, dict) else {}


def _token_stage(kind: str, folder: Path, cfg: dict) -> Stage:
    """A per-token module (Dense, Normalize), refused unless it reads and writes token embeddings (its input name
    defaults to sentence-transformers' 'sentence_embedding', its output name to its input's)."""
    name_in = cfg.get("module_input_name", "sentence_embedding")
    names = {"module_input_name": name_in, "module_output_name": cfg.get("module_output_name") or name_in}
    for key, name in names.items():
        if name != TOKENS:
            raise ModelLoadError(
                f"{folder / 'config.json'}: {kind} {key} is {name!r}; in a multi-vector pipeline only"
                f" '{TOKENS}' exists (sentence-transformers skips a Normalize on 'sentence_embedding', so"
                f" the vectors stay unnormalized: save it with module_input_name='{TOKENS}')")
    return Stage(kind, folder, cfg)


def _read_modules(source: "ModelSource") -> tuple[tuple[Stage, ...], tuple, TokenPooling | None]:
    ordered, kinds, where = _ordered_modules(source, "MultiVectorEncoder")
    for m, kind in zip(ordered, kinds):
        if not str(m.get("type", "")).startswith("sentence_transformers.") or kind not in _MODULES:
            hint = (" (of token poolings, WDE implements HierarchicalTokenPooling)" if "TokenPooling" in kind
                    else "")
            raise ModelLoadError(f"{where}: module {m.get('type')!r} is not implemented by WDE for multi-vector models"
                                 f" (it implements {', '.join(_MODULES)}){hint}")
    pooling = None
    if "HierarchicalTokenPooling" in kinds:
        if kinds.count("HierarchicalTokenPooling") != 1 or kinds[-1] != "HierarchicalTokenPooling":
            raise ModelLoadError(f"{where}: WDE runs a HierarchicalTokenPooling as the last module only, once (as"
                                 f" sentence-transformers' docs place it); this pipeline is {kinds}")
        folder, cfg = _module_config(source, ordered[-1])
        pooling = _read_pooling(cfg, folder / "config.json")
        ordered, kinds = ordered[:-1], kinds[:-1]
    if kinds[0] != "Transformer" or kinds.count("Transformer") != 1 or ordered[0].get("path"):
        raise ModelLoadError(f"{where}: WDE runs a Transformer in the folder itself followed by per-token modules;"
                             f" this pipeline is {kinds}")
    if kinds.count("MultiVectorMask") != 1:
        raise ModelLoadError(f"{where}: WDE needs exactly one MultiVectorMask (which tokens are scored); this pipeline"
                             f" is {kinds}")
    stages: list[Stage] = []
    mask: tuple = ()
    for m, kind in zip(ordered[1:], kinds[1:]):
        folder, cfg = _module_config(source, m)
        if kind == "MultiVectorMask":
            mask = _read_mask(cfg, folder / "config.json")
            continue
        stages.append(_token_stage(kind, folder, cfg))
    return tuple(stages), mask, pooling


def _read_pooling(cfg: dict, where: Path) -> TokenPooling:
    """A HierarchicalTokenPooling's config, checked as its constructor checks it."""
    unknown = sorted(set(cfg) - _POOLING_KEYS)
    if unknown:
        raise ModelLoadError(f"{where}: HierarchicalTokenPooling settings {unknown} are not implemented by WDE (it"
                             f" reads {', '.join(sorted(_POOLING_KEYS))})")
    factor = cfg.get("pool_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ModelLoadError(f"{where}: pool_factor must be a number >= 1, got {factor!r}")
    protected = cfg.get("num_protected_tokens", 1)
    if isinstance(protected, bool) or not isinstance(protected, int) or protected < 0:
        raise ModelLoadError(f"{where}: num_protected_tokens must be an integer >= 0, got {protected!r}")
    normalize = cfg.get("normalize_embeddings", False)
    if not isinstance(normalize, bool):
        raise ModelLoadError(f"{where}: normalize_embeddings must be true or false, got {normalize!r}")
    tasks = cfg.get("tasks")
    tasks = ["document"] if tasks is None else [tasks] if isinstance(tasks, str) else tasks
    if not isinstance(tasks, list) or not all(t in TASKS for t in tasks):
        raise ModelLoadError(f"{where}: tasks {tasks!r} are not implemented by WDE (its tasks are"
                             f" {', '.join(TASKS)})")
    return TokenPooling(float(factor), protected, normalize, tuple(tasks))


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


def read_transformer(source: "ModelSource", defaults: dict[str, Any] | None = None, from_file: bool = True
                     ) -> tuple[int | None, int | None, QueryExpansion | None]:
    """The Transformer's settings; `defaults` (a PyLate or Stanford folder's, translated) under what
    sentence_bert_config.json says (unless not `from_file`)."""
    saved = source.read_json("sentence_bert_config.json") if from_file else None
    cfg = {**(defaults or {}), **(saved or {})}
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
        positive(query_length, "query_length", where)
    if document_length is not None:
        positive(document_length, "document_length", where)
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
    length = positive(raw.get("length"), "query_expansion length", where)
    if query_length is not None and query_length < length:
        raise ModelLoadError(f"{where}: query_length {query_length} is smaller than query_expansion length {length}")
    return query_length, document_length, QueryExpansion(strategy, length, attend, token)
