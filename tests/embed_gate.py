"""`wde` CLI with a gated model input builder registered, for `wde embed` runs that must still be running when a
test signals them, whatever the machine's speed.

`gated_packed` (a `packed` input builder) holds any batch whose text contains the word "gate" until the file
`model_input_builder.params.gate_file` exists (polling, up to `timeout_s`), so a run started on a corpus whose later
shards say "gate" writes its first shards and then waits, deterministically, for the test. Run as
`python tests/embed_gate.py embed ... --set model_input_builder.name=gated_packed --set
model_input_builder.params.gate_file=PATH` with the repository root on PYTHONPATH; `--workers N` children re-import
this file as their main module, so they register it too. Imported (by a test), it registers nothing until
`register()` is called.
"""

from __future__ import annotations

import os
import time

from wde.components.base import Params
from wde.components.model_input_builder import ModelInput, PackedInputBuilder
from wde.components.scheduler import SchedulerOutput
from wde.registry import get_registry


class GateParams(Params):
    gate_file: str = ""
    word: str = "gate"
    timeout_s: float = 300.0


class GatedInputBuilder(PackedInputBuilder):
    kind = "model_input_builder"
    name = "gated_packed"
    Params = GateParams  # type: ignore[assignment]

    def build(self, batch: SchedulerOutput) -> ModelInput:
        p = self.params
        if p.gate_file and any(p.word in getattr(s.request.prompt, "text", "") for s in batch.scheduled):
            deadline = time.monotonic() + p.timeout_s
            while not os.path.exists(p.gate_file) and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().build(batch)


def register() -> None:
    registry = get_registry()
    if GatedInputBuilder.name not in registry.components.get(GatedInputBuilder.kind, {}):
        registry.add_component(GatedInputBuilder, plugin="tests.embed_gate")


if __name__ in ("__main__", "__mp_main__"):  # the CLI, and `--workers N` children, which re-import it as that
    register()

if __name__ == "__main__":
    from wde.cli import main

    main()
