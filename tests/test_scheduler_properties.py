"""Property tests: any mix of good and bad requests, and any aborts, leave the scheduler in order.

Every request added leaves exactly once (scheduled, or rejected with a `RequestError`) unless it was aborted
while still queued, in which case it leaves silently; no batch exceeds the token budget or the request cap; a
request the tokenizer cannot encode fails alone; and at the engine level each good request's embedding is the
one `Engine.embed` gives for it alone.

Requests are built directly (bypassing the input processor, which would refuse e.g. a lone surrogate at the edge)
and run through `engine.scheduler` of one engine built per module; every example drains the scheduler, so
examples do not leak into each other.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from wde import Engine
from wde.errors import RequestError
from wde.request import PoolingParams, Prompt, Request, RequestOutput, SchedulableRequest, TextPrompt, TokensPrompt
from tests.tiny_models import WORDS

BUDGET = 160
"""Token budget of one batch: at least the tiny model's max length (128) so any admissible input fits, but below
two full-length inputs, so the budget really splits batches."""
MAX_REQUESTS = 4
BACKGROUND_CHARS = 300
"""Texts longer than this are tokenized on the scheduler's background thread: most long texts here, no short one."""
LONG_WORDS = 130
"""Every word is at least one token, plus [CLS] and [SEP]: a text of this many words is over the 128-token limit."""
MAX_SCHEDULE_CALLS = 10_000
SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")

SETTINGS = settings(max_examples=100, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(tiny_bert: Path):
    overrides = [f"scheduler.params.max_num_batched_tokens={BUDGET}",
                 f"scheduler.params.max_num_requests={MAX_REQUESTS}",
                 f"request_processor.params.background_chars={BACKGROUND_CHARS}"]
    with Engine.from_workflow("bert", tiny_bert, pooler={"params": {"pooling": "mean"}}, overrides=overrides) as e:
        assert e.max_length <= e.scheduler.token_budget == BUDGET < 2 * e.max_length
        assert LONG_WORDS + 2 > e.max_length
        yield e


def limit_of(engine: Engine) -> int:
    return min(engine.max_length, engine.scheduler.token_budget)


# ---------------------------------------------------------------------------------------------------- strategies


@dataclass(frozen=True)
class Spec:
    """One request to make: its prompt, whether it may be truncated, and when (if ever) to abort it."""

    kind: str  # "short", "medium", "long", "tokens" or "surrogate"
    prompt: Prompt
    truncate: bool = False
    abort_at: int | None = None

    def num_tokens(self, engine: Engine) -> int:
        """Untruncated length (not for "surrogate": the tokenizer cannot encode it)."""
        if isinstance(self.prompt, TokensPrompt):
            return len(self.prompt.token_ids)
        (ids, _), = engine.tokenizer.encode([self.prompt])
        return len(ids)

    def expected(self, engine: Engine) -> str:
        """"ok" (scheduled), "too_long" (rejected as such) or "error" (rejected, any kind)."""
        if self.kind == "surrogate":
            return "error"
        if self.kind == "long":
            assert self.num_tokens(engine) > limit_of(engine)
        return "ok" if self.truncate or self.num_tokens(engine) <= limit_of(engine) else "too_long"


words = st.sampled_from(WORDS)
short_texts = st.lists(words, min_size=1, max_size=12).map(" ".join)


def _random_words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


seeds = st.integers(0, 2**32 - 1)
medium_texts = st.one_of(
    st.builds(_random_words, st.integers(13, 130), seeds),  # from a few dozen tokens to just over the limit
    st.builds(lambda n: " ".join(["the"] * n), st.integers(120, 130)),  # "the" is one token: 122 to 132 tokens
)
long_texts = st.one_of(
    st.builds(lambda w, n: " ".join([w] * n), words, st.integers(LONG_WORDS, 300)),  # "a a a …": some stay inline
    st.builds(_random_words, st.integers(LONG_WORDS, 400), seeds),  # background-tokenized
)


def _with_surrogate(text: str, surrogate: str, at: int, glued: bool) -> str:
    at = at % (len(text) + 1)
    return text[:at] + surrogate + text[at:] if glued else f"{text[:at]} {surrogate} {text[at:]}"


surrogate_texts = st.builds(_with_surrogate, st.one_of(short_texts, long_texts), st.sampled_from(SURROGATES),
                            st.integers(0, 10**6), st.booleans())


def token_ids(vocab: int) -> st.SearchStrategy[tuple[int, ...]]:
    def seeded(n: int, seed: int) -> tuple[int, ...]:
        rng = random.Random(seed)
        return tuple(rng.randrange(vocab) for _ in range(n))

    return st.one_of(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20).map(tuple),
                     st.builds(seeded, st.integers(120, 136), seeds),  # around the 128-token limit
                     st.builds(seeded, st.integers(1, 300), seeds))


