"""The `wde` command: serve, validate, inspect, plugins, embed, kernels."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from wde.errors import Issue, Location, ModelLoadError, RegistryError, WorkflowError, shown


def _workflow_files(paths: tuple[str, ...]) -> list[Path | str]:
    """What each argument of `wde validate` names: a folder's `*.yaml`/`*.yml`, a file (`Path`s), or, for an
    argument that is no file or folder on disk, the argument itself (a `str`: a registered workflow name, or a
    path that does not exist)."""
    files: list[Path | str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml")))
        elif path.exists():
            files.append(path)
        else:
            files.append(p)
    return files


def _missing(arg: str) -> str | None:
    """Why `arg`, no file or folder on disk, cannot be validated; None for a registered workflow name."""
    from wde.registry import get_registry

    if arg.endswith((".yaml", ".yml")) or any(sep in arg for sep in {"/", os.sep, os.altsep} - {None}):
        return "no such file or folder"
    try:
        get_registry().workflow_path(arg)
    except RegistryError as e:
        return f"no such file or folder, nor a registered workflow: {e}"
    return None


def int8_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--quantization`, `--min-cosine` and `--calibration`: shortcuts for the model params of the same names."""
    fn = click.option("--calibration", default=None, metavar="FILE",
                      type=click.Path(exists=True, dir_okay=False, resolve_path=True),
                      help="with --quantization int8: the fidelity gate's probe texts, one a line (default: a"
                           " built-in set; model.params.calibration)")(fn)
    fn = click.option("--min-cosine", default=None, type=click.FloatRange(0, 1, min_open=True), metavar="COSINE",
                      help="with --quantization int8: refuse to start when the int8 model's min cosine to float32"
                           " on the probe texts is below this (default 0.99; model.params.min_cosine)")(fn)
    return click.option("--quantization", default=None, type=click.Choice(["none", "int8"]),
                        help="int8: the model's block linear layers as int8 GEMMs on CPUs with VNNI or AVX2, behind"
                             " a fidelity gate at load (model.params.quantization; docs/int8.md)")(fn)


def int8_overrides(quantization: str | None, min_cosine: float | None, calibration: str | None) -> list[str]:
    """The int8 options as `--set` overrides of the model's params."""
    given = {"quantization": quantization, "min_cosine": min_cosine, "calibration": calibration}
    return [f"model.params.{k}={v}" for k, v in given.items() if v is not None]


@click.group()
@click.version_option(package_name="wde")
def main() -> None:
    """WDE, the Workflow Defined Engine: prefill-only embedding, reranking and classification models."""


@main.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", help="json for machines")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="apply overrides before validating")
def validate(paths: tuple[str, ...], fmt: str, overrides: tuple[str, ...]) -> None:
    """Validate workflow files or folders of them; exit 1 on any error."""
    from wde.workflow import load_workflow

    files = _workflow_files(paths)
    results = []
    for f in files:
        if isinstance(f, str) and (why := _missing(f)) is not None:
            results.append({"file": f, "ok": False, "issues": [Issue(Location(f), "", why).to_dict()]})
            continue
        try:
            wf = load_workflow(f, overrides)
            results.append({"file": str(f), "ok": True, "name": wf.name, "issues": []})
        except WorkflowError as e:
            results.append({"file": str(f), "ok": False, "issues": [i.to_dict() for i in e.issues]})
        except RegistryError as e:
            results.append({"file": str(f), "ok": False, "issues": [Issue(Location(str(f)), "", str(e)).to_dict()]})
    failed = [r for r in results if not r["ok"]]
    if fmt == "json":
        click.echo(json.dumps({"ok": not failed, "files": results}, indent=2))
    else:
        for r in results:
            if r["ok"]:
                click.echo(f"ok    {r['file']} ({r['name']})")
            for i in r["issues"]:
                loc = f"{i['file']}:{i['line']}:{i['column']}" if i["line"] else i["file"]
                click.echo(f"error {loc}: {i['path'] + ': ' if i['path'] else ''}{i['message']}", err=True)
        click.echo(f"{len(results) - len(failed)} valid, {len(failed)} invalid")
    if failed or not results:
        sys.exit(1)


