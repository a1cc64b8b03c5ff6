"""Broken model folders are refused at start-up with one line naming what is wrong; a non-finite output never
reaches a response body.

Each folder is built in a temporary directory from the bundled MiniLM (big files linked, not copied) or from a
tiny random model (tests/tiny_models.py, tests/tiny_heads.py). Every case is checked on `Engine.from_workflow`;
each kind of case also on `wde serve` in a subprocess (some with `--api-servers 2`, one with `wde embed`): exit
status 1, one line on stderr, no traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import shutil
import struct
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from pydantic import Field

from tests import faults
from tests.test_server import free_port, serve
from wde import Engine
from wde.components.pooler import Pooled
from wde.components.scheduler import FCFSParams, FCFSScheduler, SchedulerOutput
from wde.engine import nonfinite_rows, select_rows
from wde.errors import ModelLoadError
from wde.registry import get_registry

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
START_TIMEOUT_S = 600
"""Generous: a start-up that fails takes seconds; this only guards against a hang."""
MEAN = ("--set", "pooler.params.pooling=mean")
"""A tiny random BERT has no sentence-transformers config to read its pooling from."""


@pytest.fixture(scope="module", autouse=True)
def test_components() -> None:
    faults.register()
    if GatedScheduler.name not in get_registry().components.get("scheduler", {}):
        get_registry().add_component(GatedScheduler, plugin="tests.test_broken_folders")


def minilm_copy(minilm_path: Path, out: Path, skip: tuple[str, ...] = ()) -> Path:
    """The bundled MiniLM's folder without the files in `skip`; its weights are linked, the rest copied."""
    out.mkdir()
    for item in minilm_path.iterdir():
        if item.name in skip or item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        elif item.suffix == ".safetensors":
            (out / item.name).symlink_to(item)
        else:
            shutil.copy(item, out / item.name)
    return out


def tiny_copy(tiny_bert: Path, out: Path) -> Path:
    shutil.copytree(tiny_bert, out)
    return out


def refused(folder: Path, *overrides: str, workflow: str | None = None) -> str:
    """The start-up error `Engine.from_workflow` raises for `folder` (asserted to be one line); `overrides` as
    on the command line (`--set K=V`)."""
    with pytest.raises(ModelLoadError) as info:
        Engine.from_workflow(workflow, folder, overrides=[o for o in overrides if o != "--set"])
    message = str(info.value)
    assert "\n" not in message, message
    return message


def serve_refused(folder: Path, *args: str, api_servers: int = 0, command: str = "serve") -> str:
    """`wde serve` (or `wde embed`) on `folder`: exit status 1, no traceback, and exactly one line on stderr,
    which is returned. float32 is explicit so a CPU with native bf16 logs no hint line before the error."""
    if command == "serve":
        cli = ["serve", "--port", str(free_port()), "--api-servers", str(api_servers)]
    else:
        inputs = folder.parent / "inputs.txt"
        inputs.write_text("hello\nworld\n", encoding="utf-8")
        cli = ["embed", "--input", str(inputs), "--output", str(folder.parent / "out.npy")]
    proc = subprocess.run(
        [sys.executable, "-m", "wde.cli", *cli, "--model", str(folder), "--set", "model.params.dtype=float32", *args],
        capture_output=True, text=True, timeout=START_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr[-3000:]
    return lines[0]


# --- tokenizer -----------------------------------------------------------------------------------------------

def test_a_folder_without_tokenizer_files_is_refused(tmp_path: Path, minilm_path: Path,
                                                    minilm_engine: Engine) -> None:
    """transformers 5 would build a 5-token vocabulary and map every word to [UNK] ([2, 1, 1, 3])."""
    folder = minilm_copy(minilm_path, tmp_path / "no-tokenizer", skip=TOKENIZER_FILES)
    message = refused(folder)
    assert f"{folder} has no tokenizer files" in message and "tokenizer.params.path" in message
    line = serve_refused(folder)
    assert "has no tokenizer files" in line and str(folder) in line
    # tokenizer_config.json alone holds no vocabulary either
    shutil.copy(minilm_path / "tokenizer_config.json", folder)
    assert "has no tokenizer files" in refused(folder)
    # a tokenizer configured in the workflow serves the folder, with the original's vectors
    with Engine.from_workflow(None, folder, overrides=[f"tokenizer.params.path={minilm_path}"]) as engine:
        assert np.abs(engine.embed(["hello world", "Berlin"]) - minilm_engine.embed(["hello world", "Berlin"])).max() \
            <= 1e-5


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path: Path, minilm_path: Path) -> None:
    """Tokens added to the tokenizer of a fine-tune whose folder got the original weights and config: their ids
    (30522 and up) have no row in the 30522-row embedding table."""
    from transformers import AutoTokenizer

    folder = minilm_copy(minilm_path, tmp_path / "big-tokenizer", skip=TOKENIZER_FILES)
    tok = AutoTokenizer.from_pretrained(minilm_path)
    tok.add_tokens([f"newword{i}" for i in range(12)])
    tok.save_pretrained(folder)
    message = refused(folder)
    assert "has 30534 tokens" in message and "vocab_size 30522" in message and str(folder) in message
    line = serve_refused(folder)
    assert "30534 tokens" in line and "vocab_size 30522" in line


