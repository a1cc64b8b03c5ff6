"""YAML alias bombs and cycles are refused before anything expands them, naming the file and line, in `wde
validate`, `wde serve`, `--set` overrides and workflows a plugin registers. The subprocess runs under a 1 GiB
address-space limit: an unbounded expansion (the 443-byte bomb below expands to ~3.9e8 nodes) fails there with a
MemoryError instead of the expected one-line refusal, so these tests fail on a reader that expands aliases."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wde.errors import WorkflowError
from wde.registry import Registry
from wde.workflow import load_workflow
from wde.yaml_source import MAX_NODES, YamlBombError, check_expansion, safe_load

ROOT = Path(__file__).resolve().parents[1]


def bomb(levels: int = 9, width: int = 9) -> str:
    """The classic "billion laughs": each level lists the previous one `width` times."""
    lines = ["name: bomb", "a: &a [" + ", ".join(['"lol"'] * width) + "]"]
    prev = "a"
    for name in "bcdefghijklmnop"[:levels - 1]:
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * width) + "]")
        prev = name
    return "\n".join(lines) + "\n"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def run_wde(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from wde.cli import main; sys.argv = ['wde', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, preexec_fn=_limit_memory)


def test_the_bomb_is_small_and_huge() -> None:
    text = bomb()
    assert len(text.encode()) < 450
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    with pytest.raises(YamlBombError, match="more than 100,000 nodes"):
        check_expansion(node)
    check_expansion(node, limit=10**9)  # 9**9 + ... nodes: counted, never expanded


def test_validate_refuses_a_bomb_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb())
    result = run_wde("validate", str(path))
    assert result.returncode == 1
    assert f"error {path}:" in result.stderr and "aliases expand to more than 100,000 nodes" in result.stderr
    assert "MemoryError" not in result.stderr and "Traceback" not in result.stderr


def test_serve_refuses_a_bomb_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb())
    result = run_wde("serve", "--workflow", str(path), "--port", "1")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "aliases expand to more than" in result.stderr and "Traceback" not in result.stderr


def test_a_cycle_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cycle.yaml"
    path.write_text("name: cycle\nloop: &l [1, *l]\n")
    with pytest.raises(WorkflowError, match=r"cycle.yaml:2:7: an alias refers to a node that contains it"):
        load_workflow(path)


def test_an_override_bomb_is_refused() -> None:
    levels = ", ".join(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 7))
    with pytest.raises(WorkflowError, match="--set: model.params.x: its aliases expand to more than"):
        load_workflow("bert", [f"model.params.x=[&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], {levels}]"])


def test_a_plugin_workflow_bomb_is_unreadable_not_expanded(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb())
    registry = Registry()
    registry.add_workflow(path, plugin="evil")
    assert "aliases expand to more than" in registry.unreadable[str(path)]


def test_aliases_within_the_limit_still_work(tmp_path: Path) -> None:
    assert safe_load("a: &x {k: 1}\nb: *x\n") == {"a": {"k": 1}, "b": {"k": 1}}
    assert len(safe_load(bomb(levels=4, width=9))["d"]) == 9  # 9**4 + ... nodes: fine
    path = tmp_path / "anchored.yaml"
    text = (ROOT / "workflows" / "bert.yaml").read_text()
    assert "\nname: bert\n" in text and "\ndescription: " in text
    text = text.replace("\nname: bert\n", "\nname: &n anchored\n")
    text = "\n".join("description: *n" if line.startswith("description: ") else line for line in text.splitlines())
    path.write_text(text + "\n")
    assert load_workflow(path).name == "anchored"
    assert MAX_NODES >= 10_000
