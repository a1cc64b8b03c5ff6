"""Hook implementations: the plugin's three components (registered lazily: listing plugins imports no torch) and
its `stanford_colbert` workflow, which serves folders whose config.json names `HF_ColBERT` (as
colbert-ir/colbertv2.0's does) when named: `--workflow stanford_colbert`. WDE itself maps `HF_ColBERT` to its
built-in `multi_vector` workflows, so the plugin registers no architecture."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from wde.api import LazyComponent, Params, hookimpl
from wde_plugin_colbert.params import ColbertModelParams, ColbertTokenizerParams

WORKFLOWS_DIR = Path(__file__).parent / "workflows"


@hookimpl
def register_components(register: Callable[[LazyComponent], None]) -> None:
    module = "wde_plugin_colbert.components"
    register(LazyComponent("tokenizer", "colbert_tokenizer", f"{module}:ColbertTokenizer", ColbertTokenizerParams))
    register(LazyComponent("model", "colbert_bert", f"{module}:ColbertModel", ColbertModelParams))
    register(LazyComponent("pooler", "colbert_linear", f"{module}:ColbertPooler", Params))


@hookimpl
def register_workflows(register: Callable[[Path], None]) -> None:
    for path in sorted(WORKFLOWS_DIR.glob("*.yaml")):
        register(path)
