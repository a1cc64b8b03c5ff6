"""Hook implementations: what this plugin adds to WDE's registry.

Components are registered by reference (`LazyComponent`), so listing plugins or validating workflows never
imports torch or the model code; their modules are imported when an engine is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from wde.api import LazyComponent, ModelParams, hookimpl
from wde_plugin_t5.params import DensePoolerParams

WORKFLOWS_DIR = Path(__file__).parent / "workflows"


@hookimpl
def register_components(register: Callable[[LazyComponent], None]) -> None:
    # capabilities: it adds a relative position bias, so `wde validate` can check the attention backend fits
    register(LazyComponent("model", "t5_encoder", "wde_plugin_t5.model:T5EncoderModel", ModelParams,
                           frozenset({"attention_bias"})))
    register(LazyComponent("pooler", "sentence_dense", "wde_plugin_t5.pooler:SentenceDensePooler", DensePoolerParams))


@hookimpl
def register_workflows(register: Callable[[Path], None]) -> None:
    for path in sorted(WORKFLOWS_DIR.glob("*.yaml")):
        register(path)


@hookimpl
def register_architectures(register: Callable[[str, str], None]) -> None:
    register("T5EncoderModel", "sentence_t5")
