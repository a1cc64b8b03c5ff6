"""The engine core: a process that runs the `Engine` step loop and nothing else.

API servers (`wde.core.client.CoreClient`) send it tokenized requests, and images as preprocessed pixel values,
over a ZeroMQ ROUTER socket; it queues them in the engine's scheduler (an image whose array does not fit the model
is answered at once with its error), steps, and sends each output back to the API server that asked. Between
steps it drains every message that arrived, so batches form from all API servers at once. The loop is supervised as in
`AsyncEngine`: if `step` raises, every waiting request is failed with a "retry" answer, the engine's queues are
reset and the loop goes on; past the restart budget the core exits with `EXIT_GAVE_UP`. After every step, and
every `IDLE_POLL_MS` while idle, it beats its heartbeat (`wde.core.heartbeat`), a file the API servers read to see
a core that is stuck in a step or frozen.

An API server process that dies takes its callers' connections with it; the launcher restarts it under a new
routing id and tells the core (`wire.Gone`), which drops that server's queued requests and forgets the rest (their
results go nowhere), so a dead server leaves nothing behind in the queue, and a message of it that arrives late is
ignored.
"""

from __future__ import annotations

import logging
import signal
from typing import Callable

import zmq

from wde.async_engine import RESTARTED
from wde.core import wire
from wde.core.frontend import core_image_request, core_request
from wde.core.heartbeat import Heartbeat, heartbeat_path
from wde.engine import Engine
from wde.errors import RequestError
from wde.request import RequestOutput
from wde.restarts import EXIT_GAVE_UP, RestartBudget

log = logging.getLogger("wde.core")

IDLE_POLL_MS = 100
"""How long an idle core waits for messages before it looks at its stop flag again."""


def socket(address: str, kind: int, bind: bool, context: zmq.Context | None = None, *,
           routing_id: bytes | None = None) -> zmq.Socket:
    """A socket for the core's link: no send/receive limit (a full queue would drop or block answers) and no
    linger (a closing process never waits on a dead peer). `routing_id`: how the core's ROUTER names this peer
    (an API server's, so the launcher can name it in `wire.Gone`)."""
    sock = (context or zmq.Context.instance()).socket(kind)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address) if bind else sock.connect(address)
    return sock


class EngineCore:
    def __init__(self, engine: Engine, address: str, *, restarts: RestartBudget | None = None,
                 on_step: Callable[["EngineCore"], None] | None = None) -> None:
        self.engine = engine
        self.restarts = restarts or RestartBudget()
        self.on_step = on_step
        """Called after every step (the core's metrics read queue depth and restarts here)."""
        self.stopping = False
        self._owners: dict[str, bytes] = {}
        """Request id → identity of the API server waiting for it."""
        self._gone: set[bytes] = set()
        """Identities of API servers that died (`wire.Gone`): their late messages are dropped."""
        path = heartbeat_path(address)
        self.heartbeat = Heartbeat(path)
        """Beaten after every step and idle poll; a file next to the socket (ipc addresses) for the API servers."""
        self._sock = socket(address, zmq.ROUTER, bind=True)

    @property
    def num_pending(self) -> int:
        return len(self._owners)

    def run(self) -> int:
        """Serve until `stopping` is set and nothing is left to finish; the process exit code."""
        engine = self.engine
        beat = self.heartbeat.beat
        try:
            while not self.stopping or engine.has_unfinished():
                beat()
                self._receive(0 if engine.has_unfinished() else IDLE_POLL_MS)
                try:
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - waiting requests are told, the loop restarted or given up
                    if not self._restart(e):
                        return EXIT_GAVE_UP
                    continue
                if outputs:
                    self._send(outputs)
                if self.on_step is not None:
                    self.on_step(self)
            return 0
        finally:
            self._sock.close(0)
            self.heartbeat.close()

    def _receive(self, timeout_ms: int) -> None:
        if not self._sock.poll(timeout_ms):
            return
        scheduler = self.engine.scheduler
        while True:
            try:  # not copied out of ZeroMQ's buffer: an image's pixel values are read in place
                frame, payload = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frame.bytes
            if identity in self._gone:
                continue
            message = wire.to_core.decode(payload.buffer)
            if isinstance(message, wire.Submit):
                for a in message.requests:
                    self._owners[a.request_id] = identity
                    scheduler.add(core_request(a.request_id, a.token_ids, a.token_type_ids, a.params))
            elif isinstance(message, wire.SubmitImages):
                self._add_images(identity, message.requests)
            elif isinstance(message, wire.Gone):
                self.forget(message.routing_id)
            else:
                for rid in message.request_ids:
                    if self._owners.pop(rid, None) is not None:
                        self.engine.abort(rid)

    def forget(self, identity: bytes) -> int:
        """Drop every request of the API server `identity` (its process died) and ignore its messages from now on;
        returns how many were dropped. Queued ones leave the scheduler; one in a running batch finishes, and its
        result goes nowhere."""
        self._gone.add(identity)
        dropped = [rid for rid, owner in self._owners.items() if owner == identity]
        for rid in dropped:
            del self._owners[rid]
            self.engine.abort(rid)
        log.debug("API server %s went away; dropped its %d requests", identity.decode(errors="replace"), len(dropped))
        return len(dropped)

    def _add_images(self, identity: bytes, images: list[wire.AdmittedImage]) -> None:
        """Queue images preprocessed by an API server; answer those whose pixel values this model refuses now."""
        refused = []
        for a in images:
            self._owners[a.request_id] = identity
            try:
                request = core_image_request(a.request_id, a.pixel_values, a.image_tokens, a.params,
                                             self.engine.input_processor)
            except RequestError as e:
                refused.append(RequestOutput(a.request_id, error=e))
                continue
            self.engine.scheduler.add(request)
        if refused:
            self._send(refused)

    def _send(self, outputs: list[RequestOutput], failure: str | None = None) -> None:
        by_owner: dict[bytes, list[wire.Output]] = {}
        for out in outputs:
            identity = self._owners.pop(out.request_id, None)
            if identity is not None:  # None: aborted by its API server
                by_owner.setdefault(identity, []).append(wire.pack_output(out))
        for identity, packed in by_owner.items():
            self._sock.send_multipart([identity, wire.encoder.encode(wire.Results(packed, failure))])

    def _restart(self, error: Exception) -> bool:
        log.error("the engine loop failed (%s: %s); restarting it", type(error).__name__, error, exc_info=error)
        self.engine.reset()
        self._send([RequestOutput(rid) for rid in list(self._owners)], failure=RESTARTED)
        if self.restarts.spend():
            return True
        log.critical("the engine loop failed %d times in %.0f s (last: %s: %s); giving up", self.restarts.recent,
                     self.restarts.window_s, type(error).__name__, error)
        return False


def stop_on_sigterm(core: EngineCore) -> None:
    """SIGTERM finishes the requests in hand, then exits; Ctrl-C is the launcher's to handle."""
    signal.signal(signal.SIGTERM, lambda *_: setattr(core, "stopping", True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
