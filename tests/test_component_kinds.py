"""Each component kind has a base class (wde/components/kinds.py, exported from wde.api): every registered
component subclasses its kind's base, the registry refuses one that does not (eagerly registered classes at
registration, lazily registered ones when loaded), and the defaults the contract states are what callers read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import wde.api
from wde.components.base import COMPONENT_KINDS, Component
from wde.components.kinds import KIND_BASES, InputProcessor, Scheduler, kind_base, public_base_name
from wde.errors import RegistryError, RequestError
from wde.plugins import make_plugin_manager
from wde.registry import LazyComponent, Registry, get_registry, load_component

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
SOURCE = Path(__file__).resolve().parents[1] / "wde"


def test_every_kind_has_a_public_base_with_that_kind() -> None:
    assert set(KIND_BASES) == set(COMPONENT_KINDS)
    for kind in COMPONENT_KINDS:
        base = kind_base(kind)
        assert base.kind == kind and issubclass(base, Component)
        assert getattr(wde.api, public_base_name(kind)) is base, kind


def test_every_registered_builtin_subclasses_its_kind_base() -> None:
    registry = Registry.from_plugin_manager(make_plugin_manager(load_entrypoints=False))
    for kind, entries in registry.components.items():
        for name, entry in entries.items():
            cls = load_component(entry.value)  # type: ignore[arg-type]
            assert issubclass(cls, kind_base(kind)), f"{kind} {name!r}: {cls.__qualname__}"


class LoosePooler(Component):
    """A pooler written against the bare Component, as plugins were before the kinds had bases."""

    kind = "pooler"
    name = "loose_test"
    outputs = ("dense",)


def test_registering_a_class_outside_its_kind_base_is_refused_by_name() -> None:
    with pytest.raises(RegistryError) as info:
        Registry().add_component(LoosePooler, plugin="old_plugin")
    message = str(info.value)
    assert "LoosePooler" in message and "old_plugin" in message and "wde.api.Pooler" in message


def test_a_class_of_another_kind_is_refused_too() -> None:
    class SchedulerAsPooler(Scheduler):  # the scheduler base, declared as a pooler
        kind = "pooler"
        name = "mixed_up_test"

    with pytest.raises(RegistryError, match="does not subclass the pooler base wde.api.Pooler"):
        Registry().add_component(SchedulerAsPooler)


def test_a_lazy_registration_is_checked_when_loaded() -> None:
    lazy = LazyComponent("pooler", "loose_test", f"{__name__}:LoosePooler")
    registry = Registry()
    registry.add_component(lazy, plugin="lazy_plugin")  # nothing imported yet: registering stays cheap
    with pytest.raises(RegistryError, match=r"test_component_kinds:LoosePooler is a pooler component.*wde\.api\.Pooler"):
        registry.component("pooler", "loose_test")


def test_example_plugins_subclass_the_public_bases() -> None:
    registry = get_registry()
    for kind, name in (("pooler", "mean_max"), ("pooler", "sentence_dense"), ("model", "t5_encoder")):
        if name not in registry.components[kind]:
            pytest.skip(f"the example plugin registering {kind} {name!r} is not installed")
        assert issubclass(registry.component(kind, name), kind_base(kind))


class PlainInput(InputProcessor):
    name = "plain_test"


def test_contract_defaults_are_the_documented_ones() -> None:
    plain = PlainInput.__new__(PlainInput)
    assert (plain.prompts, plain.pairs, plain.takes_images, plain.image_token_id) == ({}, "forbid", False, None)
    assert plain.check_text("x", "input") == "x"
    with pytest.raises(RequestError, match="input is an image, but input processor 'plain_test'.*texts only"):
        plain.image_prompt(b"png", "input")
    plain.check_request([], [])  # nothing to refuse by default
    sched = Scheduler.__new__(Scheduler)
    assert (sched.num_waiting, sched.queued_tokens, sched.max_num_requests, sched.clear()) == (0, 0, None, [])


def test_docs_describe_every_kind_base() -> None:
    text = DOCS.read_text(encoding="utf-8")
    for kind in COMPONENT_KINDS:
        assert f"`{public_base_name(kind)}`" in text, f"docs/plugins.md does not describe the {kind} base"


PROBED = ("pooler", "scheduler", "input_processor", "request_processor", "tokenizer", "executor", "model", "runner",
          "attention", "model_input_builder", "output_processor", "scorer")


def test_no_getattr_probing_of_components_in_core() -> None:
    """Callers read a component's contract plainly: no getattr(<component>, "name", default) in wde/ (a Hugging
    Face object reached through a component, such as `ctx.tokenizer.hf_tokenizer`, may still be probed)."""
    kinds = "|".join(PROBED)
    patterns = [re.compile(rf"getattr\((?:ctx|engine|self|handle|self\.engine)\.(?:{kinds})\b(?!\.hf_tokenizer)"),
                re.compile(rf"getattr\((?:{kinds.replace('tokenizer|', '')}),"),  # a component passed in by name
                re.compile(r'getattr\((?:self|engine)\.components(?:\.get\(|\[)')]
    found = [f"{path.relative_to(SOURCE.parent)}:{i}: {line.strip()}"
             for path in SOURCE.rglob("*.py") for i, line in enumerate(path.read_text().splitlines(), 1)
             if any(p.search(line) for p in patterns)]
    assert not found, "\n".join(found)