@main.command()
@click.argument("workflow")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a workflow value before printing, e.g. scheduler.params.max_num_requests=64 (repeatable)")
def inspect(workflow: str, overrides: tuple[str, ...]) -> None:
    """Print the resolved workflow graph with every component's effective params (YAML)."""
    import yaml

    from wde.workflow import load_workflow

    try:
        wf = load_workflow(workflow, overrides)
    except WorkflowError as e:
        raise click.ClickException(str(e)) from None
    click.echo(yaml.safe_dump(wf.to_dict(), sort_keys=False))


@main.command()
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json for machines")
def plugins(fmt: str) -> None:
    """List loaded plugins and what each registers."""
    from wde.registry import get_registry

    reg = get_registry()
    by_plugin: dict[str, dict[str, list[str]]] = {}
    for kind, entries in reg.components.items():
        for name, entry in entries.items():
            by_plugin.setdefault(entry.plugin, {}).setdefault("components", []).append(f"{kind}:{name}")
    for name, entry in reg.workflows.items():
        by_plugin.setdefault(entry.plugin, {}).setdefault("workflows", []).append(name)
    for arch, entry in reg.architectures.items():
        by_plugin.setdefault(entry.plugin, {}).setdefault("architectures", []).append(f"{arch}->{entry.value}")
    if fmt == "json":
        click.echo(json.dumps(by_plugin, indent=2, sort_keys=True))
        return
    for plugin, what in sorted(by_plugin.items()):
        click.echo(plugin)
        for key, items in sorted(what.items()):
            click.echo(f"  {key}: {', '.join(sorted(items))}")


@main.group()
def kernels() -> None:
    """WDE's C++ CPU kernels: build them before a first start, or see which are built.

    A start on CPU compiles the kernels its model calls, once per host and Python environment (about 30 s on
    2 cores); `wde kernels build` does that ahead of time, e.g. as a container image's build step on the CPU type
    it will run on (the build is for this CPU's instruction set: another CPU builds its own)."""


@kernels.command("build")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json for machines")
def kernels_build(fmt: str) -> None:
    """Compile every kernel for this host and Python environment (those built already are only loaded)."""
    import dataclasses

    from wde.kernels.cpp_build import build_kernels, kernel_states

    todo = [s.name for s in kernel_states() if not s.built and not s.switched_off]
    if todo:
        click.echo(f"compiling {', '.join(todo)} for this CPU (once per host and Python environment)...", err=True)
    done = build_kernels()
    if fmt == "json":
        click.echo(json.dumps([{**dataclasses.asdict(b.state), "seconds": b.seconds, "error": b.error} for b in done],
                              indent=2))
    else:
        for b in done:
            s = b.state
            if s.switched_off:
                what = f"switched off ({s.switch}=0)"
            elif b.error:
                what = "not built"
            else:
                what = "already built" if b.seconds is None else f"built in {b.seconds:.0f} s"
            click.echo(f"{s.name} ({s.source}): {what}: {s.folder}")
    failed = [b for b in done if b.error]
    for b in failed:
        click.echo(f"wde kernels build: {b.state.name} not built: {b.error}", err=True)
    if failed:
        sys.exit(1)


@kernels.command("status")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json for machines")
@click.option("--check", is_flag=True, default=False, help="exit 1 when a kernel that is not switched off is not built")
def kernels_status(fmt: str, check: bool) -> None:
    """Which kernels this host and Python environment have built (reads the cache, compiles nothing)."""
    import dataclasses

    from wde.kernels.cpp_build import kernel_states

    states = kernel_states()
    if fmt == "json":
        click.echo(json.dumps([dataclasses.asdict(s) for s in states], indent=2))
    else:
        for s in states:
            what = f"switched off ({s.switch}=0)" if s.switched_off else "built" if s.built else "not built"
            click.echo(f"{s.name} ({s.source}): {what}: {s.folder}")
        if states:
            click.echo(f"compiler {states[0].compiler}, {states[0].isa or 'no instruction-set flags'}")
    missing = [s.name for s in states if not s.built and not s.switched_off]
    if check and missing:
        click.echo(f"wde kernels status: not built: {', '.join(missing)} (run `wde kernels build`)", err=True)
        sys.exit(1)


