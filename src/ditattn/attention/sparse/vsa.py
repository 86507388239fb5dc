"""Video Sparse Attention (VSA): coarse tile-pooled top-k, then exact fine attention.

Coarse stage: Q and K are mean-pooled over the real tokens of each 4x4x4 tile (64 tokens); the
pooled scores ``scale * q_tile . k_tile`` rank, per (batch, head, query tile), the video key tiles,
and the top ``k = ceil((1 - sparsity) * n_tiles)`` are kept (``n_tiles`` = video tiles of the
grid; at least 1).  Text tokens attend and are attended by everything.  Fine stage: exact attention
of every query over the tokens of its selected tiles (block-sparse core).

Upstream VSA also has a trained gate-compress branch whose coarse (tile-level) attention output is
gated into the result.  None of our checkpoints carries that branch, so the fine output stands
alone (equivalently: the gate is zero).
"""
from __future__ import annotations

from typing import Optional

import torch

from ditattn.attention.sparse.common import (
    SparsePlan,
    add_special_blocks,
    ceil_fraction,
    run_block_lists,
    topk_lists,
    topk_mask,
)
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, pooled_blocks, tile

Tensor = torch.Tensor

VSA_TILE_SIZE = (4, 4, 4)


def pooled_video_scores(q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, scale: float) -> Tensor:
    """``scale * mean(q) . mean(k)`` between video blocks: float32 ``[B, H, nv, nv]`` from tiled
    ``[B, padded_len, H, D]`` q/k (means over real tokens only)."""
    nv = layout.n_video_blocks
    pq = pooled_blocks(q_tiled, layout)[:, :, :nv]
    pk = pooled_blocks(k_tiled, layout)[:, :, :nv]
    return (pq @ pk.transpose(-1, -2)) * scale


def vsa_num_selected(sparsity: float, n_tiles: int) -> int:
    """``k = ceil((1 - sparsity) * n_tiles)``, at least 1 and at most ``n_tiles``."""
    return ceil_fraction(1.0 - float(sparsity), n_tiles)


def vsa_block_mask(q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, sparsity: float,
                   scale: float) -> tuple[Tensor, Tensor]:
    """``(block mask [B, H, n_blocks, n_blocks], coarse scores [B, H, nv, nv])``."""
    scores = pooled_video_scores(q_tiled, k_tiled, layout, scale)
    k = vsa_num_selected(sparsity, layout.n_video_blocks)
    return add_special_blocks(layout, topk_mask(scores, k)), scores


def video_sparse_attention(q: Tensor, k: Tensor, v: Tensor, *, video_shape, sparsity: float, text_len: int = 0,
                           scale: Optional[float] = None, tile_size=VSA_TILE_SIZE, return_lse: bool = False,
                           impl: str = "auto") -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """VSA over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count).

    Returns ``(out [B, S, heads, D], lse [B, heads, S] float32 or None, plan)``; ``plan.extra``
    holds the coarse ``scores`` and ``k`` (tiles kept per query tile).
    """
    layout = make_tile_layout(video_shape, tile_size, text_len)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qt, kt = tile(q, layout), tile(k, layout)
    scores = pooled_video_scores(qt, kt, layout, scale)
    kk = vsa_num_selected(sparsity, layout.n_video_blocks)
    # the lists of vsa_block_mask's mask, built from the top-k indices (no mask, no device sync)
    idx, cnt, kept = topk_lists(layout, scores, kk)
    return run_block_lists(q, k, v, layout, idx, cnt, scale=scale, return_lse=return_lse, impl=impl,
                           kept_fraction=kept, extra={"scores": scores, "k": kk}, q_tiled=qt, k_tiled=kt)
