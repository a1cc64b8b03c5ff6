"""The WDE plugin hooks: the single place that says what a plugin can add.

Built-in components and workflows are registered through these same hooks (see `wde.plugins.DEFAULT_PLUGINS`),
so a third-party plugin has exactly the power the core has. Every hook receives a `register` callback and
returns nothing; a name registered twice is an error naming both plugins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pluggy

hookspec = pluggy.HookspecMarker("wde")
hookimpl = pluggy.HookimplMarker("wde")


@hookspec
def register_components(register: Callable[[type], None]) -> None:
    """Register component classes. Called once, when the registry is first built.

    :param register: call ``register(ComponentClass)`` for each class. The class must subclass
        ``wde.components.base.Component`` and set ``kind`` (one of ``COMPONENT_KINDS``), ``name`` (unique
        within its kind) and, if it takes parameters, a ``Params`` pydantic model.
    """


@hookspec
def register_workflows(register: Callable[[Path], None]) -> None:
    """Register workflow YAML files so users can name them (``--workflow bge_m3``) and ``extends`` them.

    Called once, when the registry is first built.

    :param register: call ``register(path)`` for each workflow file; the workflow's ``name`` key is the name
        it is registered under.
    """


@hookspec
def register_architectures(register: Callable[[str, str | Callable[..., str]], None]) -> None:
    """Map Hugging Face ``architectures`` names to the workflow that serves them by default.

    Called once, when the registry is first built. Used when a user gives ``--model`` without ``--workflow``.

    :param register: call ``register(architecture, workflow_name)``, e.g.
        ``register("XLMRobertaModel", "xlm_roberta")``. For an architecture that checkpoints of several
        families declare, pass instead a callable taking the ``ModelSource`` and returning a workflow name (or
        raising ``RegistryError`` when the folder leaves the choice open); give it a ``__str__`` for ``wde plugins``.
    """
