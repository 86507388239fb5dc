"""V-MoBA: mixture-of-block attention over temporal, spatial or spatio-temporal chunks.

Layer schedule: layers ``< first_full_layer`` run full attention; from there layers cycle through
``temporal_layer`` temporal layers, then ``spatial_layer`` spatial layers, then ``st_layer``
spatio-temporal layers.  Steps ``< first_full_step`` run full attention (backend).

Chunks (latent tokens): temporal ``ct`` whole frames (``ct x H x W``); spatial a ``ch x cw`` tube
through every frame (``T x ch x cw``); spatio-temporal a ``ct x ch x cw`` box.  Chunks at the grid
edge may be partial.  Tokens are laid out chunk by chunk (:class:`TileLayout` with the chunk as the
tile) in blocks of :func:`vmoba_block_size` tokens (64, or the power of two >= the chunk volume,
at least 16, for small chunks so that padding stays small); a query block lies inside one chunk.

Gate (per batch, head, query block, chunk), ``gate``: ``pooled_query`` (default)
``log sum_{t in chunk} exp(scale * mean(q over the query block) . k_t)`` (:mod:`.block_scores`:
the chunk's mass as seen from the query block's mean; it sees sink keys and local peaks that a
chunk mean of thousands of keys averages away), or ``mean`` (upstream) ``mean(q over the query
block) . mean(k over the chunk)``.  Every query block always attends its own chunk.  Selection of
the other chunks:

* ``moba_select_mode=topk``: the ``k`` best chunks including the own chunk (``temporal_topk`` /
  ``spatial_topk`` / ``st_topk``), per query block (``moba_threshold_type=query_head``), or the
  ``k * n_query_blocks`` best (query block, chunk) pairs per head (``head_global``), or the
  ``k * heads * n_query_blocks`` best per batch element (``overall``); own chunks always count.
* ``moba_select_mode=threshold``: gates are min-max normalised over the group named by
  ``moba_threshold_type`` (a query block's chunks / a head's pairs / a batch element's pairs);
  the own-chunk mass counts first, then other entries are taken in descending order until the
  selected share of the group's normalised mass reaches ``moba_threshold``.

Text tokens attend and are attended by everything.  This is V-MoBA at query-block granularity (the
upstream kernel selects per query token); the block is the unit the sparse engine computes.

Defaults when the config leaves chunk sizes out (derived from the grid ``(T, H, W)``):
``temporal_chunk_size = max(1, T // 8)``, ``spatial_chunk_size = (ceil(H / 4), ceil(W / 4))``,
``st_chunk_size = (ceil(T / 3), ceil(H / 3), ceil(W / 3))`` — about 8, 16 and 27 chunks; a missing
top-k is ``ceil(n_chunks / 4)``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ditattn.attention.sparse.block_scores import pooled_query_block_scores
from ditattn.attention.sparse.common import SparsePlan, add_special_blocks, run_block_lists, run_block_mask
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, tile
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

VMOBA_BLOCK_SIZE = 64
MODES = ("temporal", "spatial", "st")
VMOBA_GATES = ("pooled_query", "mean")


def vmoba_layer_mode(
    layer_idx: Optional[int],
    *,
    first_full_layer: int = 0,
    temporal_layer: int = 1,
    spatial_layer: int = 1,
    st_layer: int = 1,
) -> str:
    """``"full"``, ``"temporal"``, ``"spatial"`` or ``"st"`` for DiT block ``layer_idx`` (None = 0)."""
    layer = 0 if layer_idx is None else int(layer_idx)
    if layer < first_full_layer:
        return "full"
    cycle = temporal_layer + spatial_layer + st_layer
    if cycle <= 0:
        raise AttentionConfigError(
            "vmoba_attn: temporal_layer + spatial_layer + st_layer must be > 0 (got 0); "
            "set at least one of them to a positive integer"
        )
    r = (layer - first_full_layer) % cycle
    if r < temporal_layer:
        return "temporal"
    if r < temporal_layer + spatial_layer:
        return "spatial"
    return "st"


def default_chunk_sizes(video_shape) -> dict:
    T, H, W = video_shape
    return {
        "temporal": max(1, T // 8),
        "spatial": (max(1, -(-H // 4)), max(1, -(-W // 4))),
        "st": (max(1, -(-T // 3)), max(1, -(-H // 3)), max(1, -(-W // 3))),
    }


def chunk_tile(mode: str, video_shape, chunk) -> tuple[int, int, int]:
    """The tile (``(t, h, w)`` extent) of one chunk of ``mode``."""
    T, H, W = video_shape
    if mode == "temporal":
        return (int(chunk), H, W)
    if mode == "spatial":
        ch, cw = chunk
        return (T, int(ch), int(cw))
    if mode == "st":
        ct, ch, cw = chunk
        return (int(ct), int(ch), int(cw))
    raise AttentionConfigError(f"vmoba_attn: unknown chunk mode {mode!r}; accepted: {list(MODES)}")


def vmoba_block_size(chunk_volume: int) -> int:
    """Block size for chunks of ``chunk_volume`` tokens: 64, or the power of two >= the volume (at
    least 16) when a chunk is smaller than 64 tokens."""
    if chunk_volume >= VMOBA_BLOCK_SIZE:
        return VMOBA_BLOCK_SIZE
    return max(16, 1 << (int(chunk_volume) - 1).bit_length())


def chunk_gates(
    q_tiled: Tensor,
    k_tiled: Tensor,
    layout: TileLayout,
    predictor: str = "mean",
    scale: Optional[float] = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``(gate [B, H, nv, n_chunks] float32, chunk_of_block [nv] int64)``; chunks are the layout's
    non-empty tiles in tile order.  ``predictor="mean"``: pooled query block . chunk mean key;
    ``"pooled_query"``: ``log sum_{t in chunk} exp(scale * pooled query block . k_t)`` (``scale``
    default ``D ** -0.5``)."""
    B, P, H, D = q_tiled.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    dev = q_tiled.device
    dt = torch.float64 if q_tiled.dtype == torch.float64 else torch.float32
    index = layout.on(dev)  # built once per layout and device: no host-to-device copy per call
    chunk_of_block, nc = index.chunk_of_block, index.n_chunks
    if predictor == "pooled_query":
        blocks = pooled_query_block_scores(
            q_tiled,
            k_tiled,
            layout,
            D**-0.5 if scale is None else float(scale),
            impl="reference" if impl in ("reference", "flex") else "auto",
        )
        return _segment_logsumexp(blocks, chunk_of_block, nc), chunk_of_block
    if predictor != "mean":
        raise AttentionConfigError(f"vmoba_attn: gate must be one of {list(VMOBA_GATES)}, got {predictor!r}")
    cnt = index.count_as(dt).flatten()[:nv]
    qsum = q_tiled[:, : nv * bs].to(dt).view(B, nv, bs, H, D).sum(2)  # [B,nv,H,D]
    ksum = k_tiled[:, : nv * bs].to(dt).view(B, nv, bs, H, D).sum(2)
    qmean = qsum / cnt.view(1, -1, 1, 1)
    kc = torch.zeros(B, nc, H, D, dtype=dt, device=dev).index_add_(1, chunk_of_block, ksum)
    ccount = torch.zeros(nc, dtype=dt, device=dev).index_add_(0, chunk_of_block, cnt)
    kmean = kc / ccount.view(1, -1, 1, 1)
    gate = torch.einsum("bqhd,bchd->bhqc", qmean, kmean)
    return gate, chunk_of_block


