"""Request processors: tokenize requests when the scheduler asks for them (lazily, in batches).

Tokenizing at schedule time keeps admission cheap and lets one fast batched tokenizer call serve a whole
batch. Length limits are enforced here: an input over the limit is truncated only if the request asked.
"""

from __future__ import annotations

import time
from typing import Sequence

from wde.components.base import BuildContext, Component, Params
from wde.errors import RequestError
from wde.request import PairPrompt, Request, SchedulableRequest, TokensPrompt


class LazyTokenizeRequestProcessor(Component):
    """Tokenizes scheduled requests in one batched call per prompt type and checks their length."""

    kind = "request_processor"
    name = "lazy_tokenize"
    Params = Params

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._tokenizer = ctx.tokenizer
        self.max_length: int = ctx.tokenizer.max_length

    def process(self, requests: Sequence[Request], token_budget: int) -> list[SchedulableRequest | RequestError]:
        """One result per request, in order: a tokenized request, or the error that rejects it."""
        t0 = time.perf_counter()
        limit = min(self.max_length, token_budget)
        results: list[SchedulableRequest | RequestError | None] = [None] * len(requests)
        groups: dict[type, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(type(r.prompt), []).append(i)
        for prompt_type, idx in groups.items():
            if prompt_type is TokensPrompt:
                encoded = [(list(requests[i].prompt.token_ids), None) for i in idx]  # type: ignore[union-attr]
            else:
                encoded = self._tokenizer.encode([requests[i].prompt for i in idx])  # type: ignore[misc]
            for i, (ids, types) in zip(idx, encoded):
                results[i] = self._check_length(requests[i], ids, types, limit)
        dt = (time.perf_counter() - t0) / max(len(requests), 1)
        for r in requests:
            r.tokenization_time = dt
        return results  # type: ignore[return-value]

    def _check_length(self, request: Request, ids: list[int], types: list[int] | None,
                      limit: int) -> SchedulableRequest | RequestError:
        if len(ids) <= limit:
            return SchedulableRequest(request, ids, types)
        if not request.params.truncate:
            return RequestError(
                f"input has {len(ids)} tokens, more than the limit of {limit} (model max length {self.max_length});"
                " shorten it or set truncate=true", "input", kind="too_long")
        direction = request.params.truncation_direction
        prompt = request.prompt
        if isinstance(prompt, TokensPrompt):
            kept = ids[:limit] if direction == "right" else ids[-limit:]
            return SchedulableRequest(request, kept, None)
        if isinstance(prompt, PairPrompt) and (shortest := self._tokenizer.min_pair_length(prompt)) > limit:
            return RequestError(f"input cannot be truncated to {limit} tokens: truncation shortens only the second"
                                f" text, and the first text with the special tokens already takes {shortest - 1}",
                                "input", kind="too_long")
        (ids, types), = self._tokenizer.encode([prompt], max_length=limit, direction=direction)
        return SchedulableRequest(request, ids, types)
