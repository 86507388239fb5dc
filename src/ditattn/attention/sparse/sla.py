"""Sparse-Linear Attention (SLA) and its quantized variant (SAGE_SLA).

Blocks are the tiles of :func:`.sparge.sparge_tile_size`; with ``edge_tiles="packed"`` (the
default) the tiles cut by the grid edge are packed several to a block (:mod:`.tiling`), ``"padded"``
keeps one block per tile.  The INT8 scales, the linear branch's key sums and the pooled means are
per block (over its real tokens).

Classification (per batch, head, query block): the block-pooled attention ``softmax_j(scale *
mean(q_i) . mean(k_j))`` over video key blocks ranks the key blocks; the top ``ceil(topk * n)``
are *critical*, the bottom ``floor(negligible_fraction * n)`` of the rest are *negligible*, the
others *marginal* (ties at a boundary go to whichever block ``torch.topk`` returns).  Text blocks are always critical
(and text queries attend everything).

* Sparse branch: exact softmax attention over the critical blocks (block-sparse core).  For
  ``sage_sla_attn`` Q and K enter the sparse branch INT8-quantized (K first smoothed by subtracting
  its mean over the sequence, which leaves softmax unchanged; then symmetric per-block, per-head
  scales ``max|x| / 127``; :mod:`.quant`).
* Linear branch: for the marginal blocks, ``o_l = phi(q) (sum_j phi(K_j)^T V_j) / (phi(q) .
  sum_j phi(K_j)^T 1)`` with ``phi = softmax`` over the head dimension, then a learned projection
  ``proj(o_l)`` added to the sparse output.  The projection is a trained checkpoint tensor
  (``proj_weight [D, D]``, optional ``proj_bias [D]``); checkpoints without it — every checkpoint
  this build loads — contribute zero, so the output is the sparse branch alone.  The LSE returned
  is the sparse branch's.
* Negligible blocks are skipped.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ditattn.attention.sparse.common import SparsePlan, ceil_fraction, run_block_lists, topk_lists
from ditattn.attention.sparse.quant import quantize_blocks_int8, quantize_qk_blocks  # noqa: F401 (re-export)
from ditattn.attention.sparse.sparge import sparge_tile_size
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, tile, untile
from ditattn.attention.sparse.vsa import pooled_video_scores

Tensor = torch.Tensor


def sla_counts(n_video_blocks: int, topk: float, negligible_fraction: float) -> tuple[int, int]:
    """``(critical, negligible)`` key blocks per video query block."""
    n_crit = ceil_fraction(float(topk), n_video_blocks)
    return n_crit, min(int(math.floor(float(negligible_fraction) * n_video_blocks + 1e-9)), n_video_blocks - n_crit)


def sla_classify(
    q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, *, topk: float, negligible_fraction: float, scale: float
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, float]]:
    """``(critical, marginal, pooled probabilities, lists)``: the masks and probabilities are
    ``[B, H, nv, nv]`` over video blocks; ``lists`` are the sparse branch's block lists
    ``(kv_indices, kv_counts, kept_fraction)`` (critical blocks plus every special block), built
    straight from the top-k selection (no sort of the whole score matrix)."""
    scores = pooled_video_scores(q_tiled, k_tiled, layout, scale)
    probs = torch.softmax(scores, dim=-1)
    nv = layout.n_video_blocks
    n_crit, n_negl = sla_counts(nv, topk, negligible_fraction)
    idx, cnt, kept = topk_lists(layout, probs, n_crit)
    critical = torch.zeros_like(probs, dtype=torch.bool)
    critical.scatter_(-1, idx[:, :, :nv, :n_crit].long(), True)
    marginal = ~critical
    if n_negl:  # the n_negl least probable of the non-critical blocks
        low = probs.masked_fill(critical, float("inf")).topk(n_negl, dim=-1, largest=False).indices
        marginal.scatter_(-1, low, False)
    return critical, marginal, probs, (idx, cnt, kept)


def linear_branch(q_tiled: Tensor, k_tiled: Tensor, v_tiled: Tensor, layout: TileLayout, marginal: Tensor) -> Tensor:
    """Linear attention of each query over its marginal key blocks (``phi = softmax`` over the head
    dim): ``marginal`` bool ``[B, H, n_blocks, n_blocks]`` -> float32 ``[B, P, H, D]`` (rows with
    no marginal block are zero)."""
    B, P, H, D = q_tiled.shape
    nb, bs = layout.n_blocks, layout.block_size
    valid = layout.on(q_tiled.device).valid.view(1, P, 1, 1).float()
    fq = torch.softmax(q_tiled.float(), dim=-1)
    fk = torch.softmax(k_tiled.float(), dim=-1) * valid
    fkb = fk.view(B, nb, bs, H, D)
    vb = v_tiled.float().view(B, nb, bs, H, D)
    kv = torch.einsum("bjthd,bjthe->bhjde", fkb, vb)  # [B,H,nb,D,D]
    ksum = fkb.sum(2).permute(0, 2, 1, 3)  # [B,H,nb,D]
    m = marginal.float()
    a = torch.einsum("bhij,bhjde->bhide", m, kv)
    z = torch.einsum("bhij,bhjd->bhid", m, ksum)
    fqb = fq.view(B, nb, bs, H, D)
    num = torch.einsum("bitxd,bxide->bitxe", fqb, a)
    den = torch.einsum("bitxd,bxid->bitx", fqb, z).unsqueeze(-1)
    out = torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros_like(num))
    return out.reshape(B, P, H, D)


def sla_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    text_len: int = 0,
    topk: float = 0.2,
    negligible_fraction: float = 0.0,
    block_size: int = 64,
    quantize: bool = False,
    proj_weight: Optional[Tensor] = None,
    proj_bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    impl: str = "auto",
    edge_tiles: str = "packed",
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """SLA (``quantize=True``: SAGE_SLA) over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with
    q's head count); ``edge_tiles`` as in the module docstring.  Returns ``(out, sparse-branch lse or None, plan)``;
    ``plan.extra`` holds the
    ``critical``/``marginal`` video-block masks and the pooled ``probs``."""
    layout = make_tile_layout(video_shape, sparge_tile_size(block_size), text_len, edge_tiles=edge_tiles)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qt, kt = tile(q, layout), tile(k, layout)
    critical, marginal, probs, (idx, cnt, kept) = sla_classify(
        qt, kt, layout, topk=topk, negligible_fraction=negligible_fraction, scale=scale
    )
    nv, nb = layout.n_video_blocks, layout.n_blocks
    n_crit, n_negl = sla_counts(nv, topk, negligible_fraction)
    # both fractions follow from the per-row counts of sla_classify (host arithmetic, no device sync)
    extra = {
        "critical": critical,
        "marginal": marginal,
        "probs": probs,
        "marginal_fraction": nv * (nv - n_crit - n_negl) / (nb * nb),
    }
    # the de-quantized values go into the block-sparse kernel in q's dtype (the fused bf16/fp16
    # kernel on GPU; a float32 operand would force the slow reference path)
    qs, ks = quantize_qk_blocks(qt, kt, layout, impl=impl) if quantize else (qt, kt)
    out, lse, plan = run_block_lists(
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
        extra=extra,
        q_tiled=qs,
        k_tiled=ks,
    )
    if proj_weight is not None:
        marg_full = torch.zeros(*marginal.shape[:2], nb, nb, dtype=torch.bool, device=q.device)
        marg_full[..., :nv, :nv] = marginal
        ol = linear_branch(qt, kt, tile(v, layout), layout, marg_full)
        proj = ol @ proj_weight.float().t()
        if proj_bias is not None:
            proj = proj + proj_bias.float()
        out = (out.float() + untile(proj, layout)).to(q.dtype)
    return out, lse, plan
