"""Late chunking (Jina's): one vector per chunk of a text, each pooled from the token states of the WHOLE text, so
every chunk's vector has seen its context (a pronoun in chunk 3 knows whom chunk 1 named).

The text is tokenized once, with character offsets, here (`prepare`, before the request is queued); its chunks,
given as character spans or made by a chunker, become token ranges (a token belongs to a chunk when its
characters overlap the chunk's; special tokens such as [CLS] and [SEP] have no characters and are in no chunk);
the text goes to the engine as token ids with those ranges as `PoolingParams.spans`, and the pooler (a
`SpanPooling`) gives one embedding per range: the mean of its tokens' final states, then the model's modules
after pooling, `dimensions` and normalization ('chunk_embeddings'). `Document.chunks` pairs them with their
ranges. Chunkers:

- "sentences": a sentence ends after `.`, `!` or `?` (and any closing quotes or brackets) followed by whitespace
  or the end of the text, after `。`, `！` or `？`, or at a blank line; each chunk is one sentence, without the
  whitespace around it. A simple rule, not a language model: "e.g. this" ends a sentence after "e.g.".
- "tokens": windows of `chunk_tokens` tokens of the text (special tokens left out), the last one shorter.

Jina's API shape (`late_chunking: true` on /v1/embeddings) sends a document as the list of its consecutive
chunks: `join` makes one text of them, joined by single spaces, and each becomes a chunk.

The whole text must fit the model: an over-long text is refused as any input is, unless truncated, and then only
the kept part is chunked (a span wholly cut off is refused). Left out: Jina's "long late chunking", which encodes
an over-long text in overlapping macro chunks.
"""

from __future__ import annotations

import re
import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from wde.components.pooler import SPANS
from wde.components.tokenizer import HFTokenizer
from wde.errors import RequestError
from wde.request import PoolingParams, Request, RequestOutput, TextPrompt, TokensPrompt

CHUNKERS: tuple[str, ...] = ("sentences", "tokens")

JOINER = " "
"""What joins the chunks of Jina's shape into one text."""

_SENTENCE_END = re.compile(r"""[.!?]+["'”’)\]]*(?=\s|$)|[。！？]+|\n[^\S\n]*\n""")
"""Where a sentence ends (the "sentences" chunker): see the module's docstring."""


@dataclass(frozen=True)
class LateChunk:
    """One chunk of a late-chunked text: its text, where it lies in the text (characters) and in the input's token
    sequence (special tokens counted), and its vector."""

    text: str
    char_range: tuple[int, int]
    token_range: tuple[int, int]
    vector: np.ndarray = dataclasses.field(repr=False)


@dataclass(frozen=True)
class Document:
    """A text tokenized for late chunking, ready to submit (`token_ids` with `params`, whose `spans` are
    `token_ranges`), and what its output's rows are read back with (`chunks`)."""

    text: str
    token_ids: tuple[int, ...]
    char_ranges: tuple[tuple[int, int], ...]
    token_ranges: tuple[tuple[int, int], ...]
    params: PoolingParams

    def chunks(self, out: RequestOutput) -> list[LateChunk]:
        """The chunks with their vectors, from the output of the submitted request (each cut to `dimensions`)."""
        rows = out.outputs[SPANS]
        width = self.params.dimensions or rows.shape[1]
        return [LateChunk(self.text[a:b], (a, b), t, rows[i, :width])
                for i, ((a, b), t) in enumerate(zip(self.char_ranges, self.token_ranges))]


def refuse_spans(params: PoolingParams, span_pooling: bool, workflow: str) -> None:
    """Refuse `spans` a workflow cannot honour: a pooler that is no `SpanPooling` (or cannot pool spans as built),
    and `spans` with chunked processing or truncation (the spans index the tokens as given)."""
    if not span_pooling:
        raise RequestError(f"late chunking (spans) needs a pooler that pools token spans, as 'sentence' does for a"
                           f" model pooled with one mode; workflow {workflow!r} cannot", "spans")
    for name in ("chunk", "truncate", "max_tokens"):
        if getattr(params, name) not in (False, None):
            raise RequestError(f"spans index the input's tokens as given, and {name} would change them; leave it"
                               " out (Engine.late_chunk truncates a text before choosing its spans)", "spans")