def _options(values: tuple[str, ...]) -> dict[str, str]:
    """`--option NAME=VALUE` values as a mapping (the engine refuses a name or value its workflow does not take)."""
    options: dict[str, str] = {}
    for value in values:
        name, sep, setting = value.partition("=")
        if not sep or not name.strip() or not setting.strip():
            raise click.BadParameter(f"must be NAME=VALUE, got {value!r}", param_hint="--option")
        options[name.strip()] = setting.strip()
    return options


def _split_list(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


@main.command()
@click.option("--input", "inputs", required=True, multiple=True, metavar="PATH[,PATH…]",
              help=".jsonl (strings, or objects with --text-field / --image-field), .parquet (a --text-field and/or"
                   " --image-field column) or .txt (one text a line; with --image-field one image path a line);"
                   " repeat or comma-separate for several files")
@click.option("--output", "output", required=True, metavar="PATH",
              help="out.parquet (a directory of part-NNNNNN.parquet shards: id + embedding columns) or out.npy"
                   " (the matrix only)")
@click.option("--text-field", default=None,
              help="jsonl key / parquet column with the text (default: text, unless --image-field is given)")
@click.option("--image-field", default=None, metavar="NAME",
              help="jsonl key / parquet column with the image: a local file path (relative to the input file's"
                   " folder) or a data:image/... URI, or parquet image bytes; clip / siglip workflows. With"
                   " --text-field too, each record has one or the other (docs/images.md)")
@click.option("--id-field", default=None, help="jsonl key / parquet column with the id (default: FILE:LINE)")
@click.option("--outputs", "outputs", default="dense", show_default=True, metavar="dense[,sparse,colbert]",
              help="what to write; sparse and colbert need a workflow that makes them (bge_m3)")
@click.option("--workflow", "-w", default=None, help="workflow file or name (default: chosen from the model)")
@click.option("--model", "-m", default=None, help="model folder or cached hub id (default: all-MiniLM-L6-v2)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a workflow value, e.g. scheduler.params.max_num_batched_tokens=8192 (repeatable); part"
                   " of the job, so --resume needs the same ones")
@click.option("--truncate/--no-truncate", default=False, help="truncate over-long inputs instead of failing")
@click.option("--long-inputs", default=None, type=click.Choice(["refuse", "truncate", "chunk"]),
              help="an input longer than the model: refuse it (the default), truncate it (as --truncate), or embed"
                   " it in chunks averaged by token count (dense embeddings)")
@click.option("--max-embed-len", default=None, type=click.IntRange(min=1), metavar="TOKENS",
              help="with --long-inputs chunk: the most tokens one input may have (default: no bound)")
@click.option("--prompt-name", default=None, metavar="NAME",
              help="prefix every text with this named prompt, from the model's config_sentence_transformers.json"
                   " or the workflow's input_processor.params.prompts (e.g. query for bge models)")
@click.option("--option", "options", multiple=True, metavar="NAME=VALUE",
              help="a per-request option of the workflow for every record, e.g. task=query for a late-interaction"
                   " (multi_vector) model's queries (repeatable; an option the workflow does not take is refused,"
                   " naming those it takes)")
@click.option("--skip-blank", is_flag=True, default=False,
              help=".txt: skip blank lines (default: a blank line is an error, so rows line up with lines)")
@click.option("--shard-size", default=4096, show_default=True, type=click.IntRange(min=1),
              help="records per output shard, the unit of --resume")
@click.option("--max-line-bytes", default=16 * 1024 * 1024, show_default=True, type=click.IntRange(min=1),
              help=".jsonl/.txt: refuse a longer line, naming FILE:LINE, without reading it whole")
@click.option("--resume", is_flag=True, default=False,
              help="finish an interrupted run from OUTPUT.partial, keeping its shards that still match their"
                   " checksums and input; a complete OUTPUT is left as it is")
@click.option("--overwrite", is_flag=True, default=False,
              help="start over, replacing an existing output (and OUTPUT.partial); the old output stays readable"
                   " until the new one is complete")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="worker processes, each with its own engine (one per GPU, or CPU workers sharing the cores)")
