"""Workflow validation: every error class names the problem and points at file:line:column (or `--set ...`)."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from wde.cli import main
from wde.errors import Issue, WorkflowError
from wde.plugins.builtin_workflows import workflows_dir
from wde.workflow import load_workflow


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def position(path: Path, needle: str) -> tuple[int, int]:
    """1-based line and column of the first occurrence of `needle` in the file: where the issue must point."""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if needle in line:
            return n, line.index(needle) + 1
    raise AssertionError(f"{needle!r} is not in {path}")


def only_issue(path: Path | str, overrides: list[str] | None = None) -> Issue:
    with pytest.raises(WorkflowError) as info:
        load_workflow(path, overrides)
    assert len(info.value.issues) == 1, info.value.issues
    return info.value.issues[0]


def assert_at(issue: Issue, path: Path, needle: str) -> None:
    line, column = position(path, needle)
    assert (issue.location.file, issue.location.line, issue.location.column) == (str(path), line, column)
    assert str(issue).startswith(f"{path}:{line}:{column}: ")


def test_unknown_component_has_location_and_did_you_mean(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bert\nmodel:\n  name: bertt\n")
    issue = only_issue(path)
    assert_at(issue, path, "name: bertt")
    assert issue.path == "model.name"
    assert "unknown model component 'bertt'" in issue.message
    assert "did you mean 'bert'?" in issue.message
    assert "xlm_roberta" in issue.message


def test_component_names_resolve_only_through_the_registry(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bert\nmodel:\n  name: wde.components.models.bert.BertModel\n")
    issue = only_issue(path)
    assert_at(issue, path, "name: wde.components")
    assert "unknown model component" in issue.message


def test_unknown_param_has_location_and_did_you_mean(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bert\nscheduler:\n  params:\n    max_num_batched_tokns: 64\n")
    issue = only_issue(path)
    assert_at(issue, path, "max_num_batched_tokns")
    assert issue.path == "scheduler.params.max_num_batched_tokns"
    assert "unknown param 'max_num_batched_tokns' for scheduler 'fcfs'" in issue.message
    assert "did you mean 'max_num_batched_tokens'?" in issue.message


def test_wrong_param_type(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml",
                 "name: t\nextends: bert\nscheduler:\n  params:\n    max_num_batched_tokens: lots\n")
    issue = only_issue(path)
    assert_at(issue, path, "max_num_batched_tokens")
    assert "integer" in issue.message and "'lots'" in issue.message


def test_bad_param_value(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bert\nscheduler:\n  params:\n    max_num_batched_tokens: -5\n")
    issue = only_issue(path)
    assert_at(issue, path, "max_num_batched_tokens")
    assert "greater than 0" in issue.message and "-5" in issue.message


def test_every_issue_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bert\nmodel:\n  name: bertt\nexecutor:\n  name: thred\n")
    with pytest.raises(WorkflowError) as info:
        load_workflow(path)
    assert [i.path for i in info.value.issues] == ["model.name", "executor.name"]
    assert "did you mean 'thread'?" in info.value.issues[1].message


def test_extends_unknown_name(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bret\n")
    issue = only_issue(path)
    assert_at(issue, path, "extends")
    assert "unknown workflow 'bret'" in issue.message and "did you mean 'bert'?" in issue.message


def test_extends_missing_file(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: ./nope.yaml\n")
    issue = only_issue(path)
    assert_at(issue, path, "extends")
    assert "'./nope.yaml' does not exist" in issue.message


def test_extends_cycle(tmp_path: Path) -> None:
    a = write(tmp_path, "a.yaml", "name: a\nextends: b.yaml\n")
    write(tmp_path, "b.yaml", "name: b\nextends: a.yaml\n")
    issue = only_issue(a)
    assert "cycle" in issue.message
    assert "a.yaml" in issue.message and "b.yaml" in issue.message


def test_extends_self_is_a_cycle(tmp_path: Path) -> None:
    path = write(tmp_path, "a.yaml", "name: a\nextends: a.yaml\n")
    assert "cycle" in only_issue(path).message


def test_yaml_syntax_error_location(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bert\nscheduler:\n  params: [1, 2\n")
    issue = only_issue(path)
    assert issue.location.file == str(path)
    assert issue.location.line >= 4 and issue.location.column >= 1
    assert issue.message.startswith("YAML syntax error")


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "- just\n- a list\n")
    issue = only_issue(path)
    assert (issue.location.line, issue.location.column) == (1, 1)
    assert "mapping" in issue.message


def test_missing_component_kind(tmp_path: Path) -> None:
    base = (workflows_dir() / "bert.yaml").read_text(encoding="utf-8")
    without_executor = base.replace("executor:\n  name: thread\n", "")
    assert without_executor != base
    path = write(tmp_path, "wf.yaml", without_executor)
    issue = only_issue(path)
    assert issue.path == "executor"
    assert issue.location.file == str(path) and issue.location.line == 1
    assert "sets no executor component" in issue.message


def test_component_without_name(tmp_path: Path) -> None:
    base = (workflows_dir() / "bert.yaml").read_text(encoding="utf-8")
    path = write(tmp_path, "wf.yaml", base.replace("executor:\n  name: thread\n", "executor:\n  params: {}\n"))
    issue = only_issue(path)
    assert_at(issue, path, "executor:")
    assert issue.path == "executor.name" and "sets no executor component" in issue.message


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "name: t\nextends: bert\nschedular:\n  name: fcfs\n")
    issue = only_issue(path)
    assert_at(issue, path, "schedular")
    assert issue.message.startswith("unknown key 'schedular'; did you mean 'scheduler'? (keys: name, description,")


def test_missing_name_key(tmp_path: Path) -> None:
    path = write(tmp_path, "wf.yaml", "extends: bert\n")
    issue = only_issue(path)
    assert "missing required key 'name'" in issue.message


def test_overrides_are_applied() -> None:
    wf = load_workflow("bert", ["scheduler.params.max_num_batched_tokens=64", "executor.name=sync"])
    assert wf.components["scheduler"].params.max_num_batched_tokens == 64
    assert wf.components["scheduler"].params.max_num_requests == 256
    assert wf.components["executor"].name == "sync"
    nested = load_workflow("bert", {"scheduler": {"params": {"max_num_requests": 3}}})
    assert nested.components["scheduler"].params.max_num_requests == 3


def test_override_of_a_name_keeps_only_the_params_the_new_component_declares() -> None:
    same = load_workflow("bge_v1_5", ["pooler.name=sentence"])
    assert same.components["pooler"].params.pooling == "cls"
    swapped = load_workflow("llm2vec", ["attention.name=triton_varlen"])
    assert swapped.components["attention"].name == "triton_varlen"
    assert swapped.components["attention"].params.causal is False
    threaded = load_workflow("bert", ["executor.name=thread", "executor.params.max_inflight=3"])
    back = load_workflow("bert", {"executor": {"name": "thread", "params": {"max_inflight": 3}}})
    assert threaded.components["executor"].params.max_inflight == back.components["executor"].params.max_inflight == 3
    assert load_workflow("bert", ["executor.name=thread"]).components["executor"].params.max_inflight == 2


def test_override_errors_point_at_the_override() -> None:
    issue = only_issue("bert", ["scheduler.params.max_num_batched_tokns=5"])
    assert issue.location.file == "--set scheduler.params.max_num_batched_tokns=5"
    assert str(issue).startswith("--set scheduler.params.max_num_batched_tokns=5: ")
    assert "did you mean 'max_num_batched_tokens'?" in issue.message
    bad_value = only_issue("bert", ["scheduler.params.max_num_requests=0"])
    assert bad_value.location.file == "--set scheduler.params.max_num_requests=0"
    assert "greater than 0" in bad_value.message


def test_malformed_override() -> None:
    issue = only_issue("bert", ["scheduler.params.max_num_requests"])
    assert issue.location.file == "--set" and "kind.params.key=value" in issue.message


def test_extends_merges_params_with_the_parent(tmp_path: Path) -> None:
    parent = write(tmp_path, "parent.yaml", (workflows_dir() / "bert.yaml").read_text(encoding="utf-8")
                   .replace("  name: thread\n", "  name: thread\n  params:\n    max_inflight: 4\n"))
    child = write(tmp_path, "child.yaml", f"name: child\nextends: {parent.name}\n"
                  "scheduler:\n  params:\n    max_num_requests: 8\nexecutor:\n  name: thread\n")
    wf = load_workflow(child)
    assert wf.name == "child"
    assert wf.components["scheduler"].params.max_num_requests == 8
    assert wf.components["scheduler"].params.max_num_batched_tokens == "auto"
    assert wf.components["executor"].params.max_inflight == 4
    assert wf.architectures == ("BertModel",)


def test_child_renaming_a_component_drops_params_the_new_one_lacks(tmp_path: Path) -> None:
    parent = write(tmp_path, "parent.yaml", (workflows_dir() / "bert.yaml").read_text(encoding="utf-8")
                   .replace("  name: thread\n", "  name: thread\n  params:\n    max_inflight: 4\n"))
    child = write(tmp_path, "child.yaml", f"name: child\nextends: {parent.name}\nexecutor:\n  name: sync\n")
    wf = load_workflow(child)
    assert wf.components["executor"].name == "sync"
    assert wf.components["executor"].params.model_dump() == {}


def test_issue_in_parent_points_at_the_parent_file(tmp_path: Path) -> None:
    parent = write(tmp_path, "parent.yaml", "name: p\nextends: bert\nscheduler:\n  params:\n    max_num_requests: -1\n")
    child = write(tmp_path, "child.yaml", "name: c\nextends: parent.yaml\n")
    issue = only_issue(child)
    assert_at(issue, parent, "max_num_requests")


def test_cli_validate_bundled_workflows_pass() -> None:
    result = CliRunner().invoke(main, ["validate", str(workflows_dir())])
    assert result.exit_code == 0, result.output
    assert "0 invalid" in result.output
    assert "(bert)" in result.output and "(bge_v1_5)" in result.output


def test_cli_validate_json_and_exit_code(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", "name: t\nextends: bert\nmodel:\n  name: bertt\n")
    good = write(tmp_path, "good.yaml", "name: g\nextends: bert\n")
    result = CliRunner().invoke(main, ["validate", "--format", "json", str(bad), str(good)])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["ok"] is False
    by_file = {f["file"]: f for f in report["files"]}
    assert by_file[str(good)]["ok"] is True and by_file[str(good)]["issues"] == []
    (issue,) = by_file[str(bad)]["issues"]
    line, column = position(bad, "name: bertt")
    assert issue == {"file": str(bad), "line": line, "column": column, "path": "model.name",
                     "message": issue["message"]}
    assert "did you mean 'bert'?" in issue["message"]


def test_cli_validate_text_errors_and_overrides(tmp_path: Path) -> None:
    good = write(tmp_path, "good.yaml", "name: g\nextends: bert\n")
    result = CliRunner().invoke(main, ["validate", str(good), "--set", "scheduler.params.max_num_requests=-2"])
    assert result.exit_code == 1
    assert "error --set scheduler.params.max_num_requests=-2: scheduler.params.max_num_requests:" in result.output
    assert "0 valid, 1 invalid" in result.output


def test_a_registered_name_wins_over_a_folder_of_that_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bert").mkdir()  # e.g. a model folder named like the workflow, in the working directory
    monkeypatch.chdir(tmp_path)
    assert load_workflow("bert").name == "bert"
    (tmp_path / "notaworkflow").mkdir()
    with pytest.raises(WorkflowError) as info:
        load_workflow("notaworkflow")
    assert "'notaworkflow' is a folder, not a workflow file" in str(info.value)
    assert "unknown workflow 'notaworkflow'" in str(info.value)
    with pytest.raises(WorkflowError) as info:
        load_workflow(str(tmp_path / "bert"))
    assert "is a folder, not a workflow file" in str(info.value)


# --- huge values are not echoed whole ------------------------------------------------------------------------

HUGE = "x" * (10 * 2**20)
HUGE_LENGTH = f"({len(HUGE):,} characters)"
"""How an error shows a 10 MB value: its first characters, an ellipsis, then this."""


def assert_short(text: str, limit: int = 1000) -> None:
    """Short, and saying how long the value was (a list's repr is a few characters longer than the string)."""
    assert len(text) < limit and re.search(r"… \(10,485,7\d\d characters\)", text), text[:2000]


def test_a_10_mb_param_value_is_not_echoed_whole(tmp_path: Path) -> None:
    """It was: the message (and `wde validate`'s output) was 10 MB."""
    path = write(tmp_path, "huge.yaml", f"name: huge\nextends: bert\nmodel:\n  params:\n    dtype: {HUGE}\n")
    issue = only_issue(path)
    assert issue.path == "model.params.dtype" and "Input should be 'auto'" in issue.message
    assert_short(str(issue))
    assert f"(got '{'x' * 120}'… {HUGE_LENGTH})" in issue.message
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 1
    assert_short(result.output)


@pytest.mark.parametrize("override", [f"model.params.dtype={HUGE}", f"model.params.{HUGE}=1", f"model.name={HUGE}",
                                      f"model.params.dtype=[{HUGE}]", HUGE])
def test_a_10_mb_override_is_not_echoed_whole(override: str) -> None:
    """A value, a key, a component name, a list holding the value, and an override without '='."""
    with pytest.raises(WorkflowError) as info:
        load_workflow("bert", [override])
    assert_short(str(info.value))


def test_a_fifo_workflow_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A workflow that extends a FIFO waited for ever for a writer."""
    os.mkfifo(tmp_path / "parent.yaml")
    child = write(tmp_path, "child.yaml", "name: child\nextends: parent.yaml\n")
    outcome: dict[str, object] = {}

    def load() -> None:
        try:
            load_workflow(child)
        except WorkflowError as e:
            outcome["issue"] = e.issues[0]

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        os.close(os.open(tmp_path / "parent.yaml", os.O_WRONLY | os.O_NONBLOCK))  # releases the waiting reader
        thread.join(60)
        pytest.fail("loading a workflow that extends a FIFO blocked instead of refusing it")
    issue = outcome["issue"]
    assert isinstance(issue, Issue) and issue.location.file == str(tmp_path / "parent.yaml")
    assert "not a regular file" in issue.message
    named = only_issue(tmp_path / "parent.yaml")  # given itself: it said "workflow file does not exist"
    assert named.location.file == str(tmp_path / "parent.yaml") and "not a regular file" in named.message
