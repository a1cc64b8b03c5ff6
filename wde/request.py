"""The data that flows one way through the engine: prompt → Request → SchedulableRequest → RequestOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from wde.errors import RequestError


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class PairPrompt:
    """Two texts scored together by a cross-encoder (query, document)."""

    text: str
    text_pair: str


@dataclass(frozen=True)
class TokensPrompt:
    token_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None = None
    """Segment ids of an already tokenized pair (an API server of a split engine tokenizes before the core)."""


Prompt = Union[TextPrompt, PairPrompt, TokensPrompt]


@dataclass(frozen=True)
class PoolingParams:
    """Per-request options. `None` means "the workflow's default"."""

    truncate: bool = False
    truncation_direction: Literal["right", "left"] = "right"
    normalize: bool | None = None
    prompt_name: str | None = None
    prompt: str | None = None
    dimensions: int | None = None
    outputs: tuple[str, ...] | None = None
    activation: bool | None = None
    prompt_tokens: int = 0
    """Set by the input processor, not by users: how many leading tokens are the instruction prompt
    (sentence-transformers' `prompt_length`), for a pooler that leaves the prompt out (`include_prompt: false`)."""


@dataclass
class Request:
    """A validated, not yet tokenized request (tokenization waits until the scheduler picks it)."""

    request_id: str
    prompt: Prompt
    params: PoolingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    tokenization_time: float = 0.0
    scheduled_time: float | None = None


@dataclass
class SchedulableRequest:
    """A tokenized request, ready to be packed into a batch."""

    request: Request
    token_ids: list[int]
    token_type_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class RequestOutput:
    """What a request produced (`outputs`, e.g. {"dense": ndarray}) or why it failed (`error`)."""

    request_id: str
    outputs: dict[str, Any] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    error: RequestError | None = None
    prompt_token_ids: list[int] | None = None
    queue_time: float = 0.0
    tokenization_time: float = 0.0
    inference_time: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None
