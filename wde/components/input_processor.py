"""Input processors: validate what a user sent and wrap it as a `Request`, cheaply.

No tokenization happens here (seed 000): a burst of submissions must not block on the tokenizer.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from wde.components.base import BuildContext, Params
from wde.components.kinds import InputProcessor
from wde.errors import RequestError
from wde.request import PairPrompt, PoolingParams, Prompt, Request, TextPrompt, TokensPrompt

_SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone UTF-16 surrogate: JSON's "\\ud800" escape (or raw CESU bytes) decodes to one, and no tokenizer takes it."""

InputName = str | tuple[str, str]
"""How errors name an input: one name, or for a (text, text_pair) pair a name for each side (e.g. query, documents[3])."""


class TextInputParams(Params):
    prompts: dict[str, str] = Field(default_factory=dict, description="named instruction prefixes, e.g. query")
    default_prompt_name: str | None = None
    pairs: Literal["forbid", "allow", "require"] = "forbid"
    max_input_chars: int = Field(1_000_000, gt=0, description="reject longer texts before tokenizing them")


class TextInputProcessor(InputProcessor):
    """Accepts a str, `{"text": ...}`, `{"token_ids": [...]}` or, for cross-encoders, a (text, text_pair) pair.

    Prompts come from the workflow and from sentence-transformers' `config_sentence_transformers.json`
    (the workflow wins on a name clash).
    """

    kind = "input_processor"
    name = "text_input"
    Params = TextInputParams

    def __init__(self, params: TextInputParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        st = ctx.source.read_json("config_sentence_transformers.json") or {}
        self.prompts: dict[str, str] = {**(st.get("prompts") or {}), **params.prompts}
        self.pairs = params.pairs
        self.default_prompt_name = params.default_prompt_name or st.get("default_prompt_name")
        if self.default_prompt_name and self.default_prompt_name not in self.prompts:
            raise ValueError(f"input_processor.params.default_prompt_name {self.default_prompt_name!r} is not one of the prompts {sorted(self.prompts)}")
        self._vocab_size = ctx.tokenizer.vocab_size
        self._tokenizer = ctx.tokenizer
        self._prompt_tokens: dict[str, int] | None = {} if _pooling_leaves_out_prompt(ctx) else None
        """Prompt text → its token count (sentence-transformers' rule), kept only when the model's Pooling
        leaves the prompt out; a handful of prompts in practice, and at most `_PROMPT_CACHE` of them."""

    def check_text(self, value: Any, field: str) -> str:
        """`value` if it is a usable text; else a `RequestError` naming `field` (type, empty, length, Unicode)."""
        if not isinstance(value, str):
            raise RequestError(f"{field} must be a string, got {type(value).__name__}", field)
        if not value.strip():
            raise RequestError(f"{field} is empty (after stripping whitespace); send non-empty text", field, kind="empty")
        if len(value) > self.params.max_input_chars:
            raise RequestError(f"{field} has {len(value)} characters; the limit is {self.params.max_input_chars}", field)
        if not value.isascii() and (bad := _SURROGATE.search(value)) is not None:
            raise RequestError(f"{field} is not valid Unicode: character {bad.start()} is a lone surrogate"
                               f" (U+{ord(bad.group()):04X})", field, kind="encoding")
        return value

    def _prompt_prefix(self, params: PoolingParams) -> str:
        if params.prompt is not None:
            return params.prompt
        name = params.prompt_name or self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            raise RequestError(f"prompt_name {name!r} is not defined; defined prompts: {sorted(self.prompts) or 'none'}", "prompt_name")
        return self.prompts[name]

    def prompt_tokens(self, prefix: str) -> int:
        """How many leading tokens of an input starting with `prefix` are the prompt, as sentence-transformers
        counts them: the prompt tokenized alone, special tokens included, less a trailing special token."""
        if not prefix or self._prompt_tokens is None:
            return 0
        n = self._prompt_tokens.get(prefix)
        if n is None:
            hf = self._tokenizer.hf_tokenizer
            ids = hf(prefix)["input_ids"]
            n = len(ids) - (1 if ids and ids[-1] in set(hf.all_special_ids) else 0)
            if len(self._prompt_tokens) >= _PROMPT_CACHE:
                self._prompt_tokens.clear()
            self._prompt_tokens[prefix] = n
        return n

    def to_prompt(self, inputs: Any, params: PoolingParams, field: InputName = "input") -> Prompt:
        """Validate one input and return its prompt; raise `RequestError` naming the field on bad input.

        `field` names the input in errors; a pair's sides are `field[0]` and `field[1]` unless `field` names
        them itself (a tuple); errors about the pair as a whole then name its second side.
        """
        if type(inputs) is not str or type(field) is not str:  # the usual input, a text, goes straight on
            sides = field if isinstance(field, tuple) else (f"{field}[0]", f"{field}[1]")
            field = field[1] if isinstance(field, tuple) else field
            if isinstance(inputs, Mapping):
                if "token_ids" in inputs:
                    return self._tokens(inputs["token_ids"], f"{field}.token_ids")
                if "text_pair" in inputs:
                    inputs = (inputs.get("text"), inputs["text_pair"])
                elif "text" in inputs:
                    inputs = inputs["text"]
                else:
                    raise RequestError(f"{field} must have a 'text' or 'token_ids' key", field)
            if isinstance(inputs, (tuple, list)) and len(inputs) == 2 and all(isinstance(x, str) for x in inputs):
                if self.params.pairs == "forbid":
                    raise RequestError(f"{field}: this model embeds single texts, not (text, text_pair) pairs", field)
                return PairPrompt(self._prompt_prefix(params) + self.check_text(inputs[0], sides[0]), self.check_text(inputs[1], sides[1]))
            if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(x, int) and not isinstance(x, bool) for x in inputs):
                return self._tokens(inputs, field)
        text = self.check_text(inputs, field)
        if self.params.pairs == "require":
            raise RequestError(f"{field}: this model scores (text, text_pair) pairs; a single text was given", field)
        return TextPrompt(self._prompt_prefix(params) + text)

    def _tokens(self, ids: Any, field: str) -> TokensPrompt:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise RequestError(f"{field} must be a non-empty list of token ids", field,
                               kind="empty" if isinstance(ids, (list, tuple)) else "validation")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self._vocab_size:
                raise RequestError(f"{field} contains {i!r}; token ids must be integers in [0, {self._vocab_size})", field)
        return TokensPrompt(tuple(ids))

    def process(self, request_id: str, inputs: Any, params: PoolingParams | None = None,
                arrival_time: float | None = None, field: InputName = "input") -> Request:
        params = params or PoolingParams()
        prompt = self.to_prompt(inputs, params, field)
        if self._prompt_tokens is not None and isinstance(prompt, TextPrompt):
            params = dataclasses.replace(params, prompt_tokens=self.prompt_tokens(self._prompt_prefix(params)))
        return Request(request_id, prompt, params, arrival_time or time.perf_counter())


_PROMPT_CACHE = 256


def _pooling_leaves_out_prompt(ctx: BuildContext) -> bool:
    """Whether the model folder's sentence-transformers Pooling config says `include_prompt: false`."""
    folder = ctx.source.st_module_path("Pooling")
    cfg = ctx.source.read_json(f"{folder.relative_to(ctx.source.path)}/config.json") if folder else None
    return isinstance(cfg, dict) and cfg.get("include_prompt", True) is False