def _segment_logsumexp(x: Tensor, group: Tensor, n_groups: int) -> Tensor:
    """``log sum exp`` of ``x [..., n]`` over the entries of each group (``group [n]`` int64 ids,
    consecutive or not): ``[..., n_groups]`` (``-inf`` for an empty group)."""
    idx = group.to(x.device).expand_as(x)
    m = torch.full((*x.shape[:-1], n_groups), float("-inf"), dtype=x.dtype, device=x.device)
    m.scatter_reduce_(-1, idx, x, "amax")
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    tot = torch.zeros_like(m).scatter_add_(-1, idx, (x - m_safe.gather(-1, idx)).exp())
    return torch.where(tot > 0, m_safe + tot.clamp(min=1e-30).log(), torch.full_like(m, float("-inf")))


def _select_groups(g: Tensor, own: Tensor, mode: str, k: int, threshold: float) -> Tensor:
    """Selection inside groups: ``g``/``own`` ``[G, N]`` -> bool ``[G, N]`` (own always selected)."""
    if mode == "topk":
        pri = g.masked_fill(own, float("inf"))
        kk = max(1, min(int(k), g.shape[1]))
        sel = torch.zeros_like(own)
        sel.scatter_(1, pri.topk(kk, dim=1).indices, True)
        return sel | own
    eps = 1e-6
    mn = g.amin(1, keepdim=True)
    mx = g.amax(1, keepdim=True)
    den = mx - mn
    den = torch.where(den <= eps, torch.ones_like(den), den)
    gn = (g - mn) / den
    total = gn.sum(1, keepdim=True) + eps
    remain = threshold - (gn * own).sum(1, keepdim=True) / total  # [G,1]
    others = gn.masked_fill(own, float("-inf"))
    sv, si = others.sort(dim=1, descending=True)
    sv = torch.where(torch.isfinite(sv), sv, torch.zeros_like(sv))
    before = (sv.cumsum(1) - sv) / total  # share selected before this entry
    take_sorted = (before < remain) & (remain > 0)
    take_sorted &= torch.isfinite(others.gather(1, si))  # never re-pick own entries
    sel = torch.zeros_like(own)
    sel.scatter_(1, si, take_sorted)
    return sel | own