def test_a_tokenizer_smaller_than_a_padded_embedding_table_is_served(tmp_path: Path) -> None:
    """Many real models pad their embedding table past the tokenizer (len(tokenizer) < vocab_size): fine."""
    from transformers import BertConfig, BertModel

    from tests.tiny_models import bert_tokenizer

    tok = bert_tokenizer()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tok) + 64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).eval().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with Engine.from_workflow("bert", tmp_path, overrides=["pooler.params.pooling=mean"]) as engine:
        assert np.isfinite(engine.embed("hello world")).all()


# --- files that block on read ----------------------------------------------------------------------------------

BLOCK_WAIT_S = 120
"""Generous: the refusal comes before any file is opened; this only bounds a start-up that blocks."""


def _refusal_in_child(folder: Path, overrides: tuple[str, ...], workflow: str | None, answer: Connection) -> None:
    try:
        Engine.from_workflow(workflow, folder, overrides=list(overrides)).close()
        answer.send("no error: the folder was served")
    except BaseException as e:  # noqa: BLE001 - the message, or what went wrong instead, goes to the test
        answer.send(f"{type(e).__name__}: {e}")


def refused_without_blocking(folder: Path, blocking: Path, *overrides: str, workflow: str | None = None) -> str:
    """The `ModelLoadError` message `Engine.from_workflow` gives for `folder`, from a forked child process: a load
    that blocks on `blocking` (as it did before, some readers holding the interpreter lock while they wait) is
    killed after `BLOCK_WAIT_S` and the test fails instead of hanging."""
    mine, theirs = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_refusal_in_child,
                                                        args=(folder, overrides, workflow, theirs), daemon=True)
    child.start()
    try:
        if not mine.poll(BLOCK_WAIT_S):
            pytest.fail(f"start-up blocked on {blocking} for {BLOCK_WAIT_S} s instead of refusing it")
        message = mine.recv()
    finally:
        child.kill()
        child.join()
    assert message.startswith("ModelLoadError: ") and "\n" not in message, message
    return message.removeprefix("ModelLoadError: ")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                                  "model.safetensors", "modules.json", "sentence_bert_config.json",
                                  "1_Pooling/config.json"])
def test_a_fifo_in_the_model_folder_is_refused_by_name_not_waited_on(tmp_path: Path, minilm_path: Path,
                                                                     name: str) -> None:
    """`mkfifo model/config.json` made start-up hang for ever (every reader opens files with a blocking open)."""
    folder = minilm_copy(minilm_path, tmp_path / "fifo")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    message = refused_without_blocking(folder, folder / name)
    assert message.startswith(f"{folder / name} is a FIFO (named pipe), not a regular file"), message


