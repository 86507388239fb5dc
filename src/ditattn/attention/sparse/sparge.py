"""SpargeAttention: keep, per head and query block, the key blocks that a block predictor ranks first.

Blocks are 3-D tiles (``block_size`` 32 -> 2x4x4, 64 -> 4x4x4, 128 -> 4x4x8 latent tokens), so a
pooled block is spatially coherent; with ``edge_tiles="packed"`` (the default) the tiles cut by the
grid edge are packed several to a block (:mod:`.tiling`), ``"padded"`` keeps one block per tile.
For every (batch, head, query block) a predictor scores the video key blocks and a rule keeps some
of them; text blocks are always kept and text queries attend everything.  The rule:

* ``topk`` alone (in (0, 1], default 0.5): the best ``ceil(topk * n_blocks)`` blocks, the same
  count in every row;
* with ``cdfthreshd`` (in (0, 1]; upstream SpargeAttn's name): the fewest blocks, best first,
  whose predicted share of the row's attention mass reaches ``cdfthreshd``, but at least the
  ``ceil(topk * n_blocks)`` best — ``topk`` becomes a floor, so a broad row keeps many blocks and
  a peaked one the floor.  The shares are the softmax over the row of the predictor's block
  log-masses (:func:`sparge_log_mass`), which also rank the blocks.

Upstream (``spas_sage_attn/utils.py``, ``get_block_map_meansim``) softmaxes its pooled scores the
same way, but takes *either* ``topk`` *or* ``cdfthreshd`` (two entry points, an assertion against
both) and keeps ``searchsorted(cdf, cdfthreshd, right=True)`` blocks: the longest prefix whose
cumulative share does not exceed the threshold, one block fewer than here unless a prefix hits it
exactly.  Its pure rule is ``cdfthreshd`` with a ``topk`` of at most ``1 / n_blocks`` here (floor:
one block).  The floor is ours: on the structured 480p inputs at 40 heads (docs/benchmarks.md)
the pure rule is worse than ``topk`` at every kept fraction — the predicted shares are too peaked
in the spatial and temporal heads — while the floor plus ``cdfthreshd`` beats ``topk`` (the broad
heads get the blocks the fixed count denies them).

Predictors (:mod:`.block_scores`):

* ``pooled`` — upstream SpargeAttn's ``scale * mean(q) . mean(k)`` (both sides mean-pooled);
* ``pooled_query`` (default) — ``log sum_{j in block} exp(scale * mean(q) . k_j)``: the query
  block's mean against every key of the block.  It sees sink keys and the fast RoPE channels that
  block means average away: on the structured 480p inputs of docs/benchmarks.md it lowers the
  error at ``topk`` 0.5 from 10.2 % to 5.4 % (INT8, packed tiles), for 1/128 of dense attention's FLOPs;
* ``pooled_query_var`` — ``pooled_query`` plus the query block's per-channel variance term
  (second order), twice its FLOPs.

Upstream's self-similarity rule is available as ``simthreshd1``: a block whose mean pairwise cosine
similarity (:func:`.block_scores.block_self_similarity`) is ``<= simthreshd1`` is not trusted to a
pooled summary — a query block of that kind attends every block, and a key block of that kind is
kept for every query block, on top of the rule's blocks (which are then chosen among the other key
blocks; with ``cdfthreshd`` the others' shares are renormalised among them, as upstream).  The
similarity lies in [0, 1], so upstream's top-k default ``-0.1`` (also ours) never triggers.
With ``topk`` and no fallback the lists come straight from the top-k indices (no dense mask); with
``cdfthreshd`` and no fallback row lengths vary and the lists come from the rule's video mask
(one sort) through a running count per row (:func:`.common.mass_lists`: one Triton kernel on CUDA,
a scatter on the CPU; no ``[n_blocks, n_blocks]`` mask, no second sort); with the fallback they
come from the block mask.  Off the CPU the varying-length lists have a fixed width
(``n_blocks``).  No path synchronises with the device.

Kept blocks are computed SageAttention-style, as upstream SpargeAttn does through SageAttention2
(which is why upstream calls Sparge approximate even at ``topk=1``): Q and smoothed K are quantized
to INT8 per (batch, block, head) and the scores come from the quantized values
(:mod:`.quant`); P.V stays in the input precision (fp16/bf16).  ``quantize=False`` computes the
kept blocks exactly (the plain block-sparse variant).

Shape rule (seed): only square self-attention of at least 128 tokens with head dim 64 or 128 is
sparsified; any other call runs dense SDPA (:func:`sparge_applies`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ditattn.attention.sparse.block_scores import block_self_similarity, pooled_query_block_scores
from ditattn.attention.sparse.block_sparse import block_mask_to_lists, list_width
from ditattn.attention.sparse.common import (
    SparsePlan,
    add_special_blocks,
    ceil_fraction,
    mass_lists,
    mass_mask,
    run_block_lists,
    select_impl,
    topk_lists,
    topk_mask,
)
from ditattn.attention.sparse.quant import quantize_qk_blocks
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, tile
from ditattn.attention.sparse.vsa import pooled_video_scores
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

SPARGE_TILES = {32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8)}
SPARGE_HEAD_DIMS = (64, 128)
SPARGE_MIN_TOKENS = 128
SPARGE_PREDICTORS = ("pooled_query", "pooled_query_var", "pooled")


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


def sparge_scores(
    q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, scale: float, predictor: str, impl: str = "auto"
) -> Tensor:
    """Block scores of ``predictor`` (module docstring): float32 ``[B, H, nv, nv]``, higher = keep."""
    if predictor == "pooled":
        return pooled_video_scores(q_tiled, k_tiled, layout, scale, impl)
    if predictor in ("pooled_query", "pooled_query_var"):
        return pooled_query_block_scores(
            q_tiled,
            k_tiled,
            layout,
            scale,
            variance=predictor == "pooled_query_var",
            impl="reference" if impl in ("reference", "flex") else "auto",
        )
    raise AttentionConfigError(f"sparge_attn: predictor must be one of {list(SPARGE_PREDICTORS)}, got {predictor!r}")


def sparge_log_mass(scores: Tensor, layout: TileLayout, predictor: str) -> Tensor:
    """The predictor's ``scores [B, H, nv, nv]`` as block log-masses, whose softmax over a row is
    each key block's predicted share of the query block's attention: ``pooled_query`` and
    ``pooled_query_var`` already are (a log-sum-exp over the block's keys); ``pooled``'s mean
    logit gets ``+ log(real tokens of the key block)`` (the mass of a block whose keys all sat at
    their mean; upstream's blocks are equal-sized but the last, so it leaves the term out)."""
    if predictor != "pooled":
        return scores
    count = layout.on(scores.device).block_count[: layout.n_video_blocks]
    return scores + count.to(scores.dtype).log()


def check_fraction(name: str, value) -> float:
    """``value`` as a float in (0, 1], else an :class:`AttentionConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise AttentionConfigError(f"sparge_attn: {name} must be a number in (0, 1], got {value!r}")
    return float(value)


def sparge_select(
    scores: Tensor,
    layout: TileLayout,
    *,
    topk: float,
    cdfthreshd: Optional[float],
    predictor: str,
    valid: Optional[Tensor] = None,
) -> Tensor:
    """Video block mask ``[B, H, nv, nv]`` of the rule in use (module docstring) over ``scores``;
    ``valid`` False blocks are never chosen (``cdfthreshd``: nor counted in the shares)."""
    kk = ceil_fraction(float(topk), layout.n_video_blocks)
    if cdfthreshd is None:
        return topk_mask(scores, kk, valid=valid)
    return mass_mask(sparge_log_mass(scores, layout, predictor), float(cdfthreshd), valid=valid, min_count=kk)


def sparge_block_mask(
    q_tiled: Tensor,
    k_tiled: Tensor,
    layout: TileLayout,
    topk: float,
    scale: float,
    *,
    predictor: str = "pooled_query",
    simthreshd1: float = -0.1,
    cdfthreshd: Optional[float] = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``(block mask [B, H, n_blocks, n_blocks], scores [B, H, nv, nv])`` of the module docstring's
    rule (``topk``, ``cdfthreshd`` if not None, plus the self-similarity fallback)."""
    nv = layout.n_video_blocks
    scores = sparge_scores(q_tiled, k_tiled, layout, scale, predictor, impl)
    rule = dict(topk=topk, cdfthreshd=cdfthreshd, predictor=predictor)
    if simthreshd1 < 0:  # the similarity is >= 0: nothing falls back
        return add_special_blocks(layout, sparge_select(scores, layout, **rule)), scores
    q_odd = block_self_similarity(q_tiled, layout, nv) <= simthreshd1  # [B, H, nv]
    k_odd = block_self_similarity(k_tiled, layout, nv) <= simthreshd1
    mask = sparge_select(scores, layout, valid=~k_odd.unsqueeze(2).expand_as(scores), **rule)
    mask |= k_odd.unsqueeze(2) | q_odd.unsqueeze(3)
    return add_special_blocks(layout, mask), scores


def sparge_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    topk: float = 0.5,
    cdfthreshd: Optional[float] = None,
    block_size: int = 64,
    text_len: int = 0,
    quantize: bool = False,
    predictor: str = "pooled_query",
    simthreshd1: float = -0.1,
    scale: Optional[float] = None,
    return_lse: bool = False,
    impl: str = "auto",
    edge_tiles: str = "packed",
    error_budget: float = 0.0,
    tile_size: Optional[tuple] = None,
    decide: bool = True,
    dense_above: Optional[float] = None,
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """Sparge over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count); no shape
    or dtype rule here (the backend applies :func:`sparge_applies` and FP16/BF16).  ``topk`` and
    ``cdfthreshd`` (None: off): the selection rule, each in (0, 1].  ``quantize``: INT8 Q.K in the
    kept blocks (the backend's default); False: exact kept blocks.  ``predictor`` and
    ``simthreshd1``: the block selection (module docstring); it reads the unquantized q/k.
    ``edge_tiles`` as in the module docstring.  Returns ``(out, lse or None, plan)``; ``plan.extra``:
    ``scores``, ``k`` (``topk``'s block count: every row's under ``topk`` alone, the floor under
    ``cdfthreshd``), ``cdfthreshd``, ``quantized``, ``predictor``; the kept fraction is counted
    when first read when row lengths vary.  ``error_budget`` > 0: the selection is widened until its
    predicted dropped mass per query block is at most the budget (:mod:`.budget`); with ``decide`` the call
    runs the dense kernel instead (``plan.extra["dense_fallback"]``) when it is predicted to keep more than
    ``dense_above`` of the blocks (None: :data:`.budget.DENSE_CALL_ABOVE`), first from a sample of probe rows
    (:func:`.budget.early_kept`, ``topk`` as the floor) before any selection work, then from the budgeted
    selection (one device sync each); ``decide=False`` (a sparse decision reused from an earlier step)
    checks neither (no sync).  ``tile_size``:
    the tile in latent tokens (default: ``block_size``'s 3-D tile; ``(1, 1, block_size)`` for plain
    sequences given as a ``(1, 1, S)`` grid)."""
    topk = check_fraction("topk", topk)
    cdfthreshd = None if cdfthreshd is None else check_fraction("cdfthreshd", cdfthreshd)
    tile_size = sparge_tile_size(block_size) if tile_size is None else tuple(tile_size)
    layout = make_tile_layout(video_shape, tile_size, text_len, edge_tiles=edge_tiles)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kk = ceil_fraction(topk, layout.n_video_blocks)
    extra = {"k": kk, "cdfthreshd": cdfthreshd, "quantized": bool(quantize), "predictor": predictor}
    if error_budget > 0 and decide:
        from ditattn.attention.sparse.budget import dense_budgeted, early_dense

        if early_dense(
            q, k, layout, error_budget, scale=scale, impl=impl, floor=topk, above=dense_above
        ):  # before any selection work (and before tiling q and k)
            return dense_budgeted(q, k, v, layout, error_budget, scale=scale, return_lse=return_lse, extra=extra)
    qt, kt = tile(q, layout), tile(k, layout)
    qs, ks = quantize_qk_blocks(qt, kt, layout, impl=impl) if quantize else (qt, kt)
    # every query block keeps at least topk's one block (text rows: every block), so no list is empty
    run = dict(scale=scale, return_lse=return_lse, impl=impl, q_tiled=qs, k_tiled=ks, nonempty_rows=True)
    if error_budget > 0:  # the budgeted selection: through the video mask
        from ditattn.attention.sparse.budget import budgeted_lists

        mask, scores = sparge_block_mask(
            qt, kt, layout, topk, scale, predictor=predictor, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, impl=impl
        )
        res = budgeted_lists(
            q,
            k,
            v,
            qt,
            kt,
            layout,
            mask[..., : layout.n_video_blocks, : layout.n_video_blocks],
            error_budget,
            scale=scale,
            return_lse=return_lse,
            impl=impl,
            decide=decide,
            above=dense_above,
        )
        if res.dense_out is not None:
            return res.dense_out, res.dense_lse, res.plan(extra)
        return run_block_lists(
            q, k, v, layout, res.idx, res.cnt, extra=dict(extra, scores=scores, budget=res.stats), **run
        )
    if simthreshd1 < 0 and cdfthreshd is not None:  # varying row lengths, no fallback: lists without the mask
        scores = sparge_scores(qt, kt, layout, scale, predictor, impl)
        idx, cnt = mass_lists(
            layout,
            sparge_log_mass(scores, layout, predictor),
            cdfthreshd,
            kk,
            width=list_width(q.device, layout.n_blocks),
            impl=select_impl(impl),
        )  # the lists of sparge_block_mask's mask
        return run_block_lists(q, k, v, layout, idx, cnt, extra=dict(extra, scores=scores), **run)
    if simthreshd1 >= 0:  # the self-similarity fallback: through the mask
        mask, scores = sparge_block_mask(
            qt, kt, layout, topk, scale, predictor=predictor, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, impl=impl
        )
        idx, cnt = block_mask_to_lists(mask, width=list_width(q.device, layout.n_blocks))
        return run_block_lists(q, k, v, layout, idx, cnt, extra=dict(extra, scores=scores), **run)
    scores = sparge_scores(qt, kt, layout, scale, predictor, impl)
    idx, cnt, kept = topk_lists(layout, scores, kk, select_impl(impl))  # the lists of sparge_block_mask's mask
    return run_block_lists(q, k, v, layout, idx, cnt, kept_fraction=kept, extra=dict(extra, scores=scores), **run)