@click.option("--devices", default=None, metavar="DEV[,DEV…]",
              help="one worker per device, e.g. cuda:0,cuda:1 (default: the workflow's device)")
@click.option("--ray", "ray_address", default=None, is_flag=False, flag_value="local", metavar="[ADDRESS]",
              help="run as a Ray Data job: on the cluster at ADDRESS, or a local one for a bare --ray (wde[ray])")
@click.option("--progress/--no-progress", default=None, help="progress bar on stderr (default: when it is a terminal)")
@click.option("--trust-remote-code", is_flag=True, default=False,
              help="allow the model folder's own Python code (auto_map); off unless you trust the model")
@int8_options
def embed(inputs: tuple[str, ...], output: str, text_field: str | None, image_field: str | None,
          id_field: str | None, outputs: str,
          workflow: str | None, model: str | None, overrides: tuple[str, ...], truncate: bool,
          long_inputs: str | None, max_embed_len: int | None, prompt_name: str | None, options: tuple[str, ...],
          skip_blank: bool,
          shard_size: int, max_line_bytes: int, resume: bool,
          overwrite: bool, workers: int, devices: str | None, ray_address: str | None, progress: bool | None,
          trust_remote_code: bool, quantization: str | None, min_cosine: float | None,
          calibration: str | None) -> None:
    """Embed a corpus into parquet (ids + vectors) or .npy, streaming, resumable, on one or many devices.

    Errors name the file and 1-based line. The run writes into OUTPUT.partial and renames it to OUTPUT only when
    complete. SIGINT / SIGTERM drop the shard in flight, keep the finished ones and exit 130 / 143; a killed or
    interrupted run continues with --resume (docs/scaling.md).
    """
    from pydantic import ValidationError

    from wde.corpus import CorpusError, EmbedJob, run_embed
    from wde.corpus.signals import Interrupted, SignalGuard
    from wde.errors import RequestError

    if truncate and long_inputs not in (None, "truncate"):
        raise click.BadParameter(f"--truncate contradicts --long-inputs {long_inputs}; give one",
                                 param_hint="--long-inputs")
    if max_embed_len is not None and long_inputs != "chunk":
        raise click.BadParameter("bounds chunked processing: give it with --long-inputs chunk",
                                 param_hint="--max-embed-len")
    try:
        if text_field is None and image_field is None:
            text_field = "text"
        job = EmbedJob(inputs=tuple(_split_list(inputs)), output=output, text_field=text_field,
                       image_field=image_field, id_field=id_field,
                       outputs=tuple(_split_list((outputs,))), truncate=truncate or long_inputs == "truncate",
                       chunk=long_inputs == "chunk", max_embed_len=max_embed_len, prompt_name=prompt_name,
                       options=_options(options),
                       skip_blank=skip_blank, shard_size=shard_size, max_line_bytes=max_line_bytes,
                       workflow=workflow, model=model,
                       overrides=tuple(overrides) + tuple(int8_overrides(quantization, min_cosine, calibration)),
                       trust_remote_code=trust_remote_code)
    except ValidationError as e:
        first = e.errors()[0]
        flag = "--" + str(first["loc"][0]).replace("_", "-") if first["loc"] else "wde embed"
        raise click.BadParameter(f"{first['msg']} (got {shown(first.get('input'))})", param_hint=flag) from None
    device_list = _split_list((devices,)) if devices else None
    try:
        with SignalGuard():
            if ray_address is not None:
                from wde.corpus.ray_job import run_ray_embed

                try:
                    rows, dim = run_ray_embed(job, ray_address, workers=workers, overwrite=overwrite, resume=resume)
                except (Interrupted, KeyboardInterrupt) as e:
                    signum = e.signum if isinstance(e, Interrupted) else 2
                    raise Interrupted(signum, "interrupted; a --ray run does not resume: re-run with --overwrite")
                click.echo(f"wrote {_written(rows, dim)} to {output}")
                return
            summary = run_embed(job, workers=workers, devices=device_list, resume=resume, overwrite=overwrite,
                                progress=sys.stderr.isatty() if progress is None else progress,
                                notice=lambda message: click.echo(message, err=True))
    except (CorpusError, WorkflowError, ModelLoadError, RegistryError, RequestError) as e:
        raise click.ClickException(str(e)) from None
    except Interrupted as e:
        click.echo(str(e), err=True)
        sys.exit(e.exit_code)
    if summary.already_complete:
        click.echo(f"nothing to do: {output} is complete ({_written(summary.rows, summary.dim)})")
        return
    resumed = f", {summary.shards_skipped} shard(s) kept from an earlier run" if summary.shards_skipped else ""
    click.echo(f"wrote {_written(summary.rows, summary.dim)} to {output}"
               f" ({summary.tokens:,} tokens in {summary.seconds:.1f}s{resumed})")


