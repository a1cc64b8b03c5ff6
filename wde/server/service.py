"""What every route shares: the engine behind the API, limits, the model-name check, and `run`, which turns
inputs into outputs (or into the right `ApiError`) while watching for the client going away and for the request's
deadline (`--request-timeout`); `liveness` is what /health reports."""

from __future__ import annotations

import asyncio
import copy
import logging
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import numpy as np
from fastapi import Request

from wde.components.image_input import ImageTextInputProcessor, is_image
from wde.components.lora import ADAPTER_OPTION, NO_ADAPTER
from wde.components.scorer import Scorer, scoring_plan
from wde.engine_info import EngineInfo
from wde.errors import RequestError
from wde.request import PoolingParams, RequestOutput
from wde.serving import EngineOverloaded, EngineTimeout, EngineUnavailable, ServingFrontEnd, input_names
from wde.server.config import ServerConfig
from wde.server.errors import ApiError, ErrorKind, request_id
from wde.server.image_fetch import FetchLimits, ImageFetcher
from wde.server.metrics import ServerMetrics
from wde.server.model_config import ModelConfig, name_table, public_name
from wde.server.startup import StartupError

_NEEDS = {
    "dense": "an embedding model (output 'dense')",
    "score": "a cross-encoder reranker (output 'score')",
    "probs": "a sequence classifier (output 'probs')",
    "sparse": "a sparse-embedding model such as bge-m3 or SPLADE (output 'sparse')",
}


UNSET_MODEL = "default/not-specified"
"""The `model` infinity_client sends when its user names none: it means "the served model", as on Infinity."""

TOKEN_IDS_REFUSED = (
    "{name} is a list of token ids, and this server refuses token-id inputs (wde serve --no-token-id-inputs):"
    " ids from another tokenizer would be embedded as the wrong tokens of this model's vocabulary. Send the text"
    " instead (langchain-openai's OpenAIEmbeddings sends tiktoken cl100k ids unless given"
    " check_embedding_ctx_length=False)")

_KIND: dict[str, ErrorKind] = {"empty": "empty", "encoding": "bad_text", "too_long": "too_long",
                               "bad_image": "bad_image", "image_too_large": "image_too_large"}
"""RequestError kinds → API error kinds (anything else the input caused is "validation")."""

JINA_TASKS = {"retrieval.query": "query", "retrieval.passage": "document"}
"""Jina's embedding tasks → the `task` option values of WDE's query/document workflows (multi_vector)."""
COHERE_JINA_TASKS = {"search_query": "retrieval.query", "search_document": "retrieval.passage",
                     "classification": "classification", "clustering": "separation"}
"""Cohere's input types → Jina's tasks, for a model whose `task` option takes them (jina_embeddings_v3)."""

T = TypeVar("T")

log = logging.getLogger("wde.server")

CHUNKED_LIMIT_FACTOR = 16
"""--max-embed-len's default, in multiples of the model's limit: 4,096 tokens for all-MiniLM-L6-v2, 131,072 for
bge-m3; an input's JSON is bounded by the payload limit anyway."""

RETRY_AFTER_S = 5
"""Retry-After of a 503 for a request that ran past its deadline: long enough not to pile retries onto an engine
that is behind, short against the deadline itself."""


def check_long_inputs(config: ServerConfig, info: EngineInfo) -> None:
    """Refuse `--long-inputs chunk` at start-up, in one line, for a workflow that cannot chunk."""
    if config.long_inputs == "chunk" and not (info.chunkable and "dense" in info.outputs):
        raise StartupError(f"--long-inputs chunk: workflow {info.workflow!r} cannot embed long inputs in chunks"
                           " (chunked processing is for dense embeddings from a pooler that supports it, such as"
                           " 'sentence'); use --long-inputs refuse or truncate")


def api_error(error: RequestError) -> ApiError:
    """The API error for an input the engine refused at admission (it names its field itself)."""
    return ApiError(_KIND.get(error.kind, "validation"), str(error), error.field)


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready; its requests were aborted."""


@dataclass
class Result:
    """Outputs in input order plus TEI's timing headers."""

    outputs: list[RequestOutput]
    headers: dict[str, str]

    @property
    def prompt_tokens(self) -> int:
        return sum(o.num_prompt_tokens for o in self.outputs)

    @property
    def dense(self) -> list[np.ndarray]:
        return [o.outputs["dense"] for o in self.outputs]


