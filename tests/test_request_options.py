"""Per-request options (`PoolingParams.options`, issue 35's first seam): components declare the options they read
(`Component.request_options`), the engine takes exactly those, and every request's options reach every component.

The components here are the smallest real consumers: an input processor that prefixes a text by its `task`, a request
processor that reads the same option to cap the tokens of a query, and a tokenizer that pads a query (its `encode` is
given each prompt's options by the request processor, the truncating re-encode included). All are registered as a
plugin would register them; the built-in late-interaction workflows are the core's own consumers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from wde import Engine
from wde.components.input_processor import TextInputProcessor
from wde.components.request_processor import LazyTokenizeRequestProcessor
from wde.components.tokenizer import HFTokenizer
from wde.core.frontend import Frontend
from wde.engine import resolve
from wde.errors import ModelLoadError, RequestError
from wde.registry import get_registry
from wde.request import PoolingParams

QUERY_TOKENS = 8


class TaskPrefix(TextInputProcessor):
    """Prefixes a text with "query: " for `task=query` (the default task, `document`, leaves it as it is)."""

    name = "test_task_prefix"

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": ("document", "query")}

    def to_prompt(self, inputs, params, field):  # noqa: ANN001, ANN201
        if params.option("task", "document") == "query" and isinstance(inputs, str):
            inputs = "query: " + inputs
        return super().to_prompt(inputs, params, field)


class QueryCap(LazyTokenizeRequestProcessor):
    """Truncates queries to `QUERY_TOKENS` tokens, as a late-interaction model's `query_length` does."""

    name = "test_query_cap"

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": ("document", "query")}

    def process(self, requests, token_budget):  # noqa: ANN001, ANN201
        from dataclasses import replace

        for r in requests:
            if r.params.option("task", "document") == "query":
                r.params = replace(r.params, truncate=True, max_tokens=QUERY_TOKENS)
        return super().process(requests, token_budget)


class Disagrees(LazyTokenizeRequestProcessor):
    name = "test_task_disagrees"

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": ("query", "passage")}


PAD_TO = 24


class TaskPadTokenizer(HFTokenizer):
    """Pads a query's tokens to `PAD_TO` with the mask token, as ColBERT's query tokenizer does; records the options
    each call is given."""

    name = "test_task_pad"
    seen: list = []

    def request_options(self) -> dict[str, tuple[str, ...]]:
        return {"task": ("document", "query")}

    def encode(self, prompts, max_length=None, direction="right", options=None):  # noqa: ANN001, ANN201
        self.seen.append(None if options is None else [dict(o) if o else None for o in options])
        out = super().encode(prompts, max_length, direction, options)
        mask = self.hf_tokenizer.mask_token_id
        return [(ids + [mask] * (PAD_TO - len(ids)), None if types is None else types + [0] * (PAD_TO - len(types)))
                if (o or {}).get("task") == "query" else (ids, types) for (ids, types), o in zip(out, options)]


class NoOptionsTokenizer(HFTokenizer):
    """A tokenizer written before `encode` took options."""

    name = "test_no_options"

    def encode(self, prompts, max_length=None, direction="right"):  # noqa: ANN001, ANN201
        return super().encode(prompts, max_length, direction)


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    registry = get_registry()
    for component in (TaskPrefix, QueryCap, Disagrees, TaskPadTokenizer, NoOptionsTokenizer):
        if component.name not in registry.components.get(component.kind, {}):
            registry.add_component(component, plugin="tests.test_request_options")


OVERRIDES = ["input_processor.name=test_task_prefix", "request_processor.name=test_query_cap"]
TEXT = "what is the capital of france and why is it paris"


@pytest.fixture(scope="module")
def engine(minilm_path: Path):
    with Engine.from_workflow("bert", minilm_path, overrides=OVERRIDES) as e:
        yield e