aborts = st.sampled_from([None, None, None, 0, 1, 2, 3, 5])
"""Mostly never; else abort before the n-th `schedule()` call (0: before any)."""


def specs(vocab: int, *, abort: st.SearchStrategy = aborts, bad: bool = True) -> st.SearchStrategy[list[Spec]]:
    short = st.builds(Spec, st.just("short"), short_texts.map(TextPrompt), st.booleans(), abort)
    kinds = [
        short, short,  # twice as likely as the others, so batches also fill up to the request cap
        st.builds(Spec, st.just("medium"), medium_texts.map(TextPrompt), st.booleans(), abort),
        st.builds(Spec, st.just("long"), long_texts.map(TextPrompt), st.booleans(), abort),
        st.builds(Spec, st.just("tokens"), token_ids(vocab).map(TokensPrompt), st.booleans(), abort),
    ]
    if bad:
        kinds.append(st.builds(Spec, st.just("surrogate"), surrogate_texts.map(TextPrompt), st.booleans(), abort))
    return st.lists(st.one_of(kinds), min_size=1, max_size=12)


# ------------------------------------------------------------------------------------------------------- helpers


def new_id(tag: str) -> str:
    return f"{tag}-{next(_ids)}"


def make_request(request_id: str, spec: Spec) -> Request:
    return Request(request_id, spec.prompt, PoolingParams(truncate=spec.truncate))


def reset(engine: Engine) -> None:
    """Start each example from an empty engine, even when the one before failed half way (a passing example
    drains it by itself; cleaning up at the start, not in a `finally`, never hides the first failure)."""
    if engine.has_unfinished():
        engine.reset()


def check_batch(engine: Engine, batch: list[SchedulableRequest]) -> None:
    sched = engine.scheduler
    ids = [s.request.request_id for s in batch]
    assert len(ids) == len(set(ids)), f"a request id twice in one batch: {ids}"
    assert len(batch) <= sched.params.max_num_requests
    assert sum(s.num_tokens for s in batch) <= sched.token_budget, [s.num_tokens for s in batch]


def check_scheduled(engine: Engine, spec: Spec, s: SchedulableRequest) -> None:
    limit = limit_of(engine)
    assert spec.expected(engine) == "ok", f"{spec.kind} request (truncate={spec.truncate}) was scheduled"
    assert 0 < s.num_tokens == len(s.token_ids) <= limit
    assert s.token_type_ids is None or len(s.token_type_ids) == s.num_tokens
    if isinstance(spec.prompt, TokensPrompt):
        assert s.token_ids == list(spec.prompt.token_ids)[:limit]  # truncation keeps the left end by default
    elif spec.num_tokens(engine) <= limit:
        (ids, _), = engine.tokenizer.encode([spec.prompt])
        assert s.token_ids == ids, "tokenizing in a batch must give what tokenizing alone gives"


