"""Sequence-classification heads on the encoder's first token: cross-encoder scores and class probabilities.

The encoder is the ordinary `bert` / `xlm_roberta` model component, whose loader skips head tensors; this
pooler loads the head (`*ForSequenceClassification`'s pooler/classifier) from the same checkpoint.
One pooler serves both uses because a single-logit head *is* a cross-encoder: `task: auto` yields "score"
for num_labels == 1 and "probs" otherwise.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import nn

from wde.components.base import BuildContext
from wde.components.kinds import Pooler
from wde.components.model_input_builder import ModelInput
from wde.components.models.loader import load_weights
from wde.components.params import ClassifierParams  # torch-free, so validating a workflow needs no torch
from wde.components.pooler import Pooled, pool
from wde.errors import ModelLoadError


class _Dense(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class BertClassificationHead(nn.Module):
    """BertForSequenceClassification: classifier(tanh(bert.pooler.dense(CLS)))."""

    prefixes: ClassVar[tuple[str, ...]] = ("bert.",)
    tensor_prefixes: ClassVar[tuple[str, ...]] = ("bert.pooler.", "pooler.", "classifier.")

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.pooler = _Dense(hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(cls)))


class _RobertaHeadLayers(_Dense):
    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__(hidden)
        self.out_proj = nn.Linear(hidden, num_labels)


class RobertaClassificationHead(nn.Module):
    """(XLM-)RobertaForSequenceClassification: classifier.out_proj(tanh(classifier.dense(<s>)))."""

    prefixes: ClassVar[tuple[str, ...]] = ()
    tensor_prefixes: ClassVar[tuple[str, ...]] = ("classifier.",)

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.classifier = _RobertaHeadLayers(hidden, num_labels)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(cls)))


class DistilBertClassificationHead(nn.Module):
    """DistilBertForSequenceClassification: classifier(relu(pre_classifier([CLS])))."""

    prefixes: ClassVar[tuple[str, ...]] = ()
    tensor_prefixes: ClassVar[tuple[str, ...]] = ("pre_classifier.", "classifier.")

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.pre_classifier = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, num_labels)

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.pre_classifier(cls)))


class ModernBertClassificationHead(nn.Module):
    """ModernBertForSequenceClassification: classifier(norm(act(head.dense(x)))) on the CLS state or the mean of
    the states (`classifier_pooling`)."""

    prefixes: ClassVar[tuple[str, ...]] = ()
    tensor_prefixes: ClassVar[tuple[str, ...]] = ("head.", "classifier.")

    def __init__(self, cfg: object) -> None:
        super().__init__()
        from wde.components.models.activations import activation

        self.head = nn.Module()
        self.head.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.head.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.act = activation(cfg.classifier_activation)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        if cfg.classifier_pooling not in ("cls", "mean"):
            raise ModelLoadError(f"classifier_pooling {cfg.classifier_pooling!r} is not implemented (cls, mean)")
        self.pooling = cfg.classifier_pooling

    @classmethod
    def from_config(cls, cfg: object) -> "ModernBertClassificationHead":
        return cls(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.head.norm(self.act(self.head.dense(x))))


class DebertaV2ClassificationHead(nn.Module):
    """DebertaV2ForSequenceClassification: classifier(act(pooler.dense(CLS))), act = `pooler_hidden_act`
    (transformers' ContextPooler; gelu by default)."""

    prefixes: ClassVar[tuple[str, ...]] = ()
    tensor_prefixes: ClassVar[tuple[str, ...]] = ("pooler.", "classifier.")

    def __init__(self, cfg: object) -> None:
        super().__init__()
        from wde.components.models.activations import activation

        hidden = int(cfg.hidden_size)
        pooler_size = int(getattr(cfg, "pooler_hidden_size", None) or hidden)
        if pooler_size != hidden:
            raise ModelLoadError(f"DeBERTa-v2 config pooler_hidden_size {pooler_size} != hidden_size {hidden}:"
                                 " transformers' ContextPooler reads the first token's hidden state with it")
        self.pooler = _Dense(hidden)
        self.act = activation(getattr(cfg, "pooler_hidden_act", "gelu") or "gelu")
        self.classifier = nn.Linear(hidden, int(cfg.num_labels))

    @classmethod
    def from_config(cls, cfg: object) -> "DebertaV2ClassificationHead":
        return cls(cfg)

    def forward(self, cls_state: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.act(self.pooler.dense(cls_state)))


HEADS: dict[str, type[nn.Module]] = {
    "bert": BertClassificationHead,
    "distilbert": DistilBertClassificationHead,
    "roberta": RobertaClassificationHead,
    "xlm-roberta": RobertaClassificationHead,
    "camembert": RobertaClassificationHead,
    "modernbert": ModernBertClassificationHead,
    "deberta-v2": DebertaV2ClassificationHead,
}
"""config.model_type → the head its *ForSequenceClassification class puts on the encoder."""

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}


