"""Sol attention: threshold routing between exact key blocks and block-centroid approximation.

Blocks are 4x4x4 tiles (64 tokens; ``block_size=128``: 4x4x8 tiles, whose exact part runs
FlashAttention-4's block-sparse kernel on Hopper where installed); with ``edge_tiles="packed"`` (the
default) the tiles cut by the grid edge are packed several to a block (:mod:`.tiling`), ``"padded"``
keeps one block per tile.
For every (batch, head, query block ``i``) and video key block ``j``, with block means ``q_i``,
``k_j``, ``v_j`` (over real tokens) and ``s_ij = scale * q_i . k_j``:

* threshold ``thr_i = m_i + tau * sqrt(var_i + 1e-6)`` where, for ``thresh_type=diag``,
  ``m_i = scale * q_i . mean_j(k_j)`` and ``var_i = scale^2 * sum_d q_id^2 var_j(k_jd)`` (diagonal
  approximation of the score variance), and for ``thresh_type=exact`` ``m_i``/``var_i`` are the
  mean and (population) variance of the actual scores ``s_i.`` over the video key blocks;
* with ``predictor="pooled"`` (upstream) block ``j`` is *exact* for ``i`` when ``s_ij > thr_i`` or
  the blocks hold tiles that are neighbours in tile order (``|tile_a - tile_b| <= 1`` for a tile
  ``a`` of block ``i`` and a tile ``b`` of block ``j``, flat tile indices; one tile per block unless
  packed); with ``predictor="pooled_query"`` (the default) that rule only sets *how many* blocks
  query block ``i`` computes exactly (``n_i``), and *which* ones are its neighbours plus the best
  of the rest by the pooled-query score ``log sum_{t in j} exp(scale * q_i . k_t)``
  (:mod:`.block_scores`), which sees what a block mean hides (sink keys, fast RoPE channels);
  special blocks (text tokens and the exact KV sink ``[sink_start, sink_start + sink_tokens)``) are
  exact for every query, and special query rows (text, sink tokens) attend everything exactly;
* every other block is *approximate*: it contributes one virtual key ``k_j`` with value ``v_j`` and
  weight ``|block j|`` (score ``q . k_j * scale + log |block j|``), so the softmax denominator sees
  the block's size.  With ``centroid_variance`` the score also gets the block's key spread,
  ``+ 0.5 * scale^2 * sum_d q_d^2 var_j(k_d)`` — the log of the block's mean ``exp`` score for
  keys spread normally around ``k_j`` rather than the ``exp`` of its mean score, which by Jensen's
  inequality is always lower (about 2x lower per block on the structured inputs of
  docs/benchmarks.md).

Output = softmax over (exact tokens) ∪ (virtual keys of approximate blocks), computed as the exact
block-sparse part and the centroid part merged by their LSEs (on CUDA in bf16/fp16 the centroid
part continues the exact part's softmax state in one Triton kernel,
:mod:`ditattn.attention.kernels.block_centroid`; elsewhere in PyTorch, float32).  A higher ``tau`` routes fewer
blocks exactly.  ``kv_splits`` is a kernel tuning argument of the upstream CUDA kernel; the
in-tree engine splits work itself and ignores it (it is validated).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from ditattn.attention.sparse.block_scores import pooled_query_block_scores, pooled_query_features
from ditattn.attention.sparse.block_sparse import (
    block_sparse_attention,
    dense_attention,
    list_width,
)
from ditattn.attention.sparse.common import SparsePlan, triton_path, video_mask_lists
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, pooled_blocks, tile, untile
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

SOL_TILE_SIZE = (4, 4, 4)
#: the tiles of each ``block_size``
SOL_TILES = {64: SOL_TILE_SIZE, 128: (4, 4, 8)}
SOL_PREDICTORS = ("pooled_query", "pooled")
_CHUNK_ELEMS = 1 << 25


def sol_route(
    q_tiled: Tensor,
    k_tiled: Tensor,
    layout: TileLayout,
    *,
    tau: float,
    thresh_type: str,
    scale: float,
    predictor: str = "pooled_query",
    impl: str = "auto",
    pooled: Optional[tuple[Tensor, Tensor]] = None,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """``(exact video-block routes [B, H, nv, nv] bool, pooled scores [B, H, nv, nv], thresholds
    [B, H, nv], pooled-query scores [B, H, nv, nv] or None)`` (module docstring).  ``pooled``: the
    callers' block means ``(pooled_blocks(q_tiled, layout, nv), pooled_blocks(k_tiled, layout, nv))``,
    computed here when None."""
    nv = layout.n_video_blocks
    if pooled is None:
        pooled = (pooled_blocks(q_tiled, layout, nv), pooled_blocks(k_tiled, layout, nv))
    pq, pk = pooled
    s = (pq @ pk.transpose(-1, -2)) * scale
    if thresh_type == "diag":
        mu = pk.mean(2, keepdim=True)  # [B,H,1,D]
        var_k = (pk.pow(2).mean(2, keepdim=True) - mu.pow(2)).clamp(min=0)
        m = (pq * mu).sum(-1) * scale
        var = (pq.pow(2) * var_k).sum(-1) * scale * scale
    elif thresh_type == "exact":
        m = s.mean(-1)
        var = (s.pow(2).mean(-1) - m.pow(2)).clamp(min=0)
    else:
        raise AttentionConfigError(f"sol_attn: thresh_type must be 'diag' or 'exact', got {thresh_type!r}")
    thr = m + float(tau) * torch.sqrt(var + 1e-6)
    near = neighbour_blocks(layout, s.device)
    rule = (s > thr.unsqueeze(-1)) | near
    if predictor == "pooled":
        return rule, s, thr, None
    if predictor != "pooled_query":
        raise AttentionConfigError(f"sol_attn: predictor must be one of {list(SOL_PREDICTORS)}, got {predictor!r}")
    # upstream's count per query block; the neighbours first, then the best pooled-query scores
    route = pooled_query_block_scores(
        q_tiled, k_tiled, layout, scale, impl="reference" if impl in ("reference", "flex") else "auto", q_mean=pq
    )
    # a block is exact when its score reaches the row's n_i-th largest (n_i >= 1: the diagonal is a neighbour)
    ranked = route.masked_fill(near, float("inf"))
    nth = ranked.sort(dim=-1, descending=True).values.gather(-1, rule.sum(-1, keepdim=True) - 1)
    return ranked >= nth, s, thr, route


def sol_tile_size(block_size: int) -> tuple[int, int, int]:
    """The ``(t, h, w)`` tile of a ``block_size``-token block (:data:`SOL_TILES`)."""
    try:
        return SOL_TILES[int(block_size)]
    except (KeyError, TypeError, ValueError):
        raise AttentionConfigError(
            f"sol_attn: block_size must be one of {sorted(SOL_TILES)}, got {block_size!r}"
        ) from None


@functools.lru_cache(maxsize=64)
def neighbour_blocks(layout: TileLayout, device: torch.device) -> Tensor:
    """Bool ``[nv, nv]`` on ``device`` (cached): video blocks ``i`` and ``j`` hold tiles ``a`` and
    ``b`` with ``|a - b| <= 1`` (flat tile indices)."""
    nv = layout.n_video_blocks
    blocks, tiles = layout.block_tile_pairs()
    first, count = layout.tile_first_block, layout.tile_num_blocks
    near = torch.zeros(nv, nv, dtype=torch.bool)
    for d in (-1, 0, 1):
        other = tiles + d
        ok = (other >= 0) & (other < layout.n_tiles)
        rows, other = blocks[ok], other[ok]
        n = count[other]
        offs = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        near[torch.repeat_interleave(rows, n), torch.repeat_interleave(first[other], n) + offs] = True
    with torch.inference_mode(False):  # cached: an ordinary tensor even when first built under inference mode
        return near.to(device)


def _block_means(
    qt: Tensor, kt: Tensor, vt: Tensor, layout: TileLayout, variance: bool, kernel: bool
) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """``(mean q, mean k, k's per-channel variance or None, mean v)`` of every video block, float32
    ``[B, H, nv, D]``: on the Triton path one read of each tile (:func:`ditattn.attention.kernels.block_select.
    pool_block_moments`, no float32 copy of k), else PyTorch (:func:`.tiling.pooled_blocks`)."""
    nv = layout.n_video_blocks
    if kernel:
        from ditattn.attention.kernels.block_select import pool_block_moments

        count = layout.on(qt.device).count_as(torch.float32).view(-1)
        run = functools.partial(pool_block_moments, count=count, n_blocks=nv, block_size=layout.block_size)
        kc, kvar = run(kt, variance=variance)
        return run(qt)[0], kc, kvar, run(vt)[0]
    kc, kvar = pooled_query_features(kt, layout, nv, variance=variance)
    return pooled_blocks(qt, layout, nv), kc, kvar, pooled_blocks(vt, layout, nv)


def sol_sink_range(sink_start: int, sink_tokens: int, seq_len: int) -> tuple[int, int]:
    if sink_tokens <= 0:
        return (0, 0)
    stop = sink_start + sink_tokens
    if sink_start < 0 or stop > seq_len:
        raise AttentionConfigError(
            f"sol_attn: exact KV sink [sink_start={sink_start}, sink_start+sink_tokens={stop}) lies outside the "
            f"sequence of {seq_len} tokens; set sink_start/sink_tokens inside it (or sink_tokens=0)"
        )
    return (sink_start, stop)


def _centroid_part(
    q_tiled: Tensor,
    kc: Tensor,
    vc: Tensor,
    logw: Tensor,
    approx_rows: Tensor,
    bs: int,
    scale: float,
    kvar: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Attention of every query over the virtual keys of its approximate blocks.

    q_tiled ``[B, P, H, D]``; kc/vc ``[B, H, nv, D]``; logw ``[nv]``; approx_rows ``[B, H, nb, nv]``
    bool (per query block); kvar ``[B, H, nv, D]`` or None: the blocks' per-channel key variance
    (adds ``0.5 * scale^2 * q^2 . kvar_j`` to the score).  Returns ``(out [B, H, P, D] float,
    lse [B, H, P] float)``.
    """
    B, P, H, D = q_tiled.shape
    dt = kc.dtype
    qh = q_tiled.to(dt).transpose(1, 2)  # [B,H,P,D]
    nv = kc.shape[2]
    nb = P // bs
    out = torch.zeros(B, H, P, D, dtype=dt, device=q_tiled.device)
    lse = torch.full((B, H, P), float("-inf"), dtype=dt, device=q_tiled.device)
    hc = max(1, min(H, _CHUNK_ELEMS // max(1, B * P * nv)))
    for h0 in range(0, H, hc):
        h1 = min(H, h0 + hc)
        s = torch.baddbmm(
            logw.view(1, 1, -1).to(dt),
            qh[:, h0:h1].flatten(0, 1),
            kc[:, h0:h1].flatten(0, 1).transpose(1, 2),
            alpha=scale,
        )
        if kvar is not None:
            s.baddbmm_(
                qh[:, h0:h1].flatten(0, 1).pow(2),
                kvar[:, h0:h1].flatten(0, 1).to(dt).transpose(1, 2),
                alpha=0.5 * scale * scale,
            )
        s = s.view(B, h1 - h0, nb, bs, nv)
        # the route is per query BLOCK: broadcast it over the block's rows instead of materialising it per row
        s.masked_fill_(~approx_rows[:, h0:h1, :, None, :], float("-inf"))
        s = s.view(B, h1 - h0, P, nv)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = s.sub_(m).exp_()
        l = p.sum(-1, keepdim=True)
        out[:, h0:h1] = (p @ vc[:, h0:h1]) / l.clamp(min=1e-30)
        lse[:, h0:h1] = (m + l.log()).squeeze(-1)
    return out, lse


def sol_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    text_len: int = 0,
    tau: float = 1.0,
    thresh_type: str = "diag",
    sink_start: int = 0,
    sink_tokens: int = 0,
    predictor: str = "pooled_query",
    centroid_variance: bool = True,
    scale: Optional[float] = None,
    return_lse: bool = False,
    impl: str = "auto",
    edge_tiles: str = "packed",
    error_budget: float = 0.0,
    tile_size: Optional[tuple] = None,
    block_size: int = 64,
    dense_backend: Optional[str] = None,
    decide: bool = True,
    dense_above: Optional[float] = None,
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """Sol over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count); any float
    dtype / head dim (the backend enforces bf16 and 128).  ``predictor``, ``centroid_variance``
    and ``edge_tiles``: the module docstring.  Returns ``(out, lse or None, plan)`` with
    ``plan.extra``: ``exact`` video routes ``[B, H, nv, nv]``, ``scores`` (pooled),
    ``thresholds``, ``route_scores`` (pooled-query scores, or None with ``predictor="pooled"``).
    ``error_budget`` > 0: more blocks become exact until the predicted mass of the approximate blocks
    per query block is at most the budget (:mod:`.budget`); ``decide`` and ``dense_above``: when the call
    runs ``dense_backend`` instead (``plan.extra["dense_fallback"]``), as in :func:`.sparge.sparge_attention`
    (no floor).  ``block_size``: 64 (``SOL_TILE_SIZE``, 4x4x4 tiles) or 128 (4x4x8 tiles);
    ``tile_size`` overrides it: ``(1, 1, block_size)`` for plain sequences given as a ``(1, 1, S)`` grid."""
    B, S, H, D = q.shape
    n_video = math.prod(int(x) for x in video_shape)
    sink = sol_sink_range(int(sink_start), int(sink_tokens), n_video + int(text_len))
    tiles = sol_tile_size(block_size) if tile_size is None else tuple(tile_size)
    layout = make_tile_layout(
        video_shape, tiles, text_len, special_ranges=[sink] if sink[1] > sink[0] else [], edge_tiles=edge_tiles
    )
    scale = D**-0.5 if scale is None else float(scale)
    if error_budget > 0 and decide:
        from ditattn.attention.sparse import budget as eb

        if eb.early_dense(
            q, k, layout, error_budget, scale=scale, impl=impl, above=dense_above
        ):  # before any routing work (and before tiling q, k and v)
            return eb.dense_budgeted(
                q,
                k,
                v,
                layout,
                error_budget,
                scale=scale,
                return_lse=return_lse,
                dense_backend=dense_backend,
                extra={"predictor": predictor, "sink": sink},
            )
    qt, kt, vt = tile(q, layout), tile(k, layout), tile(v, layout)
    nv, nb, bs = layout.n_video_blocks, layout.n_blocks, layout.block_size
    # each block mean once: the routing's pooled q and k, the centroids' keys (and their spread) and values
    pq, kc, kvar, vc = _block_means(qt, kt, vt, layout, bool(centroid_variance), triton_path(q, impl))
    exact, scores, thr, route = sol_route(
        qt,
        kt,
        layout,
        tau=tau,
        thresh_type=thresh_type,
        scale=scale,
        predictor=predictor,
        impl=impl,
        pooled=(pq, kc),
    )
    budget = None
    if error_budget > 0:
        from ditattn.attention.sparse import budget as eb

        lm = eb.probe_log_mass(qt, kt, layout, scale, impl=impl)
        selected = exact
        exact, dense = eb.enforce_budget(lm, exact, error_budget)
        budget = eb.budget_stats(lm, selected, exact, dense, error_budget)
        if decide and eb.call_dense(exact, dense_above):
            res = eb.Budgeted(layout, None, None, budget)
            out, lse = dense_attention(q, k, v, scale=scale, return_lse=return_lse, backend=dense_backend)
            return out, lse, res.plan({"predictor": predictor, "sink": sink})
    idx, cnt = video_mask_lists(layout, exact, width=list_width(q.device, layout.n_blocks))
    kvv = layout.kv_valid(B, q.device)
    o1, l1 = block_sparse_attention(
        qt,
        kt,
        vt,
        idx,
        cnt,
        block_size=layout.block_size,
        scale=scale,
        kv_valid=kvv,
        return_lse=True,
        impl=impl,
        nonempty_rows=True,  # every query block routes its own block exactly (a tile neighbour): no check, no sync
    )
    logw = layout.on(kc.device).block_count[:nv].to(kc.dtype).log()  # the device copy is cached: no upload
    approx = torch.zeros(B, H, nb, nv, dtype=torch.bool, device=q.device)
    approx[:, :, :nv] = ~exact
    if triton_path(q, impl):
        # the virtual keys continue the exact part's online softmax inside one Triton kernel
        from ditattn.attention.kernels.block_centroid import block_centroid_attention

        o_t, lse = block_centroid_attention(
            qt, kc, vc, logw, approx, block_size=bs, scale=scale, o_init=o1, lse_init=l1, kvar=kvar
        )
        out = untile(o_t, layout).to(q.dtype)
    else:
        o2, l2 = _centroid_part(qt, kc, vc, logw, approx, bs, scale, kvar)
        l1d = l1.to(l2.dtype)
        lse = torch.logaddexp(l1d, l2)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        w1 = torch.exp(l1d - safe).unsqueeze(-1)
        w2 = torch.exp(l2 - safe).unsqueeze(-1)
        o = o1.transpose(1, 2).to(l2.dtype) * w1 + o2 * w2  # [B,H,P,D]
        out = untile(o.transpose(1, 2), layout).to(q.dtype)
    lse_out = untile(lse.float(), layout, dim=2) if return_lse else None
    plan = SparsePlan(
        layout,
        idx,
        cnt,
        None,  # the kept fraction is counted when first read
        {
            "exact": exact,
            "scores": scores,
            "thresholds": thr,
            "route_scores": route,
            "sink": sink,
            "predictor": predictor,
            "centroid_variance": bool(centroid_variance),
            "budget": budget,
        },
    )
    return out, lse_out, plan
