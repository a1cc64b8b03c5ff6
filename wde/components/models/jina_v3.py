"""Jina embeddings v3 (transformers' `JinaEmbeddingsV3Model`): XLM-RoBERTa with rotary positions, and its five task
LoRA adapters served at once, the task chosen per request.

The backbone is BERT's post-norm layers with RoPE on q and k (no position table), built from `BertModel`'s blocks.
Both checkpoint layouts load: transformers' names (`layers.N.self_attn.q_proj`, `mlp.fc1`,
`post_attention_layernorm`, ...) and the original ones transformers saves (`encoder.layers.N.mixer.Wqkv`, `norm1`,
`emb_ln`, ...). The task adapters are PEFT folders beside the weights, one per task, named as transformers loads them
(`model.load_adapter(path, adapter_name=t, adapter_kwargs={"subfolder": t})`): `retrieval_query/`,
`retrieval_passage/`, `separation/`, `classification/`, `text_matching/`. Each request picks one with the option
`task` by Jina's names (`retrieval.query`, ..., `text-matching`); `none`, the default, is the backbone without an
adapter, as transformers' model is before `set_adapter`. Requests for different tasks share a batch
(wde/components/lora.py).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from wde.components.base import BuildContext
from wde.components.models.bert import BertEmbeddings, BertLayer, BertModel
from wde.components.params import ModelParams
from wde.components.models.rotary import RotaryEmbedding
from wde.errors import ModelLoadError

TASKS: tuple[str, ...] = ("retrieval.query", "retrieval.passage", "separation", "classification", "text-matching")
"""Jina's task names, in the order of its API and model card."""
TASK_OPTION = "task"


def task_folder(task: str) -> str:
    """The adapter subfolder of a task: `retrieval.query` → `retrieval_query`, `text-matching` → `text_matching`."""
    return task.replace(".", "_").replace("-", "_")


class JinaEmbeddingsV3Model(BertModel):
    """XLM-RoBERTa with rotary q/k (theta from `rope_parameters`, 20000 by default), token type embeddings and no
    position table; the task adapters are loaded between loading and packing (`before_packing`)."""

    name = "jina_embeddings_v3"
    model_types = ("jina_embeddings_v3",)
    checkpoint_prefixes = ("roberta.",)
    checkpoint_name_mapping = {
        "emb_ln": "embeddings.LayerNorm",
        "encoder.layers": "encoder.layer",
        "layers": "encoder.layer",
        "mixer.Wqkv": "attention.qkv",
        "mixer.out_proj": "attention.output.dense",
        "self_attn.o_proj": "attention.output.dense",
        "norm1": "attention.output.LayerNorm",
        "post_attention_layernorm": "attention.output.LayerNorm",
        "mlp.fc1": "intermediate.dense",
        "mlp.fc2": "output.dense",
        "norm2": "output.LayerNorm",
        "post_mlp_layernorm": "output.LayerNorm",
    }
    packed_modules_mapping = {
        "self_attn.q_proj": ("attention.qkv", 0),
        "self_attn.k_proj": ("attention.qkv", 1),
        "self_attn.v_proj": ("attention.qkv", 2),
    }

    def build(self, cfg: object) -> None:
        self.rotary = RotaryEmbedding.from_config(cfg, cfg.hidden_size // cfg.num_attention_heads)
        super().build(cfg)

    def build_embeddings(self, cfg: object) -> nn.Module:
        return BertEmbeddings(cfg, positions=False)

    def build_layer(self, cfg: object, index: int = 0) -> nn.Module:
        return BertLayer(cfg, self.attn_backend, rotary=self.rotary)

    def position_table_size(self, cfg: object) -> int | None:
        return None  # rotary: no table to overrun

    def _quantize(self, params: ModelParams, ctx: BuildContext) -> str:
        """`quantization: int8` is refused by this model's name: its tasks are LoRA adapters, which int8 does not
        combine with (the base class's refusal names `model.params.lora`, which this model refuses itself)."""
        if params.quantization == "int8":
            raise ModelLoadError(f"quantization=int8 does not cover model {self.name!r}: its tasks"
                                 f" ({', '.join(TASKS)}) are LoRA adapters, which int8 does not combine with; use"
                                 " quantization: none")
        return super()._quantize(params, ctx)

    def before_packing(self, ctx: BuildContext) -> None:
        """Load the task adapters found beside the weights; `model.params.lora` is refused (the tasks are this
        model's adapters)."""
        lora = self.params.lora
        if lora.modules or lora.enable:
            raise ModelLoadError("model.params.lora is not supported by jina_embeddings_v3: its adapters are its"
                                 f" tasks ({', '.join(TASKS)}), chosen per request with the option 'task'")
        folder = Path(ctx.source.path)
        found = {t: folder / task_folder(t) for t in TASKS
                 if (folder / task_folder(t) / "adapter_config.json").is_file()}
        if not found:
            expected = ", ".join(task_folder(t) + "/" for t in TASKS)
            raise ModelLoadError(f"{folder} has no task adapters (PEFT folders {expected}); jina_embeddings_v3"
                                 " serves its tasks from them")
        tasks = self.use_lora(ctx, option=TASK_OPTION, max_adapters=len(TASKS))
        for task, path in found.items():
            tasks.load_peft(task, path)
