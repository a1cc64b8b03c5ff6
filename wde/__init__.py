"""WDE, the Workflow Defined Engine: serve prefill-only transformer models defined by YAML workflows."""

from wde.engine import Engine
from wde.errors import ModelLoadError, RequestError, WorkflowError
from wde.request import PoolingParams, RequestOutput
from wde.workflow import load_workflow

__all__ = ["Engine", "ModelLoadError", "PoolingParams", "RequestError", "RequestOutput", "WorkflowError", "load_workflow"]
__version__ = "0.1.0"