def image_limit_overrides(**limits: float | None) -> list[str]:
    """The image limits given as `wde serve` options, as the `--set` overrides of the input processor's params
    they are (wde/components/image_limits.py); a text-only workflow refuses them at start-up by name. A value
    below its minimum is a `LimitError` (one line, exit 1), as the serve options ServerConfig checks are."""
    from wde.server.config import LimitError

    for name, value in limits.items():
        if value is not None and value < 1:
            bound = "a ratio, at least 1" if name == "max_image_aspect_ratio" else "an integer, at least 1"
            raise LimitError(name, value, bound, "it would refuse every image")
    return [f"input_processor.params.{name}={value}" for name, value in limits.items() if value is not None]


@main.command()
@click.option("--workflow", "-w", "workflows", multiple=True,
              help="workflow file or name (default: chosen from the model); with several --model, one per --model"
                   " in the same order, or none")
@click.option("--model", "-m", "models", multiple=True,
              help="model folder or cached hub id (default: all-MiniLM-L6-v2); repeat to serve several models, each"
                   " its own engine, requests choosing one by its name in `model`")
@click.option("--config", "serve_config", default=None, type=click.Path(dir_okay=False), metavar="SERVE.YAML",
              help="a YAML list of the models to serve, each with its workflow, names and overrides (instead of"
                   " --model, --workflow and --served-model-name; docs/operations.md)")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (loopback unless told otherwise)")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="TCP port to listen on")
@click.option("--grpc-port", default=None, type=click.IntRange(0, 65535), metavar="PORT",
              help="also serve TEI's gRPC API (tei.proto) on this port of --host (needs: pip install 'wde[grpc]')")
@click.option("--api-key", default=None, envvar="WDE_API_KEY", help="require 'Authorization: Bearer KEY'")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="name(s) the API answers to, comma separated; the first is reported (default: the model id or"
                   " folder name; its last path component, e.g. all-MiniLM-L6-v2, is always accepted); with several"
                   " --model, one per --model in the same order, or none")
@click.option("--set", "overrides", multiple=True, metavar="[NAME:]KEY=VALUE",
              help="override a workflow value, e.g. scheduler.params.max_num_batched_tokens=8192 (repeatable): of"
                   " every model, or with NAME: of the model called NAME only")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=PATH",
              help="serve a PEFT LoRA adapter folder as model NAME (repeatable): requests naming it in `model` run"
                   " with it, mixed in batches with the base model's (docs/adapters.md)")
@click.option("--max-client-batch-size", default=2048, show_default=True, type=int,
              help="most inputs one request may carry (2048 is OpenAI's own limit); more is answered 422")
