"""The conditioning embeddings of the native Wan DiT (:mod:`ditattn.models.wan.transformer`), with
diffusers' parameter names: sinusoidal timestep features and their MLP into the 6-way modulation,
the text projection, the CLIP image-token embedding of image-to-video checkpoints
(:class:`WanConditionEmbedder`), and the 3-D rotary tables of the video tokens (:func:`rope_tables`).
:class:`FP32LayerNorm` is the float32 layer norm these and the DiT blocks use."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ditattn.models.wan.config import WanTransformerConfig


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32, result cast back to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def sinusoidal_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """``[N] -> [N, dim]`` float32 timestep features: ``cos`` half first, then ``sin``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    ang = t[:, None].float() * freqs[None, :]
    emb = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class _MLP2(nn.Module):
    """``linear_2(act(linear_1(x)))`` (the key layout of diffusers' embedding MLPs)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, act: nn.Module):
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d_hidden)
        self.act = act
        self.linear_2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class _Proj(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)


class _GeluFF(nn.Module):
    """``net.0.proj`` -> exact GELU -> ``net.2`` (diffusers' FeedForward key layout, ``mult=1``)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.net = nn.ModuleList([_Proj(d_in, d_in), nn.Dropout(0.0), nn.Linear(d_in, d_out)])

    def forward(self, x):
        return self.net[2](F.gelu(self.net[0].proj(x)))


class WanImageEmbedding(nn.Module):
    """CLIP image tokens ``[B, N, image_dim]`` -> model width ``[B, N, D]`` (LayerNorm, GELU MLP,
    LayerNorm; with ``pos_embed_seq_len`` a learned position table is added first and a batch of
    two images per sample (first and last frame) becomes one sequence of ``2 N`` tokens)."""

    def __init__(self, d_in: int, d_out: int, pos_embed_seq_len: Optional[int] = None):
        super().__init__()
        self.norm1 = FP32LayerNorm(d_in)
        self.ff = _GeluFF(d_in, d_out)
        self.norm2 = FP32LayerNorm(d_out)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, d_in)) if pos_embed_seq_len else None

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            B, N, C = image.shape
            image = image.view(-1, 2 * N, C) + self.pos_embed
        return self.norm2(self.ff(self.norm1(image)))


class WanConditionEmbedder(nn.Module):
    """Timestep -> (temb, 6-way modulation), text features -> model width, and for image-to-video
    checkpoints CLIP image tokens -> model width (``image_embedder``)."""

    def __init__(self, cfg: WanTransformerConfig):
        super().__init__()
        d = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        self.time_embedder = _MLP2(cfg.freq_dim, d, d, nn.SiLU())
        self.act_fn = nn.SiLU()
        self.time_proj = nn.Linear(d, 6 * d)
        self.text_embedder = _MLP2(cfg.text_dim, d, d, nn.GELU(approximate="tanh"))
        self.image_embedder = (
            WanImageEmbedding(cfg.image_dim, d, cfg.pos_embed_seq_len) if cfg.image_dim is not None else None
        )

    def time(self, timestep: torch.Tensor, dtype: torch.dtype, timestep_seq_len: Optional[int] = None):
        """``(temb, modulation)``: timestep features cast to ``dtype`` and their 6-way projection."""
        t = sinusoidal_embedding(timestep, self.freq_dim)
        if timestep_seq_len is not None:
            t = t.unflatten(0, (-1, timestep_seq_len))
        t = t.to(self.time_embedder.linear_1.weight.dtype)
        temb = self.time_embedder(t).to(dtype)
        return temb, self.time_proj(self.act_fn(temb))

    def forward(self, timestep: torch.Tensor, text: torch.Tensor, timestep_seq_len: Optional[int] = None):
        temb, tproj = self.time(timestep, text.dtype, timestep_seq_len)
        return temb, tproj, self.text_embedder(text)


def rope_tables(head_dim: int, grid: tuple[int, int, int], device, theta: float = 10000.0):
    """Wan's 3-D rotary tables for a ``(T, H, W)`` token grid.

    The head dim splits into time / height / width parts (``h = w = 2 * (head_dim // 6)``, time gets
    the rest).  Returns ``(cos, sin)``, each float32 ``[1, T*H*W, 1, head_dim // 2]`` (one angle per
    rotated pair of channels, T-major token order).
    """
    hw = 2 * (head_dim // 6)
    dims = (head_dim - 2 * hw, hw, hw)
    T, H, W = grid
    per_axis = []
    for dim, n in zip(dims, grid):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        per_axis.append(torch.outer(torch.arange(n, dtype=torch.float64), inv))  # [n, dim/2]
    ang = torch.cat(
        [
            per_axis[0].view(T, 1, 1, -1).expand(T, H, W, -1),
            per_axis[1].view(1, H, 1, -1).expand(T, H, W, -1),
            per_axis[2].view(1, 1, W, -1).expand(T, H, W, -1),
        ],
        dim=-1,
    ).reshape(1, T * H * W, 1, -1)
    return ang.cos().float().to(device), ang.sin().float().to(device)