def test_a_fifo_among_the_image_processor_files_is_refused(tmp_path: Path, clip_path: Path) -> None:
    folder = tiny_copy(clip_path, tmp_path / "clip-fifo")
    (folder / "preprocessor_config.json").unlink()
    os.mkfifo(folder / "preprocessor_config.json")
    message = refused_without_blocking(folder, folder / "preprocessor_config.json")
    assert f"{folder / 'preprocessor_config.json'} is a FIFO" in message


def test_a_link_to_a_device_and_a_fifo_in_a_tokenizer_path_are_refused(tmp_path: Path, minilm_path: Path) -> None:
    """A link is followed (hub-cache snapshots are links to blobs): one to a device is refused like a FIFO; the
    folder named by tokenizer.params.path is checked as the model folder is."""
    folder = minilm_copy(minilm_path, tmp_path / "device")
    (folder / "vocab.txt").unlink()
    (folder / "vocab.txt").symlink_to("/dev/null")
    assert f"{folder / 'vocab.txt'} is a character device, not a regular file" in refused(folder)
    model = minilm_copy(minilm_path, tmp_path / "model", skip=TOKENIZER_FILES)
    tokenizer = minilm_copy(minilm_path, tmp_path / "tokenizer")
    (tokenizer / "tokenizer.json").unlink()
    os.mkfifo(tokenizer / "tokenizer.json")
    message = refused_without_blocking(model, tokenizer / "tokenizer.json", f"tokenizer.params.path={tokenizer}")
    assert f"{tokenizer / 'tokenizer.json'} is a FIFO" in message


