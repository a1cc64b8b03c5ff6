"""vLLM's per-request truncation (`truncate_prompt_tokens`, `truncation_side`) as engine PoolingParams fields.

vLLM tokenizes with `truncation=True, max_length=N` (special tokens kept, the first tokens unless
`truncation_side: "left"`), maps -1 to the model's limit and refuses an N above it with a 4xx naming the field.
WDE's request processor truncates the same way (`truncate`, `max_tokens`, `truncation_direction`); this module
only translates the fields and refuses what cannot be honoured, by name, before anything runs.
"""

from __future__ import annotations

from typing import Any

from wde.server.errors import ApiError
from wde.server.protocol import PromptTruncation

FIELD = "truncate_prompt_tokens"


def truncation(body: PromptTruncation, limit: int, truncate: bool = False,
               direction: str | None = None) -> dict[str, Any]:
    """PoolingParams keyword arguments for `body`'s truncation; `truncate` and `direction` are the route's own
    fields (WDE's `truncate`, TEI-style `truncation_direction`), which vLLM's fields may not contradict."""
    side = body.truncation_side
    if side is not None and direction is not None and side != direction:
        raise ApiError("validation", f"truncation_side={side!r} and truncation_direction={direction!r} contradict"
                       " each other; send one of them", "truncation_side")
    kwargs: dict[str, Any] = {"truncate": truncate, "truncation_direction": side or direction or "right"}
    n = body.truncate_prompt_tokens
    if n is None:
        return kwargs
    if n == 0:
        raise ApiError("validation", f"{FIELD}=0 leaves no token to encode; give -1 (the model's limit of {limit}"
                       f" tokens) or a count from 1 to {limit}", FIELD)
    if n > limit:
        raise ApiError("validation", f"{FIELD}={n} is above the model's limit of {limit} tokens; give at most"
                       f" {limit}, or -1 for the limit", FIELD)
    kwargs["truncate"] = True
    if 0 < n < limit:
        kwargs["max_tokens"] = n
    return kwargs
