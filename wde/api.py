"""The public API for plugin authors: every name a plugin may import from WDE, from this one module.

Anything else under `wde.` is internal and may change without notice; these names are kept stable, are
typed, and are each described in docs/plugins.md (tests/test_public_api.py fails when one is not).

Names are imported on first use (PEP 562), so a plugin's hook module can write
`from wde.api import hookimpl, LazyComponent, Params` without importing torch (`wde plugins`, `wde validate`
stay fast), while its component modules import the torch-side names (`PrefillModel`, `BertLayer`, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wde.lazy import lazy_exports

if TYPE_CHECKING:
    from wde.components.attention.base import AttentionBackend, AttentionMetadata, check_bias
    from wde.components.base import COMPONENT_KINDS, BuildContext, Component, Params
    from wde.components.input_processor import TextInputProcessor
    from wde.components.kinds import (Attention, Executor, InputProcessor, Model, ModelInputBuilder, OutputProcessor,
                                      Pooler, RequestProcessor, Runner, Scheduler, Tokenizer)
    from wde.components.model_input_builder import ModelInput, PackedInputBuilder
    from wde.components.multi_vector import maxsim
    from wde.components.request_processor import LazyTokenizeRequestProcessor
    from wde.components.models.base import PrefillModel
    from wde.components.models.bert import (BertAttention, BertEmbeddings, BertEncoder, BertIntermediate, BertLayer,
                                            BertModel, BertSelfOutput)
    from wde.components.models.decoder_layers import RMSNorm
    from wde.components.models.fused import add_layer_norm, add_rms_norm, l2_normalize
    from wde.components.lora import AdapterTable, LoraLinear, LoraSet, read_peft_adapter
    from wde.components.models.loader import checkpoint_target, fused_linear, load_weights
    from wde.components.params import AttentionParams, ModelParams, SentencePoolerParams
    from wde.components.pooler import (ChunkedPooling, Pooled, SentencePooler, SpanPooling, StPooling, finish_embeddings, pool,
                                      segment_ids, st_pooling, st_pooling_mode)
    from wde.components.scorer import Scorer, ScoringPlan, scoring_plan
    from wde.components.tokenizer import HFTokenizer, HFTokenizerParams
    from wde.errors import ModelLoadError, RequestError
    from wde.late_chunking import LateChunk
    from wde.model_source import ModelSource
    from wde.plugins import make_plugin_manager
    from wde.plugins.hookspecs import hookimpl
    from wde.registry import LazyComponent, Registry
    from wde.request import PoolingParams, SchedulableRequest

_PUBLIC: dict[str, str] = {
    # plugins and registration
    "hookimpl": "wde.plugins.hookspecs",
    "LazyComponent": "wde.registry",
    "Registry": "wde.registry",
    "make_plugin_manager": "wde.plugins",
    # every component
    "COMPONENT_KINDS": "wde.components.base",
    "Component": "wde.components.base",
    "Params": "wde.components.base",
    "BuildContext": "wde.components.base",
    # the base class of each component kind (its contract: wde/components/kinds.py)
    "Tokenizer": "wde.components.kinds",
    "InputProcessor": "wde.components.kinds",
    "RequestProcessor": "wde.components.kinds",
    "Scheduler": "wde.components.kinds",
    "ModelInputBuilder": "wde.components.kinds",
    "Attention": "wde.components.kinds",
    "Model": "wde.components.kinds",
    "Pooler": "wde.components.kinds",
    "Runner": "wde.components.kinds",
    "Executor": "wde.components.kinds",
    "OutputProcessor": "wde.components.kinds",
    "ModelSource": "wde.model_source",
    "ModelInput": "wde.components.model_input_builder",
    "PoolingParams": "wde.request",
    "SchedulableRequest": "wde.request",
    "TextInputProcessor": "wde.components.input_processor",
    "LazyTokenizeRequestProcessor": "wde.components.request_processor",
    "PackedInputBuilder": "wde.components.model_input_builder",
    "ModelLoadError": "wde.errors",
    "RequestError": "wde.errors",
    # attention
    "AttentionBackend": "wde.components.attention.base",
    "AttentionMetadata": "wde.components.attention.base",
    "AttentionParams": "wde.components.params",
    "check_bias": "wde.components.attention.base",
    "Window": "wde.components.attention.base",
    "check_window": "wde.components.attention.base",
    "window_keys": "wde.components.attention.base",
    "check_key_mask": "wde.components.attention.base",
    # models and their building blocks
    "PrefillModel": "wde.components.models.base",
    "ModelParams": "wde.components.params",
    "BertModel": "wde.components.models.bert",
    "BertEmbeddings": "wde.components.models.bert",
    "BertAttention": "wde.components.models.bert",
    "BertSelfOutput": "wde.components.models.bert",
    "BertIntermediate": "wde.components.models.bert",
    "BertLayer": "wde.components.models.bert",
    "BertEncoder": "wde.components.models.bert",
    "RMSNorm": "wde.components.models.decoder_layers",
    "RotaryEmbedding": "wde.components.models.rotary",
    "apply_rotary": "wde.components.models.rotary",
    "norm_rotary": "wde.components.models.rotary",
    "fused_linear": "wde.components.models.loader",
    "ConfigView": "wde.components.models.config_view",
    "load_weights": "wde.components.models.loader",
    "checkpoint_target": "wde.components.models.loader",
    "LoraSet": "wde.components.lora",
    "LoraLinear": "wde.components.lora",
    "AdapterTable": "wde.components.lora",
    "read_peft_adapter": "wde.components.lora",
    "add_layer_norm": "wde.components.models.fused",
    "add_rms_norm": "wde.components.models.fused",
    "l2_normalize": "wde.components.models.fused",
    "relative_position_bucket": "wde.components.models.relative_position",
    "relative_position_buckets": "wde.components.models.relative_position",
    # tokenizer
    "HFTokenizer": "wde.components.tokenizer",
    "HFTokenizerParams": "wde.components.tokenizer",
    # poolers
    "Pooled": "wde.components.pooler",
    "pool": "wde.components.pooler",
    "segment_ids": "wde.components.pooler",
    "finish_embeddings": "wde.components.pooler",
    "st_pooling_mode": "wde.components.pooler",
    "st_pooling": "wde.components.pooler",
    "StPooling": "wde.components.pooler",
    "SentencePooler": "wde.components.pooler",
    "SentencePoolerParams": "wde.components.params",
    "SpanPooling": "wde.components.pooler",
    "ChunkedPooling": "wde.components.pooler",
    "LateChunk": "wde.late_chunking",
    # scorers
    "Scorer": "wde.components.scorer",
    "ScoringPlan": "wde.components.scorer",
    "scoring_plan": "wde.components.scorer",
    "maxsim": "wde.components.multi_vector",
}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, " (the public API is wde.api.__all__)")
