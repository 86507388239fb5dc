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
dense (every block kept: the block-sparse engine costs more than a dense kernel there), and when
every head of the call does, the backend skips the sparse kernel and calls the dense one
(:func:`all_dense`).  The planners ask :func:`early_dense` first (the centre probe rows of at most
:data:`EARLY_BLOCKS` query blocks, before any selection work), so a call that ends dense costs the dense
kernel plus at most 1 / block_size of its Q.K (far less at large sizes).  ``b = 0`` turns the budget off.  The default budget of each backend (its
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
#: :func:`early_dense` probes the centre rows of at most this many query blocks per head (evenly strided over
#: the blocks): its cost stays below ``EARLY_BLOCKS / (2 * seq_len)`` of dense attention's FLOPs at any size
EARLY_BLOCKS = 128
#: ``est_rel_err = ESTIMATE_FACTOR * largest predicted dropped mass``; measured relative error <=
#: ``est_rel_err + ESTIMATE_SLACK`` on the structured families and captured activations (tests)
ESTIMATE_FACTOR = 8.0
ESTIMATE_SLACK = 0.02


def shares(log_mass: Tensor) -> Tensor:
    """Predicted share of each key block per row: ``softmax`` over the last dim of the float32
    ``log_mass [..., nk]`` (rows of ``-inf`` give zeros)."""
    return torch.softmax(log_mass.float(), dim=-1).nan_to_num_(0.0)


def dropped_mass(log_mass: Tensor, keep: Tensor) -> Tensor:
    """Predicted dropped mass per query block: float32 ``[B, H, nq]`` from ``log_mass`` (``[B, H, nq,
    nk]``, or per probe row ``[B, H, nq, R, nk]``: then the largest over the probe rows) and the bool
    selection ``keep [B, H, nq, nk]`` (True = kept)."""
    if log_mass.dim() == keep.dim() + 1:
        return (shares(log_mass) * (~keep).unsqueeze(-2)).sum(-1).amax(-1)
    return (shares(log_mass) * (~keep)).sum(-1)


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


def probe_log_mass(q_tiled: Tensor, k_tiled: Tensor, layout, scale: float, impl: str = "auto",
                   centre_only: bool = False, sampled: bool = False) -> Tensor:
    """Exact block log-masses of every video block's probe rows (:func:`probe_rows`): float32
    ``[B, H, nv, R, nv]`` (``R = 9``), entry ``[.., i, r, j] = log sum_{t in j} exp(scale * q_r . k_t)`` for
    probe row ``r`` of query block ``i``; ``R / block_size`` of the Q.K products of dense attention
    (9/64 at 64-token blocks), no P.V.  q_tiled / k_tiled ``[B, padded_len, H, D]`` in ``layout``'s
    order (k with q's heads).  ``centre_only``: the centre row alone (``R = 1``, 1 / block_size of the
    products), for :func:`early_dense`; ``sampled`` (with ``centre_only``): only every ``s``-th query block,
    ``s = ceil(nv / EARLY_BLOCKS)``, so the dim of the query blocks is ``ceil(nv / s)``."""
    from ditattn.attention.sparse.block_scores import pooled_query_lse_torch

    B, _, H, D = q_tiled.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    rows = _probe_rows_on(layout, q_tiled.device, centre_only)  # [nv, R]
    if sampled:
        rows = rows[:: -(-nv // EARLY_BLOCKS)]
    R = rows.shape[1]
    probes = q_tiled.index_select(1, rows.flatten())  # [B, nv*R, H, D]
    dt = torch.float64 if q_tiled.dtype == torch.float64 else torch.float32
    mean = probes.to(dt).permute(0, 2, 1, 3)  # [B, H, nv*R, D]
    keys = k_tiled[:, : nv * bs]
    valid = layout.on(q_tiled.device).valid[: nv * bs]
    if (keys.is_cuda and keys.dtype in (torch.float16, torch.bfloat16) and D in (16, 32, 64, 128, 256)
            and impl not in ("reference", "flex")):
        from ditattn.attention.kernels.block_scores import pooled_query_lse

        lm = pooled_query_lse(mean, None, keys, valid, block_size=bs, scale=scale)
    else:
        lm = pooled_query_lse_torch(mean, None, keys, None if _full(layout) else valid, block_size=bs, scale=scale)
    return lm.float().view(B, H, rows.shape[0], R, nv)


@functools.lru_cache(maxsize=128)
def _probe_rows_on(layout, device: torch.device, centre_only: bool) -> Tensor:
    """:func:`probe_rows` (or its centre column) on ``device``, cached: no upload per call."""
    rows = probe_rows(layout)
    with torch.inference_mode(False):
        return (rows[:, -1:] if centre_only else rows).contiguous().to(device)


@functools.lru_cache(maxsize=64)
def _full(layout) -> bool:
    return bool(layout.valid[: layout.n_video_blocks * layout.block_size].all())


def enforce_budget(log_mass: Tensor, keep: Tensor, budget: float,
                   dense_above: Optional[float] = None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(keep', dense_heads)``: ``keep`` (bool ``[B, H, nq, nk]``) plus, per row, the fewest blocks,
    largest predicted share first, whose shares reach ``1 - budget`` (``log_mass`` ``[B, H, nq, nk]``, or
    ``[B, H, nq, R, nk]`` per probe row: every probe row's blocks); a head (``[B, H]`` bool
    ``dense_heads``) whose kept fraction then exceeds ``dense_above`` (None: :data:`DENSE_ABOVE` as it is at
    the call) keeps every block.  ``budget`` <= 0 returns ``keep`` unchanged and no dense head.  Per probe row
    on CUDA (``impl`` other than ``"reference"``) one Triton kernel widens the selection
    (:func:`ditattn.attention.kernels.budget_mask.budget_need`: the same blocks, and the whole of a tie at the
    cut); elsewhere the PyTorch path sorts each row."""
    if budget <= 0:
        return keep, torch.zeros(keep.shape[:2], dtype=torch.bool, device=keep.device)
    need = _need(log_mass, budget, impl) if log_mass.dim() == keep.dim() + 1 else None
    if need is None:
        from ditattn.attention.sparse.common import mass_mask

        need = mass_mask(log_mass.float(), 1.0 - float(budget))
        if log_mass.dim() == keep.dim() + 1:
            need = (need & torch.isfinite(log_mass).any(-1, keepdim=True)).any(-2)
    out = keep | need
    dense = out.float().mean((-1, -2)) > float(DENSE_ABOVE if dense_above is None else dense_above)
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
            "error budget kernel failed (%s: %s); the budget runs its PyTorch path from now on", type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "")
        return None


def all_dense(dense_heads: Tensor) -> bool:
    """Whether every head of the call runs dense (one device sync: the caller then skips the sparse
    kernel and calls the dense one)."""
    return bool(dense_heads.all()) if dense_heads.numel() else False


def summary(log_mass: Tensor, keep: Tensor, dense_heads: Tensor, budget: float) -> dict:
    """Statistics of a budgeted selection for ``last_stats`` (device scalars, read later):
    ``dropped_mass_max`` / ``dropped_mass_mean`` (predicted, over the rows), ``dense_heads`` (how
    many heads ran dense), ``heads`` and ``error_budget``."""
    m = dropped_mass(log_mass, keep)
    return {"dropped_mass_max": m.amax() if m.numel() else 0.0, "dropped_mass_mean": m.mean() if m.numel() else 0.0,
            "dense_heads": dense_heads.sum(), "heads": int(dense_heads.numel()), "error_budget": float(budget)}


def dense_budgeted(q: Tensor, k: Tensor, v: Tensor, layout, budget: float, *, scale: Optional[float],
                   return_lse: bool, dense_backend: Optional[str] = None, extra: Optional[dict] = None):
    """``(out, lse, plan)`` of a call :func:`early_dense` sent to the dense kernel (``dense_backend``, None:
    the platform's automatic one); the plan records the fallback with every head dense."""
    from ditattn.attention.sparse.block_sparse import dense_attention

    out, lse = dense_attention(q, k, v, scale=scale, return_lse=return_lse, backend=dense_backend)
    heads = q.shape[0] * q.shape[2]
    stats = {"dropped_mass_max": 0.0, "dropped_mass_mean": 0.0, "est_rel_err": 0.0, "dense_heads": float(heads),
             "heads": heads, "error_budget": float(budget), "early": True}
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
        return SparsePlan(self.layout, empty.view(1, 1, 0, 0), empty.view(1, 1, 0), 1.0,
                          dict(extra or {}, dense_fallback=True, budget=self.stats))


def budgeted_lists(q: Tensor, k: Tensor, v: Tensor, q_tiled: Tensor, k_tiled: Tensor, layout, video_keep: Tensor,
                   budget: float, *, scale: float, return_lse: bool, impl: str = "auto",
                   dense_backend: Optional[str] = None) -> Budgeted:
    """Apply the budget to a planner's video selection and build its block lists, or run the call
    dense when every head needs it.

    q/k/v ``[B, S, H, D]`` (original order, k/v with q's heads); ``q_tiled`` / ``k_tiled``: the same in
    ``layout``'s tile order (unquantized); ``video_keep``: bool ``[B, H, nv, nv]`` selection over the
    video blocks; the predicted masses are :func:`probe_log_mass`'s.  Special (text/sink) blocks are kept
    as the planners keep them.  ``stats`` (device scalars): :func:`budget_stats`.
    The dense path calls ``dense_backend`` (None: the platform's automatic dense kernel)."""
    from ditattn.attention.sparse.block_sparse import dense_attention, list_width
    from ditattn.attention.sparse.common import select_impl, video_mask_lists

    log_mass = probe_log_mass(q_tiled, k_tiled, layout, scale, impl=impl)
    keep, dense = enforce_budget(log_mass, video_keep, budget, impl=impl)  # video_keep: the planner's selection
    stats = budget_stats(log_mass, video_keep, keep, dense, budget)
    if all_dense(dense):
        out, lse = dense_attention(q, k, v, scale=scale, return_lse=return_lse, backend=dense_backend)
        return Budgeted(layout, None, None, stats, out, lse)
    idx, cnt = video_mask_lists(layout, keep, width=list_width(q.device, layout.n_blocks), impl=select_impl(impl))
    return Budgeted(layout, idx, cnt, stats)


def budget_stats(log_mass: Tensor, selected: Tensor, keep: Tensor, dense: Tensor, budget: float) -> dict:
    """:func:`summary` of a budgeted selection plus ``est_rel_err`` (``ESTIMATE_FACTOR`` times the
    largest predicted dropped mass of ``keep``) and ``est_rel_err_unbudgeted`` (the same of the
    planner's own ``selected``)."""
    stats = summary(log_mass, keep, dense, budget)
    stats["est_rel_err"] = ESTIMATE_FACTOR * stats["dropped_mass_max"]
    m0 = dropped_mass(log_mass, selected)
    stats["est_rel_err_unbudgeted"] = ESTIMATE_FACTOR * (m0.amax() if m0.numel() else 0.0)
    return stats


def early_dense(q_tiled: Tensor, k_tiled: Tensor, layout, budget: float, *, scale: float,
                impl: str = "auto") -> bool:
    """Whether the budget already needs more than :data:`DENSE_ABOVE` of the blocks in every head from
    the centre probe rows of at most :data:`EARLY_BLOCKS` query blocks per head (evenly strided), so the
    call runs dense before any selection work.  A sample of the rows: "dense" from it is an estimate of the
    full check (which could only keep more blocks per row, and whose kept fraction the sample's mean
    estimates); a wrong "dense" costs speed, never accuracy.  Cost: the centre rows of at most
    ``EARLY_BLOCKS`` blocks against every key (at most ``1 / block_size`` of dense attention's Q.K products;
    ``EARLY_BLOCKS / seq_len`` at large sizes) and one device sync.  q_tiled / k_tiled as in
    :func:`probe_log_mass`."""
    if budget <= 0:
        return False
    lm = probe_log_mass(q_tiled, k_tiled, layout, scale, impl=impl, centre_only=True, sampled=True)
    nv = layout.n_video_blocks
    _, dense = enforce_budget(lm, torch.zeros(*lm.shape[:3], nv, dtype=torch.bool, device=lm.device), budget,
                              impl=impl)
    return all_dense(dense)


def precheck_dense(q: Tensor, k: Tensor, video_shape, text_len: int, budget: float, *, scale: Optional[float] = None,
                   impl: str = "auto", tile_size=(4, 4, 4)) -> bool:
    """Before an expensive selection (SVG2's clustering): whether meeting ``budget`` on the 3-D tile blocks
    of ``tile_size`` needs more than :data:`DENSE_ABOVE` of the blocks in every head — :func:`early_dense`
    first, then every probe row.  q/k ``[B, S, H, D]`` (k with q's heads).  At most two device syncs."""
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    layout = make_tile_layout(video_shape, tuple(tile_size), text_len)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qt, kt = tile(q, layout), tile(k, layout)
    if early_dense(qt, kt, layout, budget, scale=scale, impl=impl):
        return True
    lm = probe_log_mass(qt, kt, layout, scale, impl=impl)
    nv = layout.n_video_blocks
    _, dense = enforce_budget(lm, torch.zeros(*lm.shape[:3], nv, dtype=torch.bool, device=lm.device), budget,
                              impl=impl)
    return all_dense(dense)



#: ``{state key: (step, kept fraction, step of the last decision)}`` of each budgeted layer's last call per
#: thread (:func:`kept_last_step`, :func:`reuse_dense`)
_last_kept: dict = {}
#: a layer whose budget sent a call to the dense kernel runs the dense kernel directly (no probes, no
#: tiling) at its next steps, and checks the budget again every this many steps
RECHECK_EVERY = 5


def remember_kept(key: str, step: Optional[int], kept, decided: bool = True) -> None:
    """Record the kept fraction (float or device scalar) of layer ``key``'s call at ``step``; ``decided``:
    the budget was checked at this step (False: a reused decision)."""
    if step is not None:
        prev = _last_kept.get(key)
        since = int(step) if decided or prev is None else prev[2]
        _last_kept[key] = (int(step), kept, since)


def reuse_dense(key: str, step: Optional[int]) -> bool:
    """Whether layer ``key`` runs dense at ``step`` without checking: its call at an earlier step of this
    run ran dense under the budget (recorded kept fraction 1.0) and fewer than :data:`RECHECK_EVERY` steps
    have passed since the budget was last checked.  Host values only (no sync)."""
    prev = _last_kept.get(key)
    if prev is None or step is None or int(step) <= prev[0] or not isinstance(prev[1], float) or prev[1] < 1.0:
        return False
    return int(step) - prev[2] < RECHECK_EVERY


def kept_last_step(key: str, step: Optional[int]) -> Optional[float]:
    """The kept fraction layer ``key`` recorded at an earlier step of the same run (None: none, or the
    step did not advance, i.e. a new request); reads a device scalar (one sync, on a finished value)."""
    prev = _last_kept.get(key)
    if prev is None or step is None or int(step) <= prev[0]:
        return None
    return float(prev[1])


def clear_memory() -> None:
    """Forget every layer's recorded decisions (tests; a new run starts over by itself when its steps
    do not advance)."""
    _last_kept.clear()