def _refuse_skipped_lora(ctx: BuildContext, head_cls: type[nn.Module]) -> None:
    """A model taking LoRA adapters skips their deltas on layers no embedding output reads (`lora_skipped_modules`:
    BERT's pooler); a head that reads such a layer from the checkpoint (BertForSequenceClassification's
    `pooler.dense`) would run without the adapter's delta, so adapters and this head are refused together."""
    if ctx.model.lora is None:
        return
    strip: tuple[str, ...] = head_cls.prefixes  # type: ignore[attr-defined]
    read = [p.removeprefix(next((s for s in strip if p.startswith(s)), ""))
            for p in head_cls.tensor_prefixes]  # type: ignore[attr-defined]
    clash = [m for m in ctx.model.lora_skipped_modules if any(f"{m}.".startswith(p) for p in read)]
    if clash:
        raise ModelLoadError(f"LoRA adapters are not supported with this classification head: it reads"
                             f" {', '.join(clash)} from the checkpoint, a layer that takes no adapter delta here")


class ClassifierPooler(Pooler):
    """Runs the classification head on the first token of every sequence (output 'score' or 'probs').

    A request's `activation=False` returns raw logits; True applies the activation even when the workflow's
    default is 'none'.
    """

    kind = "pooler"
    name = "classifier"
    Params = ClassifierParams

    def __init__(self, params: ClassifierParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        cfg = ctx.source.hf_config
        self.num_labels = int(cfg.num_labels)
        task = params.task if params.task != "auto" else ("score" if self.num_labels == 1 else "probs")
        if task == "score" and self.num_labels != 1:
            raise ModelLoadError(f"pooler.params.task is 'score' but the model has {self.num_labels} labels;"
                                 " a cross-encoder has one (use task: probs or auto)")
        self.task: str = task
        self.outputs: tuple[str, ...] = (task,)
        id2label = getattr(cfg, "id2label", None) or {}
        self.labels: list[str] = [str(id2label.get(i, f"LABEL_{i}")) for i in range(self.num_labels)]
        """Class names in logit order (config.id2label)."""
        self.multi_label = getattr(cfg, "problem_type", None) == "multi_label_classification"
        self._fn, self.activate_by_default = self._resolve_activation(params.activation, cfg)
        self.head = self._load_head(ctx)

    def _resolve_activation(self, choice: str, cfg: object) -> tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
        natural = "sigmoid" if self.task == "score" or self.multi_label else "softmax"
        if choice == "none":
            return _ACTIVATIONS[natural], False
        if choice != "auto":
            return _ACTIVATIONS[choice], True
        if self.task == "probs":
            return _ACTIVATIONS[natural], True
        st = getattr(cfg, "sentence_transformers", None) or {}
        saved = st.get("activation_fn") or getattr(cfg, "sbert_ce_default_activation_function", None) or ""
        return _ACTIVATIONS[natural], not saved.endswith(".Identity")

    @staticmethod
    def _load_head(ctx: BuildContext) -> nn.Module:
        cfg = ctx.source.hf_config
        model_type = getattr(cfg, "model_type", "")
        head_cls = HEADS.get(model_type)
        if head_cls is None:
            raise ModelLoadError(f"no classification head for model_type {model_type!r}; supported: {sorted(HEADS)}")
        _refuse_skipped_lora(ctx, head_cls)
        from_config = getattr(head_cls, "from_config", None)
        head = from_config(cfg) if from_config is not None else head_cls(int(cfg.hidden_size), int(cfg.num_labels))
        try:
            weights = ctx.source.iter_weights(lambda name: name.startswith(head_cls.tensor_prefixes))
            load_weights(head, weights, head_cls.prefixes, {})  # type: ignore[arg-type]
        except ModelLoadError as e:
            raise ModelLoadError(f"classification head of {ctx.source.path}: {e}") from None
        return head.to(device=ctx.model.device, dtype=ctx.model.dtype).eval()

    def forward(self, hidden: torch.Tensor, batch: ModelInput) -> Pooled:
        logits = self.head(pool(hidden, batch, getattr(self.head, "pooling", "cls"))).float()
        on = [self.activate_by_default if p.activation is None else p.activation for p in batch.pooling_params]
        if all(on):
            logits = self._fn(logits)
        elif any(on):
            mask = torch.tensor(on, device=logits.device)[:, None]
            logits = torch.where(mask, self._fn(logits), logits)
        if self.task == "score":
            return Pooled(rows={"score": logits.squeeze(-1)})
        return Pooled(rows={"probs": logits})
