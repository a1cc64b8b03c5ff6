"""The built-in components, registered through the same hook third-party plugins use."""

from __future__ import annotations

from typing import Callable

from wde.components.attention.auto import AutoBackend
from wde.components.attention.torch_sdpa import TorchSDPABackend
from wde.components.attention.triton_varlen import TritonVarlenBackend
from wde.components.bge_m3 import BGEM3OutputProcessor, BGEM3Pooler
from wde.components.classifier import ClassifierPooler
from wde.components.executor import SyncExecutor, ThreadExecutor
from wde.components.input_processor import TextInputProcessor
from wde.components.model_input_builder import PackedInputBuilder
from wde.components.models.bert import BertModel, XLMRobertaModel
from wde.components.models.llama import LlamaModel, MistralModel
from wde.components.models.qwen2 import Qwen2Model
from wde.components.output_processor import EmbeddingOutputProcessor
from wde.components.pooler import SentencePooler
from wde.components.request_processor import LazyTokenizeRequestProcessor
from wde.components.runner import TorchRunner
from wde.components.scheduler import FCFSScheduler
from wde.components.tokenizer import HFTokenizer
from wde.plugins.hookspecs import hookimpl

BUILTIN_COMPONENTS: tuple[type, ...] = (
    HFTokenizer,
    TextInputProcessor,
    LazyTokenizeRequestProcessor,
    FCFSScheduler,
    PackedInputBuilder,
    AutoBackend,
    TorchSDPABackend,
    TritonVarlenBackend,
    BertModel,
    XLMRobertaModel,
    Qwen2Model,
    LlamaModel,
    MistralModel,
    SentencePooler,
    BGEM3Pooler,
    ClassifierPooler,
    TorchRunner,
    SyncExecutor,
    ThreadExecutor,
    EmbeddingOutputProcessor,
    BGEM3OutputProcessor,
)


@hookimpl
def register_components(register: Callable[[type], None]) -> None:
    for component in BUILTIN_COMPONENTS:
        register(component)
