"""WDE, the Workflow Defined Engine: serve prefill-only transformer models defined by YAML workflows.

The public names below are imported on first use (PEP 562), so `import wde` — and with it `wde --version`,
`wde validate`, `wde inspect` and `wde plugins` — never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wde.lazy import lazy_exports

if TYPE_CHECKING:  # for type checkers and IDEs; at run time `__getattr__` imports them
    from wde.engine import Engine  # noqa: F401
    from wde.errors import ModelLoadError, RequestError, WorkflowError  # noqa: F401
    from wde.request import PoolingParams, RequestOutput  # noqa: F401
    from wde.workflow import load_workflow  # noqa: F401

_LAZY: dict[str, str] = {
    "Engine": "wde.engine",
    "ModelLoadError": "wde.errors",
    "PoolingParams": "wde.request",
    "RequestError": "wde.errors",
    "RequestOutput": "wde.request",
    "WorkflowError": "wde.errors",
    "load_workflow": "wde.workflow",
}

__all__ = sorted(_LAZY)
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
