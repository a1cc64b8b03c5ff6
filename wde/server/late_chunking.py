"""Late chunking on /v1/embeddings (wde/late_chunking.py): one vector per chunk of a document, each pooled from
the token states of the whole document.

Two shapes, both with `late_chunking: true`:

- Jina's: `input` is the list of a document's consecutive chunks; they are joined by single spaces and encoded
  together, and each gets one vector, in order.
- WDE's: `input` is one text, and `spans` (character ranges [start, end)) or `chunker` ("sentences", or
  "tokens" with `chunk_tokens`) give its chunks.

Each data item carries, besides OpenAI's fields, its `char_range` (in the document: Jina's joined text) and its
`token_range` (in the document's token sequence, special tokens counted). `spans`, `chunker` and `chunk_tokens`
without `late_chunking: true` are refused by name, as is a body that also sends `messages`, images or token ids.
The document is tokenized here (its character offsets are needed), on the service's tokenizer thread, and sent
to the engine as token ids with `PoolingParams.spans`: a split engine's core gets them as it gets any input.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Request
from pydantic import Field

from wde.errors import RequestError
from wde.late_chunking import Document, LateChunk, join, prepare
from wde.request import PoolingParams
from wde.server.errors import ApiError
from wde.server.protocol import EmbeddingRequest, parse
from wde.server.service import Result, Service, api_error, model_service
from wde.server.truncation import truncation

FIELDS = ("late_chunking", "spans", "chunker", "chunk_tokens")
"""The body fields of late chunking; a body with any of them (but `late_chunking` false or null alone) is served
here."""


class LateChunkingRequest(EmbeddingRequest):
    """/v1/embeddings with late chunking (module docstring)."""

    late_chunking: bool = False
    spans: list[Annotated[list[int], Field(min_length=2, max_length=2)]] | None = None
    """WDE's shape: the chunks of the one `input` text, as [start, end) character ranges."""
    chunker: Literal["sentences", "tokens"] | None = None
    """WDE's shape: how to chunk the one `input` text (default "sentences" when `spans` is not given)."""
    chunk_tokens: int | None = Field(None, ge=1)
    """With chunker "tokens": the tokens in each chunk (the last one may have fewer)."""


def asked(raw: Any) -> bool:
    """Whether a /v1/embeddings body asks for late chunking (or sends one of its fields without asking)."""
    if not isinstance(raw, dict):
        return False
    flag = raw.get("late_chunking")
    return (flag is not None and flag is not False) or any(k in raw for k in FIELDS[1:])


async def late_chunks(request: Request, raw: dict) -> tuple[Service, LateChunkingRequest, list[LateChunk], Result]:
    """The service of the model the body names, the body, its document's chunks with their vectors, and the
    engine's result (usage, timing headers)."""
    if "messages" in raw:
        raise ApiError("validation", "late chunking takes texts in `input`, not `messages`", "messages")
    body = parse(LateChunkingRequest, raw)
    svc = model_service(request, body.model)
    if not body.late_chunking:
        given = next(k for k in FIELDS[1:] if k in raw)
        raise ApiError("validation", f"{given} goes with late_chunking: true", given)
    if body.modality not in (None, "text"):
        raise ApiError("validation", f"late chunking takes texts, not modality {body.modality!r}", "modality")
    svc.require("dense", request.url.path)
    if not svc.info.span_pooling:
        raise ApiError("unsupported", f"late chunking needs a pooler that pools token spans, as 'sentence' does for"
                       f" a model pooled with one mode; workflow {svc.info.workflow!r} cannot", "late_chunking")
    value = body.input
    own_chunks = body.spans is not None or body.chunker is not None or body.chunk_tokens is not None
    if own_chunks and not isinstance(value, str):
        raise ApiError("validation", "input: with spans or chunker, input is one text (the document); a list of"
                       " texts is Jina's shape, the document's chunks, without them", "input")
    pieces = [value] if isinstance(value, str) else value
    if not pieces:
        raise ApiError("empty", "input is empty: send at least one text", "input")
    if not all(isinstance(p, str) for p in pieces):
        raise ApiError("validation", "input: late chunking takes texts (it needs their characters), not token ids",
                       "input")
    svc.check_batch_size(len(pieces), "input")
    cut = truncation(body, svc.info.max_length, body.truncate)
    if not cut["truncate"] and svc.long_inputs(None).get("truncate"):
        cut["truncate"] = True  # the server's --long-inputs truncate; chunked processing is not for late chunking
    params = PoolingParams(**cut, prompt_name=body.prompt_name, dimensions=body.dimensions or None,
                           normalize=body.normalized,
                           options=svc.jina_task(body.task, body.options))
    limit = min(svc.info.max_length, svc.info.longest_input)

    def tokenized() -> Document:
        if own_chunks:
            return prepare(svc.engine.tokenizer, svc.engine.input_processor, value, params, limit,
                           spans=body.spans, chunker=body.chunker, chunk_tokens=body.chunk_tokens)
        if isinstance(value, str):  # one chunk: the whole text (a blank one is refused as any input is)
            text, spans, names = value, [(0, len(value))] if value.strip() else None, ["input"]
        else:
            (text, spans), names = join(pieces), [f"input[{i}]" for i in range(len(pieces))]
        return prepare(svc.engine.tokenizer, svc.engine.input_processor, text, params, limit, spans=spans,
                       span_names=names)

    try:
        doc = await svc.off_loop(tokenized)
    except RequestError as e:
        raise api_error(e) from None
    # a tuple, not a list: these ids are this server's own tokens of the text, not a client's token-id input
    result = await svc.run(request, [doc.token_ids], doc.params, "input", ["input"])
    return svc, body, doc.chunks(result.outputs[0]), result