class Service:
    """One served model behind the API: its engine, its names, and the server's limits (`config`)."""

    def __init__(self, engine: ServingFrontEnd, config: ServerConfig, metrics: ServerMetrics,
                 index: int = 0) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.model_metrics = metrics.for_model(name_table(config.served_models())[index][0])
        """The engine's series of `metrics`, labelled with this model."""
        self.served: ModelConfig = config.served_models()[index]
        """What `wde serve` was told about this model (its --model, --workflow, names, overrides)."""
        self.model_names = name_table(config.served_models())[index]
        """What requests may call the model (aliases included); responses show the first."""
        self.model_name = self.model_names[0]
        """What responses call the model: never a local path (a model folder is named by its last component)."""
        self.created = int(time.time())
        self.adapter: str | None = None
        """The LoRA adapter every request through this service runs with (`for_adapter`); None: the base model."""
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wde-tokenize-api")
        processor = engine.input_processor
        self.takes_images = isinstance(processor, ImageTextInputProcessor)
        """Whether the workflow embeds images too (CLIP, SigLIP): the image inputs of the routes need it."""
        self.max_image_bytes: int | None = processor.params.max_image_bytes if self.takes_images else None
        self.fetcher = (ImageFetcher(config.allow_image_fetch, fetch_limits(config, self.max_image_bytes))
                        if config.allow_image_fetch and self.max_image_bytes is not None else None)
        """Fetches image URLs from the --allow-image-fetch hosts; None (every URL refused) unless some are named."""
        check_long_inputs(config, self.info)
        self.max_embed_len: int = config.max_embed_len or CHUNKED_LIMIT_FACTOR * self.info.max_length
        """The most tokens one input may have under chunked processing (`wde serve --max-embed-len`)."""
        if config.allow_image_fetch and not self.takes_images:
            log.warning("--allow-image-fetch has no effect: workflow %r embeds text only, and images sent to it are"
                        " refused", self.info.workflow)

    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the model has loaded (docs/adapters.md), which requests select by naming them in
        `model`; none where it takes no adapters."""
        return self.info.options.get(ADAPTER_OPTION, (NO_ADAPTER,))[1:]

    def for_adapter(self, name: str) -> "Service":
        """This service as a request naming adapter `name` in `model` sees it: every input runs with the option
        `adapter` set to it, and responses call the model `name` (vLLM's convention)."""
        view = copy.copy(self)
        view.adapter, view.model_name = name, name
        return view

    def with_adapter(self, params: PoolingParams) -> PoolingParams:
        """`params` with this service's adapter as the option `adapter`; one contradicting it is a 422."""
        if self.adapter is None:
            return params
        given = (params.options or {}).get(ADAPTER_OPTION, self.adapter)
        if given != self.adapter:
            raise ApiError("validation", f"options.adapter {given!r} contradicts the model named, adapter"
                           f" {self.adapter!r}; send one", f"options.{ADAPTER_OPTION}")
        return replace(params, options={**(params.options or {}), ADAPTER_OPTION: self.adapter})

    def long_inputs(self, truncate: bool | None) -> dict[str, Any]:
        """PoolingParams keyword arguments for what an over-long input gets: truncation when its request asks
        (`truncate` True), a 422 when it asks for that (False: Cohere's NONE), else the server's --long-inputs."""
        mode = self.config.long_inputs if truncate is None else "truncate" if truncate else "refuse"
        if mode == "truncate":
            return {"truncate": True}
        if mode == "chunk":
            return {"chunk": True, "max_embed_len": self.max_embed_len}
        return {}

    def options(self, options: dict[str, str] | None, task: str | None, field: str) -> dict[str, str] | None:
        """A request's per-request options, with `task` (an API's own query/document field, named `field`) as the
        `task` option where the workflow takes one; refused by name where it takes none, or contradicts `options`."""
        if task is None:
            return options
        if "task" not in self.info.options:
            raise ApiError("validation", f"{field} {task!r}: workflow {self.info.workflow!r} embeds queries and"
                           " documents alike (it takes no task option); leave it out", field)
        if options and options.get("task", task) != task:
            raise ApiError("validation", f"{field} {task!r} and options.task {options['task']!r} contradict each"
                           " other; send one", field)
        return {**(options or {}), "task": task}

    def jina_task(self, task: str | None, options: dict[str, str] | None) -> dict[str, str] | None:
        """A Jina body's `task` as the model's `task` option (with the body's `options`): the value itself where
        the workflow takes it, else Jina's retrieval.query / retrieval.passage as query / document (the
        multi-vector workflows' values). A model that takes no task option would embed the input as it embeds
        any, silently the wrong vectors: refused by name, as is a task it does not take."""
        if task is None:
            return options
        values = self.info.options.get("task")
        if values is None:
            raise ApiError("validation", f"task {task!r}: model {self.model_name!r} (workflow {self.info.workflow!r})"
                           " takes no task option, so it would embed these inputs as any other; leave task out, or"
                           " send it to a model that takes one", "task")
        value = task if task in values else JINA_TASKS.get(task)
        if value not in values:
            raise ApiError("validation", f"task {task!r} is not a task of model {self.model_name!r}; it takes"
                           f" {', '.join(values)} (Jina's {', '.join(JINA_TASKS)} mean"
                           f" {', '.join(JINA_TASKS.values())})", "task")
        return self.options(options, value, "task")

    def input_type_task(self, input_type: str | None) -> dict[str, str] | None:
        """Cohere's `input_type` as the `task` option of a model whose tasks are Jina's (jina_embeddings_v3's
        adapters: search_query → retrieval.query, search_document → retrieval.passage, clustering → separation,
        classification); None for any other model (its prompts carry the input type) or input type."""
        task = COHERE_JINA_TASKS.get(input_type or "")
        if task is None or task not in self.info.options.get("task", ()):
            return None
        return {"task": task}

    def liveness(self) -> str | None:
        """None while the engine serves; else why not, for /health's 503: the loop stopped or gave up, or it has
        not finished a step for longer than `stall_timeout` (a hung step, a frozen engine core)."""
        engine = self.engine
        if not engine.healthy:
            return "the engine is not running" + (f": {engine.error}" if engine.error else "")
        limit = self.config.stall_timeout
        stalled = engine.seconds_since_step
        if limit and stalled > limit:
            return (f"the engine has not finished a step for {stalled:.1f} s (limit {limit:g} s, wde serve"
                    " --stall-timeout): it is hung, frozen or swamped; requests wait until it steps again")
        return None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work for a route (/tokenize) on the service's own thread, off the event loop and the
        engine thread, so a large text neither stalls other requests nor races the engine's tokenizer."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def supported(self) -> tuple[str, ...]:
        """Every output the workflow can produce, on request ones ('token_embeddings' of an embedder) included."""
        return self.engine.info.outputs

    @property
    def produces(self) -> tuple[str, ...]:
        """What the workflow produces by default: `supported` less the per-token states an embedder gives only
        to the requests that ask for them (/embed_all)."""
        outputs = self.supported
        main = tuple(o for o in outputs if o != "token_embeddings")
        return main or outputs

    def check_batch_size(self, count: int, field: str, unit: str = "inputs") -> None:
        """The 422 for a request of more inputs than `max_client_batch_size` (`field` holds them, counted as
        `unit`: /vertex's instances); routes whose images are fetched check it before the first fetch."""
        limit = self.config.max_client_batch_size
        if count > limit:
            raise ApiError("validation", f"batch size {count} > maximum allowed batch size {limit}"
                           f" ({field} has {count} {unit}; the limit is {limit})", field)

    def check_token_cap(self, cap: int | None, field: str, unit: str = "") -> None:
        """Refuse a client's token cap (Cohere's max_tokens...) below the model's limit: WDE truncates only to it."""
        limit = self.info.max_length
        if cap is not None and cap < limit:
            raise ApiError("validation", f"{field}={cap} is below the model's limit of {limit} tokens{unit}, and WDE"
                           f" truncates only to that limit; leave it out or give at least {limit}", field)

    def require(self, output: str, route: str) -> None:
        if output not in self.supported:
            hint = ""
            if output == "dense" and "sparse" in self.supported:  # a sparse-only model (SPLADE)
                hint = ("; this model gives sparse embeddings only: POST /embed_sparse (TEI: [{index, value}] per"
                        " input) or /pooling (OpenAI-style list with {token_id: weight})")
            raise ApiError("unsupported", f"{route} needs {_NEEDS.get(output, repr(output))}, but model"
                           f" {self.model_name!r} (workflow {self.info.workflow!r}) produces {list(self.produces)}"
                           f"{hint}")

    def scorer(self, route: str) -> Scorer:
        """The workflow's scorer (`EngineInfo.scorer`), or the 424 naming `route` where it scores nothing."""
        scorer = self.info.scorer
        if scorer.output is None:
            raise ApiError("unsupported", f"{route} needs a model that scores: a cross-encoder reranker (output"
                           " 'score'), an embedder or a multi-vector model, but model"
                           f" {self.model_name!r} (workflow {self.info.workflow!r}) produces {list(self.produces)}"
                           f" and its scorer is {scorer.scoring!r}")
        return scorer

    async def score(self, request: Request, pairs: Sequence[tuple[Any, Any]], params: PoolingParams, field: str,
                    names: Sequence[tuple[str, str]], images: bool = False) -> tuple[np.ndarray, Result]:
        """Score (query, document) `pairs` with the workflow's scorer (`scorer`, which the route checked): a pair
        scorer runs each pair, an embedding scorer each distinct query and document once (`scoring_plan`).
        `params` are the route's (truncation, activation); `names` name each pair's two sides in errors;
        `images`: the route resolved image inputs (`run`'s)."""
        try:
            plan = scoring_plan(self.info.scorer, pairs, params)
        except RequestError as e:
            raise api_error(e) from None
        pair = self.info.scorer.pairs
        run_names = [names[i] if pair else names[i][side] for i, side in plan.origins]
        result = await self.run(request, plan.inputs, plan.params, field, run_names, images=images)
        return plan.scores([o.outputs for o in result.outputs]), result

    def labels(self) -> list[str]:
        """Class names in class-id order: the pooler's `labels`, else the model config's id2label."""
        return list(self.info.labels)

    async def run(self, request: Request, inputs: Sequence[Any], params: PoolingParams | Sequence[PoolingParams],
                  field: str, names: Sequence[str | tuple[str, str]] | None = None, images: bool = False) -> Result:
        """Validate the batch, run it, and map every failure to its status code.

        `field` is the body field holding the inputs; `names`, when given, names each input in errors (a pair
        may name each side, e.g. ``("query", "documents[3]")``), else they are `field` / `field[i]`. Only a route
        that reads image fields passes `images=True` (wde/server/image_inputs.py); elsewhere a data:image/ URI in
        a text field is refused rather than embedded as an image the API never said it takes.
        """
        start = time.perf_counter()
        if self.adapter is not None:
            params = (self.with_adapter(params) if isinstance(params, PoolingParams)
                      else [self.with_adapter(p) for p in params])
        if not inputs:
            raise ApiError("empty", f"{field} is empty: send at least one input", field)
        self.check_batch_size(len(inputs), field)
        names = input_names(names if names is not None else field, len(inputs))
        if not self.config.token_id_inputs:
            for item, name in zip(inputs, names):
                if is_token_ids(item):
                    where = name if isinstance(name, str) else name[1]
                    raise ApiError("validation", TOKEN_IDS_REFUSED.format(name=where), where)
        if self.takes_images and not images:
            for item, name in zip(inputs, names):
                if is_image(item):
                    where = name if isinstance(name, str) else name[1]
                    raise ApiError("validation", f"{where} is a data:image/ URI in a field that carries texts; send"
                                   " images as image_url parts of /v1/embeddings `messages`, with /embeddings"
                                   " `modality: \"image\"`, or as /v2/embed `images` (docs/images.md)", where)
        rid = request_id(request)
        timeout = self.config.request_timeout or None
        try:
            outputs = await unless_disconnected(request, self.engine.encode(inputs, params, names, rid, timeout))
        except RequestError as e:
            raise api_error(e) from None
        except EngineOverloaded as e:
            raise ApiError("overloaded", str(e)) from None
        except EngineTimeout as e:
            self.model_metrics.timeouts.inc()
            log.warning("request %s: no answer within the request timeout of %g s; its inputs were aborted, answered"
                        " 503 (the engine last finished a step %.1f s ago)", rid, timeout,
                        self.engine.seconds_since_step)
            raise ApiError("timeout", str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineUnavailable as e:
            raise ApiError("unhealthy", str(e)) from None
        internal = False
        for i, out in enumerate(outputs):
            if out.error is None:
                continue
            if out.error.kind == "internal":
                internal = True
                continue
            where = _name_of(names[i], out.error.field)
            raise ApiError(_KIND.get(out.error.kind, "validation"), f"{where}: {out.error}", where)
        if internal:
            raise ApiError("backend", f"internal error while serving this request (request id {rid}); the server log"
                           " has the details")
        self.model_metrics.on_outputs(outputs)
        return Result(outputs, _timing_headers(outputs, start, inputs))

    @property
    def prompts(self) -> dict[str, str]:
        """The served model's named prompts (`prompt_name`, Cohere's input types, Weaviate's task types); none for
        an input processor that defines none."""
        return dict(self.engine.input_processor.prompts)

    def hf_tokenizer(self) -> Any:
        """The tokenizer component, for the routes that tokenize or decode on their own (/tokenize, /decode,
        /detokenize); the 'unsupported' refusal when it exposes no Hugging Face tokenizer."""
        component = self.engine.tokenizer
        if component.hf_tokenizer is None:
            raise ApiError("unsupported", "this workflow's tokenizer does not expose a Hugging Face tokenizer")
        return component

    def check_texts(self, texts: Sequence[str], names: Sequence[str]) -> None:
        """The input processor's own text check (`check_text`) on texts a route tokenizes itself, each refusal an
        `ApiError` naming the input."""
        for text, name in zip(texts, names):
            try:
                self.engine.input_processor.check_text(text, name)
            except RequestError as e:
                raise api_error(e) from None

    async def decode(self, ids: list[list[int]], skip_special_tokens: bool, names: list[str]) -> list[str]:
        """Token ids back to text (TEI /decode) on the service's tokenizer thread; an id outside the
        vocabulary is an `ApiError` naming it (`names[i][j]`)."""
        component = self.hf_tokenizer()
        vocab = component.vocab_size
        for i, row in enumerate(ids):
            for j, tid in enumerate(row):
                if not 0 <= tid < vocab:
                    where = f"{names[i]}[{j}]"
                    raise ApiError("validation", f"{where} is {tid}; token ids must be integers in [0, {vocab})", where)
        return await self.off_loop(lambda: component.hf_tokenizer.batch_decode(
            ids, skip_special_tokens=skip_special_tokens))


def fetch_limits(config: ServerConfig, max_image_bytes: int) -> FetchLimits:
    """The --image-fetch-* limits of `config` for a model taking images of up to `max_image_bytes`."""
    return FetchLimits(image_bytes=max_image_bytes, timeout=config.image_fetch_timeout,
                       max_urls=config.image_fetch_max_urls, total_bytes=config.image_fetch_max_bytes,
                       deadline=config.image_fetch_deadline, connections=config.image_fetch_connections)


def is_token_ids(item: Any) -> bool:
    """Whether an engine input is token ids (`{"token_ids": [...]}` or a bare list of ints) rather than text."""
    if isinstance(item, Mapping):
        return "token_ids" in item
    return isinstance(item, list) and bool(item) and all(isinstance(x, int) and not isinstance(x, bool) for x in item)


class ServedModels:
    """Every model a server serves, each a `Service`, by every name requests may call it (`ModelConfig.names`);
    the first is the default, which answers a request that names no model.

    `pick` is where a request's `model` becomes what serves it; a served name that selects a LoRA adapter of a
    model would map here to (that model's Service, the adapter), for the engine to apply per request."""

    def __init__(self, services: Sequence[Service]) -> None:
        self.services = tuple(services)
        self.default = self.services[0]
        self.by_name: dict[str, Service] = {n: svc for svc in self.services for n in svc.model_names}
        for svc in self.services:
            for adapter in svc.adapters():
                self.check_adapter_name(adapter, StartupError)

    def check_adapter_name(self, name: str, error: Callable[[str], Exception], into: Service | None = None) -> None:
        """Refuse a LoRA adapter name that a served model or another model's adapter already answers to (`into`:
        the model it is being loaded into at run time, whose own adapters the load itself checks)."""
        taken = self.by_name.get(name)
        if taken is not None:
            raise error(f"LoRA adapter {name!r} has the name of served model {taken.model_name!r}; name it otherwise")
        owners = [svc.model_name for svc in self.services if name in svc.adapters()]
        if into is not None and any(svc.engine is not into.engine and name in svc.adapters() for svc in self.services):
            raise error(f"LoRA adapter {name!r} is loaded by model {owners[0]!r} already; name it otherwise")
        if len(owners) > 1:
            raise error(f"LoRA adapter {name!r} is loaded by models {owners[0]!r} and {owners[1]!r}; name them apart")

    def pick(self, name: str | None) -> Service:
        """The service of the model called `name` (the default where it is None, or infinity_client's "not
        specified"); the 404 naming the served models for a name no model has."""
        if name is None or name == UNSET_MODEL:
            return self.default
        found = self.by_name.get(name)
        if found is None:
            for svc in self.services:  # a LoRA adapter's name: its model, running every input with the adapter
                if name in svc.adapters():
                    return svc.for_adapter(name)
            raise self.not_served(name)
        return found

    def not_served(self, name: str) -> ApiError:
        """The 404 for a `model` this server does not serve, naming what it serves (never a local path)."""
        served = []
        for svc in self.services:
            aliases = ", ".join(repr(n) for n in svc.model_names[1:] if public_name(n) == n)
            adapters = ", ".join(repr(n) for n in svc.adapters())
            served.append(f"{svc.model_name!r}{f' (also accepted: {aliases})' if aliases else ''}"
                          f"{f' (LoRA adapters: {adapters})' if adapters else ''}")
        return ApiError("not_found", f"model {name!r} is not served here; this server serves {'; '.join(served)}",
                        "model")

    def liveness(self) -> str | None:
        """None while every model's engine serves; else why one does not (naming it where there are several)."""
        for svc in self.services:
            problem = svc.liveness()
            if problem is not None:
                return problem if len(self.services) == 1 else f"model {svc.model_name!r}: {problem}"
        return None


MODEL_QUERY = "model"
"""The query parameter that names the model of a request whose body has no `model` field (TEI's routes, /vertex,
Weaviate's): `POST /rerank?model=reranker`."""


def model_service(request: Request, name: str | None = None) -> Service:
    """The service of the model a request names: `name`, its body's `model` field, else the `?model=` query
    parameter, else the server's default (first) model. Both given and naming different models is a 422."""
    models: ServedModels = request.app.state.models
    query = request.query_params.get(MODEL_QUERY)
    if name is None or name == UNSET_MODEL:
        return models.pick(query)
    picked = models.pick(name)
    if query is not None and models.pick(query) is not picked:
        raise ApiError("validation", f"model {name!r} and the query parameter ?model={query} name different"
                       " models; name one", "model")
    return picked


def _name_of(name: str | tuple[str, str], error_field: str | None) -> str:
    """The name of the input an engine error is about: a pair's first side when the error says so."""
    if isinstance(name, str):
        return name
    return name[0] if (error_field or "").endswith("[0]") else name[1]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await the engine (or a request's image fetches), but give up (cancelling, hence aborting, the work) if the
    client disconnects: `ClientDisconnected` once the work's own clean-up (aborting its requests) has run.

    The work runs in the caller's task; one watcher task waits for the disconnect and cancels the caller's task
    when it comes (a second task and `asyncio.wait` per request cost the event loop ~5% of a small request)."""
    caller = asyncio.current_task()
    assert caller is not None
    hung_up = False

    def cancel_caller(watcher: "asyncio.Task[None]") -> None:
        nonlocal hung_up
        if not watcher.cancelled() and watcher.exception() is None:
            hung_up = True
            caller.cancel()

    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(cancel_caller)
    try:
        return await work
    except BaseException:
        if not hung_up:  # the work's own failure, or the caller itself cancelled
            raise
        if sys.version_info >= (3, 11):
            caller.uncancel()  # this cancellation is answered by ClientDisconnected, not passed on
        raise ClientDisconnected() from None  # whatever the work made of the cancellation: nobody reads it
    finally:
        watcher.remove_done_callback(cancel_caller)
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _timing_headers(outputs: list[RequestOutput], start: float, inputs: Sequence[Any]) -> dict[str, str]:
    """TEI's headers: milliseconds, per-input times averaged over the batch."""
    def ms(seconds: float) -> str:
        return str(int(seconds * 1000))

    n = len(outputs)
    total = time.perf_counter() - start
    texts = (x.get("text") if isinstance(x, Mapping) else x for x in inputs)
    chars = sum(len(t) for x in texts for t in (x if isinstance(x, tuple) else (x,)) if isinstance(t, str))
    return {
        "x-compute-type": "wde",
        "x-compute-time": ms(total),
        "x-total-time": ms(total),
        "x-compute-tokens": str(sum(o.num_prompt_tokens for o in outputs)),
        "x-compute-characters": str(chars),
        "x-tokenization-time": ms(sum(o.tokenization_time for o in outputs) / n),
        "x-queue-time": ms(sum(o.queue_time for o in outputs) / n),
        "x-inference-time": ms(sum(o.inference_time for o in outputs) / n),
    }


def to_json(value: Any) -> Any:
    """numpy outputs to JSON: arrays stay arrays (the JSON response writes them), sparse {token_id: weight}
    dicts become string-keyed dicts of floats."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, dict):
        return {str(k): float(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def scalar(value: Any) -> float:
    return float(np.asarray(value, dtype=np.float32).reshape(-1)[0])
