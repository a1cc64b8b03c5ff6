"""The oneDNN primitive caches are capped before the first prepacked linear runs: packed batches have a new token
count nearly every batch, and with the default caches a server's memory grew by ~1 MB per count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from wde.components.models.cpu_linear import onednn_available

CODE = """
import random, sys, torch
from wde.components.models.cpu_linear import PackedLinear
import os
assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64" and os.environ["LRU_CACHE_CAPACITY"] == "64"
pl = PackedLinear(torch.nn.Linear(384, 384), 2048)
random.seed(0)
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
for _ in range(300):
    pl(torch.randn(random.randint(1, 2048), 384))
before = rss()
for _ in range(1200):
    pl(torch.randn(random.randint(1, 2048), 384))
print(rss() - before)
"""


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN (mkldnn)")
def test_memory_stays_flat_over_new_token_counts() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=600, check=True)
    growth_mib = int(out.stdout.strip().splitlines()[-1])
    # uncapped, 1,200 more counts add ~600 MiB here; capped, the caches are full after the first few dozen
    assert growth_mib < 200, f"RSS grew {growth_mib} MiB over 1,200 new token counts"
