"""Read a YAML file with `yaml.safe_load` semantics and remember where every key was written.

Validation errors point at `file:line:column` of the offending key; PyYAML's data API drops positions,
so we compose the node tree (safe loader) alongside and record each key's mark by its dotted path.

Aliases are bounded: a document whose node tree, with every alias expanded, would exceed `MAX_NODES` nodes (a
"billion laughs" bomb: a few hundred bytes that expand to billions of nodes), or whose aliases form a cycle, is
refused after composing it, before anything walks or constructs it, naming the file and line.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from wde.errors import Issue, Location, WorkflowError

KeyPath = tuple[Any, ...]

SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader when PyYAML was built with it (about 10x faster), else the pure-Python one."""

MAX_NODES = 100_000
"""The most nodes a YAML document may hold once its aliases are expanded (a bundled workflow has about 60)."""


class YamlBombError(yaml.YAMLError):
    """A document whose aliases expand past `MAX_NODES` nodes, or refer to themselves."""

    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        super().__init__(message)
        self.message, self.mark = message, mark


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_expansion(root: yaml.Node, limit: int = MAX_NODES) -> None:
    """Raise `YamlBombError` if `root`, with its aliases expanded, has more than `limit` nodes or a cycle.

    Aliases share node objects in the composed graph, so sizes are computed once per node (linear in the
    document, whatever the expansion would be).
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in _children(node))
            if sizes[key] > limit:
                raise YamlBombError(f"its aliases expand to more than {limit:,} nodes (an alias bomb?); refused",
                                    node.start_mark)
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise YamlBombError("an alias refers to a node that contains it (a cycle); refused", node.start_mark)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)


def compose_bounded(text: str) -> tuple[Any, yaml.Node | None]:
    """(data, node) of a YAML document, exactly as `yaml.safe_load` reads it, after `check_expansion`."""
    loader = SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        check_expansion(node)
        return loader.construct_document(node), node
    except RecursionError:
        raise YamlBombError("it is nested too deeply; refused", None) from None
    finally:
        loader.dispose()


def safe_load(text: str) -> Any:
    """`yaml.safe_load` with aliases bounded (see `check_expansion`); raises `yaml.YAMLError`."""
    return compose_bounded(text)[0]


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
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read for ever, a device never end
            raise WorkflowError([Issue(Location(file), "", "not a regular file (a FIFO, socket or device); a workflow"
                                       " is read whole, so it must be a file")])
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkflowError([Issue(Location(file), "", f"cannot read workflow file: {e.strerror or e}")]) from None
    try:  # compose once, then construct from that node: exactly `yaml.safe_load`, with the positions kept
        data, node = compose_bounded(text)
    except YamlBombError as e:
        loc = Location(file, e.mark.line + 1, e.mark.column + 1) if e.mark else Location(file)
        raise WorkflowError([Issue(loc, "", e.message)]) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        loc = Location(file, mark.line + 1, mark.column + 1) if mark else Location(file)
        problem = " ".join(p for p in (e.context, e.problem) if p)
        raise WorkflowError([Issue(loc, "", f"YAML syntax error: {problem}")]) from None
    except yaml.YAMLError as e:
        raise WorkflowError([Issue(Location(file), "", f"YAML error: {e}")]) from None
    locations: dict[KeyPath, Location] = {(): Location(file, 1, 1)}
    if node is not None:
        _walk(node, (), file, locations)
    return data, locations


def locate(locations: dict[KeyPath, Location], path: KeyPath) -> Location:
    """The location of `path`, or of its nearest written ancestor (a missing key points at its parent)."""
    while path not in locations and path:
        path = path[:-1]
    return locations.get(path, Location("<workflow>"))
