"""Workflow files: schema, `extends`, overrides, and resolution of component names into classes.

A workflow names one component per kind with its params. The schema here knows the kinds but not any
component's params: those are validated against each component's own `Params` model once its name is
resolved through the registry.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from wde.components.base import COMPONENT_KINDS, DEFAULT_COMPONENTS, Component, Params
from wde.errors import SHOWN_CHARS, Issue, Location, RegistryError, WorkflowError, brief, did_you_mean, shown
from wde.registry import LazyComponent, Registry, capabilities_of, get_registry, load_component
from wde.yaml_source import KeyPath, YamlBombError, load_yaml_with_locations, locate, safe_load


class ComponentRef(BaseModel):
    """`{name, params}` as written in a workflow; params stay a dict until the component is known."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


_WorkflowFile = create_model(
    "WorkflowFile",
    __config__=ConfigDict(extra="forbid"),
    name=(str, ...),
    description=(str, ""),
    family=(str, ""),
    extends=(str | None, None),
    architectures=(list[str], Field(default_factory=list)),
    **{kind: (ComponentRef | None, None) for kind in COMPONENT_KINDS},
)


@dataclass(frozen=True)
class ResolvedComponent:
    """A component kind bound to its registration and validated params."""

    kind: str
    name: str
    component: type[Component] | LazyComponent
    """The registered class, or a lazy reference to it: resolving a workflow imports no component module."""
    params: Params
    plugin: str

    @property
    def cls(self) -> type[Component]:
        """The component class (imported now if it was registered lazily)."""
        return load_component(self.component)


@dataclass(frozen=True)
class ResolvedWorkflow:
    """A fully merged and validated workflow: ready to build an engine from."""

    name: str
    description: str
    family: str
    architectures: tuple[str, ...]
    source: str
    components: dict[str, ResolvedComponent]

    def to_dict(self) -> dict[str, Any]:
        """The effective graph, as `wde inspect` prints it."""
        return {
            "name": self.name,
            "family": self.family,
            "description": self.description,
            "architectures": list(self.architectures),
            "source": self.source,
            **{
                kind: {"name": c.name, "plugin": c.plugin, "params": c.params.model_dump(mode="json")}
                for kind, c in self.components.items()
            },
        }


@dataclass
class _Layer:
    """Raw workflow data merged so far, with the location each key came from."""

    data: dict[str, Any]
    locations: dict[KeyPath, Location]
    file: str
    inherited: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Params of a component that was replaced by another name: the new component keeps those it declares."""


_UNION_TAG = re.compile(r"^[a-z][a-z-]*(\[.*\])?$")


def _merge_union_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pydantic reports a value that fits no member of `int | Literal["auto"]` once per member, with the member's
    tag appended to `loc`; fold those into one error at the field, listing what each member expected."""
    merged: dict[tuple, dict[str, Any]] = {}
    for e in errors:
        loc = tuple(e["loc"])
        siblings = [x for x in errors if tuple(x["loc"])[:-1] == loc[:-1] and len(x["loc"]) == len(loc)]
        if len(loc) > 1 and len(siblings) > 1 and all(_UNION_TAG.match(str(x["loc"][-1])) for x in siblings):
            key = loc[:-1]
            if key in merged:
                merged[key]["msg"] += f" or {e['msg'][0].lower()}{e['msg'][1:]}"
            else:
                merged[key] = {**e, "loc": key}
        else:
            merged[loc] = e
    return list(merged.values())


def _known_keys(path: KeyPath) -> list[str]:
    """The keys a workflow allows where `path`'s last key was written (top level, or inside a component)."""
    if len(path) == 1:
        return list(_WorkflowFile.model_fields)
    if len(path) == 2 and path[0] in COMPONENT_KINDS:
        return list(ComponentRef.model_fields)
    return []


def dotted_path(path: KeyPath) -> str:
    return ".".join(brief(p) for p in path)


def _pydantic_issues(err: ValidationError, locations: dict[KeyPath, Location], prefix: KeyPath) -> list[Issue]:
    """One issue per pydantic error; every value and key is echoed through `shown` / `brief`, so a 10 MB value
    (or key) makes a short message, not a 10 MB one."""
    issues = []
    for e in _merge_union_errors(err.errors()):
        path = prefix + tuple(e["loc"])
        dotted = dotted_path(path)
        msg = brief(e["msg"]) if len(e["msg"]) > 4 * SHOWN_CHARS else e["msg"]  # a validator may quote the value
        if e["type"] == "extra_forbidden":
            known = _known_keys(path)
            msg = f"unknown key {shown(path[-1])};{did_you_mean(str(path[-1]), known)}" + \
                (f" (keys: {', '.join(known)})" if known else "")
        elif e["type"] == "missing":
            msg = f"missing required key {shown(path[-1])}"
        elif "input" in e:
            msg = f"{msg} (got {shown(e['input'])})"
        issues.append(Issue(locate(locations, path), dotted, msg))
    return issues


