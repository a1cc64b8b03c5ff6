"""Output processors: slice a batch's pooled tensors into one `RequestOutput` per request (numpy arrays)."""

from __future__ import annotations

import time

from wde.components.base import Params
from wde.components.kinds import OutputProcessor
from wde.components.pooler import Pooled
from wde.components.scheduler import SchedulerOutput
from wde.request import RequestOutput


class EmbeddingOutputProcessor(OutputProcessor):
    """Every pooled output becomes a numpy array under its name (e.g. `outputs["dense"]`)."""

    kind = "output_processor"
    name = "embedding"
    Params = Params

    def process(self, batch: SchedulerOutput, pooled: Pooled, inference_time: float) -> list[RequestOutput]:
        rows = [(k, list(v.numpy())) for k, v in pooled.rows.items()]  # each request's row, a view
        ragged = [(k, v.numpy(), b) for k, (v, b) in pooled.ragged.items()]
        now = time.perf_counter()
        outs = []
        for i, s in enumerate(batch.scheduled):
            r = s.request
            outputs = {k: v[i] for k, v in rows}
            for k, v, b in ragged:
                outputs[k] = v[b[i]:b[i + 1]]
            dimensions = s.params.dimensions
            if dimensions is not None and "dense" in outputs:
                outputs["dense"] = outputs["dense"][:dimensions]  # a mixed batch pads rows to full width
            queue = (r.scheduled_time or now) - r.arrival_time
            outs.append(RequestOutput(r.request_id, outputs, s.num_tokens, None, s.token_ids,
                                      queue_time=queue, tokenization_time=r.tokenization_time,
                                      inference_time=inference_time))
        return outs
