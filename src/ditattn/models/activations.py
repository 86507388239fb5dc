"""Activation functions by their transformers ``hidden_act`` names (the native encoders' MLPs)."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ditattn.errors import AttentionConfigError


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU written out as transformers' ``gelu_new`` computes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (OpenAI CLIP's activation)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name``; an unknown name is an :class:`AttentionConfigError` naming
    ``what`` (the model) and the supported names."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise AttentionConfigError(
            f"{what}: unsupported activation '{name}'; supported: {', '.join(ACTIVATIONS)}"
        ) from None
