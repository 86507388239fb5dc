"""Pieces shared by the planners: special (text/sink) blocks, running a plan, plan masks."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ditattn.attention.sparse.block_sparse import (
    block_lists_to_dense_mask,
    block_mask_to_lists,
    block_sparse_attention,
    kept_fraction,
)
from ditattn.attention.sparse.tiling import TileLayout, tile, untile

Tensor = torch.Tensor


@dataclasses.dataclass
class SparsePlan:
    """What a planner decided for one call.

    layout: the tile layout the lists refer to; kv_indices/kv_counts: block lists (see
    :mod:`.block_sparse`); kept_fraction: kept (query block, key block) pairs / all pairs;
    extra: planner-specific details (scores, windows, cluster labels, ...).
    """

    layout: Optional[TileLayout]
    kv_indices: Tensor
    kv_counts: Tensor
    kept_fraction: float
    extra: dict = dataclasses.field(default_factory=dict)


def add_special_blocks(layout: TileLayout, video_mask: Tensor) -> Tensor:
    """Extend a video-block mask ``[..., n_video_blocks, n_video_blocks]`` to all blocks: every
    query block attends every special (text/sink) key block and every special query block attends
    every block.  Returns bool ``[..., n_blocks, n_blocks]``."""
    nv, nb = layout.n_video_blocks, layout.n_blocks
    if nb == nv:
        return video_mask
    lead = video_mask.shape[:-2]
    out = torch.ones(*lead, nb, nb, dtype=torch.bool, device=video_mask.device)
    out[..., :nv, :nv] = video_mask
    return out


def topk_mask(scores: Tensor, k: int, valid: Optional[Tensor] = None) -> Tensor:
    """Boolean mask of the ``k`` largest entries along the last dim (``valid`` False entries never
    chosen; fewer than k valid entries -> all valid ones)."""
    n = scores.shape[-1]
    k = max(0, min(int(k), n))
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    out = torch.zeros_like(scores, dtype=torch.bool)
    if k == 0:
        return out
    idx = scores.topk(k, dim=-1).indices
    out.scatter_(-1, idx, True)
    if valid is not None:
        out &= valid
    return out


def ceil_fraction(fraction: float, n: int) -> int:
    """``ceil(fraction * n)`` robust to float noise (``(1 - 0.7) * 10`` is 3, not 4), at least 1."""
    return max(1, min(n, math.ceil(round(fraction * n, 9))))


def run_block_mask(q: Tensor, k: Tensor, v: Tensor, layout: TileLayout, block_mask: Tensor, *,
                   scale: Optional[float], return_lse: bool, impl: str = "auto",
                   extra: Optional[dict] = None, q_tiled: Optional[Tensor] = None,
                   k_tiled: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """Tile q/k/v (original order ``[B, S, H, D]``, k/v already expanded to q's heads), run the
    block-sparse core with ``block_mask`` (bool ``[B or 1, H or 1, n_blocks, n_blocks]``) and
    untile.  Returns ``(out [B, S, H, D], lse [B, H, S] or None, plan)``."""
    qt = tile(q, layout) if q_tiled is None else q_tiled
    kt = tile(k, layout) if k_tiled is None else k_tiled
    vt = tile(v, layout)
    idx, cnt = block_mask_to_lists(block_mask.to(q.device))
    B = q.shape[0]
    kv_valid = layout.kv_valid(B, q.device)
    out_t, lse_t = block_sparse_attention(qt, kt, vt, idx, cnt, block_size=layout.block_size, scale=scale,
                                          kv_valid=kv_valid, return_lse=return_lse, impl=impl)
    out = untile(out_t, layout).to(q.dtype)
    lse = untile(lse_t, layout, dim=2) if lse_t is not None else None
    plan = SparsePlan(layout, idx, cnt, kept_fraction(cnt, layout.n_blocks), extra or {})
    return out, lse, plan


def plan_token_mask(plan: SparsePlan) -> Tensor:
    """The explicit token mask of a tile-layout plan in ORIGINAL token order: bool
    ``[B or 1, H or 1, S, S]`` (True = the query token attends the key token)."""
    lay = plan.layout
    dense = block_lists_to_dense_mask(plan.kv_indices, plan.kv_counts, block_size=lay.block_size)
    dense = dense & lay.valid.to(dense.device).view(1, 1, 1, -1)
    pos = lay.position.to(dense.device)
    return dense.index_select(2, pos).index_select(3, pos)
