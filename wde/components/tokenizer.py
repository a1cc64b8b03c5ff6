"""Tokenizers: turn prompts into token ids. Called by the request processor, only when a request is scheduled."""

from __future__ import annotations

import copy
import functools
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

from pydantic import Field

from wde.components.base import BuildContext, Params
from wde.components.kinds import Tokenizer
from wde.errors import ModelLoadError, one_line
from wde.request import PairPrompt, TextPrompt

Encoded = tuple[list[int], list[int] | None]

PromptOptions = Sequence[Mapping[str, str] | None]
"""What `encode` is told of each prompt's request: its per-request options (`PoolingParams.options`; None where it
has none), one per prompt, in order."""

VOCAB_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model",
               "spm.model", "sentencepiece.model", "tokenizer.model", "*.tiktoken")
"""Files that hold a vocabulary (tokenizer_config.json and special_tokens_map.json do not). A folder with none of
these, nor of the files its tokenizer class names, has no tokenizer: transformers would build an empty one."""


class HFTokenizerParams(Params):
    max_length: int | None = Field(None, gt=0, description=(
        "tokens per input (lower only); default: what the model allows. More than the model allows is refused at"
        " start-up, naming its maximum (it was cut to the model's maximum without a word)"))
    max_length_cap: int | None = Field(None, gt=0, description=(
        "for a workflow: the most tokens it lets an input have whatever the model allows (e5_mistral: its 4096-token"
        " attention window); a model that allows fewer keeps its own limit. max_length, when set, wins"))
    padding_side: Literal["left", "right"] | None = None
    add_eos: bool = Field(False, description="append the EOS token when the tokenizer's template does not"
                                             " (last-token pooling reads the EOS state)")
    position_offset: int | None = Field(None, ge=0, description="index of position 0 in the model's position table"
                                        " (RoBERTa: pad_token_id + 1), which shortens the max length by as much;"
                                        " default: from the config's model_type")
    path: str | None = Field(None, min_length=1, description="folder to load the tokenizer from when the model folder"
                             " has no tokenizer files; default: the model folder")


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer loaded from the model folder.

    The max length is the smallest of what the model allows (sentence-transformers' `max_seq_length`, the
    tokenizer's `model_max_length` and the model's position table, so no input can overrun the positions) and the
    workflow's `max_length_cap`; the `max_length` param replaces it, and is refused when over what the model allows.

    Thread-safe: a fast tokenizer changes its truncation state on calls that truncate, and two threads in one
    Rust tokenizer at once fail ("Already borrowed"), so each thread that encodes (the engine loop, the
    background tokenizer, the /tokenize route) uses its own copy, made on its first call.
    """

    kind = "tokenizer"
    name = "hf_tokenizer"
    Params = HFTokenizerParams

    def __init__(self, params: HFTokenizerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        from transformers import AutoTokenizer

        folder = Path(params.path).expanduser() if params.path is not None else ctx.source.path
        if not folder.is_dir():
            raise ModelLoadError(f"tokenizer.params.path {params.path!r} is not a folder")
        if params.path is not None:  # the model folder was checked when its ModelSource was made
            from wde.model_source import check_regular_files

            check_regular_files(folder)
        try:
            self._tok = AutoTokenizer.from_pretrained(
                folder, trust_remote_code=ctx.source.trust_remote_code, use_fast=True
            )
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the tokenizer from {folder}: {one_line(e)}") from None
        cfg = ctx.source.hf_config
        self._check_vocabulary(folder, cfg)
        self.max_length: int = self._max_length(ctx, cfg)
        # Length limits are enforced by the request processor with a clear error; silence transformers' own
        # "sequence length is longer than the specified maximum" warning for inputs it is about to reject.
        self._tok.model_max_length = int(1e30)
        if params.add_eos and self._tok.eos_token_id is None:
            raise ModelLoadError(f"tokenizer.params.add_eos is set but the tokenizer in {ctx.source.path} has no EOS token")
        self._returns_types = "token_type_ids" in self._tok.model_input_names and getattr(cfg, "type_vocab_size", 0) > 1
        self._local = threading.local()
        self._copy_lock = threading.Lock()
        self._original_taken = False
        self._single_types = self._returns_types
        """Whether a single text's token types are kept: not where the tokenizer makes them all 0 (BERT's template:
        a pair's first text and its special tokens are type 0), which models read as no token types at all."""
        self._direct = self._direct_matches()
        """Whether `encode` calls the Rust tokenizer itself when it does not truncate (`_encode_direct`)."""

    def model_limits(self, ctx: BuildContext, cfg: object) -> dict[str, int]:
        """What the model allows per input, by where it says so (only the limits it states)."""
        limits: dict[str, int] = {}
        st = ctx.source.read_json("sentence_bert_config.json") or {}
        if isinstance(st.get("max_seq_length"), int) and not isinstance(st["max_seq_length"], bool):
            limits["sentence_bert_config.json max_seq_length"] = st["max_seq_length"]
        if self._tok.model_max_length < 10**9:
            limits["the tokenizer's model_max_length"] = int(self._tok.model_max_length)
        max_pos = getattr(cfg, "max_position_embeddings", None)
        if max_pos is None and hasattr(cfg, "get_text_config"):  # a two-tower config (CLIP, SigLIP): the text tower's
            max_pos = getattr(cfg.get_text_config(), "max_position_embeddings", None)
        if max_pos is not None:
            offset = self.params.position_offset if self.params.position_offset is not None \
                else self.position_offset(cfg)
            limits["config.json's position table" + (f" from offset {offset}" if offset else "")] = max_pos - offset
        return limits

    def _max_length(self, ctx: BuildContext, cfg: object) -> int:
        """The tokens one input may have: `max_length` when set (refused above what the model allows: it used to
        be cut to the model's maximum without a word), else the smallest of the model's limits and the workflow's
        `max_length_cap` (512 when nothing states one)."""
        limits = self.model_limits(ctx, cfg)
        allowed = min(limits.values()) if limits else None
        wanted = self.params.max_length
        if wanted is not None:
            if allowed is not None and wanted > allowed:
                said = ", ".join(f"{where} {n}" for where, n in limits.items())
                raise ModelLoadError(
                    f"tokenizer.params.max_length={wanted} is more than {ctx.source.path} allows: at most {allowed}"
                    f" tokens per input ({said}); set tokenizer.params.max_length to {allowed} or less, or leave it"
                    " unset")
            return wanted
        caps = [n for n in (allowed, self.params.max_length_cap) if n is not None]
        return min(caps) if caps else 512

    def _check_vocabulary(self, folder: Path, cfg: object) -> None:
        """Refuse a folder without tokenizer files (transformers 5 then builds a 5-token vocabulary and every
        word becomes the unknown token) and a tokenizer with more tokens than the model has embeddings."""
        names = {*VOCAB_FILES, *(n for n in getattr(type(self._tok), "vocab_files_names", {}).values()
                                 if isinstance(n, str))}
        if not any(next(folder.glob(n), None) is not None for n in names):
            fix = "add them" if self.params.path is not None else (
                "copy the model's tokenizer files into it, or set tokenizer.params.path to a folder that has them")
            raise ModelLoadError(f"{folder} has no tokenizer files (tokenizer.json, or a vocabulary such as vocab.txt,"
                                 f" sentencepiece.bpe.model, spiece.model, vocab.json + merges.txt): {fix}")
        vocab_size = getattr(cfg, "vocab_size", None)
        if not isinstance(vocab_size, int) and hasattr(cfg, "get_text_config"):
            vocab_size = getattr(cfg.get_text_config(), "vocab_size", None)
        if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and len(self._tok) > vocab_size:
            raise ModelLoadError(
                f"the tokenizer in {folder} has {len(self._tok)} tokens but the model's config.json says vocab_size"
                f" {vocab_size}: ids from {vocab_size} on have no embedding; the tokenizer files belong to another"
                " model")

    def _hf(self) -> Any:
        """This thread's tokenizer: the loaded one for the first thread that asks, a copy for each other."""
        tok = getattr(self._local, "tok", None)
        if tok is None:
            with self._copy_lock:
                if not self._original_taken:
                    self._original_taken, tok = True, self._tok
                else:
                    tok = _copy_tokenizer(self._tok)
            self._local.tok = tok
        return tok

    @staticmethod
    def position_offset(cfg: object) -> int:
        """RoBERTa-style models start positions after the padding index. Other families whose position table
        starts later declare it with the `position_offset` param (the model checks it when it is built)."""
        if getattr(cfg, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
            return getattr(cfg, "pad_token_id", 1) + 1
        return 0

    @property
    def hf_tokenizer(self):  # noqa: ANN201 - a transformers PreTrainedTokenizerFast
        """The calling thread's Hugging Face tokenizer (the server's /tokenize needs its offsets)."""
        return self._hf()

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(
        self,
        prompts: Sequence[TextPrompt | PairPrompt],
        max_length: int | None = None,
        direction: Literal["left", "right"] = "right",
        options: PromptOptions | None = None,
    ) -> list[Encoded]:
        """Token ids (and token type ids for pairs on BERT-like models) for each prompt.

        With `max_length` the inputs are truncated to it (pairs: from the second text only), else not at all.
        `options` (the request processor always passes them): each prompt's per-request options, for a tokenizer
        that tokenizes a request by them (a late-interaction query and document); such a tokenizer declares the
        options it reads with `request_options()`, as every component does. This one reads none.
        """
        if options is not None and len(options) != len(prompts):
            raise ValueError(f"encode got {len(options)} options for {len(prompts)} prompts; give one per prompt")
        if not prompts:
            return []
        texts = [p.text for p in prompts]
        pairs = [p.text_pair for p in prompts] if isinstance(prompts[0], PairPrompt) else None
        tok = self._hf()
        if max_length is None and self._direct:
            out = _encode_direct(tok, texts, pairs, self._single_types if pairs is None else self._returns_types)
        else:
            out = self._encode_hf(tok, texts, pairs, max_length, direction)
        return [self._with_eos(ids, t) for ids, t in out] if self.params.add_eos else out

    def _encode_hf(self, tok: Any, texts: list[str], pairs: list[str] | None, max_length: int | None,
                   direction: Literal["left", "right"]) -> list[Encoded]:
        """`encode` through the Hugging Face tokenizer's own call (truncation, and tokenizers `_direct` is not)."""
        kwargs = self._call_kwargs(max_length, pairs=pairs is not None)
        kwargs["return_token_type_ids"] = self._returns_types
        tok.truncation_side = direction
        enc = tok(texts, pairs, **kwargs) if pairs else tok(texts, **kwargs)
        types = enc.get("token_type_ids") if self._returns_types else None
        return [(ids, types[i] if types is not None else None) for i, ids in enumerate(enc["input_ids"])]

    def _direct_matches(self) -> bool:
        """Whether `_encode_direct` gives what the Hugging Face tokenizer's call gives, for this tokenizer: its class
        keeps transformers' batch encoding (LayoutLM, LUKE, MarkupLM... override it), and on `DIRECT_PROBES`
        (texts, pairs, the tokenizer's own special tokens written out) the ids and token types are the same. Sets
        `_single_types` off where the call gives single texts token types that are all 0 (a template's types do
        not depend on the text, so the probes show them)."""
        tok = self._tok
        from transformers import PreTrainedTokenizerFast

        if not getattr(tok, "is_fast", False) or not hasattr(tok, "backend_tokenizer") or any(
                getattr(type(tok), name, None) is not getattr(PreTrainedTokenizerFast, name, None)
                for name in _BATCH_ENCODING):
            return False
        specials = " ".join(t for t in tok.all_special_tokens if isinstance(t, str))
        texts = [*DIRECT_PROBES, f"{specials} between {specials}"]
        pairs = [texts[-1 - i] for i in range(len(texts))]
        try:
            singles = self._encode_hf(tok, texts, None, None, "right")
            if self._returns_types and not any(any(types) for _, types in singles):
                self._single_types = False
            want = [(ids, types if self._single_types else None) for ids, types in singles]
            if _encode_direct(tok, texts, None, self._single_types) != want:
                return False
            if _encode_direct(tok, texts, pairs, self._returns_types) != self._encode_hf(tok, texts, pairs, None,
                                                                                          "right"):
                return False
        except Exception:  # noqa: BLE001 - a tokenizer the direct call does not suit keeps the Hugging Face call
            self._single_types = self._returns_types
            return False
        return True

    def encode_with_offsets(self, text: str, max_length: int | None = None,
                            direction: Literal["left", "right"] = "right") -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`'s token ids of one text, with each token's character offsets ((0, 0) for special tokens and the
        EOS `add_eos` appends): what late chunking maps character spans with. Needs a fast tokenizer."""
        kwargs = self._call_kwargs(max_length, pairs=False)
        kwargs.update(return_token_type_ids=False, return_offsets_mapping=True, return_special_tokens_mask=True)
        tok = self._hf()
        tok.truncation_side = direction
        enc = tok(text, **kwargs)
        ids = list(enc["input_ids"])
        offsets = [(0, 0) if special else (int(a), int(b))
                   for (a, b), special in zip(enc["offset_mapping"], enc["special_tokens_mask"])]
        if self.params.add_eos:
            with_eos, _ = self._with_eos(ids, None)
            offsets += [(0, 0)] * (len(with_eos) - len(ids))
            ids = with_eos
        return ids, offsets

    def _call_kwargs(self, max_length: int | None, pairs: bool) -> dict[str, Any]:
        """The Hugging Face tokenizer's arguments: special tokens, and truncation to `max_length` (pairs: the second
        text only) leaving room for the EOS `add_eos` appends."""
        kwargs: dict[str, Any] = dict(add_special_tokens=True, return_attention_mask=False)
        if max_length is not None:
            room = max_length - 1 if self.params.add_eos else max_length
            kwargs.update(truncation="only_second" if pairs else True, max_length=room)
        return kwargs

    def min_pair_length(self, prompt: PairPrompt) -> int:
        """The fewest tokens `prompt` can be truncated to: truncation cuts only the second text and leaves it at
        least one token, so the first text and the special tokens always stay."""
        first = len(self._hf()(prompt.text, add_special_tokens=False)["input_ids"])
        return first + self._tok.num_special_tokens_to_add(pair=True) + 1 + int(self.params.add_eos)

    def _with_eos(self, ids: list[int], types: list[int] | None) -> Encoded:
        eos = self._tok.eos_token_id
        if ids and ids[-1] == eos:
            return ids, types
        return ids + [eos], (types + types[-1:] if types else types)

    def register_special_tokens(self, register: "Callable[[Any], object]") -> None:
        """Let `register(hf_tokenizer)` add special tokens (a late-interaction model's "[Q] " prefix, as one piece),
        on the loaded tokenizer and on the copy this thread already uses, so every thread's tokenizer has them.
        Call it while the engine is built, before any other thread tokenizes."""
        with self._copy_lock:
            register(self._tok)
            mine = getattr(self._local, "tok", None)
            if mine is not None and mine is not self._tok:
                register(mine)

    @functools.cached_property
    def special_affixes(self) -> tuple[list[int], list[int]] | None:
        """The special tokens this tokenizer puts before and after a single text ([CLS] and [SEP]; <s> and </s>;
        none and EOS), as `encode` adds them: what each chunk of a long input is given (wde/chunking.py). None
        when a probe text's tokens are not found whole inside its encoding (special tokens that change with the
        text), so the ids cannot be told apart."""
        probe = "hello world"
        (full, _), = self.encode([TextPrompt(probe)])
        content = self._hf()(probe, add_special_tokens=False)["input_ids"]
        for start in range(len(full) - len(content) + 1):
            if full[start:start + len(content)] == content:
                return full[:start], full[start + len(content):]
        return None

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(ids))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    @property
    def special_ids(self) -> set[int]:
        return set(self._tok.all_special_ids)

    def special_ids_for(self, roles: Sequence[str]) -> set[int]:
        """Ids of the special tokens with these roles ('cls_token', 'unk_token', ...) the tokenizer defines."""
        named = self._tok.special_tokens_map
        return {self._tok.convert_tokens_to_ids(named[r]) for r in roles if isinstance(named.get(r), str)}


_BATCH_ENCODING = ("__call__", "_call_one", "_encode_plus", "_batch_encode_plus", "encode_plus", "batch_encode_plus",
                   "_convert_encoding", "set_truncation_and_padding")
"""The methods of transformers' fast tokenizer (4.x and 5.x names) that make its call's output; a tokenizer class
that overrides one of them keeps the Hugging Face call."""

DIRECT_PROBES = ("Hello world.", "  Leading and trailing spaces  ", "UPPER lower MiXeD 12,345.67 don't",
                 "naïve café — 東京 😀 \u00e9\u0301", "tabs\tand\nnewlines", "a", "x" * 300)
"""Texts on which `HFTokenizer` checks, at load, that the direct call matches the Hugging Face one."""


def _encode_direct(tok: Any, texts: list[str], pairs: list[str] | None, types: bool) -> list[Encoded]:
    """Token ids (and token types where `types`) of untruncated texts (or pairs) from the Rust tokenizer itself, set
    as the Hugging Face call sets it when it neither truncates nor pads: what that call returns without the ~10
    microseconds per input it spends building its dicts (a third of the engine's host work for short texts)."""
    backend = tok.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split = bool(getattr(tok, "split_special_tokens", False))
    if getattr(backend, "encode_special_tokens", split) != split:
        backend.encode_special_tokens = split
    encodings = batch_encoder(backend)(list(zip(texts, pairs)) if pairs is not None else texts,
                                       add_special_tokens=True)
    if types:
        return [(e.ids, e.type_ids) for e in encodings]
    return [(e.ids, None) for e in encodings]


def batch_encoder(backend: Any) -> Callable[..., list]:
    """The Rust tokenizer's batch call `_encode_direct` makes: `encode_batch_fast` (tokenizers >= 0.21), the same ids
    and types as `encode_batch` without the character offsets, which nothing there reads (~17% less of the
    tokenizer's time on 30-word texts, docs/benchmarks.md); `encode_batch` where the library is older."""
    return getattr(backend, "encode_batch_fast", None) or backend.encode_batch


def _copy_tokenizer(tok: Any) -> Any:
    """A deep copy; copying reads the Rust tokenizer, which fails while its owner is mid-way through changing
    its truncation settings, so try again a moment later."""
    for attempt in range(50):
        try:
            return copy.deepcopy(tok)
        except RuntimeError:
            time.sleep(0.001 * (attempt + 1))
    return copy.deepcopy(tok)