def test_wde_serve_refuses_a_fifo_config_json_in_one_line(tmp_path: Path, minilm_path: Path) -> None:
    folder = minilm_copy(minilm_path, tmp_path / "fifo-config", skip=("config.json",))
    os.mkfifo(folder / "config.json")
    try:
        line = serve_refused(folder)
    finally:  # a start-up that blocked (and was killed by the timeout) must not leave a reader behind
        if (folder / "config.json").is_fifo():
            try:
                os.close(os.open(folder / "config.json", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader: nothing waits
                pass
    assert line == f"Error: {folder / 'config.json'} is a FIFO (named pipe), not a regular file: reading it could" \
                   " block or never end, so the model folder is refused; replace it with the file itself"


# --- a max length the model does not allow ---------------------------------------------------------------------

def test_a_max_length_over_the_models_is_refused_naming_the_models_maximum(minilm_path: Path) -> None:
    """`--set tokenizer.params.max_length=100000` was cut to all-MiniLM-L6-v2's 256 without a word."""
    message = refused(minilm_path, "tokenizer.params.max_length=100000")
    assert f"tokenizer.params.max_length=100000 is more than {minilm_path} allows: at most 256 tokens per input" \
           " (sentence_bert_config.json max_seq_length 256, the tokenizer's model_max_length 512, config.json's" \
           " position table 512)" in message, message
    assert "set tokenizer.params.max_length to 256 or less" in message
    assert "at most 256 tokens" in refused(minilm_path, "tokenizer.params.max_length=257")
    for allowed in (256, 100):
        with Engine.from_workflow(None, minilm_path, tokenizer={"params": {"max_length": allowed}}) as engine:
            assert engine.max_length == allowed


def test_a_workflows_max_length_cap_gives_way_to_a_smaller_model(tmp_path: Path, minilm_path: Path) -> None:
    """What a workflow allows at most (e5_mistral: 4096, its attention window) is a cap, not a demand: a model
    allowing fewer keeps its own limit (the tiny Mistral: 512); a smaller cap applies."""
    from tests import tiny_decoders

    with Engine.from_workflow("e5_mistral", tiny_decoders.build_mistral(tmp_path / "mistral")) as engine:
        assert engine.workflow.components["tokenizer"].params.max_length_cap == 4096
        assert engine.max_length == 512
    with Engine.from_workflow(None, minilm_path, tokenizer={"params": {"max_length_cap": 100}}) as engine:
        assert engine.max_length == 100


def test_wde_serve_refuses_a_max_length_over_the_models_in_one_line(minilm_path: Path) -> None:
    line = serve_refused(minilm_path, "--set", "tokenizer.params.max_length=100000")
    assert line.startswith("Error: ") and "tokenizer.params.max_length=100000 is more than" in line
    assert "at most 256 tokens" in line


# --- weights -------------------------------------------------------------------------------------------------

def test_a_truncated_safetensors_file_is_refused(tmp_path: Path, tiny_bert: Path) -> None:
    folder = tiny_copy(tiny_bert, tmp_path / "truncated")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 2 // 3])  # the header is intact, the data stops short
    message = refused(folder, *MEAN)
    assert f"{weights} is truncated or corrupt" in message
    line = serve_refused(folder, *MEAN)
    assert f"{weights} is truncated or corrupt" in line


def test_a_garbage_safetensors_header_is_refused(tmp_path: Path, tiny_bert: Path) -> None:
    folder = tiny_copy(tiny_bert, tmp_path / "garbage-header")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x07" * 64 + data[64:])
    assert f"{weights} is truncated or corrupt" in refused(folder, *MEAN)


def corrupt_data(weights: Path) -> None:
    """Overwrite every tensor byte with 0xFF (NaN in float32), leaving the safetensors header intact."""
    data = bytearray(weights.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    data[start:] = b"\xff" * (len(data) - start)
    weights.write_bytes(bytes(data))


def test_weights_whose_data_is_garbage_are_refused_by_the_load_probe(tmp_path: Path, tiny_bert: Path) -> None:
    """Before: served, with HTTP 200 and `"embedding": [null, null, ...]`. Now the probe run at load refuses it."""
    folder = tiny_copy(tiny_bert, tmp_path / "nan-weights")
    corrupt_data(folder / "model.safetensors")
    message = refused(folder, *MEAN)
    assert f"model folder {folder} gives NaN or infinite values" in message and "probe" in message
    line = serve_refused(folder, *MEAN)
    assert f"model folder {folder} gives NaN or infinite values" in line
    assert f"model folder {folder} gives NaN" in serve_refused(folder, *MEAN, api_servers=2)
    assert f"model folder {folder} gives NaN" in serve_refused(folder, *MEAN, command="embed")


def test_the_load_probe_covers_a_cross_encoder_head(tmp_path: Path) -> None:
    """Garbage in the head alone (the encoder is fine) is caught too: the probe runs the whole pooler, on a
    (query, document) pair for a workflow that scores pairs."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_heads import build_xlmr_classifier

    folder = build_xlmr_classifier(tmp_path / "reranker", num_labels=1)
    state = load_file(folder / "model.safetensors")
    state["classifier.out_proj.weight"] = torch.full_like(state["classifier.out_proj.weight"], float("nan"))
    save_file(state, folder / "model.safetensors")
    assert f"model folder {folder} gives NaN or infinite values (output 'score')" in refused(folder)


def test_the_load_probe_covers_every_bge_m3_head(tmp_path: Path) -> None:
    """bge-m3's probe asks for dense, sparse and ColBERT outputs: garbage in the ColBERT head alone is caught."""
    from tests.tiny_heads import build_bge_m3

    folder = build_bge_m3(tmp_path / "bge-m3")
    with Engine.from_workflow("bge_m3", folder) as engine:
        assert set(engine.supported_outputs) == {"dense", "sparse", "colbert"}
    torch.save({"weight": torch.full((32, 32), float("nan")), "bias": torch.zeros(32)}, folder / "colbert_linear.pt")
    message = refused(folder, workflow="bge_m3")
    assert f"model folder {folder} gives NaN or infinite values (output 'colbert')" in message
    (folder / "sparse_linear.pt").write_bytes(b"not a pickle")
    assert f"cannot read {folder / 'sparse_linear.pt'} (truncated or corrupt?)" in refused(folder, workflow="bge_m3")


# --- config.json ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    ('{"model_type": "bert", "hidden_size": 384,', "config.json is not valid JSON: Expecting property name"),
    ("[1, 2]", "config.json must hold a JSON object, not list"),
    ('{"model_type": "no-such-model"}', "does not recognize this architecture"),
    ('{"model_type": "bert", "hidden_size": "wide"}', "hidden_size"),
])
def test_a_malformed_config_json_is_refused(tmp_path: Path, minilm_path: Path, config: str, expected: str) -> None:
    folder = minilm_copy(minilm_path, tmp_path / "bad-config", skip=("config.json",))
    (folder / "config.json").write_text(config, encoding="utf-8")
    message = refused(folder)
    assert str(folder / "config.json") in message and expected in message


@pytest.mark.parametrize("workflow, architecture, model, served", [
    ("mpnet", "MPNetModel", "mpnet", "'mpnet'"),
    ("deberta_v2", "DebertaV2Model", "deberta_v2", "'deberta-v2'"),
    ("distilbert", "DistilBertModel", "distilbert", "'distilbert'"),
    ("modernbert", "ModernBertModel", "modernbert", "'modernbert'"),
    ("nomic_bert", "NomicBertModel", "nomic_bert", "'nomic_bert'"),
    ("decoder_features", "LlamaModel", "llama", "'llama' or 'mistral'"),
    ("embeddinggemma", "Gemma3TextModel", "gemma3", "'gemma3_text'"),
])
def test_a_config_of_another_model_type_is_refused_in_the_same_words(tmp_path: Path, minilm_path: Path,
                                                                      workflow: str, architecture: str, model: str,
                                                                      served: str) -> None:
    """A folder whose `architectures` name the family but whose config is another model_type (here BERT's) is
    refused by every model class with one message, before anything reads the config."""
    folder = minilm_copy(minilm_path, tmp_path / "mislabelled", skip=("config.json",))
    config = json.loads((minilm_path / "config.json").read_text(encoding="utf-8"))
    (folder / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}), encoding="utf-8")
    message = refused(folder, workflow=workflow)
    assert f"model {model!r} serves config model_type {served}; {folder} is 'bert'" in message, message