@click.option("--max-concurrent-requests", default=512, show_default=True, type=int,
              help="HTTP requests inside the engine at once; one more is answered 429 at once, not queued")
@click.option("--shared-token-budget", default=None, type=int, metavar="N",
              help="tokens the forwards of all served models may hold at once, in one process (--api-servers 0);"
                   " several models share one pool anyway, sized by the largest model's token budget")
@click.option("--payload-limit", default=None, type=int, metavar="BYTES",
              help="largest request body in bytes; larger ones are answered 413 (default: a full batch of"
                   " max-length inputs fits, batch x (max length x 16 + 64) + 64 KiB, at least 2,000,000)")
@click.option("--trust-remote-code", is_flag=True, default=False,
              help="allow the model folder's own Python code (auto_map); off unless you trust the model")
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="log one line per request")
@click.option("--quantization-ranges", default=None, type=click.Path(exists=True, dir_okay=False),
              help=".npy (2, dim) per-dimension min/max for int8/uint8 embeddings (docs/http_api.md)")
@click.option("--api-servers", default="auto", show_default=True, metavar="N|auto",
              help="API-server processes in front of an engine core process (0: one process; auto: 0 on a"
                   " CPU-only host, else a quarter of the cores, 1 to 8)")
@click.option("--token-id-inputs/--no-token-id-inputs", default=True, show_default=True,
              help="accept inputs given as token ids; --no-token-id-inputs refuses them (422), for clients that send"
                   " another tokenizer's ids (langchain-openai's OpenAIEmbeddings by default)")
@click.option("--long-inputs", default="refuse", show_default=True, type=click.Choice(["refuse", "truncate", "chunk"]),
              help="an input longer than the model, where its request does not say: refuse it (422), truncate it,"
                   " or embed it in chunks averaged by token count (vLLM's chunked processing; dense embeddings)")
@click.option("--max-embed-len", default=None, type=int, metavar="TOKENS",
              help="with --long-inputs chunk: the most tokens one input may have (more is 422; default 16 times the"
                   " model's limit)")
@click.option("--request-timeout", default=300.0, show_default=True, type=float, metavar="SECONDS",
              help="abort a request the engine has not answered within this long (queued or running) and answer 503"
                   " with Retry-After; 0: no deadline")
@click.option("--stall-timeout", default=15.0, show_default=True, type=float, metavar="SECONDS",
              help="/health answers 503 while the engine has not finished a step for this long (hung, frozen);"
                   " 0: never")
@click.option("--header-timeout", default=10.0, show_default=True, type=float, metavar="SECONDS",
              help="answer 408 and close a connection that has not sent a request's headers within this long;"
                   " 0: never")
@click.option("--body-timeout", default=60.0, show_default=True, type=float, metavar="SECONDS",
              help="answer 408 and close the connection when a request body has not arrived this long after its"
                   " headers; 0: never")
@click.option("--allowed-origins", multiple=True, metavar="ORIGIN[,ORIGIN…]",
              help="web origins (https://app.example.com) whose pages may call the server from a browser, or *;"
                   " requests from any other web page (an Origin header) are answered 403 (default: none)")
@click.option("--allow-image-fetch", multiple=True, metavar="HOST[,HOST…]",
              help="hosts whose http(s) image URLs an image-text model (CLIP, SigLIP) may fetch (any port; streamed"
                   " within max_image_bytes, no redirect elsewhere); by default no URL is fetched: images come as"
                   " data:image/...;base64 URIs (docs/images.md)")
@click.option("--image-fetch-timeout", default=10.0, show_default=True, type=float,
              metavar="SECONDS", help="the most one image fetch (--allow-image-fetch) may take in all; then it is 400")
@click.option("--image-fetch-max-urls", default=64, show_default=True, type=int, metavar="N",
              help="the most image URLs one request may name; more are refused (422) before any is fetched")