def test_options_reach_every_component_that_reads_them(engine: Engine, minilm_engine: Engine) -> None:
    assert engine.request_options == {"task": ("document", "query")} == engine.info.options
    document, = engine.encode([TEXT])
    query, = engine.encode([TEXT], PoolingParams(options={"task": "query"}))
    explicit, = engine.encode([TEXT], PoolingParams(options={"task": "document"}))
    assert np.abs(document.outputs["dense"] - minilm_engine.embed(TEXT)).max() <= 1e-6
    assert np.abs(explicit.outputs["dense"] - document.outputs["dense"]).max() == 0
    assert query.num_prompt_tokens == QUERY_TOKENS  # the request processor read it
    capped, = minilm_engine.encode(["query: " + TEXT], PoolingParams(max_tokens=QUERY_TOKENS))  # so did the input one
    assert np.abs(query.outputs["dense"] - capped.outputs["dense"]).max() <= 1e-6


def test_an_option_no_component_declares_is_refused_by_name(engine: Engine, minilm_engine: Engine) -> None:
    with pytest.raises(RequestError, match=r"option 'mode' is not an option of workflow 'bert'; it takes task") as e:
        engine.encode([TEXT], PoolingParams(options={"mode": "query"}))
    assert e.value.field == "options.mode"
    with pytest.raises(RequestError, match=r"option task='passage' .* give one of document, query") as e:
        engine.encode([TEXT], PoolingParams(options={"task": "passage"}))
    assert e.value.field == "options.task"
    with pytest.raises(RequestError, match="it takes none"):
        minilm_engine.encode([TEXT], PoolingParams(options={"task": "query"}))


def test_components_that_read_one_option_must_agree(minilm_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="input_processor and request_processor declare option 'task' with"
                                             " different values"):
        Engine.from_workflow("bert", minilm_path, overrides=["input_processor.name=test_task_prefix",
                                                             "request_processor.name=test_task_disagrees"])


def test_a_split_api_server_checks_options_as_the_engine_does(engine: Engine, minilm_path: Path) -> None:
    """The API server of a split engine validates with the core's EngineInfo, and its own input processor reads
    the option (the core receives token ids)."""
    workflow, source = resolve("bert", minilm_path, overrides=OVERRIDES)
    frontend = Frontend(workflow, source, engine.info)
    with pytest.raises(RequestError, match="not an option") as e:
        frontend.make_request(TEXT, PoolingParams(options={"mode": "x"}), "r1", "input")
    assert e.value.field == "options.mode"
    request = frontend.make_request(TEXT, PoolingParams(options={"task": "query"}), "r2", "input")
    assert request.prompt.text == "query: " + TEXT


def test_the_tokenizer_is_given_each_prompts_options(minilm_path: Path, minilm_engine: Engine) -> None:
    """In order, one per prompt, in the batched call and in the re-encode that truncates an over-long input."""
    with Engine.from_workflow("bert", minilm_path, overrides=["tokenizer.name=test_task_pad"]) as engine:
        assert engine.request_options == {"task": ("document", "query")}
        TaskPadTokenizer.seen.clear()
        query, document = engine.encode(["paris", "berlin"], PoolingParams(options={"task": "query"})), \
            engine.encode(["paris"])
        assert [o.num_prompt_tokens for o in query] == [PAD_TO, PAD_TO] and document[0].num_prompt_tokens == 3
        assert [{"task": "query"}, {"task": "query"}] in TaskPadTokenizer.seen and [None] in TaskPadTokenizer.seen
        plain, = minilm_engine.encode(["paris"])
        assert np.abs(document[0].outputs["dense"] - plain.outputs["dense"]).max() <= 1e-6
        assert np.abs(query[0].outputs["dense"] - plain.outputs["dense"]).max() > 1e-3  # the padding was embedded
        TaskPadTokenizer.seen.clear()
        engine.encode([TEXT * 60], PoolingParams(truncate=True, options={"task": "query"}))
        assert TaskPadTokenizer.seen[-1] == [{"task": "query"}]  # the truncating call, after the batched one
        assert len(TaskPadTokenizer.seen) == 2


def test_a_tokenizer_whose_encode_takes_no_options_is_refused_at_build(minilm_path: Path,
                                                                       minilm_engine: Engine) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer 'test_no_options': its encode\\(\\) takes no `options`"):
        Engine.from_workflow("bert", minilm_path, overrides=["tokenizer.name=test_no_options"])
    from wde.request import TextPrompt

    with pytest.raises(ValueError, match="1 options for 2 prompts"):
        minilm_engine.tokenizer.encode([TextPrompt("a"), TextPrompt("b")], options=[None])
