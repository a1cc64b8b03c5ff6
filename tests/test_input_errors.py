"""Bad input is a `RequestError` naming the field and the limit, and never costs other requests their results."""

from __future__ import annotations

from pathlib import Path

import pytest

from wde import Engine, PoolingParams, RequestError
from wde.request import TextPrompt

TOO_LONG = " ".join(["paris berlin water"] * 100)


@pytest.fixture(scope="module")
def engine(tiny_bert: Path):
    inputs = {"params": {"prompts": {"query": "query: "}, "max_input_chars": 2000}}
    with Engine.from_workflow("bert", tiny_bert, pooler={"params": {"pooling": "mean"}}, input_processor=inputs) as e:
        yield e


def rejected(engine: Engine, inputs: object, params: PoolingParams | None = None) -> RequestError:
    with pytest.raises(RequestError) as info:
        engine.add_request(inputs, params)
    assert not engine.has_unfinished(), "a rejected request must not be queued"
    return info.value


@pytest.mark.parametrize("text", ["", "   ", "\n\t "])
def test_empty_text(engine: Engine, text: str) -> None:
    err = rejected(engine, text)
    assert err.field == "input" and "input is empty" in str(err)


def test_empty_text_inside_a_mapping(engine: Engine) -> None:
    err = rejected(engine, {"text": " "})
    assert err.field == "input" and "empty" in str(err)


@pytest.mark.parametrize(("value", "type_name"), [(5, "int"), (None, "NoneType"), (3.5, "float"), ([1.0], "list")])
def test_wrong_type(engine: Engine, value: object, type_name: str) -> None:
    err = rejected(engine, value)
    assert err.field == "input" and f"must be a string, got {type_name}" in str(err)


def test_mapping_without_text(engine: Engine) -> None:
    err = rejected(engine, {"txt": "hello"})
    assert err.field == "input" and "'text' or 'token_ids'" in str(err)


def test_too_many_characters(engine: Engine) -> None:
    err = rejected(engine, "x" * 2001)
    assert err.field == "input" and "2001 characters" in str(err) and "limit is 2000" in str(err)


@pytest.mark.parametrize("bad", [-1, "vocab", 1.0, True])
def test_token_ids_out_of_range_or_wrong_type(engine: Engine, bad: object) -> None:
    vocab = engine.tokenizer.vocab_size
    value = vocab if bad == "vocab" else bad
    err = rejected(engine, {"token_ids": [2, value, 3]})
    assert err.field == "input.token_ids"
    assert f"contains {value!r}" in str(err) and f"[0, {vocab})" in str(err)


def test_empty_token_ids(engine: Engine) -> None:
    err = rejected(engine, {"token_ids": []})
    assert err.field == "input.token_ids" and "non-empty list" in str(err)


def test_unknown_prompt_name(engine: Engine) -> None:
    err = rejected(engine, "hello", PoolingParams(prompt_name="passage"))
    assert err.field == "prompt_name"
    assert "'passage' is not defined" in str(err) and "['query']" in str(err)


def test_pairs_forbidden(engine: Engine) -> None:
    err = rejected(engine, ("a query", "a document"))
    assert err.field == "input" and "not (text, text_pair) pairs" in str(err)
    err = rejected(engine, {"text": "a query", "text_pair": "a document"})
    assert err.field == "input"


def test_encode_names_the_index_of_the_bad_input(engine: Engine) -> None:
    with pytest.raises(RequestError, match=r"^input\[2\]: input is empty") as info:
        engine.encode(["fine", "also fine", "  "])
    assert info.value.field == "input"
    assert not engine.has_unfinished()


def test_too_long_without_truncate_names_the_limit(engine: Engine) -> None:
    with pytest.raises(RequestError) as info:
        engine.embed(["short text", TOO_LONG])
    n_tokens = len(engine.tokenizer.encode([TextPrompt(TOO_LONG)])[0][0])
    message = str(info.value)
    assert message.startswith("input[1]: ")
    assert f"{n_tokens} tokens" in message and f"limit of {engine.max_length}" in message
    assert info.value.field == "input" and info.value.kind == "too_long"
    assert engine.embed(TOO_LONG, truncate=True).shape == engine.embed("short text").shape


def test_one_bad_request_does_not_lose_the_others(engine: Engine) -> None:
    good = ["the water is hot", "paris and berlin", "café naïve"]
    ids = [engine.add_request(good[0]), engine.add_request(TOO_LONG, request_id="too-long"),
           engine.add_request(good[1]), engine.add_request({"text": good[2]})]
    with pytest.raises(RequestError):
        engine.add_request("")
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    assert set(outputs) == set(ids)
    bad = outputs.pop("too-long")
    assert not bad.ok and bad.outputs == {} and bad.error.field == "input" and "tokens" in str(bad.error)
    expected = engine.embed(good)
    for row, rid in zip(expected, [ids[0], ids[2], ids[3]]):
        assert outputs[rid].ok
        assert abs(outputs[rid].outputs["dense"] - row).max() <= 1e-5


def test_dimensions_larger_than_the_embedding_is_refused_before_any_work(engine: Engine) -> None:
    width = engine.embed("short text").shape[-1]
    assert engine.dense_size == width
    error = rejected(engine, "short text", PoolingParams(dimensions=width + 1))
    assert error.field == "dimensions" and f"dimensions={width + 1}" in str(error) and f"size {width}" in str(error)
    with pytest.raises(RequestError, match=r"input\[0\]: dimensions="):
        engine.embed(["a", "b"], dimensions=width + 1)
    assert not engine.has_unfinished()
    assert engine.embed("short text", dimensions=width).shape == (width,)
