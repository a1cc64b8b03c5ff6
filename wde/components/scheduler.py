"""Schedulers: decide which waiting requests form the next batch. Plain Python: no tensors.

Prefill-only requests are independent (no KV cache, no preemption), so first-come-first-served under a
token budget and a request cap is enough, and scheduling can run ahead of the device. A request the request
processor calls large (a huge text) is tokenized on a background thread and joins the ready queue when done,
so it never holds up the requests behind it. The chunks of a long input (wde/chunking.py) are queued together
and scheduled like any other sequences; only the first is checked for an abort: once it runs, the rest run too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field

from wde.components.base import BuildContext, Params
from wde.components.kinds import Scheduler
from wde.request import Request, RequestOutput, SchedulableRequest


GPU_TOKEN_BUDGET = 16384
CPU_TOKEN_BUDGET = 2048
"""On CPU, for a model of BERT-base's width (hidden size 768) or wider: batches past a few thousand tokens spill the
caches and run slower per token (docs/benchmarks.md); narrower models get more (`cpu_token_budget`)."""
CPU_TOKEN_BUDGET_MAX = 8192
"""The most a narrow model's CPU batch holds under `auto`."""
BACKGROUND_POLL_S = 0.005
"""How long an otherwise idle `schedule()` waits for a background tokenization before returning empty."""


def cpu_token_budget(hidden_size: object, int8: bool = False) -> int:
    """The `auto` token budget on CPU for a model whose hidden size (config.json's `hidden_size`) is `hidden_size`:
    `CPU_TOKEN_BUDGET` at BERT-base's width (768) and wider, or where the config has no such number; a narrower
    model's token costs less (its layers' GEMMs scale with the width squared) and its batches hold (768 / width)^2
    times as many tokens, rounded down to a power of two, at most `CPU_TOKEN_BUDGET_MAX` (all-MiniLM-L6-v2, width
    384: 8,192). `int8` (`quantization: int8`): a token costs half, its GEMMs running at twice the float rate, and
    batches hold twice as many (BERT-base: 4,096). A batch's forward then takes about as long as a 2,048-token
    BERT-base batch in float or less, while the per-batch costs (a layer's op calls, its threads' fork and join) are
    spread over more tokens: on the Zen 4 of docs/benchmarks.md MiniLM's long texts ran 3.6% (bf16) and 6.3% (int8)
    faster at 8,192 than at 2,048, and a BERT-base-sized model's in int8 4.5% faster at 4,096."""
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        return CPU_TOKEN_BUDGET
    per_bert_token = (768 / hidden_size) ** 2 * (2 if int8 else 1)  # tokens costing one BERT-base token in float
    budget = CPU_TOKEN_BUDGET
    while budget < CPU_TOKEN_BUDGET_MAX and per_bert_token >= 2 * budget / CPU_TOKEN_BUDGET:
        budget *= 2
    return budget


def auto_token_budget(ctx: BuildContext) -> int:
    """`max_num_batched_tokens: auto`: `GPU_TOKEN_BUDGET` with a CUDA device, else `cpu_token_budget` of the model's
    hidden size and its `quantization`."""
    from wde.components.params import ModelParams
    from wde.device import default_device  # imports torch: only when an engine is built
    from wde.errors import ModelLoadError

    if default_device().type == "cuda":
        return GPU_TOKEN_BUDGET
    try:
        hidden_size = getattr(ctx.source.hf_config, "hidden_size", None)
    except ModelLoadError:  # no readable config.json (a plugin's model): its loader says so where it matters
        hidden_size = None
    model = ctx.params.get("model")
    return cpu_token_budget(hidden_size, int8=isinstance(model, ModelParams) and model.quantization == "int8")


class FCFSParams(Params):
    max_num_batched_tokens: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    """Token budget of one batch. auto: 16384 with a CUDA device; on CPU 2048 for a model of BERT-base's width or
    wider, up to 8192 for narrower ones, twice as many with `quantization: int8` (`cpu_token_budget`: 8192 for
    all-MiniLM-L6-v2, 4096 for BERT-base in int8); an input longer than that
    (up to the model's max length) runs in a batch of its own. A number: also the longest input admitted (at most
    the model's max length)."""
    max_num_requests: int = Field(256, gt=0, description="requests in one batch at most")


