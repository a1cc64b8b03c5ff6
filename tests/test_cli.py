"""The `wde` command line: embed, inspect and plugins, run in-process with click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from wde import Engine
from wde.cli import main
from wde.plugins import DEFAULT_PLUGINS
from wde.plugins.builtin_components import BUILTIN_COMPONENTS

TEXTS = ["This is an example sentence", "Each sentence is converted", "naïve café — 東京", "short"]


def run(*args: str) -> object:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


@pytest.fixture(scope="module")
def expected(minilm_engine: Engine) -> np.ndarray:
    return minilm_engine.embed(TEXTS)


def test_embed_txt(tmp_path: Path, minilm_path: Path, expected: np.ndarray) -> None:
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS[:2]) + "\n\n" + "\n".join(TEXTS[2:]) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    result = run("embed", "--model", str(minilm_path), "--input", str(src), "--output", str(out), "--skip-blank")
    assert result.exit_code == 0, result.output
    assert f"wrote {len(TEXTS)} x 384 embeddings" in result.output
    got = np.load(out)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-6


def test_embed_jsonl_with_workflow(tmp_path: Path, minilm_path: Path, expected: np.ndarray) -> None:
    src = tmp_path / "in.jsonl"
    lines = [json.dumps(TEXTS[0]), json.dumps({"text": TEXTS[1]}), json.dumps(TEXTS[2]), json.dumps({"text": TEXTS[3]})]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    result = run("embed", "-w", "bert", "-m", str(minilm_path), "--input", str(src), "--output", str(out),
                 "--set", "scheduler.params.max_num_requests=2")
    assert result.exit_code == 0, result.output
    assert np.abs(np.load(out) - expected).max() <= 1e-5


def test_embed_bad_input_is_a_clean_error(tmp_path: Path, minilm_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps("fine") + "\n" + json.dumps({"text": 5}) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    result = run("embed", "-m", str(minilm_path), "--input", str(src), "--output", str(out))
    assert result.exit_code == 1
    assert f"{src}:2: field 'text' (--text-field) must be a string, got int" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_embed_too_long_and_truncate(tmp_path: Path, minilm_path: Path, minilm_engine: Engine) -> None:
    src = tmp_path / "in.txt"
    long_text = "word " * 300
    src.write_text(long_text + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    refused = run("embed", "-m", str(minilm_path), "--input", str(src), "--output", str(out))
    assert refused.exit_code == 1 and "limit of 256" in refused.output
    ok = run("embed", "-m", str(minilm_path), "--input", str(src), "--output", str(out), "--truncate")
    assert ok.exit_code == 0, ok.output
    assert np.abs(np.load(out)[0] - minilm_engine.embed(long_text.strip(), truncate=True)).max() <= 1e-5


def test_embed_bad_override_names_it(tmp_path: Path, minilm_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("hello\n", encoding="utf-8")
    result = run("embed", "-m", str(minilm_path), "--input", str(src), "--output", str(tmp_path / "o.npy"),
                 "--set", "scheduler.params.max_num_requets=2")
    assert result.exit_code == 1
    assert "--set scheduler.params.max_num_requets=2" in result.output and "max_num_requests" in result.output


def test_inspect_shows_effective_params() -> None:
    result = run("inspect", "bge_v1_5")
    assert result.exit_code == 0, result.output
    graph = yaml.safe_load(result.output)
    assert graph["name"] == "bge_v1_5"
    assert graph["pooler"]["params"] == {"pooling": "cls", "normalize": True}
    assert graph["input_processor"]["params"]["prompts"]["query"].startswith("Represent this sentence")
    assert graph["input_processor"]["params"]["pairs"] == "forbid"
    assert graph["scheduler"]["params"]["max_num_batched_tokens"] == "auto"
    assert graph["model"] == {"name": "bert", "plugin": "wde.plugins.builtin_components",
                              "params": graph["model"]["params"]}
    assert graph["architectures"] == ["BertModel"]


def test_inspect_with_override_and_error() -> None:
    graph = yaml.safe_load(run("inspect", "bert", "--set", "scheduler.params.max_num_requests=7").output)
    assert graph["scheduler"]["params"]["max_num_requests"] == 7
    bad = run("inspect", "bret")
    assert bad.exit_code == 1 and "unknown workflow 'bret'" in bad.output and "did you mean 'bert'?" in bad.output


def test_plugins_lists_builtins() -> None:
    text = run("plugins")
    assert text.exit_code == 0
    for plugin in DEFAULT_PLUGINS:
        assert plugin in text.output
    listing = json.loads(run("plugins", "--format", "json").output)
    components = set(listing["wde.plugins.builtin_components"]["components"])
    assert {f"{c.kind}:{c.name}" for c in BUILTIN_COMPONENTS} <= components
    assert {"bert", "bge_v1_5", "xlm_roberta"} <= set(listing["wde.plugins.builtin_workflows"]["workflows"])
    assert "BertModel->bert" in listing["wde.plugins.builtin_workflows"]["architectures"]


def test_validate_a_missing_path_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`wde validate workflows/` where there is no such folder names the missing path (one line, exit 1), not
    an unknown workflow; a registered workflow name is still accepted."""
    monkeypatch.chdir(tmp_path)
    for arg in ("workflows/", "workflows/bert.yaml", "nosuch.yaml", str(tmp_path / "nowhere")):
        result = run("validate", arg)
        assert result.exit_code == 1, result.output
        assert result.output.splitlines() == [f"error {arg}: no such file or folder", "0 valid, 1 invalid"]
    bare = run("validate", "workflows")  # no such folder, nor a workflow of that name: both said
    assert bare.exit_code == 1
    assert bare.output.startswith("error workflows: no such file or folder, nor a registered workflow:"
                                  " unknown workflow 'workflows'")
    report = json.loads(run("validate", "--format", "json", "workflows/").output)
    assert report == {"ok": False, "files": [{"file": "workflows/", "ok": False, "issues": [
        {"file": "workflows/", "line": 0, "column": 0, "path": "", "message": "no such file or folder"}]}]}
    ok = run("validate", "bert", "bge_v1_5")
    assert ok.exit_code == 0 and "ok    bert (bert)" in ok.output and "2 valid, 0 invalid" in ok.output


def test_every_option_of_every_command_has_help() -> None:
    """`wde X --help` documents every option: walk each command's params (and the group's own)."""
    import click

    def commands(cmd: click.Command, path: str):
        yield path, cmd
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from commands(sub, f"{path} {name}")

    missing = [f"{path} {'/'.join(p.opts)}" for path, cmd in commands(main, "wde")
               for p in cmd.get_params(click.Context(cmd))
               if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert {"embed", "serve", "validate", "inspect", "plugins"} <= set(main.commands)
    assert missing == [], f"options without help text: {missing}"
    for name in main.commands:  # and the help pages render
        result = run(name, "--help")
        assert result.exit_code == 0 and "Usage:" in result.output, result.output


def test_a_10_mb_option_value_is_not_echoed_whole(tmp_path: Path) -> None:
    """A huge value given by mistake makes a short error naming the option, not a 10 MB one."""
    huge = "y" * (10 * 2**20)
    embed = run("embed", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "o.npy"), "--outputs", huge)
    assert embed.exit_code == 2 and "--outputs" in embed.output and "(10,485,760 characters)" in embed.output
    assert len(embed.output) < 1000
    validate = run("validate", "bert", "--set", f"model.params.dtype={huge}")
    assert validate.exit_code == 1 and "(10,485,760 characters)" in validate.output and len(validate.output) < 1000
