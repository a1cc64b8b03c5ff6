"""The default device, decided once: components that size themselves for the hardware ask here."""

from __future__ import annotations

import functools

import torch


@functools.cache
def default_device() -> torch.device:
    """cuda when a CUDA device is present, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
