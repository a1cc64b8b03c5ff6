"""What every component is: a class with a kind, a registered name and a pydantic `Params` model.

The engine builds components in `COMPONENT_KINDS` order and hands each the same `BuildContext`, which
carries the model source and the components built before it. A component may call the public methods of
an earlier one (the request processor calls the tokenizer) but never its private state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from wde.model_source import ModelSource
    from wde.workflow import ResolvedWorkflow

COMPONENT_KINDS: tuple[str, ...] = (
    "tokenizer",
    "input_processor",
    "request_processor",
    "scheduler",
    "model_input_builder",
    "attention",
    "model",
    "pooler",
    "scorer",
    "runner",
    "executor",
    "output_processor",
)
"""Every workflow names one component of each kind; this is also the order they are built in."""

DEFAULT_COMPONENTS: dict[str, str] = {"scorer": "auto"}
"""The component a workflow gets for a kind it does not name: kinds added after workflows were written (a plugin's
standalone workflow from before the `scorer` kind builds, scoring by what its pooler produces)."""


class Params(BaseModel):
    """Base for component parameter models: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Component:
    """Base class of all components. A component subclasses its kind's base (`wde.components.kinds`: `Pooler`,
    `Tokenizer`, ..., which sets `kind` and states what every component of the kind has) and sets `name` and, when
    it takes any, `Params`."""

    kind: ClassVar[str] = ""
    """Set by the kind's base class (`wde.components.kinds`): which kind of component this is."""
    name: ClassVar[str] = ""
    """The name a workflow gives it (unique within its kind); empty: not registrable."""
    Params: ClassVar[type[Params]] = Params

    def __init__(self, params: Params, ctx: "BuildContext") -> None:
        self.params = params

    @classmethod
    def cpu_kernels(cls, params: Params) -> tuple[str, ...]:
        """The host-compiled C++ kernels (`wde.kernels.cpp_build.KERNELS`) a component of this class built with
        these params calls on CPU. An engine placed on CPU starts their builds first thing, so that a first start's
        compiles run beside each other and beside the model's load. None by default."""
        return ()

    def request_options(self) -> dict[str, tuple[str, ...]]:
        """The per-request options this component reads (`PoolingParams.options`, with `PoolingParams.option`),
        each with the values it takes, the default first. The engine accepts an option only where a component
        declares it; components that read the same option must declare the same values. None by default."""
        return {}


@dataclass
class BuildContext:
    """What a component may use while it is built: the model source, the workflow, earlier components."""

    source: "ModelSource"
    workflow_name: str
    components: dict[str, Component] = field(default_factory=dict)
    params: dict[str, Params] = field(default_factory=dict)
    """Every kind's params as the workflow resolved them, its component built yet or not: what a component may read
    of one built after it (the scheduler's `auto` token budget reads the model's `quantization`)."""

    @classmethod
    def of(cls, source: "ModelSource", workflow: "ResolvedWorkflow") -> "BuildContext":
        """The context a workflow's components are built in: no component yet, every kind's params."""
        return cls(source, workflow.name, params={kind: rc.params for kind, rc in workflow.components.items()})

    def __getattr__(self, kind: str) -> Any:
        components = self.__dict__.get("components", {})
        if kind in components:
            return components[kind]
        raise AttributeError(f"component {kind!r} is not built yet (build order: {', '.join(COMPONENT_KINDS)})")
