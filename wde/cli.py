"""The `wde` command: serve, validate, inspect, plugins, embed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from wde.errors import Issue, Location, ModelLoadError, RegistryError, WorkflowError


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
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
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
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text")
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


def _split_list(values: tuple[str, ...]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


@main.command()
@click.option("--input", "inputs", required=True, multiple=True, metavar="PATH[,PATH…]",
              help=".jsonl (strings, or objects with --text-field), .parquet (a --text-field column) or .txt (one"
                   " text a line); repeat or comma-separate for several files")
@click.option("--output", "output", required=True, metavar="PATH",
              help="out.parquet (a directory of part-NNNNNN.parquet shards: id + embedding columns) or out.npy"
                   " (the matrix only)")
@click.option("--text-field", default="text", show_default=True, help="jsonl key / parquet column with the text")
@click.option("--id-field", default=None, help="jsonl key / parquet column with the id (default: FILE:LINE)")
@click.option("--outputs", "outputs", default="dense", show_default=True, metavar="dense[,sparse,colbert]",
              help="what to write; sparse and colbert need a workflow that makes them (bge_m3)")
@click.option("--workflow", "-w", default=None, help="workflow file or name (default: chosen from the model)")
@click.option("--model", "-m", default=None, help="model folder or cached hub id (default: all-MiniLM-L6-v2)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--truncate/--no-truncate", default=False, help="truncate over-long inputs instead of failing")
@click.option("--prompt-name", default=None)
@click.option("--skip-blank", is_flag=True, default=False,
              help=".txt: skip blank lines (default: a blank line is an error, so rows line up with lines)")
@click.option("--shard-size", default=4096, show_default=True, type=click.IntRange(min=1),
              help="records per output shard, the unit of --resume")
@click.option("--resume", is_flag=True, default=False, help="finish an interrupted run: keep the shards it wrote")
@click.option("--overwrite", is_flag=True, default=False, help="replace an existing output")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1),
              help="worker processes, each with its own engine (one per GPU, or CPU workers sharing the cores)")
@click.option("--devices", default=None, metavar="DEV[,DEV…]",
              help="one worker per device, e.g. cuda:0,cuda:1 (default: the workflow's device)")
@click.option("--ray", "ray_address", default=None, is_flag=False, flag_value="local", metavar="[ADDRESS]",
              help="run as a Ray Data job: on the cluster at ADDRESS, or a local one for a bare --ray (wde[ray])")
@click.option("--progress/--no-progress", default=None, help="progress bar on stderr (default: when it is a terminal)")
@click.option("--trust-remote-code", is_flag=True, default=False)
def embed(inputs: tuple[str, ...], output: str, text_field: str, id_field: str | None, outputs: str,
          workflow: str | None, model: str | None, overrides: tuple[str, ...], truncate: bool,
          prompt_name: str | None, skip_blank: bool, shard_size: int, resume: bool, overwrite: bool, workers: int,
          devices: str | None, ray_address: str | None, progress: bool | None, trust_remote_code: bool) -> None:
    """Embed a corpus into parquet (ids + vectors) or .npy, streaming, resumable, on one or many devices.

    Errors name the file and 1-based line. A killed run continues with --resume (docs/scaling.md).
    """
    from pydantic import ValidationError

    from wde.corpus import CorpusError, EmbedJob, run_embed
    from wde.errors import RequestError

    try:
        job = EmbedJob(inputs=tuple(_split_list(inputs)), output=output, text_field=text_field, id_field=id_field,
                       outputs=tuple(_split_list((outputs,))), truncate=truncate, prompt_name=prompt_name,
                       skip_blank=skip_blank, shard_size=shard_size, workflow=workflow, model=model,
                       overrides=overrides, trust_remote_code=trust_remote_code)
    except ValidationError as e:
        first = e.errors()[0]
        flag = "--" + str(first["loc"][0]).replace("_", "-") if first["loc"] else "wde embed"
        raise click.BadParameter(f"{first['msg']} (got {first.get('input')!r})", param_hint=flag) from None
    device_list = _split_list((devices,)) if devices else None
    try:
        if ray_address is not None:
            from wde.corpus.ray_job import run_ray_embed

            rows, dim = run_ray_embed(job, ray_address, workers=workers, overwrite=overwrite, resume=resume)
            click.echo(f"wrote {rows} x {dim} embeddings to {output}")
            return
        summary = run_embed(job, workers=workers, devices=device_list, resume=resume, overwrite=overwrite,
                            progress=sys.stderr.isatty() if progress is None else progress)
    except (CorpusError, WorkflowError, ModelLoadError, RegistryError, RequestError) as e:
        raise click.ClickException(str(e)) from None
    resumed = f", {summary.shards_skipped} shard(s) kept from an earlier run" if summary.shards_skipped else ""
    click.echo(f"wrote {summary.rows} x {summary.dim} embeddings to {output}"
               f" ({summary.tokens:,} tokens in {summary.seconds:.1f}s{resumed})")


@main.command()
@click.option("--workflow", "-w", default=None, help="workflow file or name (default: chosen from the model)")
@click.option("--model", "-m", default=None, help="model folder or cached hub id (default: all-MiniLM-L6-v2)")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (loopback unless told otherwise)")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key", default=None, envvar="WDE_API_KEY", help="require 'Authorization: Bearer KEY'")
@click.option("--served-model-name", default=None,
              help="name(s) the API answers to, comma separated; the first is reported (default: the model id or"
                   " folder name; its last path component, e.g. all-MiniLM-L6-v2, is always accepted)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--max-client-batch-size", default=1024, show_default=True, type=int)
@click.option("--max-concurrent-requests", default=512, show_default=True, type=int)
@click.option("--payload-limit", default=2_000_000, show_default=True, type=click.IntRange(min=1),
              help="largest request body in bytes; larger ones are answered 413")
@click.option("--trust-remote-code", is_flag=True, default=False)
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="log one line per request")
@click.option("--quantization-ranges", default=None, type=click.Path(exists=True, dir_okay=False),
              help=".npy (2, dim) per-dimension min/max for int8/uint8 embeddings (docs/http_api.md)")
@click.option("--api-servers", default="auto", show_default=True, metavar="N|auto",
              help="API-server processes in front of an engine core process (0: one process; auto: 0 on a"
                   " CPU-only host, else a quarter of the cores, 1 to 8)")
def serve(workflow: str | None, model: str | None, host: str, port: int, api_key: str | None,
          served_model_name: str | None, overrides: tuple[str, ...], max_client_batch_size: int,
          max_concurrent_requests: int, payload_limit: int, trust_remote_code: bool, access_log: bool,
          quantization_ranges: str | None, api_servers: str) -> None:
    """Serve a workflow over HTTP (OpenAI, rerank and TEI-compatible routes).

    Exits 0 after SIGINT/SIGTERM (requests in flight are finished first), and 3 when the engine loop failed
    repeatedly, so a process supervisor restarts the server (docs/operations.md).
    """
    from wde.server import ServerConfig, run_server
    from wde.server.app import EngineFailed

    try:
        config = ServerConfig(workflow=workflow, model=model, host=host, port=port, api_key=api_key,
                              served_model_name=served_model_name, overrides=list(overrides),
                              max_client_batch_size=max_client_batch_size,
                              max_concurrent_requests=max_concurrent_requests, payload_limit=payload_limit,
                              trust_remote_code=trust_remote_code, access_log=access_log,
                              quantization_ranges=quantization_ranges)
    except ValueError as e:
        hint = "--api-key" if "api_key" in str(e) else "--quantization-ranges" if "quantization" in str(e) else None
        raise click.BadParameter(str(e), param_hint=hint) from None
    if api_servers != "auto" and not (api_servers.isdigit() and int(api_servers) <= 64):
        raise click.BadParameter(f"must be 'auto' or a number of processes from 0 to 64, got {api_servers!r}",
                                 param_hint="--api-servers")
    try:
        if api_servers == "auto" or int(api_servers) > 0:
            from wde.server.processes import default_api_servers, run_split_server

            count = default_api_servers() if api_servers == "auto" else int(api_servers)
            if count > 0:
                sys.exit(run_split_server(config, count))
        run_server(config)
    except (WorkflowError, ModelLoadError, RegistryError) as e:
        raise click.ClickException(str(e)) from None
    except EngineFailed as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
