"""The activation functions a config names (`hidden_act` and kin), computed as transformers' `ACT2FN` computes them.

WDE's families used to take `transformers.activations.ACT2FN` itself. Importing that module (transformers 5.x)
imports its hub-kernel integration and with it `torch.distributed.tensor`: about 3 s of CPU in every process that
builds a model (a `wde serve` start, each engine core, each `wde embed`), as much as importing torch. This table
holds the same functions under the same names, each written as transformers writes it (the same torch calls in the
same order, so the same roundings; tests/test_activations.py compares every name with transformers' module). A
name not here is refused with the list of those that are: never a different function in its place.

`cpu_linear` fuses some of these into the linear layer before them (`post_op`); it keys them by these classes, and
by transformers' own classes of the same function where a plugin's module brings those (matched by name, without
importing transformers' module).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from wde.errors import ModelLoadError


class GELUActivation(nn.Module):
    """"gelu": the exact (erf) GELU; "gelu_python" spells out the same function as `x * (1 + erf(x / sqrt 2)) / 2`."""

    def __init__(self, use_gelu_python: bool = False) -> None:
        super().__init__()
        self.use_gelu_python = use_gelu_python

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_gelu_python:
            return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        return F.gelu(x)


class GELUTanh(nn.Module):
    """"gelu_pytorch_tanh": torch's tanh-approximate GELU; "gelu_python_tanh": the same approximation spelled out."""

    def __init__(self, use_gelu_tanh_python: bool = False) -> None:
        super().__init__()
        self.use_gelu_tanh_python = use_gelu_tanh_python

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_gelu_tanh_python:
            return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        return F.gelu(x, approximate="tanh")


class NewGELUActivation(nn.Module):
    """"gelu_new": the tanh approximation as BERT's and GPT's original code wrote it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class SiLUActivation(nn.Module):
    """"silu": x * sigmoid(x) (`nn.functional.silu`). "swish" is `nn.SiLU`, the same function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class FastGELUActivation(nn.Module):
    """"gelu_fast"."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class QuickGELUActivation(nn.Module):
    """"quick_gelu": x * sigmoid(1.702 x) (CLIP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ClippedGELUActivation(nn.Module):
    """"gelu_10": the exact GELU clipped to [min, max]."""

    def __init__(self, min: float, max: float) -> None:  # noqa: A002 (transformers' argument names)
        super().__init__()
        if min > max:
            raise ValueError(f"min should be < max (got min: {min}, max: {max})")
        self.min, self.max = min, max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clip(F.gelu(x), self.min, self.max)


class AccurateGELUActivation(nn.Module):
    """"gelu_accurate" (MEGA)."""

    def __init__(self) -> None:
        super().__init__()
        self.precomputed_constant = math.sqrt(2 / math.pi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(self.precomputed_constant * (x + 0.044715 * torch.pow(x, 3))))


class MishActivation(nn.Module):
    """"mish": x * tanh(softplus(x)) (`nn.functional.mish`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mish(x)


class LinearActivation(nn.Module):
    """"linear": the input unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class LaplaceActivation(nn.Module):
    """"laplace" (MEGA's attention activation)."""

    def forward(self, x: torch.Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> torch.Tensor:
        x = (x - mu).div(sigma * math.sqrt(2.0))
        return 0.5 * (1.0 + torch.erf(x))


class ReLUSquaredActivation(nn.Module):
    """"relu2": relu(x) squared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


class SqrtSoftplusActivation(nn.Module):
    """"sqrtsoftplus": sqrt(softplus(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(x).sqrt()


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": GELUActivation,
    "gelu_10": lambda: ClippedGELUActivation(min=-10, max=10),
    "gelu_fast": FastGELUActivation,
    "gelu_new": NewGELUActivation,
    "gelu_python": lambda: GELUActivation(use_gelu_python=True),
    "gelu_pytorch_tanh": GELUTanh,
    "gelu_python_tanh": lambda: GELUTanh(use_gelu_tanh_python=True),
    "gelu_accurate": AccurateGELUActivation,
    "hardswish": nn.Hardswish,
    "laplace": LaplaceActivation,
    "leaky_relu": nn.LeakyReLU,
    "linear": LinearActivation,
    "mish": MishActivation,
    "quick_gelu": QuickGELUActivation,
    "relu": nn.ReLU,
    "relu2": ReLUSquaredActivation,
    "relu6": nn.ReLU6,
    "sigmoid": nn.Sigmoid,
    "silu": SiLUActivation,
    "sqrtsoftplus": SqrtSoftplusActivation,
    "swish": nn.SiLU,
    "tanh": nn.Tanh,
}
"""Every name transformers' `ACT2CLS` maps, less "prelu" (a module with a learned weight: not a function of the
config alone) and "xielu" (learned parameters, and a CUDA kernel where installed)."""


def activation(name: str) -> nn.Module:
    """A new module computing the activation `name`; an unknown name is refused (ModelLoadError) naming it and the
    names known."""
    try:
        make = ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ModelLoadError(f"activation {name!r} is not implemented; known: {', '.join(sorted(ACTIVATIONS))}") from None
    return make()
