"""Error budget of the training-free sparse selections: estimate the attention mass a selection
drops, keep more blocks (or run a head dense) until the estimate meets the budget.

A selection keeps, per (batch, head, query block ``i``), a set ``K_i`` of key blocks.  The planners
already compute a *block log-mass* ``L_ij`` per pair (:mod:`.block_scores`: ``log sum_{t in j}
exp(scale * qbar_i . k_t)``, the block's attention mass as seen from the query block's mean), so the
predicted share of block ``j`` is ``w_ij = softmax_j(L_ij)`` and the predicted **dropped mass** of
the row is ``m_i = sum_{j not in K_i} w_ij``.

Output error.  For one query row with exact weights ``p`` over the keys, the sparse output is the
softmax renormalised over the kept keys, so with ``m`` the row's dropped mass::

    o_sparse - o = m * (o_kept - o_drop),   |o_sparse - o| <= m * (|o_kept| + |o_drop|) <= 2 m max|v|

(``o_kept`` / ``o_drop``: the attention outputs over the kept / dropped keys alone).  The relative
error of a row is therefore at most ``2 m max|v| / |o|``; with block-mean values ``vbar_j`` the
estimate used here is ``m_i |ohat_kept,i - ohat_drop,i| / |ohat_i|`` (``ohat``: the ``w``-weighted
means of ``vbar`` over the kept / dropped / all blocks), aggregated over the rows as the benchmark's
relative error is (root of summed squares over root of summed squares).  :func:`estimate_error`
computes it; it is reported, not enforced.  It sees the block means only (the rows of a block spread
their mass more than their mean does), so it is low: on the structured families and the captured
activations the measured error stays below ``ESTIMATE_FACTOR * estimate + ESTIMATE_SLACK``
(8x + 0.005; 3-7x measured at the CPU test grid).

The rule (:func:`enforce_budget`): with ``error_budget = b`` every video query block keeps, on top
of its own selection, the fewest blocks, largest share first, whose shares reach ``1 - b`` (so
``m_i <= b`` by the estimate); a head whose kept fraction then exceeds :data:`DENSE_ABOVE` runs
dense (every block kept: the block-sparse engine costs more than a dense kernel there), and when
every head of the call does, the backend skips the sparse kernel and calls the dense one
(:func:`all_dense`).  ``b = 0`` turns the budget off.  The default budget of each backend (its
``error_budget`` schema entry: 0.01 for Sparge, V-MoBA and SVG2, 0.02 for Sol, whose approximate
blocks are not dropped but summarised by their centroids) was chosen on the structured families of
:mod:`ditattn.evaluation.structured` so that the output stays within 5 % relative error
(cosine >= 0.998); docs/attention.md gives the figures.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

Tensor = torch.Tensor
log = logging.getLogger(__name__)

#: a head whose kept fraction (video blocks) exceeds this after the budget runs dense
DENSE_ABOVE = 0.85
#: the documented factor between measured and estimated relative error on the structured families
#: and the captured activations (measured <= ESTIMATE_FACTOR * estimated + ESTIMATE_SLACK)
ESTIMATE_FACTOR = 8.0
ESTIMATE_SLACK = 0.005


def budget_value(value) -> float:
    """The budget as a float in [0, 1); ``None``, ``"none"``, ``"off"`` and 0 mean off (0.0)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "off", "")):
        return 0.0
    return float(value)


def shares(log_mass: Tensor) -> Tensor:
    """Predicted share of each key block per row: ``softmax`` over the last dim of the float32
    ``log_mass [..., nq, nk]`` (rows of ``-inf`` give zeros)."""
    return torch.softmax(log_mass.float(), dim=-1).nan_to_num_(0.0)


def dropped_mass(log_mass: Tensor, keep: Tensor) -> Tensor:
    """Predicted dropped mass ``m_i`` per row: float32 ``[..., nq]`` from ``log_mass [..., nq, nk]``
    and the bool selection ``keep`` of the same shape (True = kept)."""
    return (shares(log_mass) * (~keep)).sum(-1)