def check_rejected(engine: Engine, spec: Spec, out: RequestOutput) -> None:
    expected = spec.expected(engine)
    assert expected != "ok", f"{spec.kind} request (truncate={spec.truncate}) rejected: {out.error!r}"
    assert not out.ok and isinstance(out.error, RequestError), out
    assert out.outputs == {}
    if expected == "too_long":
        assert out.error.kind == "too_long", out.error


# ---------------------------------------------------------------------------------------------------- properties


@SETTINGS
@given(data=st.data())
def test_every_request_leaves_the_scheduler_exactly_once(engine: Engine, data: st.DataObject) -> None:
    """Any mix of good, too-long, truncated, token-id and unencodable requests, with aborts at any time: each
    request leaves once, as scheduled or rejected as its input deserves, unless aborted while still queued;
    every batch keeps the token budget and the request cap; `schedule()` never raises."""
    sched = engine.scheduler
    reset(engine)
    todo = data.draw(specs(engine.tokenizer.vocab_size), label="requests")
    by_id = {new_id("s"): spec for spec in todo}
    left: dict[str, SchedulableRequest | RequestOutput] = {}
    dropped: set[str] = set()  # aborted while still queued: must never come out
    for rid, spec in by_id.items():
        sched.add(make_request(rid, spec))
    for call in range(MAX_SCHEDULE_CALLS):
        for rid, spec in by_id.items():
            if spec.abort_at == call:
                sched.abort(rid)
                if rid not in left:
                    dropped.add(rid)
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_batch(engine, out.scheduled)
        if not out.scheduled and not out.rejected:
            event("empty schedule() while a request is still tokenizing")
        if len(out.scheduled) == MAX_REQUESTS:
            event("a batch at the request cap")
        if out.num_tokens + engine.max_length > sched.token_budget:
            event("a batch near the token budget")
        for rid, item in [(s.request.request_id, s) for s in out.scheduled] + [(r.request_id, r) for r in out.rejected]:
            assert rid in by_id, f"unknown request {rid} came out"
            assert rid not in left, f"request {rid} came out twice"
            assert rid not in dropped, f"request {rid} came out after it was aborted"
            left[rid] = item
            if isinstance(item, RequestOutput):
                event(f"rejected: {by_id[rid].kind}")
    else:
        pytest.fail(f"the scheduler did not drain in {MAX_SCHEDULE_CALLS} schedule() calls")

    assert set(left) | dropped == set(by_id) and not set(left) & dropped
    for rid, item in left.items():
        if isinstance(item, SchedulableRequest):
            check_scheduled(engine, by_id[rid], item)
        else:
            check_rejected(engine, by_id[rid], item)

    # Aborting a request that already left, or one never added, changes nothing.
    for rid in list(by_id)[:3]:
        sched.abort(rid)
    sched.abort(new_id("never-added"))
    assert not sched.has_unfinished()
    out = sched.schedule()
    assert out.scheduled == [] and out.rejected == []


@SETTINGS
@given(data=st.data())
def test_a_request_aborted_before_scheduling_never_comes_out(engine: Engine, data: st.DataObject) -> None:
    """Aborted before the first `schedule()`: gone, whatever its input; the others are unaffected."""
    sched = engine.scheduler
    reset(engine)
    todo = data.draw(specs(engine.tokenizer.vocab_size, abort=st.sampled_from([None, 0])), label="requests")
    by_id = {new_id("a"): spec for spec in todo}
    seen: list[str] = []
    for rid, spec in by_id.items():
        sched.add(make_request(rid, spec))
    for rid, spec in by_id.items():
        if spec.abort_at == 0:
            sched.abort(rid)
    for _ in range(MAX_SCHEDULE_CALLS):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_batch(engine, out.scheduled)
        seen += [s.request.request_id for s in out.scheduled] + [r.request_id for r in out.rejected]
    else:
        pytest.fail(f"the scheduler did not drain in {MAX_SCHEDULE_CALLS} schedule() calls")
    assert sorted(seen) == sorted(rid for rid, spec in by_id.items() if spec.abort_at is None)


