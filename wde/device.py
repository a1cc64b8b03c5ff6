"""The default device, decided once: components that size themselves for the hardware ask here."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def default_device() -> torch.device:
    """`WDE_DEVICE` when set (e.g. "cpu" to keep a GPU machine's runs on CPU), else cuda when present, else cpu."""
    forced = os.environ.get("WDE_DEVICE")
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