def enforce_budget(log_mass: Tensor, keep: Tensor, budget: float,
                   dense_above: float = DENSE_ABOVE) -> tuple[Tensor, Tensor]:
    """``(keep', dense_heads)``: ``keep`` (bool ``[B, H, nq, nk]``) plus, per row, the fewest blocks,
    largest predicted share first, whose shares reach ``1 - budget``; a head (``[B, H]`` bool
    ``dense_heads``) whose kept fraction then exceeds ``dense_above`` keeps every block.  ``budget``
    <= 0 returns ``keep`` unchanged and no dense head."""
    from ditattn.attention.sparse.common import mass_mask

    if budget <= 0:
        return keep, torch.zeros(keep.shape[:2], dtype=torch.bool, device=keep.device)
    need = mass_mask(log_mass.float(), 1.0 - float(budget))
    out = keep | need
    dense = out.float().mean((-1, -2)) > float(dense_above)
    out = out | dense[:, :, None, None]
    return out, dense


def all_dense(dense_heads: Tensor) -> bool:
    """Whether every head of the call runs dense (one device sync: the caller then skips the sparse
    kernel and calls the dense one)."""
    return bool(dense_heads.all()) if dense_heads.numel() else False


def block_values(v_tiled: Tensor, layout, n_blocks: int) -> Tensor:
    """Mean value of each of the first ``n_blocks`` blocks over its real tokens: float32
    ``[B, H, n_blocks, D]`` from ``v_tiled [B, padded_len, H, D]``."""
    from ditattn.attention.sparse.tiling import pooled_blocks

    return pooled_blocks(v_tiled, layout, n_blocks).float()


def estimate_error(log_mass: Tensor, keep: Tensor, vbar: Tensor, rows: Optional[Tensor] = None) -> Tensor:
    """Estimated relative output error of a selection (module docstring): ``log_mass`` / ``keep``
    ``[B, H, nq, nk]``, ``vbar [B, H, nk, D]`` (block-mean values, :func:`block_values`);
    ``rows`` (float ``[nq]``, default 1): real tokens per query block, the weight of its row.
    Returns ``sqrt(sum_i n_i m_i^2 |ohat_kept - ohat_drop|^2 / sum_i n_i |ohat|^2)`` as a float32
    0-dim tensor on the inputs' device (no sync)."""
    w = shares(log_mass)
    kept = w * keep
    drop = w - kept
    mk = kept.sum(-1, keepdim=True)
    md = drop.sum(-1, keepdim=True)
    o_all = w @ vbar
    o_k = (kept @ vbar) / mk.clamp(min=1e-30)
    o_d = (drop @ vbar) / md.clamp(min=1e-30)
    err = (md * (o_k - o_d)).pow(2).sum(-1)  # [B, H, nq]
    ref = o_all.pow(2).sum(-1)
    n = torch.ones(err.shape[-1], device=err.device) if rows is None else rows.to(err.device, torch.float32)
    return ((err * n).sum() / (ref * n).sum().clamp(min=1e-30)).sqrt()


def summary(log_mass: Tensor, keep: Tensor, dense_heads: Tensor, budget: float) -> dict:
    """Statistics of a budgeted selection for ``last_stats`` (device scalars, read later):
    ``dropped_mass_max`` / ``dropped_mass_mean`` (predicted, over the rows), ``dense_heads`` (how
    many heads ran dense), ``heads`` and ``error_budget``."""
    m = dropped_mass(log_mass, keep)
    return {"dropped_mass_max": m.amax() if m.numel() else 0.0, "dropped_mass_mean": m.mean() if m.numel() else 0.0,
            "dense_heads": dense_heads.sum(), "heads": int(dense_heads.numel()), "error_budget": float(budget)}


class Budgeted:
    """What :func:`budgeted_lists` decided: block lists ``idx`` / ``cnt`` (None when the call ran
    dense), the dense output ``dense_out`` / ``dense_lse`` (None when it did not) and ``stats``."""

    def __init__(self, layout, idx, cnt, stats, dense_out=None, dense_lse=None):
        self.layout, self.idx, self.cnt, self.stats = layout, idx, cnt, stats
        self.dense_out, self.dense_lse = dense_out, dense_lse

    def plan(self, extra: Optional[dict] = None):
        """The :class:`.common.SparsePlan` of a call that ran dense (kept fraction 1, no lists)."""
        from ditattn.attention.sparse.common import SparsePlan

        empty = torch.zeros(0, dtype=torch.int32)
        return SparsePlan(self.layout, empty.view(1, 1, 0, 0), empty.view(1, 1, 0), 1.0,
                          dict(extra or {}, dense_fallback=True, budget=self.stats))