@SETTINGS
@given(data=st.data())
def test_request_processor_isolates_each_request(engine: Engine, data: st.DataObject) -> None:
    """`process` never raises, answers one result per request in order, and a request's result does not depend
    on which others share its call (an unencodable neighbour included)."""
    processor = engine.components["request_processor"]
    budget = engine.scheduler.token_budget
    todo = data.draw(specs(engine.tokenizer.vocab_size, abort=st.none()), label="requests")
    requests = [make_request(new_id("p"), spec) for spec in todo]
    together = processor.process(requests, budget)
    assert len(together) == len(requests)
    for spec, request, result in zip(todo, requests, together):
        alone, = processor.process([request], budget)
        assert type(result) is type(alone)
        if isinstance(result, SchedulableRequest):
            assert result.request is request
            check_scheduled(engine, spec, result)
            assert (result.token_ids, result.token_type_ids) == (alone.token_ids, alone.token_type_ids)
        else:
            assert isinstance(result, RequestError), result
            check_rejected(engine, spec, RequestOutput(request.request_id, error=result))
            assert result.kind == alone.kind


def engine_input(spec: Spec) -> Any:
    if isinstance(spec.prompt, TokensPrompt):
        return {"token_ids": list(spec.prompt.token_ids)}
    assert isinstance(spec.prompt, TextPrompt)
    return spec.prompt.text


@settings(SETTINGS, max_examples=30)
@given(data=st.data())
def test_engine_gives_each_request_one_output(engine: Engine, data: st.DataObject) -> None:
    """Through `add_request` and `step()`: one output per request id (none for one aborted before any step, at
    most one for one aborted later); good ones embed exactly as `Engine.embed` does alone, too-long ones fail
    with kind "too_long", and an input the edge refuses raises at `add_request` and queues nothing."""
    reset(engine)
    todo = data.draw(specs(engine.tokenizer.vocab_size, bad=False), label="requests")
    refused = data.draw(st.lists(st.one_of(surrogate_texts, st.sampled_from(["", "  ", "\n\t"])), max_size=2),
                        label="refused at the edge")
    by_id: dict[str, Spec] = {}
    outputs: dict[str, RequestOutput] = {}
    for spec in todo:
        rid = engine.add_request(engine_input(spec), PoolingParams(truncate=spec.truncate), request_id=new_id("e"))
        by_id[rid] = spec
    for text in refused:
        with pytest.raises(RequestError):
            engine.add_request(text, request_id=new_id("refused"))
    for step in range(MAX_SCHEDULE_CALLS):
        for rid, spec in by_id.items():
            if spec.abort_at == step:
                engine.abort(rid)
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id in by_id, f"unknown request {out.request_id} came out"
            assert out.request_id not in outputs, f"request {out.request_id} came out twice"
            outputs[out.request_id] = out
    else:
        pytest.fail(f"the engine did not drain in {MAX_SCHEDULE_CALLS} steps")

    for rid, spec in by_id.items():
        if spec.abort_at is None:
            assert rid in outputs, f"request {rid} ({spec.kind}) finished without an output"
        elif spec.abort_at == 0:
            assert rid not in outputs, f"request {rid} was aborted before any step but came out"
    for rid, out in outputs.items():
        spec = by_id[rid]
        if spec.expected(engine) == "too_long":
            assert not out.ok and out.error.kind == "too_long" and out.outputs == {}, out
            continue
        assert out.ok, f"{spec.kind} request (truncate={spec.truncate}) failed: {out.error!r}"
        expected = engine.embed([engine_input(spec)], truncate=spec.truncate)[0]
        got = np.asarray(out.outputs["dense"])
        assert got.shape == expected.shape
        assert float(np.abs(got - expected).max()) <= 1e-5
