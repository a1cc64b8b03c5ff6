"""The command line fits users' hands: light commands import no torch, every unknown workflow key gets a
did-you-mean, `wde serve` says what it serves, and the model answers to its short alias."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from tests.test_server import free_port, wait_healthy
from wde.allocator import restart_env
from wde.cli import main
from wde.components.params import ClassifierParams
from wde.errors import RegistryError
from wde.plugins.builtin_components import BUILTIN_COMPONENTS
from wde.registry import LazyComponent, Registry
from wde.server.config import ServerConfig
from wde.server.startup import address

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "numpy", "wde.engine", "wde.components.models.base")

_PROBE = """
import json, sys
from wde.allocator import restart_env
from wde.cli import main
codes = []
for args in {commands!r}:
    try:
        main(args)
    except SystemExit as e:
        codes.append(e.code)
sys.stdout.flush()
print("\\nPROBE", json.dumps({{"codes": codes, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def probe(*commands: list[str], plugins: str | None = "") -> dict:
    """Run `wde` commands in a fresh interpreter (built-in plugins only, or `plugins` as WDE_LOAD_PLUGINS; None:
    every installed plugin); their exit codes and which heavy modules they imported."""
    env = {k: v for k, v in os.environ.items() if k != "WDE_LOAD_PLUGINS"}
    if plugins is not None:
        env["WDE_LOAD_PLUGINS"] = plugins
    code = _PROBE.format(commands=list(commands), heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.rsplit("PROBE", 1)[1])


def test_the_example_plugins_keep_validate_light() -> None:
    """Both example plugins register their components lazily, so installing them keeps `wde validate` fast."""
    result = probe(["validate", "workflows/"], ["plugins"], plugins="wde-plugin-example,wde-plugin-t5")
    assert result == {"codes": [0, 0], "heavy": []}


def test_version_imports_no_torch() -> None:
    result = probe(["--version"])
    assert result == {"codes": [0], "heavy": []}
    assert "0.1.0" in CliRunner().invoke(main, ["--version"]).output


def test_validate_inspect_plugins_import_no_torch() -> None:
    """What makes them start in well under a second: no torch, transformers, numpy or component module."""
    result = probe(["validate", "workflows/"], ["validate", "--format", "json", "workflows/bert.yaml"],
                   ["inspect", "bge_v1_5"], ["plugins"])
    assert result == {"codes": [0, 0, 0, 0], "heavy": []}


def test_public_api_still_imports() -> None:
    import wde
    import wde.engine

    from wde import Engine, PoolingParams, load_workflow  # noqa: F401 - resolved lazily

    assert wde.Engine is wde.engine.Engine and "Engine" in dir(wde) and set(wde.__all__) >= {"Engine", "RequestError"}
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        wde.Engin  # noqa: B018


def test_every_builtin_lazy_component_matches_its_class() -> None:
    for spec in BUILTIN_COMPONENTS:
        cls = spec.load()  # checks kind, name and Params against the registration
        assert (cls.kind, cls.name, cls.Params) == (spec.kind, spec.name, spec.params)


def test_lazy_component_errors_name_the_mismatch() -> None:
    wrong = LazyComponent("pooler", "sentence", "wde.components.pooler:SentencePooler", ClassifierParams)
    with pytest.raises(RegistryError, match="does not match its registration.*SentencePoolerParams.*ClassifierParams"):
        wrong.load()
    with pytest.raises(RegistryError, match="cannot import 'wde.components.pooler:Nope'"):
        LazyComponent("pooler", "nope", "wde.components.pooler:Nope").load()
    with pytest.raises(RegistryError, match="not a wde.components.base.Params subclass"):
        Registry().add_component(LazyComponent("pooler", "x", "m:C", dict), plugin="p")  # type: ignore[arg-type]
    with pytest.raises(RegistryError, match="kind 'poolr'"):
        Registry().add_component(LazyComponent("poolr", "x", "m:C"), plugin="p")


def validate(tmp_path: Path, text: str, *overrides: str) -> str:
    path = tmp_path / "wf.yaml"
    path.write_text(text, encoding="utf-8")
    args = ["validate", str(path)] + [a for o in overrides for a in ("--set", o)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    return result.output.replace(str(path), "wf.yaml")


@pytest.mark.parametrize("text,expected", [
    ("name: t\nextends: bert\npoolr:\n  name: sentence\n",
     "error wf.yaml:3:1: poolr: unknown key 'poolr'; did you mean 'pooler'?"),
    ("name: t\nextends: bert\ndescripton: x\n",
     "error wf.yaml:3:1: descripton: unknown key 'descripton'; did you mean 'description'?"),
    ("name: t\nextends: bert\nscheduler:\n  nmae: fcfs\n",
     "error wf.yaml:4:3: scheduler.nmae: unknown key 'nmae'; did you mean 'name'? (keys: name, params)"),
    ("name: t\nextends: bert\npooler:\n  params:\n    poolng: cls\n",
     "error wf.yaml:5:5: pooler.params.poolng: unknown param 'poolng' for pooler 'sentence'; did you mean 'pooling'?"),
    ("name: t\nextends: bert\npooler:\n  name: sentense\n",
     "error wf.yaml:4:3: pooler.name: unknown pooler component 'sentense'; did you mean 'sentence'?"),
    ("name: t\nextends: bret\n", "error wf.yaml:2:1: extends: unknown workflow 'bret'; did you mean 'bert'?"),
])
def test_every_unknown_key_gets_a_did_you_mean(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in validate(tmp_path, text)


def test_did_you_mean_for_overrides(tmp_path: Path) -> None:
    out = validate(tmp_path, "name: t\nextends: bert\n", "poolr.name=sentence")
    assert "error --set poolr.name=sentence: poolr: unknown key 'poolr'; did you mean 'pooler'?" in out


def test_model_names_and_aliases() -> None:
    default = "sentence-transformers/all-MiniLM-L6-v2"
    assert ServerConfig().model_names(default) == (default, "all-MiniLM-L6-v2")
    several = ServerConfig(model="/models/my-model", served_model_name="prod, prod/v2 ,")
    assert several.model_names("my-model") == ("prod", "prod/v2", "my-model", "/models/my-model", "v2")
    with pytest.raises(ValueError, match="served_model_name is empty"):
        ServerConfig(served_model_name=" , ")
    assert address("::", 80) == "http://[::]:80" and address("0.0.0.0", 8000) == "http://0.0.0.0:8000"


def test_serve_logs_what_it_serves_and_answers_to_aliases(tiny_bert: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "WDE_DEVICE": "cpu", "WDE_LOAD_PLUGINS": ""}
    with log.open("w") as err:
        args = ["serve", "--model", str(tiny_bert), "--port", str(port), "--served-model-name", "tiny,tiny/alias",
                "--set", "pooler.params.pooling=mean"]  # the tiny model has no sentence-transformers config
        proc = subprocess.Popen([sys.executable, "-m", "wde.cli", *args], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        for name in ("tiny", "tiny/alias", "alias", tiny_bert.name, str(tiny_bert), None):
            r = httpx.post(f"{url}/v1/embeddings", json={"input": "hello", **({"model": name} if name else {})})
            assert r.status_code == 200 and r.json()["model"] == "tiny", (name, r.text)
        wrong = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": "hello"})
        assert wrong.status_code == 404
        message = wrong.json()["error"]["message"]
        assert "this server serves 'tiny' (also accepted:" in message and str(tiny_bert) not in message
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [line for line in log.read_text().splitlines() if "serving model" in line]
    assert len(lines) == 1, log.read_text()
    allocator = "system" if restart_env(env, ["wde", "serve"]) is None and "tcmalloc" not in env.get(
        "LD_PRELOAD", "") else "tcmalloc"
    assert lines[0].endswith(
        f"serving model {tiny_bert} (API names: tiny, tiny/alias, {tiny_bert.name}, {tiny_bert}, alias)"
        f" with workflow bert on cpu (float32) at http://127.0.0.1:{port}; allocator {allocator}")
