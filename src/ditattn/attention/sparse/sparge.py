"""SpargeAttention: keep, per head, the ``topk`` fraction of key blocks ranked by block-pooled Q.K.

Blocks are 3-D tiles (``block_size`` 32 -> 2x4x4, 64 -> 4x4x4, 128 -> 4x4x8 latent tokens), so a
pooled block is spatially coherent; with ``edge_tiles="packed"`` (the default) the tiles cut by the
grid edge are packed several to a block (:mod:`.tiling`), ``"padded"`` keeps one block per tile.
For every (batch, head, query block) the pooled similarity
``scale * mean(q) . mean(k)`` ranks the video key blocks and the top ``ceil(topk * n_blocks)`` are
kept (``topk`` in (0, 1]); text blocks are always kept and text queries attend everything.  The
block lists come straight from the top-k indices (no dense mask, no sort, no device sync).

Kept blocks are computed SageAttention-style, as upstream SpargeAttn does through SageAttention2
(which is why the seed calls Sparge approximate even at ``topk=1``): Q and smoothed K are quantized
to INT8 per (batch, block, head) and the scores come from the quantized values
(:mod:`.quant`); P.V stays in the input precision (fp16/bf16).  ``quantize=False`` computes the
kept blocks exactly (the plain block-sparse variant).  Upstream's self-similarity fallback for
incoherent blocks has no seed parameter and is not applied.

Shape rule (seed): only square self-attention of at least 128 tokens with head dim 64 or 128 is
sparsified; any other call runs dense SDPA (:func:`sparge_applies`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ditattn.attention.sparse.common import (SparsePlan, add_special_blocks, ceil_fraction, run_block_lists, topk_lists,
                                            topk_mask)
from ditattn.attention.sparse.quant import quantize_qk_blocks
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, tile
from ditattn.attention.sparse.vsa import pooled_video_scores
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

SPARGE_TILES = {32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8)}
SPARGE_HEAD_DIMS = (64, 128)
SPARGE_MIN_TOKENS = 128


def sparge_tile_size(block_size: int) -> tuple[int, int, int]:
    try:
        return SPARGE_TILES[int(block_size)]
    except KeyError:
        raise AttentionConfigError(
            f"sparge_attn: block_size must be one of {sorted(SPARGE_TILES)}, got {block_size!r}"
        ) from None


def sparge_applies(seq_q: int, seq_kv: int, head_dim: int) -> tuple[bool, str]:
    """Whether a call is sparsified (and if not, why it runs dense SDPA)."""
    if seq_q != seq_kv:
        return False, f"not square self-attention (q {seq_q} tokens, kv {seq_kv})"
    if seq_q < SPARGE_MIN_TOKENS:
        return False, f"{seq_q} tokens < {SPARGE_MIN_TOKENS}"
    if head_dim not in SPARGE_HEAD_DIMS:
        return False, f"head dim {head_dim} not in {list(SPARGE_HEAD_DIMS)}"
    return True, ""


def sparge_block_mask(q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, topk: float,
                      scale: float) -> tuple[Tensor, Tensor]:
    """``(block mask [B, H, n_blocks, n_blocks], pooled scores [B, H, nv, nv])``."""
    scores = pooled_video_scores(q_tiled, k_tiled, layout, scale)
    kk = ceil_fraction(float(topk), layout.n_video_blocks)
    return add_special_blocks(layout, topk_mask(scores, kk)), scores


def sparge_attention(q: Tensor, k: Tensor, v: Tensor, *, video_shape, topk: float = 0.5, block_size: int = 64,
                     text_len: int = 0, quantize: bool = False, scale: Optional[float] = None,
                     return_lse: bool = False, impl: str = "auto",
                     edge_tiles: str = "packed") -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """Sparge over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count); no shape
    or dtype rule here (the backend applies :func:`sparge_applies` and FP16/BF16).  ``quantize``:
    INT8 Q.K in the kept blocks (the backend's default); False: exact kept blocks.  The selection
    uses the unquantized pooled scores.  ``edge_tiles`` as in the module docstring.  Returns
    ``(out, lse or None, plan)``."""
    layout = make_tile_layout(video_shape, sparge_tile_size(block_size), text_len, edge_tiles=edge_tiles)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qt, kt = tile(q, layout), tile(k, layout)
    scores = pooled_video_scores(qt, kt, layout, scale)
    kk = ceil_fraction(float(topk), layout.n_video_blocks)
    idx, cnt, kept = topk_lists(layout, scores, kk)  # the lists of sparge_block_mask's mask
    qs, ks = quantize_qk_blocks(qt, kt, layout, impl=impl) if quantize else (qt, kt)
    return run_block_lists(q, k, v, layout, idx, cnt, scale=scale, return_lse=return_lse, impl=impl,
                           kept_fraction=kept, extra={"scores": scores, "k": kk, "quantized": bool(quantize)},
                           q_tiled=qs, k_tiled=ks)
