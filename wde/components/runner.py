"""Runners: the device side of a step — copy inputs in, run the model and pooler, copy results out."""

from __future__ import annotations

import time

import torch

from wde.components.base import BuildContext
from wde.components.kinds import Runner
from wde.components.cpu_streams import CpuStreams, auto_streams
from wde.components.model_input_builder import ModelInput
from wde.components.params import TorchRunnerParams
from wde.components.pooler import Pooled


class TorchRunner(Runner):
    """Runs model + pooler under `inference_mode`. Only this code touches the device.

    On CPU a batch of several short sequences is split over `cpu_streams` (wde/components/cpu_streams.py); a batch
    of long ones (`cpu_stream_max_mean_tokens`) runs whole on every thread."""

    kind = "runner"
    name = "torch"
    Params = TorchRunnerParams

    def __init__(self, params: TorchRunnerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self._model = ctx.model
        self._pooler = ctx.pooler
        self.device: torch.device = ctx.model.device
        self._min_tokens = params.cpu_stream_min_tokens
        self._max_mean = params.cpu_stream_max_mean_tokens
        self._streams: CpuStreams | None = None
        if self.device.type == "cpu":
            threads = torch.get_num_threads()
            count = auto_streams(threads) if params.cpu_streams == "auto" else params.cpu_streams
            if count > 1 and threads > 1:
                self._streams = CpuStreams(count, threads)

    def run(self, batch: ModelInput) -> tuple[Pooled, float]:
        """Pooled outputs on CPU, and the seconds spent (copies included)."""
        t0 = time.perf_counter()
        pieces = self._streams.count if self._streams else 1
        pieces = min(pieces, batch.num_seqs, batch.num_tokens // self._min_tokens)
        if batch.num_tokens >= self._max_mean * batch.num_seqs:  # long sequences: one piece on every thread
            pieces = 1
        if pieces > 1:
            pooled = Pooled.cat(self._streams.map(self._forward, batch.split(pieces)))
        else:
            pooled = self._forward(batch)
        return pooled, time.perf_counter() - t0

    @torch.inference_mode()
    def _forward(self, batch: ModelInput) -> Pooled:
        on_device = batch.to(self.device)
        hidden = self._model(on_device)
        return self._pooler.forward(hidden, on_device).to("cpu")

    def shutdown(self) -> None:
        if self._streams is not None:
            self._streams.close()
