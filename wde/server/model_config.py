"""The models one `wde serve` serves: from repeated `--model` options (each with a matching `--workflow` and
`--served-model-name`, or none) or from a small YAML serve config (`--config serve.yaml`), and the names requests
may call each by.

Every problem is a `StartupError`: one line naming the option (or the file, line and column of the YAML key),
exit 1, before anything loads.

`--set KEY=VALUE` applies to every model; `--set NAME:KEY=VALUE` only to the model called NAME (any of its explicit
names: a --served-model-name, the --model value or the name clients see for it).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from wde.errors import WorkflowError
from wde.model_source import DEFAULT_MODEL
from wde.server.startup import StartupError


@dataclass(frozen=True)
class ModelConfig:
    """One served model: what `Engine.from_workflow` builds it from and what the API calls it."""

    model: str | None = None
    """A model folder or cached hub id; None: the default model (all-MiniLM-L6-v2)."""
    workflow: str | None = None
    """A workflow file or name; None: chosen from the model folder."""
    served_model_name: str | None = None
    """The names requests may call it by, comma separated; the first is the one responses show."""
    overrides: tuple[str, ...] = ()
    """`--set KEY=VALUE` overrides of its workflow."""

    @property
    def public_name(self) -> str:
        """The model as clients see it: a hub id as given, a local folder by its name alone."""
        return public_name(self.model) or DEFAULT_MODEL

    def explicit_names(self) -> tuple[str, ...]:
        """The served names, then the public name and the --model value: names a user chose or typed."""
        return explicit_names(self.served_model_name, self.public_name, self.model)

    def names(self) -> tuple[str, ...]:
        """Every `model` a request may name, the primary first (`with_aliases`)."""
        return with_aliases(self.explicit_names())

    def engine_args(self, trust_remote_code: bool) -> dict[str, object]:
        """What `Engine.from_workflow` / `wde.engine.resolve` are given to build it."""
        return {"workflow": self.workflow, "model": self.model, "overrides": list(self.overrides),
                "trust_remote_code": trust_remote_code}


def explicit_names(served_model_name: str | None, public: str, model: str | None) -> tuple[str, ...]:
    """The --served-model-name values (comma separated), then `public` (the model as clients see it), then the
    --model value."""
    served = [n.strip() for n in (served_model_name or "").split(",") if n.strip()]
    return tuple(dict.fromkeys([*served, public, *([model] if model else [])]))


def with_aliases(names: Sequence[str]) -> tuple[str, ...]:
    """`names`, then each one's short alias, its last path component (`sentence-transformers/all-MiniLM-L6-v2` →
    `all-MiniLM-L6-v2`)."""
    every = [*names, *(n.rstrip("/").rsplit("/", 1)[-1] for n in names)]
    return tuple(dict.fromkeys(n for n in every if n))


def public_name(model: str | None) -> str | None:
    """A model argument fit to show clients: a hub id as given, a local folder by its name alone."""
    if model is None:
        return None
    path = Path(model).expanduser()
    return path.name if path.is_absolute() or path.exists() or model.startswith(".") else model


def name_table(models: Sequence[ModelConfig]) -> list[tuple[str, ...]]:
    """The names each model answers to, in `models` order, the primary first. An explicit name (a served name,
    the public name, the --model value) that two models share is a `StartupError` naming both; a short alias two
    models share, or that is another model's explicit name, is dropped from the one that only derived it (a
    request naming it would be a guess)."""
    explicit = [m.explicit_names() for m in models]
    owner: dict[str, int] = {}
    for i, names in enumerate(explicit):
        for name in names:
            if name in owner and owner[name] != i:
                j = owner[name]
                raise StartupError(f"models {j + 1} ({models[j].model or DEFAULT_MODEL}) and {i + 1}"
                                   f" ({models[i].model or DEFAULT_MODEL}) are both called {name!r}; give each its"
                                   " own --served-model-name (or served_model_name in the serve config)")
            owner[name] = i
    derived: dict[str, set[int]] = {}
    for i, m in enumerate(models):
        for name in m.names():
            if name not in explicit[i]:
                derived.setdefault(name, set()).add(i)
    table = []
    for i, m in enumerate(models):
        table.append(tuple(n for n in m.names() if n in explicit[i]
                           or (n not in owner and derived.get(n) == {i})))
    return table


def from_options(models: Sequence[str], workflows: Sequence[str], names: Sequence[str],
                 overrides: Sequence[str]) -> tuple[ModelConfig, ...]:
    """The models of repeated `--model` options, each paired with the `--workflow` and `--served-model-name` in
    the same place (either option given once per model, or not at all), and the `--set` overrides that apply to
    it. A count that does not match is a `StartupError` in one line."""
    count = max(len(models), 1)
    for option, values in (("--workflow", workflows), ("--served-model-name", names)):
        if values and len(values) != count:
            given = f"{len(models)} --model" if models else "no --model (the default model)"
            raise StartupError(f"{given} but {len(values)} {option}: give one {option} per --model, in the same"
                               f" order, or none{_HINTS[option]}")
    bare = [ModelConfig(model=models[i] if models else None, workflow=workflows[i] if workflows else None,
                        served_model_name=names[i] if names else None) for i in range(count)]
    return with_overrides(bare, overrides)


_HINTS = {"--workflow": " (each model's workflow is then chosen from its folder)",
          "--served-model-name": " (several names for one model: comma separated, 'a,b')"}


def with_overrides(models: Sequence[ModelConfig], overrides: Sequence[str]) -> tuple[ModelConfig, ...]:
    """`models` with the `--set` overrides added: `KEY=VALUE` to each, `NAME:KEY=VALUE` to the model called NAME
    (a StartupError when no model, or several, is)."""
    extra: list[list[str]] = [[] for _ in models]
    for override in overrides:
        key, sep, value = override.partition("=")
        name, scoped, path = key.rpartition(":") if ":" in key else ("", "", key)
        if not scoped:
            for each in extra:
                each.append(override)
            continue
        called = [i for i, m in enumerate(models) if name in m.explicit_names()]
        if len(called) != 1:
            known = ", ".join(repr(m.explicit_names()[0]) for m in models)
            why = "no model is" if not called else "several models are"
            raise StartupError(f"--set {override!r}: {why} called {name!r}; NAME:KEY=VALUE scopes an override to"
                               f" one of {known}")
        extra[called[0]].append(f"{path}{sep}{value}")
    return tuple(ModelConfig(m.model, m.workflow, m.served_model_name, (*m.overrides, *more))
                 for m, more in zip(models, extra))


MODEL_KEYS = ("model", "workflow", "served_model_name", "set")
"""What one entry of a serve config's `models` list may say."""


