"""The data that flows one way through the engine: prompt → Request → SchedulableRequest → RequestOutput."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
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


@dataclass(frozen=True, eq=False)
class ImagePrompt:
    """An image, checked when it was admitted (limits, format, size and mode read from its header:
    wde/components/image_input.py) but not yet decoded: like a text's tokens, its pixels are made when the scheduler
    picks it. `data` is the encoded file (bytes), a PIL image, or pixel values already preprocessed (a float32
    numpy array [channels, height, width], or [h patches, w patches, 3 x patch x patch] for SigLIP 2 NaFlex); the
    vision tower reads it as one sequence of `num_tokens` tokens (patches, plus a class token where the model has
    one). `pixels`: width x height (0 when already preprocessed)."""

    data: Any
    num_tokens: int
    pixels: int = 0


Prompt = Union[TextPrompt, PairPrompt, TokensPrompt, ImagePrompt]


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
    max_tokens: int | None = None
    """Truncate to at most this many tokens (special tokens included), below the model's limit: vLLM's
    `truncate_prompt_tokens` N. Implies truncation; None: the model's limit, truncated only with `truncate`."""
    chunk: bool = False
    """Chunked processing of an input over the model's limit (vLLM's): its tokens are cut into chunks that fit,
    each with the model's special tokens, each chunk is pooled before normalization, and the chunk vectors are
    averaged weighted by their token counts before `dimensions` and normalization apply (wde/chunking.py). For
    dense embeddings; `truncate` (or `max_tokens`) wins where both are set."""
    max_embed_len: int | None = None
    """With `chunk`: the most tokens an input may have in all (the server's --max-embed-len); more is refused.
    None: no bound."""
    prompt_tokens: int = 0
    """Set by the input processor, not by users: how many leading tokens are the instruction prompt
    (sentence-transformers' `prompt_length`), for a pooler that leaves the prompt out (`include_prompt: false`)."""
    spans: tuple[tuple[int, int], ...] | None = None
    """Late chunking (wde/late_chunking.py): token ranges [start, end) of the input's full token sequence (special
    tokens counted), each pooled from the token states of the whole input, by the mean of its tokens' final
    states, then the model's modules after pooling, `dimensions` and normalization (output 'chunk_embeddings',
    one row per span). Needs a pooler that is a `SpanPooling` and the input as token ids; not with a pair,
    `chunk`, `truncate` or `max_tokens` (the spans index the tokens as given). `Engine.late_chunk` makes them
    from character spans or a chunker."""
    options: dict[str, str] | None = None
    """Per-request options a workflow's components declare (`Component.request_options`), e.g. {"task": "query"}
    for a late-interaction model's query side: each reaches every component, which reads it with `option`. A name
    or value no component of the workflow declares is refused (a 4xx naming `options.NAME`), never ignored."""

    def option(self, name: str, default: str) -> str:
        """The request's value of option `name`, or `default` (the declaring component's) when it gives none."""
        return default if not self.options else self.options.get(name, default)


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
    pixel_values: Any = None
    """An image request's pixels (`ImagePrompt.pixel_values`); its `token_ids` are then empty."""
    image_tokens: int = 0
    """An image request's sequence length in the vision tower (what it counts against the token budget)."""
    chunks: list[tuple[list[int], list[int] | None]] | None = None
    """A long input's chunks (`PoolingParams.chunk`, wde/chunking.py), each fitting the model: the scheduler
    queues them in its place (`sequences`), while `token_ids` keep the whole input (what a split engine's API
    server sends its core)."""
    chunk: tuple[int, int] | None = None
    """(index, count) when this sequence is one chunk of a long input."""
    masked_keys: int = 0
    """How many of the last `token_ids` no token may attend to (a late-interaction query's expansion tokens with
    `attend: false`, wde/components/multi_vector.py): its model input builder masks them as keys
    (`ModelInput.key_mask`); they still get outputs of their own."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) if self.pixel_values is None else self.image_tokens

    def sequences(self) -> list["SchedulableRequest"]:
        """What the scheduler queues for this request: itself, or its chunks, together and in order (they share
        this `Request`)."""
        if not self.chunks:
            return [self]
        n = len(self.chunks)
        return [SchedulableRequest(self.request, ids, types, chunk=(i, n)) for i, (ids, types) in enumerate(self.chunks)]

    @property
    def params(self) -> PoolingParams:
        """The params this sequence is pooled with: the request's, except that a chunk is pooled raw (no
        `dimensions`, no normalization: they apply once its request's chunks are merged, wde/chunking.py), and
        an instruction prompt's tokens are only in the first chunk."""
        params = self.request.params
        if self.chunk is None:
            return params
        return replace(params, normalize=False, dimensions=None,
                       prompt_tokens=params.prompt_tokens if self.chunk[0] == 0 else 0)


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
