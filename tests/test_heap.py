"""`wde serve` freezes its start-up heap out of the cyclic garbage collector's reach while it serves
(wde/server/heap.py): every serving process does it, and the freeze ends with serving."""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import httpx
import pytest

from tests.test_server import serve_split
from wde.server.heap import frozen_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_heap_keeps_start_up_objects_from_the_collector_until_it_ends() -> None:
    assert gc.get_freeze_count() == 0
    node = Node()
    alive = weakref.ref(node)
    with frozen_heap() as count:
        assert count > 1000 and gc.get_freeze_count() > 1000
        del node
        gc.collect()
        assert alive() is not None, "a frozen object was scanned by the collector"
        fresh = Node()  # made after the freeze: collected as usual
        fresh_ref = weakref.ref(fresh)
        del fresh
        gc.collect()
        assert fresh_ref() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None, "unfreezing gave the collector its objects back"


@pytest.mark.parametrize("api_servers, processes", [(0, 1), (1, 2)])
def test_every_serving_process_freezes_its_heap(minilm_path: Path, tmp_path: Path, api_servers: int,
                                                 processes: int) -> None:
    log = tmp_path / "serve.log"
    with serve_split(minilm_path, api_servers, "--log-level", "debug", log=log) as (url, _):
        response = httpx.post(f"{url}/v1/embeddings", json={"input": "frozen start-up heap"}, timeout=60)
        assert response.status_code == 200
        frozen = [int(n) for n in re.findall(r"froze (\d+) start-up objects", log.read_text(errors="replace"))]
    assert len(frozen) == processes, log.read_text(errors="replace")[-3000:]
    assert all(n > 10_000 for n in frozen)  # torch, transformers and the server's modules