def budgeted_lists(q: Tensor, k: Tensor, v: Tensor, q_tiled: Tensor, k_tiled: Tensor, layout, video_keep: Tensor,
                   budget: float, *, scale: float, return_lse: bool, impl: str = "auto",
                   log_mass: Optional[Tensor] = None, dense_backend: Optional[str] = None) -> Budgeted:
    """Apply the budget to a planner's video selection and build its block lists, or run the call
    dense when every head needs it.

    q/k/v ``[B, S, H, D]`` (original order, k/v with q's heads); ``q_tiled`` / ``k_tiled``: the same in
    ``layout``'s tile order (unquantized); ``video_keep``: bool ``[B, H, nv, nv]`` selection over the
    video blocks; ``log_mass``: the block log-masses ``[B, H, nv, nv]`` when the planner has them
    (pooled-query ones; None: computed here).  Special (text/sink) blocks are kept as the planners keep
    them.  ``stats`` (device scalars): :func:`summary` plus ``est_rel_err`` (:func:`estimate_error`).
    The dense path calls ``dense_backend`` (None: the platform's automatic dense kernel)."""
    from ditattn.attention.sparse.block_scores import pooled_query_block_scores
    from ditattn.attention.sparse.block_sparse import dense_attention, list_width
    from ditattn.attention.sparse.common import select_impl, video_mask_lists

    nv = layout.n_video_blocks
    if log_mass is None:
        log_mass = pooled_query_block_scores(q_tiled, k_tiled, layout, scale,
                                             impl="reference" if impl in ("reference", "flex") else "auto")
    keep, dense = enforce_budget(log_mass, video_keep, budget)
    stats = budget_stats(log_mass, video_keep, keep, dense, budget, _tile_v(v, layout), layout)
    if all_dense(dense):
        out, lse = dense_attention(q, k, v, scale=scale, return_lse=return_lse, backend=dense_backend)
        return Budgeted(layout, None, None, stats, out, lse)
    idx, cnt = video_mask_lists(layout, keep, width=list_width(q.device, layout.n_blocks), impl=select_impl(impl))
    return Budgeted(layout, idx, cnt, stats)


def budget_stats(log_mass: Tensor, selected: Tensor, keep: Tensor, dense: Tensor, budget: float, v_tiled: Tensor,
                 layout) -> dict:
    """:func:`summary` of a budgeted selection plus ``est_rel_err`` (:func:`estimate_error` of ``keep``)
    and ``est_rel_err_unbudgeted`` (of the planner's own ``selected``); ``v_tiled`` in ``layout``'s order."""
    nv = layout.n_video_blocks
    stats = summary(log_mass, keep, dense, budget)
    rows = layout.on(v_tiled.device).block_count[:nv].float()
    vbar = block_values(v_tiled, layout, nv)
    stats["est_rel_err"] = estimate_error(log_mass, keep, vbar, rows)
    stats["est_rel_err_unbudgeted"] = estimate_error(log_mass, selected, vbar, rows)
    return stats


def _tile_v(v: Tensor, layout) -> Tensor:
    from ditattn.attention.sparse.tiling import tile

    return tile(v, layout)


def precheck_dense(q: Tensor, k: Tensor, video_shape, text_len: int, budget: float, *, scale: Optional[float] = None,
                   impl: str = "auto", tile_size=(4, 4, 4)) -> tuple[bool, Tensor]:
    """Before an expensive selection (SVG2's clustering): whether meeting ``budget`` on the 3-D tile
    blocks of ``tile_size`` would keep more than :data:`DENSE_ABOVE` of the blocks in every head, so the
    call should run dense without selecting.  q/k ``[B, S, H, D]`` (k with q's heads).  Returns
    ``(all heads dense, kept fraction per head [B, H] float32)``; one device sync."""
    from ditattn.attention.sparse.block_scores import pooled_query_block_scores
    from ditattn.attention.sparse.common import mass_mask
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    layout = make_tile_layout(video_shape, tuple(tile_size), text_len)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lm = pooled_query_block_scores(tile(q, layout), tile(k, layout), layout, scale,
                                   impl="reference" if impl in ("reference", "flex") else "auto")
    frac = mass_mask(lm, 1.0 - float(budget)).float().mean((-1, -2))
    return all_dense(frac > DENSE_ABOVE), frac
