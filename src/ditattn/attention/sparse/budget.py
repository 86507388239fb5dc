"""Error budget of the training-free sparse selections: estimate the attention mass a selection
drops, keep more blocks (or run a head dense) until the estimate meets the budget.

A selection keeps, per (batch, head, query block ``i``), a set ``K_i`` of key blocks.  For each
query block, nine *probe rows* ``r`` (the tokens at the 8 corners of its box in ``(t, h, w)`` and its
centre, :func:`probe_rows`) get their exact block log-masses ``L_irj = log sum_{t in j} exp(scale *
q_r . k_t)`` (:func:`probe_log_mass`: 9 / block_size of dense attention's Q.K products, no P.V), so the
share of key block ``j`` in probe row ``r`` is ``w_irj = softmax_j(L_irj)`` and the predicted
**dropped mass** of the query block is ``m_i = max_r sum_{j not in K_i} w_irj``.  (One mean query per
block, as the planners' pooled-query predictor uses, hides very local heads: their RoPE phases cancel
in the mean; a row at a corner of the block sees every neighbouring block any row of it needs.)

Output error.  For one query row with exact weights ``p`` over the keys, the sparse output is the
softmax renormalised over the kept keys, so with ``m`` the row's dropped mass::

    o_sparse - o = m * (o_kept - o_drop),   |o_sparse - o| <= m * (|o_kept| + |o_drop|) <= 2 m max|v|

(``o_kept`` / ``o_drop``: the attention outputs over the kept / dropped keys alone), a relative error
of at most ``2 m max|v| / |o|``.  The reported estimate, ``est_rel_err = ESTIMATE_FACTOR * max_i m_i``
(8x), holds empirically: on every structured family at the CPU test grid the measured relative error
against float64 exact attention stays below ``est_rel_err + ESTIMATE_SLACK`` (0.02: the kernels' own
error, Sparge's INT8 Q.K, Sol's centroids; ``tests/attention/test_sparse_budget.py``).

The rule (:func:`enforce_budget`): with ``error_budget = b`` every video query block keeps, on top
of its own selection, the fewest blocks, largest share first, whose shares reach ``1 - b`` (so
``m_i <= b`` by the estimate); a head whose kept fraction then exceeds :data:`DENSE_ABOVE` runs
dense (every block kept).  A call predicted to keep more than :data:`DENSE_CALL_ABOVE` (config key
``dense_above``) of its video blocks, mean over heads, runs the dense kernel instead: the block-sparse
path is slower there (:data:`H200_KEPT_VS_FA`).  The planners ask :func:`early_kept` first (nine probe rows
of :data:`EARLY_BLOCKS` sampled query blocks, before any selection work and without a tiled copy of q),
then :func:`call_dense` on the budgeted selection.  The backends take that decision at the first step of
a layer in a request and reuse it at its later steps (:func:`decided`): a dense layer calls the dense
kernel directly, a sparse one enforces the budget on the device without a host read.  ``b = 0`` turns
the budget off.  The default budget of each backend (its
``error_budget`` schema entry: 0.005 for Sparge, V-MoBA and SVG2, 0.01 for Sol, whose approximate
blocks are not dropped but summarised by their centroids) was chosen on the structured families of
:mod:`ditattn.evaluation.structured` so that the output stays within 5 % relative error
(cosine >= 0.998); docs/attention.md gives the figures.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

Tensor = torch.Tensor

#: a head whose kept fraction (video blocks) exceeds this after the budget runs dense
DENSE_ABOVE = 0.85
#: H200, bf16, Wan 480p grid 21x30x52 (32,760 tokens), head dim 128, 12 and 40 heads, side by side with
#: FlashAttention-4 in one process: ``(kept block fraction, speed of the block-sparse path / dense)``.  Without
#: the budget Sparge keeps 0.50 at 1.24-1.29x, SVG2 0.31-0.35 at 1.38-1.52x, Sol 0.21-0.22 at 1.74-1.82x;
#: calls that kept 0.66-0.87 under the budget ran at 0.47-0.55x.
H200_KEPT_VS_FA = (
    (0.21, 1.82),
    (0.22, 1.74),
    (0.31, 1.52),
    (0.35, 1.38),
    (0.50, 1.28),
    (0.66, 0.54),
    (0.72, 0.53),
    (0.74, 0.49),
    (0.82, 0.53),
    (0.87, 0.49),
)
#: break-even of the block-sparse path: a call predicted to keep more than this fraction of the video blocks
#: (mean over heads) runs the dense kernel instead (:data:`H200_KEPT_VS_FA`: the kernel's time grows with the
#: kept fraction from 1.28x at 0.50, so it reaches dense speed near 0.6-0.65); the ``dense_above`` config key
DENSE_CALL_ABOVE = 0.6
#: query blocks :func:`early_kept` probes (spread evenly over the grid)
EARLY_BLOCKS = 14
#: :func:`early_dense` sends a call dense when its estimate exceeds ``dense_above - EARLY_MARGIN``: the estimate
#: samples the grid and leaves out the planner's own blocks (Sol's routed ones, V-MoBA's chunks), and a call
#: the full check sends dense afterwards costs its probes and selection on top of the dense kernel, while
#: one kept sparse just below the break-even gains little
EARLY_MARGIN = 0.05
#: SVG2 under ``error_budget = b`` keeps, per query cluster, key clusters up to a predicted share of at least
#: ``1 - SVG2_BUDGET_SCALE * b`` (:func:`svg2_top_p`): its cluster masses come from centroids, coarser than the
#: probe rows, so it takes the budget tighter.  H200 at 480p with ``1 - b`` (0.995): 6.1 % / 7.4 % relative
#: error on the structured / mixed families at 12 heads (kept 0.71 / 0.77); at the 480p grid on the CPU (mixed
#: family, 2 heads) halving ``b`` cut the error from 0.65 % to 0.38 % for 0.85 -> 0.89 of the blocks kept
SVG2_BUDGET_SCALE = 0.5
#: ``est_rel_err = ESTIMATE_FACTOR * largest predicted dropped mass``; measured relative error <=
#: ``est_rel_err + ESTIMATE_SLACK`` on the structured families and captured activations (tests)
ESTIMATE_FACTOR = 8.0
ESTIMATE_SLACK = 0.02


def svg2_top_p(top_p: float, budget: float) -> float:
    """SVG2's cumulative share per query cluster under ``budget`` (> 0): at least ``1 - SVG2_BUDGET_SCALE *
    budget``; ``top_p`` unchanged without a budget."""
    return max(float(top_p), 1.0 - SVG2_BUDGET_SCALE * float(budget)) if budget > 0 else float(top_p)


def shares(log_mass: Tensor) -> Tensor:
    """Predicted share of each key block per row: ``softmax`` over the last dim of the float32
    ``log_mass [..., nk]`` (rows of ``-inf`` give zeros)."""
    return torch.softmax(log_mass.float(), dim=-1).nan_to_num_(0.0)


def dropped_mass(log_mass: Tensor, keep: Tensor, share: Optional[Tensor] = None) -> Tensor:
    """Predicted dropped mass per query block: float32 ``[B, H, nq]`` from ``log_mass`` (``[B, H, nq,
    nk]``, or per probe row ``[B, H, nq, R, nk]``: then the largest over the probe rows) and the bool
    selection ``keep [B, H, nq, nk]`` (True = kept).  ``share``: :func:`shares` of ``log_mass`` when the
    caller has it (one softmax pass less); per probe row the sum is one batched product (no temporary of
    ``log_mass``'s size)."""
    share = shares(log_mass) if share is None else share
    if log_mass.dim() == keep.dim() + 1:
        drop = (~keep).to(share.dtype).unsqueeze(-1)  # [B, H, nq, nk, 1]
        return (share @ drop).squeeze(-1).amax(-1)
    return (share * (~keep)).sum(-1)


@functools.lru_cache(maxsize=64)
def probe_rows(layout) -> Tensor:
    """The probe rows of every video block of ``layout``: int64 ``[nv, 9]`` tiled positions (``block *
    block_size + offset``) of the block's real token closest to each of the 8 corners of its bounding
    box in ``(t, h, w)`` and of its centre (for a full tile: its 8 corner tokens and a middle one).
    A very local head's row attends its neighbours, so the rows at the block's corners see every
    neighbouring block that any row of the block needs."""
    nv, bs = layout.n_video_blocks, layout.block_size
    _, H, W = layout.video_shape
    src = layout.source[: nv * bs].view(nv, bs)
    real = src >= 0
    n = src.clamp(min=0)
    coords = torch.stack([n // (H * W), (n // W) % H, n % W], -1).to(torch.float64)  # [nv, bs, 3]
    signs = torch.tensor([[a, b, c] for a in (-1, 1) for b in (-1, 1) for c in (-1, 1)], dtype=torch.float64)
    score = torch.einsum("nbd,cd->nbc", coords, signs)  # [nv, bs, 8]: larger = nearer that corner
    score = score.masked_fill(~real.unsqueeze(-1), float("-inf"))
    corner = score.argmax(1)  # [nv, 8]
    centre = (coords * real.unsqueeze(-1)).sum(1) / real.sum(1, keepdim=True).clamp(min=1)
    dist = (coords - centre.unsqueeze(1)).pow(2).sum(-1).masked_fill(~real, float("inf"))
    mid = dist.argmin(1, keepdim=True)
    offs = torch.cat([corner, mid], 1)
    with torch.inference_mode(False):
        return offs + torch.arange(nv).unsqueeze(1) * bs


def probe_log_mass(q_tiled: Tensor, k_tiled: Tensor, layout, scale: float, impl: str = "auto") -> Tensor:
    """Exact block log-masses of every video block's probe rows (:func:`probe_rows`): float32
    ``[B, H, nv, R, nv]`` (``R = 9``), entry ``[.., i, r, j] = log sum_{t in j} exp(scale * q_r . k_t)`` for
    probe row ``r`` of query block ``i``; ``R / block_size`` of the Q.K products of dense attention
    (9/64 at 64-token blocks), no P.V.  q_tiled / k_tiled ``[B, padded_len, H, D]`` in ``layout``'s
    order (k with q's heads)."""
    B, _, H, _ = q_tiled.shape
    nv = layout.n_video_blocks
    rows = _probe_rows_on(layout, q_tiled.device)  # [nv, R]
    R = rows.shape[1]
    lm = probe_masses(q_tiled.index_select(1, rows.flatten()), k_tiled, layout, scale, impl)
    return lm.view(B, H, nv, R, nv)


@functools.lru_cache(maxsize=128)
def _probe_rows_on(layout, device: torch.device) -> Tensor:
    """:func:`probe_rows` on ``device``, cached: no upload per call."""
    rows = probe_rows(layout)
    with torch.inference_mode(False):
        return rows.contiguous().to(device)


@functools.lru_cache(maxsize=64)
def _full(layout) -> bool:
    return bool(layout.valid[: layout.n_video_blocks * layout.block_size].all())


def enforce_budget(
    log_mass: Tensor, keep: Tensor, budget: float, dense_above: float = DENSE_ABOVE, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    """``(keep', dense_heads)``: ``keep`` (bool ``[B, H, nq, nk]``) plus, per row, the fewest blocks,
    largest predicted share first, whose shares reach ``1 - budget`` (``log_mass`` ``[B, H, nq, nk]``, or
    ``[B, H, nq, R, nk]`` per probe row: every probe row's blocks); a head (``[B, H]`` bool
    ``dense_heads``) whose kept fraction then exceeds ``dense_above`` keeps every block.  ``budget``
    <= 0 returns ``keep`` unchanged and no dense head.  Per probe row on CUDA the union is one Triton kernel
    (:func:`_need`; the same blocks as the sort of the PyTorch path)."""
    from ditattn.attention.sparse.common import mass_mask

    if budget <= 0:
        return keep, torch.zeros(keep.shape[:2], dtype=torch.bool, device=keep.device)
    need = _need(log_mass, budget, impl) if log_mass.dim() == keep.dim() + 1 else None
    if need is None:
        need = mass_mask(log_mass.float(), 1.0 - float(budget))
        if log_mass.dim() == keep.dim() + 1:
            need = (need & torch.isfinite(log_mass).any(-1, keepdim=True)).any(-2)
    out = keep | need
    dense = out.float().mean((-1, -2)) > float(dense_above)
    out = out | dense[:, :, None, None]
    return out, dense


_kernel_failed: list = []


def _need(log_mass: Tensor, budget: float, impl: str) -> Optional[Tensor]:
    """The Triton kernel's union of the probe rows' blocks (``[B, H, nq, R, nk]`` masses on CUDA), or None:
    the PyTorch path (elsewhere, ``impl="reference"``, rows wider than the kernel holds, or a kernel that failed
    once in this process: said once)."""
    if not log_mass.is_cuda or impl == "reference" or _kernel_failed:
        return None
    from ditattn.attention.kernels.budget_mask import MAX_BUDGET_BLOCKS, budget_need

    if log_mass.shape[-1] > MAX_BUDGET_BLOCKS:
        return None
    try:
        return budget_need(log_mass.float(), float(budget))
    except Exception as exc:  # keep serving on the PyTorch path; the GPU tests call the kernel directly
        import logging

        _kernel_failed.append(repr(exc))
        logging.getLogger("ditattn.attention.sparse").warning(
            "error budget kernel failed (%s: %s); the budget runs its PyTorch path from now on",
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
        )
        return None


def summary(
    log_mass: Tensor, keep: Tensor, dense_heads: Tensor, budget: float, share: Optional[Tensor] = None
) -> dict:
    """Statistics of a budgeted selection for ``last_stats`` (device scalars, read later):
    ``dropped_mass_max`` / ``dropped_mass_mean`` (predicted, over the rows), ``dense_heads`` (how
    many heads ran dense), ``heads`` and ``error_budget``.  ``share`` as in :func:`dropped_mass`."""
    m = dropped_mass(log_mass, keep, share)
    return {
        "dropped_mass_max": m.amax() if m.numel() else 0.0,
        "dropped_mass_mean": m.mean() if m.numel() else 0.0,
        "dense_heads": dense_heads.sum(),
        "heads": int(dense_heads.numel()),
        "error_budget": float(budget),
    }


def dense_budgeted(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout,
    budget: float,
    *,
    scale: Optional[float],
    return_lse: bool,
    dense_backend: Optional[str] = None,
    extra: Optional[dict] = None,
):
    """``(out, lse, plan)`` of a call :func:`early_dense` sent to the dense kernel (``dense_backend``, None:
    the platform's automatic one); the plan records the fallback with every head dense."""
    from ditattn.attention.sparse.block_sparse import dense_attention

    out, lse = dense_attention(q, k, v, scale=scale, return_lse=return_lse, backend=dense_backend)
    heads = q.shape[0] * q.shape[2]
    stats = {
        "dropped_mass_max": 0.0,
        "dropped_mass_mean": 0.0,
        "est_rel_err": 0.0,
        "dense_heads": float(heads),
        "heads": heads,
        "error_budget": float(budget),
        "early": True,
    }
    return out, lse, Budgeted(layout, None, None, stats).plan(extra)


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
        return SparsePlan(
            self.layout,
            empty.view(1, 1, 0, 0),
            empty.view(1, 1, 0),
            1.0,
            dict(extra or {}, dense_fallback=True, budget=self.stats),
        )


def budgeted_lists(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_tiled: Tensor,
    k_tiled: Tensor,
    layout,
    video_keep: Tensor,
    budget: float,
    *,
    scale: float,
    return_lse: bool,
    impl: str = "auto",
    dense_backend: Optional[str] = None,
    decide: bool = True,
    above: Optional[float] = None,
) -> Budgeted:
    """Apply the budget to a planner's video selection and build its block lists, or run the call
    dense when the budgeted selection keeps more than ``above`` (None: :data:`DENSE_CALL_ABOVE`) of the
    video blocks (:func:`call_dense`; one device sync, skipped with ``decide=False``: a decision reused
    from an earlier step, the heads that need it still run dense through the lists).

    q/k/v ``[B, S, H, D]`` (original order, k/v with q's heads); ``q_tiled`` / ``k_tiled``: the same in
    ``layout``'s tile order (unquantized); ``video_keep``: bool ``[B, H, nv, nv]`` selection over the
    video blocks; the predicted masses are :func:`probe_log_mass`'s.  Special (text/sink) blocks are kept
    as the planners keep them.  ``stats`` (device scalars): :func:`budget_stats`.
    The dense path calls ``dense_backend`` (None: the platform's automatic dense kernel)."""
    from ditattn.attention.sparse.block_sparse import dense_attention, list_width
    from ditattn.attention.sparse.common import select_impl, video_mask_lists

    log_mass = probe_log_mass(q_tiled, k_tiled, layout, scale, impl=impl)
    keep, dense = enforce_budget(log_mass, video_keep, budget)  # video_keep: the planner's selection
    stats = budget_stats(log_mass, video_keep, keep, dense, budget)
    if decide and call_dense(keep, above):
        out, lse = dense_attention(q, k, v, scale=scale, return_lse=return_lse, backend=dense_backend)
        return Budgeted(layout, None, None, stats, out, lse)
    idx, cnt = video_mask_lists(layout, keep, width=list_width(q.device, layout.n_blocks), impl=select_impl(impl))
    return Budgeted(layout, idx, cnt, stats)


def budget_stats(log_mass: Tensor, selected: Tensor, keep: Tensor, dense: Tensor, budget: float) -> dict:
    """:func:`summary` of a budgeted selection plus ``est_rel_err`` (``ESTIMATE_FACTOR`` times the
    largest predicted dropped mass of ``keep``) and ``est_rel_err_unbudgeted`` (the same of the
    planner's own ``selected``)."""
    share = shares(log_mass)  # once for both
    stats = summary(log_mass, keep, dense, budget, share)
    stats["est_rel_err"] = ESTIMATE_FACTOR * stats["dropped_mass_max"]
    m0 = dropped_mass(log_mass, selected, share)
    stats["est_rel_err_unbudgeted"] = ESTIMATE_FACTOR * (m0.amax() if m0.numel() else 0.0)
    return stats


def early_kept(
    q: Tensor, k: Tensor, layout, budget: float, *, scale: float, impl: str = "auto", floor: float = 0.0
) -> Tensor:
    """The call's predicted kept fraction under ``budget`` before any selection work: a 0-d float32 device
    tensor (no sync).  The probe rows (:func:`probe_rows`, all nine) of at most :data:`EARLY_BLOCKS` video
    query blocks spread evenly over the grid give each head's kept fraction of the budget alone,
    ``need_h``; with the planner's own known minimum ``floor`` (Sparge's ``topk``; 0: none) the head keeps
    about ``1 - (1 - floor) (1 - need_h)`` (the two selections taken as independent), a head above
    :data:`DENSE_ABOVE` counts as 1 (it would run dense) and the call's figure is the mean over heads.
    ``q`` / ``k`` ``[B, S, H, D]`` in the original order (k with q's heads): the probe rows are gathered from
    q and, on CUDA, the kernel reads k's blocks through the layout's index (no tiled copy of either).
    Cost: ``9 * EARLY_BLOCKS / n_video_tokens`` of dense attention's Q.K products (0.4 % at 32,760 tokens)."""
    nv = layout.n_video_blocks
    rows = _early_rows_on(layout, q.device)  # [m, 9] original token indices
    m = rows.shape[0]
    lm = probe_masses(q.index_select(1, rows.flatten()), k, layout, scale, impl, tiled=False).view(
        q.shape[0], q.shape[2], m, rows.shape[1], nv
    )
    from ditattn.attention.sparse.common import mass_mask

    need = mass_mask(lm, 1.0 - float(budget)).any(-2)  # [B, H, m, nv]: every probe row's blocks (all real rows)
    head = need.float().mean((-1, -2))  # [B, H]
    head = 1.0 - (1.0 - float(floor)) * (1.0 - head)
    head = torch.where(head > DENSE_ABOVE, torch.ones_like(head), head)
    return head.mean()


def early_dense(
    q: Tensor,
    k: Tensor,
    layout,
    budget: float,
    *,
    scale: float,
    impl: str = "auto",
    floor: float = 0.0,
    above: Optional[float] = None,
) -> bool:
    """Whether the call runs the dense kernel before any selection work: its :func:`early_kept` exceeds
    ``above - EARLY_MARGIN`` (``above`` None: :data:`DENSE_CALL_ABOVE`; ``above`` 1: only an estimate of 1),
    near or past the point where the block-sparse kernel is slower than the dense one.  One device sync.
    ``budget`` <= 0: False (no probe)."""
    if budget <= 0:
        return False
    limit = DENSE_CALL_ABOVE if above is None else float(above)
    limit = limit - EARLY_MARGIN if limit < 1.0 else 1.0 - 1e-6
    return bool(early_kept(q, k, layout, budget, scale=scale, impl=impl, floor=floor) > limit)


def call_kept(keep: Tensor) -> Tensor:
    """The kept fraction of a budgeted video selection ``keep`` (bool ``[B, H, nq, nk]``, dense heads all
    True): a 0-d float32 device tensor, the mean over every head and block pair."""
    return keep.float().mean() if keep.numel() else torch.ones((), device=keep.device)


def call_dense(keep: Tensor, above: Optional[float] = None) -> bool:
    """Whether a budgeted selection keeps more than ``above`` (None: :data:`DENSE_CALL_ABOVE`) of the video
    blocks over the whole call, so the dense kernel is faster than the block-sparse one, or keeps every block
    (``above`` 1); one device sync."""
    limit = min(DENSE_CALL_ABOVE if above is None else float(above), 1.0 - 1e-6)  # every block kept: dense
    return bool(call_kept(keep) > limit)


@functools.lru_cache(maxsize=128)
def _early_rows_on(layout, device: torch.device) -> Tensor:
    """Original token indices ``[m, 9]`` of the probe rows of :func:`early_kept`'s sampled query blocks
    (``m = min(EARLY_BLOCKS, nv)``, evenly spaced block indices), on ``device``, cached."""
    nv = layout.n_video_blocks
    m = min(EARLY_BLOCKS, nv)
    pick = torch.linspace(0, nv - 1, m).round().long().unique()
    rows = probe_rows(layout)[pick]  # tiled positions of real tokens
    with torch.inference_mode(False):
        return layout.source[rows].contiguous().to(device)


def probe_masses(probes: Tensor, k: Tensor, layout, scale: float, impl: str = "auto", tiled: bool = True) -> Tensor:
    """``log sum_{t in j} exp(scale * p . k_t)`` of every probe row ``p`` (``probes [B, M, H, D]``, any
    order) against every video key block ``j`` of ``layout``: float32 ``[B, H, M, nv]``.  ``k``: ``[B,
    padded_len, H, D]`` in ``layout``'s order, or with ``tiled=False`` ``[B, S, H, D]`` in the original order
    (the CUDA kernel then reads the blocks through the layout's index, no tiled copy).  The Triton kernel on
    CUDA for fp16/bf16 (the probes stay in the input dtype: no float32 copy), PyTorch elsewhere."""
    from ditattn.attention.sparse.block_scores import pooled_query_lse_torch

    nv, bs = layout.n_video_blocks, layout.block_size
    D = k.shape[-1]
    mean = probes.permute(0, 2, 1, 3)  # [B, H, M, D]
    dev = layout.on(k.device)
    if (
        k.is_cuda
        and k.dtype in (torch.float16, torch.bfloat16)
        and D in (16, 32, 64, 128, 256)
        and impl not in ("reference", "flex")
    ):
        from ditattn.attention.kernels.block_scores import pooled_query_lse

        index = None if tiled else dev.source_clamped[: nv * bs]
        return pooled_query_lse(
            mean,
            None,
            k if index is not None else k[:, : nv * bs],
            dev.valid[: nv * bs],
            block_size=bs,
            scale=scale,
            key_index=index,
        )
    if not tiled:
        from ditattn.attention.sparse.tiling import tile

        k = tile(k, layout)
    valid = None if _full(layout) else dev.valid[: nv * bs]
    return pooled_query_lse_torch(mean, None, k[:, : nv * bs], valid, block_size=bs, scale=scale).float()


def precheck_dense(
    q: Tensor,
    k: Tensor,
    video_shape,
    text_len: int,
    budget: float,
    *,
    scale: Optional[float] = None,
    impl: str = "auto",
    tile_size=(4, 4, 4),
    above: Optional[float] = None,
) -> bool:
    """Before an expensive selection (SVG2's clustering): whether meeting ``budget`` on the 3-D tile blocks
    of ``tile_size`` is predicted to keep more than ``above`` (None: :data:`DENSE_CALL_ABOVE`) of the blocks
    (:func:`early_dense`).  q/k ``[B, S, H, D]`` (k with q's heads).  One device sync."""
    from ditattn.attention.sparse.tiling import make_tile_layout

    layout = make_tile_layout(video_shape, tuple(tile_size), text_len)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return early_dense(q, k, layout, budget, scale=scale, impl=impl, above=above)


#: ``{state key: (step, runs dense)}``: each budgeted layer's call-level decision in the current request, per
#: calling thread (:func:`decided`, :func:`remember`)
_decisions: dict = {}


def decided(key: str, step: Optional[int]) -> Optional[bool]:
    """The call-level decision layer ``key`` took at an earlier step of the current request: True (the dense
    kernel), False (the block-sparse path, the budget still enforced per head on the device, no sync), None
    when there is none to reuse: no step, the step did not advance (a new request starts over) or no call
    yet.  A decision holds for the rest of the request, so its probe and its syncs are paid once per layer
    and request.  Host values only (no sync)."""
    prev = _decisions.get(key)
    if prev is None or step is None or int(step) <= prev[0]:
        return None
    return prev[1]


def remember(key: str, step: Optional[int], dense: bool) -> None:
    """Record layer ``key``'s decision at ``step`` (also when reused: the step marks where the request is)."""
    if step is not None:
        _decisions[key] = (int(step), bool(dense))


def clear_memory() -> None:
    """Forget every layer's recorded decisions (tests; a new request starts over by itself when its steps
    do not advance); also the measured error check's modes (:func:`.check.clear_memory`)."""
    from ditattn.attention.sparse.check import clear_memory as clear_checks

    _decisions.clear()
    clear_checks()
