"""Read a YAML file with `yaml.safe_load` semantics and remember where every key was written.

Validation errors point at `file:line:column` of the offending key; PyYAML's data API drops positions,
so we compose the node tree (safe loader) alongside and record each key's mark by its dotted path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from wde.errors import Issue, Location, WorkflowError

KeyPath = tuple[Any, ...]

SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML was built with it (about 10x faster), else the pure-Python one."""


def _walk(node: yaml.Node, path: KeyPath, file: str, out: dict[KeyPath, Location]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node)) if not isinstance(key_node, yaml.ScalarNode) else key_node.value
            child = path + (key,)
            out[child] = Location(file, key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            _walk(value_node, child, file, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            child = path + (i,)
            out[child] = Location(file, item.start_mark.line + 1, item.start_mark.column + 1)
            _walk(item, child, file, out)


def load_yaml_with_locations(path: Path) -> tuple[Any, dict[KeyPath, Location]]:
    """Parse `path` safely; return the data and a map from key path to where that key is written."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkflowError([Issue(Location(file), "", f"cannot read workflow file: {e.strerror or e}")]) from None
    loader = SafeLoader(text)
    try:  # compose once, then construct from that node: exactly `yaml.safe_load`, with the positions kept
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = Location(file, mark.line + 1, mark.column + 1) if mark else Location(file)
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise WorkflowError([Issue(loc, "", f"YAML syntax error: {problem}")]) from None
    except yaml.YAMLError as e:
        raise WorkflowError([Issue(Location(file), "", f"YAML error: {e}")]) from None
    finally:
        loader.dispose()
    locations: dict[KeyPath, Location] = {(): Location(file, 1, 1)}
    if node is not None:
        _walk(node, (), file, locations)
    return data, locations


def locate(locations: dict[KeyPath, Location], path: KeyPath) -> Location:
    """The location of `path`, or of its nearest written ancestor (a missing key points at its parent)."""
    while path not in locations and path:
        path = path[:-1]
    return locations.get(path, Location("<workflow>"))