@dataclass
class SchedulerOutput:
    """The only thing handed to the input builder: the batch, plus requests rejected while tokenizing."""

    scheduled: list[SchedulableRequest] = field(default_factory=list)
    rejected: list[RequestOutput] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class FCFSScheduler(Scheduler):
    """First come, first served; tokenizes lazily through the request processor as it fills a batch."""

    kind = "scheduler"
    name = "fcfs"
    Params = FCFSParams

    def __init__(self, params: FCFSParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._request_processor = ctx.request_processor
        self._is_large = ctx.request_processor.is_large
        budget = params.max_num_batched_tokens
        if budget == "auto":
            budget = auto_token_budget(ctx)
            longest = max(budget, ctx.request_processor.max_length)
        else:
            longest = budget
        self.token_budget: int = budget
        """Tokens of one batch; a batch of one sequence may hold up to `longest_input`."""
        self.longest_input: int = longest
        """The longest input admitted (the request processor rejects or chunks a longer one). Under auto it is the
        model's max length: batches of a long-context model (Qwen3-Embedding: 32,768 tokens) stay at the CPU's
        budget, where a 32,768-token budget ran the same texts 1.7x slower (a Qwen3-0.6B-sized model, 60 texts of
        ~200 tokens, bf16, 2 vCPUs; docs/benchmarks.md), and a longer input runs alone."""
        self.max_num_requests: int = params.max_num_requests
        self._waiting: deque[Request] = deque()
        self._ready: deque[SchedulableRequest] = deque()
        self._aborted: set[str] = set()
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._tokenizing: list[tuple[Request, Future]] = []
        self._background: ThreadPoolExecutor | None = None

    def add(self, request: Request) -> None:
        with self._lock:
            self._queued.add(request.request_id)
            self._waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Drop a request that has not been scheduled yet (e.g. its client went away); others are ignored."""
        with self._lock:
            if request_id in self._queued:
                self._aborted.add(request_id)

    def _dequeued(self, request_id: str) -> bool:
        """Forget a request leaving the queue; True if it had been aborted."""
        with self._lock:
            self._queued.discard(request_id)
            if request_id in self._aborted:
                self._aborted.discard(request_id)
                return True
            return False

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._ready) + len(self._tokenizing)

    @property
    def queued_tokens(self) -> int:
        """Tokens of the waiting sequences tokenized so far (those in `_waiting` are not tokenized yet)."""
        return sum(s.num_tokens for s in list(self._ready))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._ready or self._tokenizing)

    def clear(self) -> list[str]:
        """Drop every queued request (the engine resets after an internal failure); returns their ids."""
        with self._lock:
            ids = [r.request_id for r in self._waiting] + [s.request.request_id for s in self._ready]
            ids += [r.request_id for r, _ in self._tokenizing]
            self._waiting.clear()
            self._ready.clear()
            self._tokenizing.clear()
            self._queued.clear()
            self._aborted.clear()
        return ids

    def _take_waiting(self, n: int) -> list[Request]:
        with self._lock:
            taken = []
            while self._waiting and len(taken) < n:
                r = self._waiting.popleft()
                if r.request_id in self._aborted:
                    self._aborted.discard(r.request_id)
                    self._queued.discard(r.request_id)
                    continue
                taken.append(r)
            return taken

    def _accept(self, requests: list[Request], results: list, out: SchedulerOutput) -> None:
        for req, res in zip(requests, results):
            if isinstance(res, SchedulableRequest):
                self._ready.extend(res.sequences())
            elif not self._dequeued(req.request_id):
                out.rejected.append(RequestOutput(req.request_id, error=res, tokenization_time=req.tokenization_time))

    def _tokenize_in_background(self, request: Request) -> None:
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wde-tokenize")
        self._tokenizing.append((request, self._background.submit(
            self._request_processor.process, [request], self.longest_input)))

    def _collect_background(self, out: SchedulerOutput, wait_s: float) -> None:
        """Move finished background tokenizations to the ready queue (waiting up to `wait_s` for one)."""
        if wait_s > 0:
            wait([f for _, f in self._tokenizing], timeout=wait_s, return_when=FIRST_COMPLETED)
        still = []
        for req, fut in self._tokenizing:
            if fut.done():
                self._accept([req], fut.result(), out)  # process() never raises
            else:
                still.append((req, fut))
        self._tokenizing = still

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget, cap = self.token_budget, self.params.max_num_requests
        tokens = 0
        now = time.perf_counter()
        if self._tokenizing:
            self._collect_background(out, 0)
        while len(out.scheduled) < cap:
            if not self._ready:
                chunk = self._take_waiting(cap - len(out.scheduled))
                if not chunk:
                    break
                inline = []
                for req in chunk:
                    if self._is_large(req):
                        self._tokenize_in_background(req)
                    else:
                        inline.append(req)
                self._accept(inline, self._request_processor.process(inline, self.longest_input), out)
                continue
            head = self._ready[0]
            if tokens + head.num_tokens > budget and out.scheduled:  # a longer input than the budget runs alone
                break
            self._ready.popleft()
            if (head.chunk is None or head.chunk[0] == 0) and self._dequeued(head.request.request_id):
                while self._ready and self._ready[0].request is head.request:  # an aborted input's other chunks
                    self._ready.popleft()
                continue
            head.request.scheduled_time = now
            out.scheduled.append(head)
            tokens += head.num_tokens
        if not out.scheduled and not out.rejected and self._tokenizing and not self._waiting:
            self._collect_background(out, BACKGROUND_POLL_S)  # nothing else to do: wait briefly, do not spin
        return out
