"""Triton kernels for prefill-only serving: varlen attention over packed sequences, row L2 normalisation,
and fused residual-add + LayerNorm / RMSNorm.

Importing this package needs no GPU: the package itself does not import triton, and the kernel modules
(`wde.kernels.varlen_attention`, `wde.kernels.l2norm`, `wde.kernels.fused_norm`) only define their kernels on import.
Triton decides at definition time whether a kernel is compiled for the GPU or run by its CPU interpreter
(`TRITON_INTERPRET=1`), so that variable must be set before a kernel module is first imported. Interpreted
kernels accept CPU tensors and are meant for tests (about 1000x slower than torch); compiled kernels need CUDA
tensors, and the wrappers say so instead of failing deep inside triton.
"""

from __future__ import annotations

import torch


def check_device(interpreted: bool, *tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors on one device; the interpreter takes CPU tensors."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(f"triton kernels need CUDA tensors, got {device}; set TRITON_INTERPRET=1 before "
                           "importing `wde.kernels` to run them on CPU (slow, for tests), or use a torch implementation")