def check_spans(request: Request) -> None:
    """Refuse a request's `spans` that cannot be pooled: an input that is not token ids (a text is tokenized only
    later, so its spans could not be checked), no spans, more spans than tokens, or a span that is empty or outside
    the tokens. Raises `RequestError` naming `spans[i]`."""
    spans = request.params.spans
    if spans is None:
        return
    if not isinstance(request.prompt, TokensPrompt):
        raise RequestError("spans index an input's tokens, so the input must be token ids; use Engine.late_chunk"
                           " (or late_chunking on /v1/embeddings) to late-chunk a text", "spans")
    n = len(request.prompt.token_ids)
    if not spans:
        raise RequestError("spans is empty: give at least one [start, end) token range", "spans")
    if len(spans) > n:
        raise RequestError(f"spans has {len(spans)} ranges, more than the input's {n} tokens", "spans")
    for i, span in enumerate(spans):
        if not (_is_range(span) and 0 <= span[0] < span[1] <= n):
            raise RequestError(f"spans[{i}] is {_show(span)}; a span is a [start, end) token range with"
                               f" 0 <= start < end <= {n} (the input's tokens)", f"spans[{i}]")


def join(pieces: Sequence[str], field: str = "input") -> tuple[str, list[tuple[int, int]]]:
    """Jina's shape: a document's consecutive chunks as one text (joined by `JOINER`) and each chunk's span."""
    spans = []
    start = 0
    for i, piece in enumerate(pieces):
        if not isinstance(piece, str):
            raise RequestError(f"{field}[{i}] is not a text; late chunking takes texts", f"{field}[{i}]")
        if not piece.strip():
            raise RequestError(f"{field}[{i}] is empty: each chunk needs some text", f"{field}[{i}]", kind="empty")
        spans.append((start, start + len(piece)))
        start += len(piece) + len(JOINER)
    return JOINER.join(pieces), spans


def sentences(text: str) -> list[tuple[int, int]]:
    """The "sentences" chunker: each sentence's character span, without the whitespace around it."""
    spans = []
    start = 0
    for end in [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]:
        piece = text[start:end]
        stripped = piece.strip()
        if stripped:
            a = start + len(piece) - len(piece.lstrip())
            spans.append((a, a + len(stripped)))
        start = end
    return spans


def prepare(tokenizer: Any, input_processor: Any, text: str, params: PoolingParams, limit: int, *,
            spans: Sequence[Sequence[int]] | None = None, chunker: str | None = None,
            chunk_tokens: int | None = None, span_names: Sequence[str] | None = None,
            field: str = "input") -> Document:
    """Tokenize `text` (its prompt, if `params` names one, prepended as for any text) and turn its chunks into
    token ranges: character `spans`, else the `chunker`'s ("sentences" by default; "tokens" takes
    `chunk_tokens`). `params` may ask for truncation (`truncate`, `max_tokens`, `truncation_direction`) below
    `limit`, the most tokens one input may have; the returned params do not (the text is truncated here).
    `span_names` name the spans in errors (default spans[i]). Raises `RequestError` naming the field."""
    if spans is not None and chunker is not None:
        raise RequestError("spans and chunker are both given; send one (spans: your own chunks; chunker: let WDE"
                           " make them)", "chunker")
    if chunker is not None and chunker not in CHUNKERS:
        raise RequestError(f"chunker {chunker!r} is not one of {list(CHUNKERS)}", "chunker")
    chunker = chunker or ("sentences" if spans is None else None)
    if (chunk_tokens is not None) != (chunker == "tokens"):
        raise RequestError("chunk_tokens goes with chunker 'tokens', and only with it", "chunk_tokens")
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise RequestError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}", "chunk_tokens")
    if not isinstance(text, str):
        raise RequestError(f"{field}: late chunking takes a text", field)
    if spans is not None:
        names = list(span_names) if span_names is not None else [f"spans[{i}]" for i in range(len(spans))]
        _check_char_spans(spans, len(text), names)
    prompt = input_processor.to_prompt(text, replace(params, spans=None), field)
    if not isinstance(prompt, TextPrompt):
        raise RequestError(f"{field}: late chunking takes a single text, and this workflow makes"
                           f" {type(prompt).__name__} of it", field)
    shift = len(prompt.text) - len(text)  # the prompt's characters, before the text's
    cap = limit if params.max_tokens is None else min(limit, params.max_tokens)
    truncate = params.truncate or params.max_tokens is not None
    ids, offsets = _tokenize(tokenizer, prompt.text, cap if truncate else None, params.truncation_direction)
    if truncate and len(ids) > cap:
        raise RequestError(f"{field} cannot be truncated to {cap} tokens: it keeps {len(ids)}, the model's special"
                           " tokens and the instruction prompt's included", field, kind="too_long")
    if spans is not None and len(spans) > len(ids):
        raise RequestError(f"spans has {len(spans)} ranges, more than the input's {len(ids)} tokens", "spans")
    # the text's tokens: not special, with characters, after the prompt; their spans in the text's characters
    content = [(i, a - shift, b - shift) for i, (a, b) in enumerate(offsets) if b > a and b > shift]
    if spans is not None:
        char_ranges = [(int(a), int(b)) for a, b in spans]
    elif chunker == "tokens":
        char_ranges = []
        token_ranges = []
        for k in range(0, len(content), chunk_tokens):  # type: ignore[arg-type]
            window = content[k:k + chunk_tokens]  # type: ignore[operator]
            char_ranges.append((max(window[0][1], 0), window[-1][2]))
            token_ranges.append((window[0][0], window[-1][0] + 1))
    else:
        kept = (max(content[0][1], 0), content[-1][2]) if content else (0, 0)
        char_ranges = [(max(a, kept[0]), min(b, kept[1])) for a, b in sentences(text) if a < kept[1] and b > kept[0]]
    if chunker != "tokens":
        token_ranges = _token_ranges(content, char_ranges, names if spans is not None else None)
    if not token_ranges:
        raise RequestError(f"{field} has no text to chunk (no token but special ones)", field)
    submitted = replace(params, truncate=False, max_tokens=None, prompt_name=None, prompt=None, chunk=False,
                        max_embed_len=None, spans=tuple(token_ranges))
    return Document(text, tuple(ids), tuple(char_ranges), tuple(token_ranges), submitted)