@click.option("--image-fetch-max-bytes", default=32 * 2**20, show_default=True, type=int, metavar="BYTES",
              help="the most bytes the image fetches of one request may bring in together; past them it is 413")
@click.option("--image-fetch-deadline", default=30.0, show_default=True, type=float, metavar="SECONDS",
              help="the most all the image fetches of one request may take together; then they stop and it is 400")
@click.option("--image-fetch-connections", default=32, show_default=True, type=int, metavar="N",
              help="connections for fetching images the server holds at once, all requests together")
@click.option("--max-image-pixels", default=None, type=int, metavar="PIXELS",
              help="image-text models: refuse an image whose header says width x height is over this (413) before"
                   " decoding it (default 33,554,432; input_processor.params.max_image_pixels)")
@click.option("--max-image-aspect-ratio", default=None, type=float, metavar="RATIO",
              help="image-text models: refuse an image whose longer side is over RATIO times its shorter one (413)"
                   " before decoding it (default 200; input_processor.params.max_image_aspect_ratio)")
@click.option("--max-request-image-pixels", default=None, type=int, metavar="PIXELS",
              help="image-text models: refuse a request whose images add up to more pixels than this (413) before"
                   " decoding any (default 268,435,456; input_processor.params.max_request_image_pixels)")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              help="log level; debug also prints the traceback of a start-up failure after its one line")