def _read_layer(path: Path) -> _Layer:
    data, locations = load_yaml_with_locations(path)
    if not isinstance(data, dict):
        raise WorkflowError([Issue(Location(str(path), 1, 1), "", "a workflow file must be a YAML mapping")])
    try:
        _WorkflowFile.model_validate(data)
    except ValidationError as e:
        raise WorkflowError(_pydantic_issues(e, locations, ())) from None
    return _Layer(data, locations, str(path))


def _merge(base: _Layer, child: _Layer) -> _Layer:
    """Child keys override the parent's; a component keeping its name merges params key by key, a component
    replaced by another name keeps (as `inherited`) the parent's params for the new one to pick from."""
    data = copy.deepcopy(base.data)
    locations = dict(base.locations)
    inherited = copy.deepcopy(base.inherited)
    for key, value in child.data.items():
        if key == "extends":
            continue
        if key in COMPONENT_KINDS and isinstance(value, dict) and isinstance(data.get(key), dict):
            parent = data[key]
            params = dict(parent.get("params") or {})
            if value.get("name") not in (None, parent.get("name")):
                inherited[key] = {**inherited.get(key, {}), **params}
                params = {}
            params.update(value.get("params") or {})
            data[key] = {"name": value.get("name", parent.get("name")), "params": params}
        else:
            locations = {p: l for p, l in locations.items() if p[:1] != (key,)}
            data[key] = copy.deepcopy(value)
    locations.update({p: l for p, l in child.locations.items() if p})
    return _Layer(data, locations, child.file, inherited)


def _load_chain(path: Path, registry: Registry, seen: tuple[Path, ...] = ()) -> _Layer:
    layer = _read_layer(path)
    parent_ref = layer.data.get("extends")
    if parent_ref is None:
        return layer
    loc = locate(layer.locations, ("extends",))
    if parent_ref.endswith((".yaml", ".yml")) or "/" in parent_ref:
        parent_path = (path.parent / parent_ref).resolve()
        if not parent_path.exists():
            raise WorkflowError([Issue(loc, "extends", f"extended workflow file {shown(parent_ref)} does not exist")])
    else:
        try:
            parent_path = registry.workflow_path(parent_ref)
        except RegistryError as e:
            raise WorkflowError([Issue(loc, "extends", str(e))]) from None
    if parent_path.resolve() in seen or parent_path.resolve() == path.resolve():
        chain = " -> ".join(str(p) for p in seen + (path, parent_path))
        raise WorkflowError([Issue(loc, "extends", f"workflow inheritance cycle: {chain}")])
    parent = _load_chain(parent_path, registry, seen + (path.resolve(),))
    return _merge(parent, layer)


def parse_override(text: str) -> tuple[KeyPath, Any]:
    """`scheduler.params.max_num_batched_tokens=8192` → (('scheduler','params','max_num_batched_tokens'), 8192).

    The value is read as YAML (safe) so numbers, booleans, lists and null keep their types.
    """
    if "=" not in text:
        raise WorkflowError([Issue(Location("--set"), brief(text),
                                   "an override must look like 'kind.params.key=value'")])
    key, _, raw = text.partition("=")
    path = tuple(p for p in key.strip().split(".") if p)
    if not path:
        raise WorkflowError([Issue(Location("--set"), brief(text), "an override needs a key before '='")])
    try:
        value = safe_load(raw) if raw.strip() else None
    except YamlBombError as e:
        raise WorkflowError([Issue(Location("--set"), brief(key.strip()), e.message)]) from None
    except yaml.YAMLError:
        value = raw
    return path, value


Overrides = Iterable["str | tuple[KeyPath, Any]"] | Mapping[str, Any] | None


