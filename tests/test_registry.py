"""The plugin surface: every hook is tested and documented, duplicates and typos fail loudly, the allowlist works."""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
import types
from pathlib import Path
from typing import Callable

import pluggy
import pytest

import wde.plugins
from wde import Engine
from wde.api import Pooler
from wde.components.base import Component, Params
from wde.errors import ModelLoadError, RegistryError, WorkflowError
from wde.model_source import ModelSource
from wde.plugins import hookspecs, make_plugin_manager
from wde.plugins.builtin_components import BUILTIN_COMPONENTS
from wde.plugins.builtin_workflows import DEFAULT_ARCHITECTURES, workflows_dir
from wde.registry import Registry
from wde.workflow import load_workflow

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
HOOKS = sorted(name for name, fn in vars(hookspecs).items() if callable(fn) and hasattr(fn, "wde_spec"))


class EchoPooler(Pooler):
    """A throwaway pooler that exists only in these tests."""

    name = "echo_test"

    class Params(Params):
        scale: float = 1.0


class OtherEchoPooler(Pooler):
    name = "echo_test"


def plugin_object(**hooks: Callable[..., None]) -> types.SimpleNamespace:
    """A plugin object whose attributes are hook implementations (what pluggy accepts besides modules)."""
    return types.SimpleNamespace(**{name: hookspecs.hookimpl(fn) for name, fn in hooks.items()})


def registry_with(*plugins: tuple[str, object]) -> Registry:
    """A registry from the built-ins plus `plugins`, which are always unregistered again."""
    pm = make_plugin_manager(load_entrypoints=False)
    try:
        for name, plugin in plugins:
            pm.register(plugin, name=name)
        pm.check_pending()
        return Registry.from_plugin_manager(pm)
    finally:
        for name, _ in plugins:
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)


def test_every_hook_is_found() -> None:
    assert HOOKS, "no hookspecs found in wde/plugins/hookspecs.py"
    assert set(HOOKS) >= {"register_components", "register_workflows", "register_architectures"}


@pytest.mark.parametrize("hook", HOOKS)
def test_plugin_hooks_have_tests(hook: str) -> None:
    assert callable(globals().get(f"test_hook_{hook}")), f"Plugin hook is missing tests: {hook}"


@pytest.mark.parametrize("hook", HOOKS)
def test_plugin_hooks_are_documented(hook: str) -> None:
    docs = DOCS.read_text(encoding="utf-8")
    params = ", ".join(inspect.signature(getattr(hookspecs, hook)).parameters)
    assert f"{hook}({params})" in docs, f"Plugin hook is missing documentation: {hook}({params}) in {DOCS}"


def test_hook_register_components(tmp_path: Path) -> None:
    plugin = plugin_object(register_components=lambda register: register(EchoPooler))
    reg = registry_with(("throwaway", plugin))
    entry = reg.components["pooler"]["echo_test"]
    assert entry.value is EchoPooler and entry.plugin == "throwaway"
    assert set(reg.components["pooler"]) >= {"sentence", "echo_test"}
    wf = tmp_path / "wf.yaml"
    wf.write_text("name: t\nextends: bert\npooler:\n  name: echo_test\n  params:\n    scale: 2\n", encoding="utf-8")
    resolved = load_workflow(wf, registry=reg).components["pooler"]
    assert (resolved.cls, resolved.plugin, resolved.params.scale) == (EchoPooler, "throwaway", 2.0)
    with pytest.raises(WorkflowError, match="unknown pooler component 'echo_test'"):
        load_workflow(wf, registry=registry_with())


class WidthlessDensePooler(Pooler):
    """Produces 'dense' without saying how wide it is."""

    name = "widthless_test"
    outputs = ("dense",)


def test_a_dense_pooler_must_declare_its_width(tmp_path: Path, tiny_bert: Path) -> None:
    reg = registry_with(("throwaway", plugin_object(register_components=lambda register: register(WidthlessDensePooler))))
    wf = tmp_path / "wf.yaml"
    wf.write_text("name: t\nextends: bert\npooler:\n  name: widthless_test\n", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="pooler 'widthless_test' produces 'dense' but does not declare its width"):
        Engine(load_workflow(wf, registry=reg), ModelSource.from_model(tiny_bert))