@pytest.mark.parametrize("side_file", ["sentence_bert_config.json", "modules.json", "1_Pooling/config.json"])
def test_a_malformed_sentence_transformers_file_is_refused(tmp_path: Path, minilm_path: Path, side_file: str) -> None:
    folder = minilm_copy(minilm_path, tmp_path / "bad-side-file")
    (folder / side_file).write_text('{"max_seq_length": 256,', encoding="utf-8")
    assert f"{folder / side_file} is not valid JSON" in refused(folder)


def test_wde_serve_refuses_a_malformed_config_json_in_one_line(tmp_path: Path, minilm_path: Path) -> None:
    folder = minilm_copy(minilm_path, tmp_path / "bad-config", skip=("config.json",))
    (folder / "config.json").write_text('{"model_type": "bert",\n "hidden_size": 384,', encoding="utf-8")
    line = serve_refused(folder)
    assert f"{folder / 'config.json'} is not valid JSON" in line
    assert f"{folder / 'config.json'} is not valid JSON" in serve_refused(folder, api_servers=2)
    (folder / "config.json").write_text('{"model_type": "no-such-model"}', encoding="utf-8")
    assert f"cannot read {folder / 'config.json'}" in serve_refused(folder)


# --- serve time: a non-finite output fails its request alone --------------------------------------------------

class GateParams(FCFSParams):
    gate: int = Field(1, ge=1, description="schedule nothing until this many requests wait")


class GatedScheduler(FCFSScheduler):
    """FCFS, except that the first batch waits until `gate` requests are queued, so they are batched together
    whatever the timing; records the request ids of every batch."""

    kind = "scheduler"
    name = "gated_fcfs"
    Params = GateParams

    def __init__(self, params: GateParams, ctx: object) -> None:
        super().__init__(params, ctx)  # type: ignore[arg-type]
        self.batches: list[list[str]] = []

    def schedule(self) -> SchedulerOutput:
        if not self.batches and self.num_waiting < self.params.gate:
            time.sleep(0.001)
            return SchedulerOutput()
        out = super().schedule()
        if out.scheduled:
            self.batches.append([s.request.request_id for s in out.scheduled])
        return out


NAN_TEXT = "the nan word makes this row NaN"
GOOD = ["A man is eating food.", "Berlin has 3.5 million people."]