def overrides_to_paths(overrides: Overrides) -> list[tuple[KeyPath, Any]]:
    """Normalise CLI strings, (path, value) pairs or nested dicts (`{"scheduler": {"params": {...}}}`)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        out: list[tuple[KeyPath, Any]] = []

        def flatten(prefix: KeyPath, value: Any) -> None:
            if isinstance(value, Mapping) and value:
                for k, v in value.items():
                    flatten(prefix + tuple(str(k).split(".")), v)
            elif prefix:
                out.append((prefix, value))

        flatten((), overrides)
        return out
    return [o if isinstance(o, tuple) else parse_override(o) for o in overrides]


def _apply_overrides(layer: _Layer, overrides: list[tuple[KeyPath, Any]]) -> _Layer:
    data = copy.deepcopy(layer.data)
    locations = dict(layer.locations)
    inherited = copy.deepcopy(layer.inherited)
    for path, value in overrides:
        current = data.get(path[0])
        if path[0] in COMPONENT_KINDS and path[1:] == ("name",) and isinstance(current, dict) \
                and current.get("name") != value:
            inherited[path[0]] = {**inherited.get(path[0], {}), **(current.get("params") or {})}
            current["params"] = {}
        node = data
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
        where = Location(f"--set {dotted_path(path)}={brief(value)}")
        locations[path] = where
        for i in range(1, len(path)):  # a key the override introduces is reported at the override
            locations.setdefault(path[:i], where)
    return _Layer(data, locations, layer.file, inherited)


def _resolve_components(layer: _Layer, registry: Registry) -> dict[str, ResolvedComponent]:
    try:
        wf = _WorkflowFile.model_validate(layer.data)
    except ValidationError as e:
        raise WorkflowError(_pydantic_issues(e, layer.locations, ())) from None
    issues: list[Issue] = []
    resolved: dict[str, ResolvedComponent] = {}
    for kind in COMPONENT_KINDS:
        ref: ComponentRef | None = getattr(wf, kind)
        if ref is None and kind in DEFAULT_COMPONENTS:
            ref = ComponentRef(name=DEFAULT_COMPONENTS[kind])
        if ref is None or ref.name is None:
            path = (kind,) if ref is None else (kind, "name")
            issues.append(Issue(locate(layer.locations, path), ".".join(path),
                                f"the workflow sets no {kind} component (add '{kind}: {{name: ...}}' or extend a workflow that does)"))
            continue
        known = registry.components[kind]
        entry = known.get(ref.name)
        if entry is None:
            names = sorted(known)
            issues.append(Issue(locate(layer.locations, (kind, "name")), f"{kind}.name",
                                f"unknown {kind} component {shown(ref.name)};{did_you_mean(ref.name, names)}"
                                f" (available: {', '.join(names) or 'none'})"))
            continue
        component: type[Component] | LazyComponent = entry.value  # type: ignore[assignment]
        params_model = component.Params
        kept = {k: v for k, v in layer.inherited.get(kind, {}).items() if k in params_model.model_fields}
        try:
            params = params_model.model_validate({**kept, **ref.params})
        except ValidationError as e:
            field_names = list(params_model.model_fields)
            for issue in _pydantic_issues(e, layer.locations, (kind, "params")):
                last = issue.path.rsplit(".", 1)[-1]
                if issue.message.startswith("unknown key"):
                    hint = did_you_mean(last, field_names)
                    issue = Issue(issue.location, issue.path,
                                  f"unknown param {last!r} for {kind} {ref.name!r};{hint}"
                                  f" (params: {', '.join(field_names) or 'none'})")
                issues.append(issue)
            continue
        resolved[kind] = ResolvedComponent(kind, ref.name, component, params, entry.plugin)
    if not issues:
        issues.extend(_capability_issues(resolved, layer, registry))
    if issues:
        raise WorkflowError(issues)
    return resolved


_NEEDS = {"attention_bias": "adds an additive attention bias", "attention_window": "uses local (windowed) attention"}


def _capability_issues(resolved: dict[str, ResolvedComponent], layer: _Layer, registry: Registry) -> list[Issue]:
    """The model's needs that its attention backend does not support, each naming the backends that fit."""
    model, attention = resolved.get("model"), resolved.get("attention")
    if model is None or attention is None:
        return []
    missing = sorted(capabilities_of(model.component) - capabilities_of(attention.component))
    if not missing:
        return []
    fits = sorted(name for name, entry in registry.components["attention"].items()
                  if set(missing) <= capabilities_of(entry.value))  # type: ignore[arg-type]
    needs = " and ".join(_NEEDS.get(m, m) for m in missing)
    return [Issue(locate(layer.locations, ("attention", "name")), "attention.name",
                  f"model {model.name!r} {needs}, which attention {attention.name!r} does not support;"
                  f" attention backends that fit: {', '.join(fits) or 'none'}")]


def find_workflow_file(workflow: str | Path, registry: Registry | None = None) -> Path:
    """A path on disk, or the file of a registered workflow name."""
    registry = registry or get_registry()
    path = Path(workflow)
    if path.exists() and not path.is_dir():  # a FIFO or device: refused by name when read
        return path
    folder = " is a folder, not a workflow file (a .yaml file or a registered workflow name)" if path.is_dir() else ""
    if isinstance(workflow, str) and not workflow.endswith((".yaml", ".yml")) and "/" not in workflow:
        try:  # a registered name wins over a folder of that name in the working directory (`-w clip` beside ./clip)
            return registry.workflow_path(workflow)
        except RegistryError as e:
            raise WorkflowError([Issue(Location(workflow), "", f"{workflow!r}{folder}; {e}" if folder else str(e))]) \
                from None
    raise WorkflowError([Issue(Location(str(workflow)), "", folder.strip() or "workflow file does not exist")])


def load_workflow(
    workflow: str | Path,
    overrides: Overrides = None,
    registry: Registry | None = None,
) -> ResolvedWorkflow:
    """Read, inherit, override and resolve a workflow; raise `WorkflowError` listing every problem."""
    registry = registry or get_registry()
    path = find_workflow_file(workflow, registry)
    layer = _load_chain(path, registry)
    layer = _apply_overrides(layer, overrides_to_paths(overrides))
    components = _resolve_components(layer, registry)
    return ResolvedWorkflow(
        name=layer.data["name"],
        description=layer.data.get("description", ""),
        family=layer.data.get("family", ""),
        architectures=tuple(layer.data.get("architectures", [])),
        source=str(path),
        components=components,
    )
