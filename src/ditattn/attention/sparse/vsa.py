"""Video Sparse Attention (VSA): coarse block-pooled top-k, then exact fine attention.

Blocks: the 4x4x4 tiles (64 tokens) of :mod:`.tiling`.  With ``edge_tiles="packed"`` (the default)
the tiles cut by the grid edge are packed several to a block (at 21x30x52: 513 blocks instead of
624, for 512 blocks' worth of tokens); with ``"padded"`` each tile is its own block, padded.

Coarse stage: Q and K are mean-pooled over the real tokens of each video block; the pooled scores
``scale * q_block . k_block`` rank, per (batch, head, query block), the video key blocks, and the
top ``k = ceil((1 - sparsity) * n_blocks)`` are kept (``n_blocks`` = video blocks of the layout; at
least 1).  Upstream VSA pads every tile and keeps ``ceil((1 - sparsity) * n_video_tokens / 64)``
tiles; the packed layout has at most one block more than ``n_video_tokens / 64`` rounded up, so
its ``k`` is upstream's at the Wan grids (52 at 21x30x52, 119 at 21x45x80), where the padded layout
counts the padded tiles (63 and 144).  Among equal scores the lower block id wins.  Text tokens
attend and are attended by everything.  On CUDA the coarse stage is three launches: pooling of q
and k, the ``nv x nv`` score matmul, and the top-k that writes the int32 block lists
(:mod:`ditattn.attention.kernels.block_select`).  Fine stage: exact attention of every query over
the tokens of its selected blocks (block-sparse core).

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
    select_impl,
    select_kernels,
    topk_lists,
    topk_mask,
    triton_path,
)
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, pooled_blocks, tile
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

VSA_TILE_SIZE = (4, 4, 4)


def pooled_video_blocks(
    q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, scale: float, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    """``(scale * mean(q), mean(k))`` over the real tokens of each video block: float32 ``[B, H,
    nv, D]`` each, from tiled ``[B, padded_len, H, D]`` q/k.

    ``impl`` (a planner's, :func:`~ditattn.attention.sparse.common.select_impl`): ``"auto"`` pools q
    and k in one Triton launch (:func:`~ditattn.attention.kernels.block_select.pool_qk_blocks`) on
    CUDA for fp16/bf16 with a power-of-two head dim 16..256 and block size 16..128, else with
    :func:`~ditattn.attention.sparse.tiling.pooled_blocks` (the reference: per element the same
    operations in the same order, only the sums may round differently); ``"triton"`` forces the kernel."""
    nv = layout.n_video_blocks
    impl = select_impl(impl)
    mod = select_kernels() if triton_path(q_tiled, impl) else None
    if impl == "triton" and mod is None:
        raise AttentionConfigError("the Triton block pooling kernel needs the triton package; use impl='reference'")
    if mod is not None and (impl == "triton" or layout.block_size in mod.POOL_BLOCK_SIZES):
        count = layout.on(q_tiled.device).count_as(torch.float32).view(-1)
        return mod.pool_qk_blocks(q_tiled, k_tiled, count, n_blocks=nv, block_size=layout.block_size, scale=scale)
    return pooled_blocks(q_tiled, layout, nv, scale=scale), pooled_blocks(k_tiled, layout, nv)


def pooled_video_scores(
    q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, scale: float, impl: str = "auto"
) -> Tensor:
    """``scale * mean(q) . mean(k)`` between video blocks: float32 ``[B, H, nv, nv]`` from tiled
    ``[B, padded_len, H, D]`` q/k (:func:`pooled_video_blocks`, then one matmul; the scale is applied
    to the pooled queries, not to the ``nv x nv`` product)."""
    pq, pk = pooled_video_blocks(q_tiled, k_tiled, layout, scale, impl)
    return pq @ pk.transpose(-1, -2)


def vsa_num_selected(sparsity: float, n_tiles: int) -> int:
    """``k = ceil((1 - sparsity) * n_tiles)``, at least 1 and at most ``n_tiles``."""
    return ceil_fraction(1.0 - float(sparsity), n_tiles)


def vsa_block_mask(
    q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, sparsity: float, scale: float
) -> tuple[Tensor, Tensor]:
    """``(block mask [B, H, n_blocks, n_blocks], coarse scores [B, H, nv, nv])``."""
    scores = pooled_video_scores(q_tiled, k_tiled, layout, scale)
    k = vsa_num_selected(sparsity, layout.n_video_blocks)
    return add_special_blocks(layout, topk_mask(scores, k)), scores


def video_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    sparsity: float,
    text_len: int = 0,
    scale: Optional[float] = None,
    tile_size=VSA_TILE_SIZE,
    return_lse: bool = False,
    impl: str = "auto",
    edge_tiles: str = "packed",
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """VSA over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count).

    ``edge_tiles``: ``"packed"`` or ``"padded"`` (module docstring).  ``impl``: the block-sparse
    core's (:func:`~ditattn.attention.sparse.block_sparse.block_sparse_attention`); the selection
    stage follows ``"reference"`` and ``"triton"`` and is automatic otherwise
    (:func:`pooled_video_blocks`, :func:`~ditattn.attention.sparse.common.topk_lists`).  Returns
    ``(out [B, S, heads, D], lse [B, heads, S] float32 or None, plan)``; ``plan.extra`` holds the
    coarse ``scores`` and ``k`` (blocks kept per query block).
    """
    layout = make_tile_layout(video_shape, tile_size, text_len, edge_tiles=edge_tiles)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qt, kt = tile(q, layout), tile(k, layout)
    scores = pooled_video_scores(qt, kt, layout, scale, impl)
    kk = vsa_num_selected(sparsity, layout.n_video_blocks)
    # the lists of vsa_block_mask's mask, built from the top-k (no mask, no device sync)
    idx, cnt, kept = topk_lists(layout, scores, kk, select_impl(impl))
    return run_block_lists(
        q,
        k,
        v,
        layout,
        idx,
        cnt,
        scale=scale,
        return_lse=return_lse,
        impl=impl,
        kept_fraction=kept,
        extra={"scores": scores, "k": kk},
        q_tiled=qt,
        k_tiled=kt,
    )
