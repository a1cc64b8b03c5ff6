"""Request processors: tokenize requests when the scheduler asks for them (lazily, in batches), each prompt with its
request's per-request options (the tokenizer's `options`).

Tokenizing at schedule time keeps admission cheap and lets one fast batched tokenizer call serve a whole
batch. Length limits are enforced here: an input over the limit is truncated only if the request asked.
A request the tokenizer fails on fails alone: the others of its call are tokenized again one by one.
"""

from __future__ import annotations

import inspect
import time
from typing import Sequence

from pydantic import Field

from wde.components.base import BuildContext, Params
from wde.components.kinds import RequestProcessor
from wde.chunking import split
from wde.errors import ModelLoadError, RequestError, internal_error
from wde.request import PairPrompt, Request, SchedulableRequest, TextPrompt, TokensPrompt

Result = SchedulableRequest | RequestError


class LazyTokenizeParams(Params):
    background_chars: int = Field(
        16384, ge=0,
        description="requests with more characters than this are tokenized on a background thread, so a huge"
                    " input never stalls the batches of others; 0 tokenizes every request inline")


class LazyTokenizeRequestProcessor(RequestProcessor):
    """Tokenizes scheduled requests in one batched call per prompt type and checks their length."""

    kind = "request_processor"
    name = "lazy_tokenize"
    Params = LazyTokenizeParams

    def __init__(self, params: LazyTokenizeParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._tokenizer = ctx.tokenizer
        self.max_length: int = ctx.tokenizer.max_length
        takes = inspect.signature(ctx.tokenizer.encode).parameters
        if "options" not in takes and not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            raise ModelLoadError(f"tokenizer {ctx.tokenizer.name!r}: its encode() takes no `options`, which the"
                                 " request processor passes (each prompt's per-request options); add the parameter"
                                 " `options=None` and pass it on to HFTokenizer.encode (docs/plugins.md)")

    def is_large(self, request: Request) -> bool:
        """Whether `request` should be tokenized off the scheduling thread (see `background_chars`)."""
        if not self.params.background_chars or isinstance(request.prompt, TokensPrompt):
            return False
        prompt = request.prompt
        chars = len(prompt.text) + (len(prompt.text_pair) if isinstance(prompt, PairPrompt) else 0)
        return chars > self.params.background_chars

    def process(self, requests: Sequence[Request], token_budget: int) -> list[Result]:
        """One result per request, in order: a tokenized request, or the error that rejects it. Never raises."""
        t0 = time.perf_counter()
        limit = min(self.max_length, token_budget)
        results: list[Result | None] = [None] * len(requests)
        groups: dict[type, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(type(r.prompt), []).append(i)
        for prompt_type, idx in groups.items():
            if prompt_type is TokensPrompt:
                encoded: list = [_given_tokens(requests[i].prompt) for i in idx]  # type: ignore[arg-type]
            else:
                encoded = self._encode([requests[i] for i in idx])
            for i, enc in zip(idx, encoded):
                if isinstance(enc, RequestError):
                    results[i] = enc
                    continue
                try:
                    results[i] = self._check_length(requests[i], enc[0], enc[1], limit)
                except Exception as e:  # noqa: BLE001 - the truncating re-encode failed: this request alone fails
                    results[i] = internal_error(requests[i].request_id, e, "tokenizer")
        dt = (time.perf_counter() - t0) / max(len(requests), 1)
        for r in requests:
            r.tokenization_time = dt
        return results  # type: ignore[return-value]

    def _encode(self, requests: Sequence[Request]) -> list:
        """One batched tokenizer call; if it raises, each request alone, so only the culprit fails."""
        try:
            return self._tokenizer.encode([r.prompt for r in requests],  # type: ignore[misc]
                                          options=[r.params.options for r in requests])
        except Exception as e:  # noqa: BLE001 - isolated below
            if len(requests) == 1:
                return [internal_error(requests[0].request_id, e, "tokenizer")]
        return [enc for r in requests for enc in self._encode([r])]

    def _check_length(self, request: Request, ids: list[int], types: list[int] | None,
                      limit: int) -> SchedulableRequest | RequestError:
        cap = request.params.max_tokens
        if cap is not None:
            limit = min(limit, cap)
        if len(ids) <= limit:
            return SchedulableRequest(request, ids, types)
        if request.params.chunk and not request.params.truncate and cap is None:
            return self._chunked(request, ids, types, limit)
        if not request.params.truncate and cap is None:
            return RequestError(
                f"input has {len(ids)} tokens, more than the limit of {limit} (model max length {self.max_length});"
                " shorten it or set truncate=true", "input", kind="too_long")
        direction = request.params.truncation_direction
        prompt = request.prompt
        if isinstance(prompt, TokensPrompt):
            cut = slice(None, limit) if direction == "right" else slice(-limit, None)
            return SchedulableRequest(request, ids[cut], types[cut] if types is not None else None)
        if isinstance(prompt, PairPrompt) and (shortest := self._tokenizer.min_pair_length(prompt)) > limit:
            return RequestError(f"input cannot be truncated to {limit} tokens: truncation shortens only the second"
                                f" text, and the first text with the special tokens already takes {shortest - 1}",
                                "input[0]", kind="too_long")
        assert isinstance(prompt, (TextPrompt, PairPrompt))
        (ids, types), = self._tokenizer.encode([prompt], max_length=limit, direction=direction,
                                               options=[request.params.options])
        return SchedulableRequest(request, ids, types)

    def _chunked(self, request: Request, ids: list[int], types: list[int] | None,
                 limit: int) -> SchedulableRequest | RequestError:
        """A long input cut into chunks of at most `limit` tokens (`PoolingParams.chunk`), within `max_embed_len`."""
        bound = request.params.max_embed_len
        if bound is not None and len(ids) > bound:
            return RequestError(f"input has {len(ids)} tokens, more than the {bound} that chunked processing takes"
                                " (max_embed_len); shorten it or set truncate=true", "input", kind="too_long")
        if isinstance(request.prompt, PairPrompt):
            return RequestError(f"input has {len(ids)} tokens, more than the limit of {limit}, and a pair cannot be"
                                " chunked; shorten it or set truncate=true", "input", kind="too_long")
        affixes = self._tokenizer.special_affixes
        if affixes is None:
            return RequestError("chunked processing needs to tell this tokenizer's special tokens from a text's, and"
                                " it cannot; shorten the input or set truncate=true", "input", kind="too_long")
        return SchedulableRequest(request, ids, types, chunks=split(ids, types, limit, affixes))


def _given_tokens(prompt: TokensPrompt) -> tuple[list[int], list[int] | None]:
    types = prompt.token_type_ids
    return list(prompt.token_ids), list(types) if types is not None else None
