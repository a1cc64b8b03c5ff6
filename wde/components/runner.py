"""Runners: the device side of a step — copy inputs in, run the model and pooler, copy results out."""

from __future__ import annotations

import time

import torch

from wde.components.base import BuildContext, Component, Params
from wde.components.model_input_builder import ModelInput
from wde.components.pooler import Pooled


class TorchRunner(Component):
    """Runs model + pooler under `inference_mode`. Only this code touches the device."""

    kind = "runner"
    name = "torch"
    Params = Params

    def __init__(self, params: Params, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._model = ctx.model
        self._pooler = ctx.pooler
        self.device: torch.device = ctx.model.device

    @torch.inference_mode()
    def run(self, batch: ModelInput) -> tuple[Pooled, float]:
        """Pooled outputs on CPU, and the seconds spent (copies included)."""
        t0 = time.perf_counter()
        on_device = batch.to(self.device)
        hidden = self._model(on_device)
        pooled = self._pooler.forward(hidden, on_device).to("cpu")
        return pooled, time.perf_counter() - t0