def vmoba_select(
    gate: Tensor, chunk_of_block: Tensor, *, select_mode: str, topk: int, threshold: float, threshold_type: str
) -> Tensor:
    """Selected chunks per query block: bool ``[B, H, nv, n_chunks]`` (see module docstring)."""
    B, H, nq, nc = gate.shape
    # each query block's own chunk, by comparison (an index-put of a Python True would copy it to the device and
    # synchronise every call)
    own = chunk_of_block.to(gate.device).view(nq, 1) == torch.arange(nc, device=gate.device)
    own = own.expand(B, H, nq, nc)
    if select_mode not in ("topk", "threshold"):
        raise AttentionConfigError(f"vmoba_attn: moba_select_mode must be 'topk' or 'threshold', got {select_mode!r}")
    if threshold_type == "query_head":
        g, o, per = gate.reshape(-1, nc), own.reshape(-1, nc), 1
    elif threshold_type == "head_global":
        g, o, per = gate.reshape(B * H, nq * nc), own.reshape(B * H, nq * nc), nq
    elif threshold_type == "overall":
        g, o, per = gate.reshape(B, H * nq * nc), own.reshape(B, H * nq * nc), H * nq
    else:
        raise AttentionConfigError(
            f"vmoba_attn: moba_threshold_type must be one of ['query_head', 'head_global', 'overall'], got "
            f"{threshold_type!r}"
        )
    sel = _select_groups(g, o.contiguous(), select_mode, int(topk) * per, float(threshold))
    return sel.reshape(B, H, nq, nc)


def vmoba_block_mask(
    q_tiled: Tensor,
    k_tiled: Tensor,
    layout: TileLayout,
    *,
    select_mode: str,
    topk: int,
    threshold: float,
    threshold_type: str,
    gate: str = "mean",
    scale: Optional[float] = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor, Tensor]:
    """``(block mask [B, H, n_blocks, n_blocks], chunk selection [B, H, nv, n_chunks], chunk_of_block)``."""
    gates, cob = chunk_gates(q_tiled, k_tiled, layout, gate, scale, impl)
    sel = vmoba_select(
        gates, cob, select_mode=select_mode, topk=topk, threshold=threshold, threshold_type=threshold_type
    )
    video = sel[..., cob]  # key block j selected iff its chunk is
    return add_special_blocks(layout, video), sel, cob