def _tokenize(tokenizer: Any, text: str, max_length: int | None,
              direction: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The token ids the engine makes of `text` (as `HFTokenizer.encode` does: special tokens, truncation to
    `max_length`, the EOS its `add_eos` appends) and each token's character offsets ((0, 0) for special tokens)."""
    hf = tokenizer.hf_tokenizer if isinstance(tokenizer, HFTokenizer) else None
    if hf is None or not getattr(hf, "is_fast", False):
        raise RequestError("late chunking needs a fast Hugging Face tokenizer's character offsets, and this"
                           " workflow's tokenizer has none", "input")
    return tokenizer.encode_with_offsets(text, max_length, direction)  # type: ignore[arg-type]


def _token_ranges(content: list[tuple[int, int, int]], char_ranges: list[tuple[int, int]],
                  names: list[str] | None) -> list[tuple[int, int]]:
    """Each character span's token range: from the first to the last token whose characters overlap it. A span
    that no token overlaps is refused naming it (`names`; the chunker's own spans always overlap one)."""
    index = np.array([c[0] for c in content], dtype=np.int64)
    starts = np.array([c[1] for c in content], dtype=np.int64)
    ends = np.array([c[2] for c in content], dtype=np.int64)
    ranges = []
    for i, (a, b) in enumerate(char_ranges):
        hit = np.flatnonzero((starts < b) & (ends > a))
        if not hit.size:
            name = names[i] if names is not None else f"spans[{i}]"
            raise RequestError(f"{name} (characters [{a}, {b})) covers no token of the input: it is whitespace, or"
                               " lies in a part truncation cut off", name)
        ranges.append((int(index[hit[0]]), int(index[hit[-1]]) + 1))
    return ranges


def _check_char_spans(spans: Sequence[Any], length: int, names: list[str]) -> None:
    if not spans:
        raise RequestError("spans is empty: give at least one [start, end) character range", "spans")
    for span, name in zip(spans, names):
        if not (_is_range(span) and 0 <= span[0] < span[1] <= length):
            raise RequestError(f"{name} is {_show(span)}; a span is a [start, end) character range of the text with"
                               f" 0 <= start < end <= {length}", name)


def _is_range(span: Any) -> bool:
    return (isinstance(span, (tuple, list)) and len(span) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in span))


def _show(span: Any) -> str:
    return repr(list(span)) if isinstance(span, (tuple, list)) else repr(span)