def test_hook_register_workflows(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text("name: throwaway_wf\nextends: bert\nscheduler:\n  params:\n    max_num_requests: 3\n",
                    encoding="utf-8")
    plugin = plugin_object(register_workflows=lambda register: register(path))
    reg = registry_with(("throwaway", plugin))
    assert reg.workflows["throwaway_wf"].plugin == "throwaway"
    assert reg.workflow_path("throwaway_wf") == path
    assert load_workflow("throwaway_wf", registry=reg).components["scheduler"].params.max_num_requests == 3
    child = tmp_path / "child.yaml"
    child.write_text("name: child\nextends: throwaway_wf\n", encoding="utf-8")
    assert load_workflow(child, registry=reg).components["scheduler"].params.max_num_requests == 3


def test_hook_register_architectures() -> None:
    plugin = plugin_object(register_architectures=lambda register: register("ThrowawayModel", "bge_v1_5"))
    reg = registry_with(("throwaway", plugin))
    assert reg.workflow_for(["UnknownModel", "ThrowawayModel"]) == "bge_v1_5"
    assert reg.architectures["ThrowawayModel"].plugin == "throwaway"
    with pytest.raises(RegistryError, match="register_architectures"):
        registry_with().workflow_for(["ThrowawayModel"])


def test_builtins_come_through_the_same_hooks() -> None:
    reg = registry_with()
    registered = {entry.value for kinds in reg.components.values() for entry in kinds.values()}
    assert set(BUILTIN_COMPONENTS) <= registered
    assert {name for name in reg.workflows} >= {p.stem for p in workflows_dir().glob("*.yaml")}
    for arch, workflow in DEFAULT_ARCHITECTURES.items():
        assert reg.workflow_for([arch]) == workflow
    assert {e.plugin for e in reg.workflows.values()} == {"wde.plugins.builtin_workflows"}


def test_duplicate_component_names_both_plugins() -> None:
    first = plugin_object(register_components=lambda register: register(EchoPooler))
    second = plugin_object(register_components=lambda register: register(OtherEchoPooler))
    with pytest.raises(RegistryError) as info:
        registry_with(("plugin_one", first), ("plugin_two", second))
    message = str(info.value)
    assert "duplicate pooler component 'echo_test'" in message
    assert "plugin_one" in message and "plugin_two" in message


def test_duplicate_builtin_name_names_the_builtin_plugin() -> None:
    class FakeSentence(Pooler):
        name = "sentence"

    plugin = plugin_object(register_components=lambda register: register(FakeSentence))
    with pytest.raises(RegistryError) as info:
        registry_with(("intruder", plugin))
    assert "'wde.plugins.builtin_components'" in str(info.value) and "'intruder'" in str(info.value)


def test_duplicate_workflow_and_architecture_name_both_plugins(tmp_path: Path) -> None:
    path = tmp_path / "bert.yaml"
    path.write_text("name: bert\nextends: xlm_roberta\n", encoding="utf-8")
    plugin = plugin_object(register_workflows=lambda register: register(path))
    with pytest.raises(RegistryError, match="duplicate workflow 'bert'.*wde.plugins.builtin_workflows.*shadow"):
        registry_with(("shadow", plugin))
    arch = plugin_object(register_architectures=lambda register: register("BertModel", "xlm_roberta"))
    with pytest.raises(RegistryError, match="BertModel.*wde.plugins.builtin_workflows.*remap"):
        registry_with(("remap", arch))


def test_registering_something_that_is_not_a_component_fails() -> None:
    class NoKind(Component):
        name = "x"

    for bad, words in ((object, "not a Component subclass"), (NoKind, "kind")):
        plugin = plugin_object(register_components=lambda register, bad=bad: register(bad))
        with pytest.raises(RegistryError, match=words):
            registry_with(("bad_plugin", plugin))


def test_hookimpl_with_a_typo_fails_check_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("_wde_typo_plugin")
    module.register_component = hookspecs.hookimpl(lambda register: None)  # missing the final "s"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(wde.plugins, "DEFAULT_PLUGINS", wde.plugins.DEFAULT_PLUGINS + (module.__name__,))
    with pytest.raises(pluggy.PluginValidationError, match="register_component"):
        make_plugin_manager(load_entrypoints=False)


class _FakeDist:
    """Just enough of `importlib.metadata.Distribution` for entry-point loading."""

    def __init__(self, name: str, module: str) -> None:
        self.metadata = {"Name": name}
        self.entry_points = [importlib.metadata.EntryPoint(name="fake_plugin", value=module, group="wde")]
        self.version = "0.0.1"
        self.name = name


@pytest.fixture
def fake_installed_plugin(monkeypatch: pytest.MonkeyPatch) -> str:
    """Pretend a distribution `wde-fake-plugin` is installed with a `wde` entry point registering a pooler."""
    module = types.ModuleType("_wde_fake_plugin")
    module.register_components = hookspecs.hookimpl(lambda register: register(EchoPooler))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    dist = _FakeDist("wde-fake-plugin", module.__name__)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda **kw: [dist])
    return "fake_plugin"


@pytest.mark.parametrize(
    ("allow", "loaded"),
    [(None, True), ("wde-fake-plugin", True), ("other, wde_fake_plugin", True), ("", False), ("other", False)],
)
def test_wde_load_plugins_allowlist(monkeypatch: pytest.MonkeyPatch, fake_installed_plugin: str,
                                    allow: str | None, loaded: bool) -> None:
    if allow is None:
        monkeypatch.delenv("WDE_LOAD_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("WDE_LOAD_PLUGINS", allow)
    pm = make_plugin_manager()
    assert (pm.get_plugin(fake_installed_plugin) is not None) == loaded
    reg = Registry.from_plugin_manager(pm)
    assert ("echo_test" in reg.components["pooler"]) == loaded
    assert "sentence" in reg.components["pooler"]