def vmoba_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    mode: str,
    chunk=None,
    topk: Optional[int] = None,
    select_mode: str = "threshold",
    threshold: float = 0.25,
    threshold_type: str = "query_head",
    gate: str = "pooled_query",
    text_len: int = 0,
    scale: Optional[float] = None,
    return_lse: bool = False,
    impl: str = "auto",
    error_budget: float = 0.0,
    decide: bool = True,
    dense_above: Optional[float] = None,
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """V-MoBA with chunking ``mode`` (``temporal``/``spatial``/``st``) over ``[B, T*H*W + text_len,
    heads, D]`` q/k/v (k/v with q's head count).  ``chunk``/``topk`` None -> grid defaults.
    ``error_budget`` > 0: the chunk selection is widened block by block until its predicted dropped
    mass per query block is at most the budget (:mod:`.budget`); ``decide`` and ``dense_above``: when the
    call runs the dense kernel instead (``plan.extra["dense_fallback"]``), as in
    :func:`.sparge.sparge_attention` (no floor)."""
    vs = tuple(int(x) for x in video_shape)
    if chunk is None:
        chunk = default_chunk_sizes(vs)[mode]
    ctile = chunk_tile(mode, vs, chunk)
    vol = math.prod(min(c, g) for c, g in zip(ctile, vs))
    layout = make_tile_layout(vs, ctile, text_len, block_size=vmoba_block_size(vol))
    n_chunks = int((layout.tile_num_blocks > 0).sum())
    if topk is None:
        topk = max(1, math.ceil(n_chunks / 4))
    if error_budget > 0 and decide:
        from ditattn.attention.sparse.budget import dense_budgeted, early_dense

        scale_ = q.shape[-1] ** -0.5 if scale is None else scale
        if early_dense(
            q, k, layout, error_budget, scale=scale_, impl=impl, above=dense_above
        ):  # before the chunk gates (and before tiling q and k)
            return dense_budgeted(
                q,
                k,
                v,
                layout,
                error_budget,
                scale=scale,
                return_lse=return_lse,
                extra={"mode": mode, "chunk": chunk, "topk": topk, "gate": gate},
            )
    qt, kt = tile(q, layout), tile(k, layout)
    bm, sel, cob = vmoba_block_mask(
        qt,
        kt,
        layout,
        select_mode=select_mode,
        topk=topk,
        threshold=threshold,
        threshold_type=threshold_type,
        gate=gate,
        scale=scale,
        impl=impl,
    )
    extra = {
        "mode": mode,
        "chunk": chunk,
        "topk": topk,
        "gate": gate,
        "selection": sel,
        "chunk_of_block": cob,
        "n_chunks": n_chunks,
    }
    if error_budget > 0:
        from ditattn.attention.sparse.budget import budgeted_lists

        nv = layout.n_video_blocks
        scale_ = q.shape[-1] ** -0.5 if scale is None else scale
        res = budgeted_lists(
            q,
            k,
            v,
            qt,
            kt,
            layout,
            bm[..., :nv, :nv],
            error_budget,
            scale=scale_,
            return_lse=return_lse,
            impl=impl,
            decide=decide,
            above=dense_above,
        )
        if res.dense_out is not None:
            return res.dense_out, res.dense_lse, res.plan(extra)
        return run_block_lists(
            q,
            k,
            v,
            layout,
            res.idx,
            res.cnt,
            scale=scale,
            return_lse=return_lse,
            impl=impl,
            extra=dict(extra, budget=res.stats),
            q_tiled=qt,
            k_tiled=kt,
        )
    return run_block_mask(
        q, k, v, layout, bm, scale=scale, return_lse=return_lse, impl=impl, extra=extra, q_tiled=qt, k_tiled=kt
    )
