"""The `wde` command: serve, validate, inspect, plugins, embed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from wde.errors import Issue, Location, ModelLoadError, RegistryError, RequestError, WorkflowError


def _workflow_files(paths: tuple[str, ...]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(sorted(path.glob("*.yaml")) + sorted(path.glob("*.yml")))
        else:
            files.append(path)
    return files


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
        try:
            wf = load_workflow(f if f.exists() else str(f), overrides)
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


def _load_inputs(path: Path) -> list:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return [line for line in text.splitlines() if line.strip()]


@main.command()
@click.option("--workflow", "-w", default=None, help="workflow file or name (default: chosen from the model)")
@click.option("--model", "-m", default=None, help="model folder or cached hub id (default: all-MiniLM-L6-v2)")
@click.option("--input", "input_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=".txt (one text a line) or .jsonl (strings or {'text': ...} objects)")
@click.option("--output", "output_path", required=True, type=click.Path(dir_okay=False, path_type=Path), help=".npy file")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--truncate/--no-truncate", default=False, help="truncate over-long inputs instead of failing")
@click.option("--prompt-name", default=None)
@click.option("--progress/--no-progress", default=False)
@click.option("--trust-remote-code", is_flag=True, default=False)
def embed(workflow: str | None, model: str | None, input_path: Path, output_path: Path, overrides: tuple[str, ...],
          truncate: bool, prompt_name: str | None, progress: bool, trust_remote_code: bool) -> None:
    """Embed a file of texts offline and save the matrix as .npy."""
    import numpy as np

    from wde.engine import Engine

    try:
        engine = Engine.from_workflow(workflow, model, overrides=overrides, trust_remote_code=trust_remote_code)
        with engine:
            vectors = engine.embed(_load_inputs(input_path), truncate=truncate, prompt_name=prompt_name, progress=progress)
    except (WorkflowError, ModelLoadError, RegistryError, RequestError) as e:
        raise click.ClickException(str(e)) from None
    np.save(output_path, vectors)
    click.echo(f"wrote {vectors.shape[0]} x {vectors.shape[1] if vectors.ndim > 1 else 0} embeddings to {output_path}")


@main.command()
@click.option("--workflow", "-w", default=None, help="workflow file or name (default: chosen from the model)")
@click.option("--model", "-m", default=None, help="model folder or cached hub id (default: all-MiniLM-L6-v2)")
@click.option("--host", default="127.0.0.1", show_default=True, help="bind address (loopback unless told otherwise)")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key", default=None, envvar="WDE_API_KEY", help="require 'Authorization: Bearer KEY'")
@click.option("--served-model-name", default=None, help="model name reported by the API (default: the model path)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--max-client-batch-size", default=1024, show_default=True, type=int)
@click.option("--max-concurrent-requests", default=512, show_default=True, type=int)
@click.option("--payload-limit", default=2_000_000, show_default=True, type=click.IntRange(min=1),
              help="largest request body in bytes; larger ones are answered 413")
@click.option("--trust-remote-code", is_flag=True, default=False)
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="log one line per request")
def serve(workflow: str | None, model: str | None, host: str, port: int, api_key: str | None,
          served_model_name: str | None, overrides: tuple[str, ...], max_client_batch_size: int,
          max_concurrent_requests: int, payload_limit: int, trust_remote_code: bool, access_log: bool) -> None:
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
                              trust_remote_code=trust_remote_code, access_log=access_log)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--api-key" if "api_key" in str(e) else None) from None
    try:
        run_server(config)
    except (WorkflowError, ModelLoadError, RegistryError) as e:
        raise click.ClickException(str(e)) from None
    except EngineFailed as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