def load_serve_config(path: str | Path) -> tuple[ModelConfig, ...]:
    """The models of a YAML serve config (`wde serve --config serve.yaml`)::

        models:
          - model: /models/bge-small-en-v1.5
            served_model_name: embedder          # or a list: [embedder, bge]
          - model: /models/bge-reranker-base
            workflow: cross_encoder              # optional: chosen from the folder
            served_model_name: reranker
            set:                                 # optional: overrides of this model's workflow
              scheduler.params.max_num_batched_tokens: 8192

    Read as WDE reads any YAML (aliases bounded, wde/yaml_source.py); an unknown key, a wrong type or an empty
    list is a `StartupError` naming the file, line and column."""
    from wde.yaml_source import load_yaml_with_locations, locate

    file = Path(path)
    try:
        data, where = load_yaml_with_locations(file)
    except WorkflowError as e:
        raise StartupError(f"--config {file}: {e.issues[0].location}: {e.issues[0].message}") from None

    def refuse(key_path: tuple[Any, ...], message: str) -> StartupError:
        dotted = ".".join(str(k) for k in key_path)
        return StartupError(f"serve config {locate(where, key_path)}: {dotted + ': ' if dotted else ''}{message}")

    if not isinstance(data, dict):
        raise refuse((), "a serve config is a mapping with a `models` list")
    for key in data:
        if key != "models":
            raise refuse((key,), f"unknown key{_did_you_mean(key, ('models',))}; a serve config has `models` only"
                         " (server options are given on the command line)")
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise refuse(("models",), "must be a list of at least one model (each a mapping with `model`)")
    models = []
    for i, entry in enumerate(entries):
        at = ("models", i)
        if not isinstance(entry, dict):
            raise refuse(at, "each model is a mapping with `model` (and optionally workflow, served_model_name, set)")
        for key in entry:
            if key not in MODEL_KEYS:
                raise refuse((*at, key), f"unknown key{_did_you_mean(key, MODEL_KEYS)}; a model takes"
                             f" {', '.join(MODEL_KEYS)}")
        if "model" not in entry:
            raise refuse(at, "`model` is missing: a model folder or cached hub id")
        for key in ("model", "workflow"):
            if key in entry and not (isinstance(entry[key], str) and entry[key].strip()):
                raise refuse((*at, key), f"must be a non-empty string, got {entry[key]!r}")
        models.append(ModelConfig(model=entry["model"], workflow=entry.get("workflow"),
                                  served_model_name=_names(entry.get("served_model_name"), (*at, "served_model_name"),
                                                           refuse),
                                  overrides=_overrides(entry.get("set"), (*at, "set"), refuse)))
    return tuple(models)


def _names(value: Any, at: tuple[Any, ...], refuse: Any) -> str | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names) \
            or any("," in n for n in names):
        raise refuse(at, f"must be a name or a list of names (without commas), got {value!r}")
    return ",".join(n.strip() for n in names)


def _overrides(value: Any, at: tuple[Any, ...], refuse: Any) -> tuple[str, ...]:
    """`set` as a mapping (KEY: VALUE) or a list of "KEY=VALUE" strings, as `--set` takes them."""
    if value is None:
        return ()
    if isinstance(value, dict):
        return tuple(f"{k}={_scalar(v, (*at, k), refuse)}" for k, v in value.items())
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return tuple(value)
    raise refuse(at, f"must be a mapping of KEY: VALUE or a list of 'KEY=VALUE' strings, got {value!r}")


def _scalar(value: Any, at: tuple[Any, ...], refuse: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise refuse(at, f"must be a single value (a string, number or boolean), got {value!r}")


def _did_you_mean(key: Any, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