def test_a_nan_row_fails_its_request_and_spares_the_batch(minilm_path: Path, minilm_engine: Engine,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    overrides = ["pooler.name=nan_sentence", "scheduler.name=gated_fcfs", "scheduler.params.gate=3"]
    with Engine.from_workflow("bert", minilm_path, overrides=overrides) as engine, \
            caplog.at_level(logging.ERROR, logger="wde"):
        outs = engine.encode([GOOD[0], NAN_TEXT, GOOD[1]], raise_on_error=False)
        assert len(engine.scheduler.batches) == 1 and len(engine.scheduler.batches[0]) == 3  # one batch
    bad = outs[1]
    assert not bad.ok and bad.outputs == {} and bad.error.kind == "internal"
    assert bad.request_id in str(bad.error) and "NaN" not in str(bad.error)  # the log has the details
    assert any(bad.request_id in r.getMessage() and "NaN" in r.getMessage() for r in caplog.records)
    got = np.stack([outs[0].outputs["dense"], outs[2].outputs["dense"]])
    assert np.abs(got - minilm_engine.embed(GOOD)).max() <= 1e-5


def test_a_nan_output_is_a_500_naming_the_request_never_a_200_with_nulls(minilm_path: Path, minilm_engine: Engine,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Three HTTP requests in one engine batch; the one whose vector is NaN gets a 500 naming its request id,
    the two others their right vectors. Before: a 200 with `"embedding": [null, null, ...]`."""
    overrides = ["pooler.name=nan_sentence", "scheduler.name=gated_fcfs", "scheduler.params.gate=3"]

    async def post(url: str, text: str, rid: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            return await client.post(f"{url}/v1/embeddings", json={"input": text}, headers={"x-request-id": rid})

    async def scenario(url: str) -> list[httpx.Response]:
        return list(await asyncio.gather(post(url, GOOD[0], "good-0"), post(url, NAN_TEXT, "nan-request-1"),
                                         post(url, GOOD[1], "good-1")))

    with Engine.from_workflow("bert", minilm_path, overrides=overrides) as engine, serve(engine) as (url, _), \
            caplog.at_level(logging.ERROR, logger="wde"):
        first, bad, second = asyncio.run(scenario(url))
        assert len(engine.scheduler.batches[0]) == 3  # the three were batched together
    assert bad.status_code == 500, bad.text
    assert "nan-request-1" in bad.json()["error"]["message"] and "embedding" not in bad.text
    assert bad.headers["x-request-id"] == "nan-request-1"
    assert any("nan-request-1" in r.getMessage() and "NaN" in r.getMessage() for r in caplog.records)
    assert first.status_code == 200 and second.status_code == 200
    got = np.array([first.json()["data"][0]["embedding"], second.json()["data"][0]["embedding"]])
    assert np.abs(got - minilm_engine.embed(GOOD)).max() <= 1e-5


def test_nonfinite_rows_finds_each_culprit_in_rows_and_ragged_outputs() -> None:
    rows = torch.zeros(4, 3)
    rows[2, 1] = float("inf")
    flat = torch.zeros(9, 2)  # request i owns tokens bounds[i]:bounds[i+1]
    flat[5, 0] = float("nan")  # a token of request 3
    bounds = [0, 2, 3, 5, 9]
    pooled = Pooled(rows={"dense": rows, "score": torch.tensor([0.1, float("nan"), 0.3, 0.4])},
                    ragged={"colbert": (flat, bounds)})
    assert nonfinite_rows(pooled) == {1: "score", 2: "dense", 3: "colbert"}
    assert nonfinite_rows(Pooled(rows={"dense": torch.full((2, 2), 3e38)})) == {}  # a sum overflows: no culprit
    kept = select_rows(pooled, [0, 3])
    assert kept.rows["dense"].shape == (2, 3) and kept.ragged["colbert"][1] == [0, 2, 6]
    assert torch.allclose(kept.ragged["colbert"][0], torch.cat([flat[0:2], flat[5:9]]), equal_nan=True)
