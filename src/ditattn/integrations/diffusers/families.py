"""What ditattn knows about diffusers transformer families: how to read the latent grid and the
text tokens of joint attention from a transformer's forward arguments, where the text sits, and
whether the processors pass an attention mask (:data:`FAMILIES`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn

Geometry = Callable[[nn.Module, tuple, dict], tuple[Optional[tuple[int, int, int]], int]]


def forward_arg(args: tuple, kwargs: dict, name: str, index: int):
    """Argument ``name`` of a forward call, given by keyword or at position ``index`` (None if absent)."""
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _video_grid(model: nn.Module, args: tuple, kwargs: dict):
    """Wan: latents ``[B, C, F, H, W]`` patchified by ``config.patch_size = (p_t, p_h, p_w)``;
    self-attention sees the video tokens only."""
    x = forward_arg(args, kwargs, "hidden_states", 0)
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return None, 0
    pt, ph, pw = (int(p) for p in model.config.patch_size)
    return (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw), 0


def _flux_grid(model: nn.Module, args: tuple, kwargs: dict):
    """Flux: packed latents ``[B, H' * W', C]`` whose ``img_ids [H' * W', 3]`` hold ``(0, row,
    col)`` in row-major order, after ``encoder_hidden_states [B, L, D]`` text tokens (joint
    attention, text first).  A sequence that is not one such grid (reference images) has none."""
    x, ids = forward_arg(args, kwargs, "hidden_states", 0), kwargs.get("img_ids")
    text = forward_arg(args, kwargs, "encoder_hidden_states", 1)
    if not isinstance(x, torch.Tensor) or not isinstance(ids, torch.Tensor) or not isinstance(text, torch.Tensor):
        return None, 0
    ids = ids[0] if ids.dim() == 3 else ids
    rows, cols = ids[:, 1].long(), ids[:, 2].long()
    h, w = int(rows.max()) + 1, int(cols.max()) + 1
    n = torch.arange(ids.shape[0], device=ids.device)
    if h * w != x.shape[1] or not (torch.equal(rows, n // w) and torch.equal(cols, n % w)):
        return None, text.shape[1]
    return (1, h, w), text.shape[1]


@dataclasses.dataclass(frozen=True)
class Family:
    """How ditattn reads one family of diffusers transformers.

    classes: the transformer class names; geometry: ``(model, args, kwargs) -> (grid, text_len)``
    from the transformer's forward arguments (None: no grid, so no sparse backend); text_first:
    joint attention puts the text tokens before the video/image tokens (ditattn's sparse backends
    take them after); needs_bias: the processors pass an attention mask (only backends that take an
    additive mask qualify).
    """

    name: str
    classes: tuple[str, ...]
    geometry: Optional[Geometry] = None
    text_first: bool = False
    needs_bias: bool = False


FAMILIES = (
    Family("Wan 2.1 / 2.2", ("WanTransformer3DModel",), geometry=_video_grid),
    Family("Flux", ("FluxTransformer2DModel",), geometry=_flux_grid, text_first=True),
    Family("HunyuanVideo", ("HunyuanVideoTransformer3DModel",), needs_bias=True),
    Family("Qwen-Image", ("QwenImageTransformer2DModel",), needs_bias=True),
)
GENERIC = Family("other diffusers transformers", ())


def family_of(model: nn.Module) -> Family:
    name = type(model).__name__
    return next((f for f in FAMILIES if name in f.classes), GENERIC)