@int8_options
def serve(workflows: tuple[str, ...], models: tuple[str, ...], serve_config: str | None, host: str, port: int,
          grpc_port: int | None, api_key: str | None,
          served_model_names: tuple[str, ...], overrides: tuple[str, ...], lora_modules: tuple[str, ...],
          max_client_batch_size: int,
          max_concurrent_requests: int, shared_token_budget: int | None, payload_limit: int | None,
          trust_remote_code: bool, access_log: bool,
          quantization_ranges: str | None, api_servers: str, token_id_inputs: bool, long_inputs: str,
          max_embed_len: int | None, request_timeout: float,
          stall_timeout: float, header_timeout: float, body_timeout: float, allowed_origins: tuple[str, ...],
          allow_image_fetch: tuple[str, ...], image_fetch_timeout: float, image_fetch_max_urls: int,
          image_fetch_max_bytes: int, image_fetch_deadline: float, image_fetch_connections: int,
          max_image_pixels: int | None,
          max_image_aspect_ratio: float | None, max_request_image_pixels: int | None, log_level: str,
          quantization: str | None, min_cosine: float | None, calibration: str | None) -> None:
    """Serve a workflow over HTTP (OpenAI, rerank and TEI-compatible routes; images too for CLIP and SigLIP), and
    TEI's gRPC API with --grpc-port.

    Exits 0 after SIGINT/SIGTERM (requests in flight are finished first), 1 when it cannot start (one line naming
    the cause: port in use, bad host, broken model folder...; nothing is loaded when the port is taken), and 3 when
    the engine loop failed repeatedly, so a process supervisor restarts the server (docs/operations.md).
    """
    from wde.model_source import ModelSource
    from wde.restarts import EngineFailed
    from wde.server import ServerConfig
    from wde.server.config import LimitError
    from wde.server.model_config import from_options, load_serve_config, with_overrides
    from wde.server.startup import StartupError

    try:
        every = list(overrides) + image_limit_overrides(
            max_image_pixels=max_image_pixels, max_image_aspect_ratio=max_image_aspect_ratio,
            max_request_image_pixels=max_request_image_pixels) + int8_overrides(quantization, min_cosine, calibration)
        if serve_config is not None:
            given = [o for o, v in (("--model", models), ("--workflow", workflows),
                                    ("--served-model-name", served_model_names)) if v]
            if given:
                raise StartupError(f"--config lists the models to serve; {', '.join(given)} cannot be given beside"
                                   " it (put them in the config's entries)")
            served = with_overrides(load_serve_config(serve_config), every)
        else:
            served = from_options(models, workflows, served_model_names, every)
        if lora_modules:
            from wde.server.lora_routes import lora_module_overrides

            served = with_overrides(served, lora_module_overrides(lora_modules, len(served)))
        config = ServerConfig(models=served, host=host, port=port, grpc_port=grpc_port,
                              api_key=api_key,
                              max_client_batch_size=max_client_batch_size,
                              max_concurrent_requests=max_concurrent_requests, payload_limit=payload_limit,
                              shared_token_budget=shared_token_budget,
                              trust_remote_code=trust_remote_code, access_log=access_log,
                              quantization_ranges=quantization_ranges, token_id_inputs=token_id_inputs,
                              long_inputs=long_inputs, max_embed_len=max_embed_len,  # type: ignore[arg-type]
                              request_timeout=request_timeout, stall_timeout=stall_timeout,
                              header_timeout=header_timeout, body_timeout=body_timeout,
                              allowed_origins=tuple(_split_list(allowed_origins)),
                              allow_image_fetch=tuple(_split_list(allow_image_fetch)),
                              image_fetch_timeout=image_fetch_timeout, image_fetch_max_urls=image_fetch_max_urls,
                              image_fetch_max_bytes=image_fetch_max_bytes, image_fetch_deadline=image_fetch_deadline,
                              image_fetch_connections=image_fetch_connections, log_level=log_level)
        for served_model in config.served_models():  # a model that is not there fails before torch is imported
            ModelSource.from_model(served_model.model, trust_remote_code=trust_remote_code)
    except ModelLoadError as e:
        raise click.ClickException(str(e)) from None
    except LimitError as e:  # a start-up refusal like any other: one line naming the option, exit 1
        raise click.ClickException(e.message(e.option)) from None
    except StartupError as e:  # mismatched --model/--workflow/--served-model-name, a bad --config: one line
        raise click.ClickException(str(e)) from None
    except ValueError as e:
        hint = ("--api-key" if "api_key" in str(e) else "--max-embed-len" if "max_embed_len" in str(e)
                else "--quantization-ranges" if "quantization" in str(e) else "--allowed-origins" if "origin" in str(e)
                else "--allow-image-fetch" if "image_fetch" in str(e) else None)
        raise click.BadParameter(str(e), param_hint=hint) from None
    if api_servers != "auto" and not (api_servers.isdigit() and int(api_servers) <= 64):
        raise click.BadParameter(f"must be 'auto' or a number of processes from 0 to 64, got {api_servers!r}",
                                 param_hint="--api-servers")
    try:
        if api_servers == "auto" or int(api_servers) > 0:
            from wde.server.processes import default_api_servers, run_split_server

            count = default_api_servers() if api_servers == "auto" else int(api_servers)
            if count > 0:
                if shared_token_budget is not None:
                    raise StartupError("--shared-token-budget shares tokens between the engines of one process,"
                                       f" but --api-servers {api_servers} runs each model's engine core in a process"
                                       " of its own; give --api-servers 0")
                sys.exit(run_split_server(config, count))
        from wde.server.app import run_server  # torch, the engine, FastAPI: only once the options hold

        run_server(config)
    except EngineFailed as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(3)
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - every start-up failure is one line; the traceback with --log-level debug
        if log_level == "debug":
            import traceback

            traceback.print_exception(e)
        known = isinstance(e, (WorkflowError, ModelLoadError, RegistryError, StartupError))
        raise click.ClickException(str(e) if known else f"{type(e).__name__}: {e}") from None


def _written(rows: int, dim: int) -> str:
    """What `wde embed` wrote: rows x width for a fixed-width `embedding` column, else rows (a ragged output such
    as `colbert`: a list of token vectors per row)."""
    return f"{rows} x {dim} embeddings" if dim else f"{rows} rows"


def run() -> None:
    """The `wde` command: `wde serve` and `wde embed` start again with tcmalloc preloaded where the host has it
    (`wde.allocator`), then the click group."""
    from wde.allocator import restart_with_tcmalloc

    restart_with_tcmalloc()
    main()


if __name__ == "__main__":
    run()
