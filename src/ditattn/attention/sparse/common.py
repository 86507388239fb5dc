"""Pieces shared by the planners: special (text/sink) blocks, running a plan, plan masks."""

from __future__ import annotations

import functools
import importlib
import math
from typing import Optional, Union

import torch

from ditattn.attention.sparse.block_sparse import (
    block_lists_to_dense_mask,
    block_mask_to_lists,
    block_sparse_attention,
)
from ditattn.attention.sparse.block_sparse import kept_fraction as count_kept_fraction
from ditattn.attention.sparse.tiling import TileLayout, tile, untile
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor


class SparsePlan:
    """What a planner decided for one call.

    layout: the tile layout the lists refer to; kv_indices/kv_counts: block lists (see
    :mod:`.block_sparse`); kept_fraction: kept (query block, key block) pairs / all pairs, a float;
    extra: planner-specific details (scores, windows, cluster labels, ...).

    ``kept_fraction`` may be given as a float, as a 0-dim tensor, or as None (then it is counted
    from ``kv_counts`` over ``layout.n_blocks`` key blocks).  Tensors become a float on the first
    read of :attr:`kept_fraction`, so a caller that never reads it never waits for the device.
    """

    def __init__(
        self,
        layout: Optional[TileLayout],
        kv_indices: Tensor,
        kv_counts: Tensor,
        kept_fraction: Union[float, Tensor, None] = None,
        extra: Optional[dict] = None,
    ):
        if kept_fraction is None and layout is None:
            raise ValueError("SparsePlan needs kept_fraction when it has no layout")
        self.layout = layout
        self.kv_indices = kv_indices
        self.kv_counts = kv_counts
        self._kept = kept_fraction
        self.extra = {} if extra is None else extra

    @property
    def kept_fraction_pending(self) -> Union[float, Tensor]:
        """The kept fraction without waiting for the device: a float when it is known on the host,
        else a 0-dim tensor (counted from ``kv_counts`` on their device when it was None).  For
        statistics that are read later (:class:`ditattn.attention.sparse.LayerStats`)."""
        if self._kept is None:
            total = self.kv_counts.numel() * self.layout.n_blocks
            self._kept = self.kv_counts.sum(dtype=torch.float64) / total if total else 0.0
        return self._kept

    @property
    def kept_fraction(self) -> float:
        if self._kept is None:
            self._kept = count_kept_fraction(self.kv_counts, self.layout.n_blocks)  # syncs
        if isinstance(self._kept, Tensor):
            self._kept = float(self._kept)  # syncs
        return self._kept

    def __repr__(self) -> str:
        kept = "pending" if isinstance(self._kept, (Tensor, type(None))) else f"{self._kept:.4f}"
        return (
            f"SparsePlan(layout={self.layout!r}, kv_indices={tuple(self.kv_indices.shape)}, "
            f"kept_fraction={kept}, extra={sorted(self.extra)})"
        )


def add_special_blocks(layout: TileLayout, video_mask: Tensor) -> Tensor:
    """Extend a video-block mask ``[..., n_video_blocks, n_video_blocks]`` to all blocks: every
    query block attends every special (text/sink) key block and every special query block attends
    every block.  Returns bool ``[..., n_blocks, n_blocks]``."""
    nv, nb = layout.n_video_blocks, layout.n_blocks
    if nb == nv:
        return video_mask
    lead = video_mask.shape[:-2]
    out = torch.ones(*lead, nb, nb, dtype=torch.bool, device=video_mask.device)
    out[..., :nv, :nv] = video_mask
    return out


def topk_indices(scores: Tensor, k: int) -> Tensor:
    """int64 indices of the ``k`` largest entries along the last dim, in no particular order.

    The rule (also the Triton selection kernel's, :mod:`ditattn.attention.kernels.block_select`):
    higher score first, equal scores by lower index; ``-0.0`` equals ``+0.0``; NaN ranks above
    ``+inf``.  ``torch.topk`` leaves the choice among ties to its kernel (CPU and CUDA choose
    differently), so this is a stable descending sort.
    """
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def topk_mask(scores: Tensor, k: int, valid: Optional[Tensor] = None) -> Tensor:
    """Boolean mask of the ``k`` largest entries along the last dim, ties as in :func:`topk_indices`
    (``valid`` False entries never chosen; fewer than k valid entries -> all valid ones)."""
    n = scores.shape[-1]
    k = max(0, min(int(k), n))
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    out = torch.zeros_like(scores, dtype=torch.bool)
    if k == 0:
        return out
    out.scatter_(-1, topk_indices(scores, k), True)
    if valid is not None:
        out &= valid
    return out


def mass_mask(log_mass: Tensor, threshold: float, valid: Optional[Tensor] = None, min_count: int = 1) -> Tensor:
    """Boolean mask, per row of ``log_mass [..., n]`` (unnormalised log masses: ``softmax`` along
    the last dim is each entry's share), of the fewest entries, largest share first (ties to the
    lower index, as :func:`topk_indices`), whose shares sum to at least ``threshold`` in (0, 1] —
    but at least ``min_count`` (>= 1) entries, the first ones in that order.  ``valid`` False
    entries have no share and are never chosen (a row with fewer valid entries keeps all of them).

    Computed as "keep sorted position ``i`` while the share from ``i`` on exceeds ``1 - threshold``"
    (a suffix sum, exact at the small end): ``threshold=1`` keeps exactly the entries whose float
    share is nonzero (and the first ``min_count``).
    """
    if valid is not None:
        log_mass = log_mass.masked_fill(~valid, float("-inf"))
    sv, si = torch.sort(log_mass, dim=-1, descending=True, stable=True)
    p = torch.softmax(sv, dim=-1).nan_to_num_(0.0)  # a row of -inf: NaN -> no share
    # share from each sorted position on (a suffix sum), compared before flipping back: the same bits as
    # flipping the float sums back first, one float copy fewer
    take = (p.flip(-1).cumsum(-1) > 1.0 - float(threshold)).flip(-1)
    take[..., : max(1, int(min_count))] = True
    out = torch.zeros_like(take).scatter_(-1, si, take)
    if valid is not None:
        out &= valid
    return out


def video_mask_lists(
    layout: TileLayout, video_mask: Tensor, width: Optional[int] = None, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Block lists of a video-block mask plus the special blocks, without the dense mask or a sort:
    equal (``torch.equal``) to ``block_mask_to_lists(add_special_blocks(layout, video_mask), width)``.

    ``video_mask``: bool ``[B, H, nv, nv]`` (``nv = layout.n_video_blocks``; True = the video query
    block attends the video key block).  Returns ``(kv_indices, kv_counts)`` (contiguous int32
    ``[B, H, nb, W]`` and ``[B, H, nb]``, ``nb = layout.n_blocks``): a video query row lists its True
    video key blocks in ascending order, then every special block ``nv .. nb-1``, then zeros (count:
    its True blocks + ``nb - nv``); a special query row lists ``0 .. nb-1`` (count ``nb``).  ``W``:
    ``width`` when given (in ``[1, nb]``; rows longer than ``W`` are cut, their counts kept, as
    :func:`.block_mask_to_lists` does), else ``max(1, longest row)`` (one device sync when there are
    no special blocks; pass :func:`.block_sparse.list_width` off the CPU).  No device sync when
    ``width`` is given.

    ``impl``: ``"auto"`` (the Triton kernel :func:`ditattn.attention.kernels.block_select.mask_block_lists`
    for CUDA masks with a given ``width`` and at most its ``MAX_TOPK_BLOCKS`` blocks, else PyTorch),
    ``"reference"`` (PyTorch) or ``"triton"`` (the kernel; CUDA, or CPU under ``TRITON_INTERPRET=1``).
    Both paths give identical lists.  The PyTorch path scatters each video row into a zeroed row: True
    column ``j`` to slot ``(True columns <= j) - 1`` (an inclusive running count), special block
    ``nv + s`` to ``count + s``, every False column (value 0) to slot ``nb - 1``, which lies past the
    row's count whenever the row has a False column.
    """
    if video_mask.dtype != torch.bool or video_mask.dim() != 4:
        raise ValueError("video_mask must be a bool tensor [B, H, n_video_blocks, n_video_blocks]")
    nv, nb = layout.n_video_blocks, layout.n_blocks
    ns = nb - nv
    if video_mask.shape[-2:] != (nv, nv):
        raise ValueError(f"video_mask must end in ({nv}, {nv}) video blocks, got {tuple(video_mask.shape)}")
    if width is not None and not 1 <= width <= nb:
        raise ValueError(f"width must be in [1, n_blocks={nb}], got {width}")
    kernel = _mask_lists_kernel(video_mask, nb, width, impl)
    if kernel is not None:
        if width is None:  # "triton" without a width: the tight one (a sync)
            width = nb if ns else max(1, int(video_mask.sum(-1).max())) if video_mask.numel() else 1
        return kernel(video_mask, n_blocks=nb, width=width)
    B, H = video_mask.shape[:2]
    dev = video_mask.device
    slot = video_mask.cumsum(-1)  # int64 [B, H, nv, nv]: True columns up to and including j
    count = slot[..., -1:].clone()  # [B, H, nv, 1]
    # True column j -> slot (running count - 1); False columns -> slot nb - 1 with value 0 (a zero slot:
    # a row with a False column has count + ns <= nb - 1), so equal values collide there, in any order
    slot.sub_(1).masked_fill_(video_mask.logical_not(), nb - 1)
    out = torch.zeros(B, H, nb, nb, dtype=torch.int32, device=dev)
    rows = out[:, :, :nv]
    rows.scatter_(-1, slot, video_mask * torch.arange(nv, dtype=torch.int32, device=dev))
    counts = torch.full((B, H, nb), nb, dtype=torch.int32, device=dev)
    counts[:, :, :nv] = count.squeeze(-1) + ns
    if ns:
        spec = torch.arange(ns, device=dev)
        rows.scatter_(-1, count + spec, (spec + nv).to(torch.int32).expand(B, H, nv, ns))
        out[:, :, nv:] = torch.arange(nb, dtype=torch.int32, device=dev)
    if width is None:
        width = nb if ns else max(1, int(count.max())) if count.numel() else 1  # syncs without special blocks
    if width < nb:
        out = out[..., :width].contiguous()
    return out, counts


def _mask_lists_kernel(video_mask: Tensor, nb: int, width: Optional[int], impl: str):
    """The Triton list builder for :func:`video_mask_lists`, or None for the PyTorch path."""
    return _list_kernel("mask list", "mask_block_lists", impl, video_mask.is_cuda and width is not None, nb)


def _list_kernel(what: str, name: str, impl: str, auto_eligible: bool, n_cols: int):
    """The list-building kernel ``name`` of :mod:`ditattn.attention.kernels.block_select` for a call, or
    None for the PyTorch path: ``impl`` "reference" -> None; "auto" -> the kernel when
    ``auto_eligible`` (the inputs it takes on CUDA), Triton imports and ``n_cols`` fits its rows
    (``MAX_TOPK_BLOCKS``); "triton" -> the kernel (an error naming ``what`` without Triton)."""
    if impl not in ("auto", "reference", "triton"):
        raise AttentionConfigError(f"{what} impl must be 'auto', 'reference' or 'triton', got {impl!r}")
    if impl == "reference" or (impl == "auto" and not auto_eligible):
        return None
    mod = select_kernels()
    if mod is None:
        if impl == "triton":
            raise AttentionConfigError(f"the Triton {what} kernel needs the triton package; use impl='reference'")
        return None
    if impl == "auto" and n_cols > mod.MAX_TOPK_BLOCKS:
        return None
    return getattr(mod, name)


def mass_lists(
    layout: TileLayout,
    log_mass: Tensor,
    threshold: float,
    min_count: int = 1,
    valid: Optional[Tensor] = None,
    width: Optional[int] = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Block lists of the :func:`mass_mask` rule over the video blocks plus every special block (each
    special query block keeps everything), without the dense ``[nb, nb]`` mask and with one sort (the
    rule's own): equal (``torch.equal``) to :func:`mass_lists_via_mask`, i.e.
    ``block_mask_to_lists(add_special_blocks(layout, mass_mask(log_mass, threshold, valid,
    min_count)), width)``.

    ``log_mass``: float ``[B, H, nv, nv]`` (``nv = layout.n_video_blocks``), row = video query block,
    column = video key block; ``threshold``, ``valid`` (bool, ``log_mass``'s shape or broadcast to it)
    and ``min_count`` as in :func:`mass_mask`.  Returns ``(kv_indices int32 [B, H, nb, W], kv_counts
    int32 [B, H, nb])`` in the layout of :func:`video_mask_lists` (``width`` and ``impl`` likewise:
    ``width`` given, no device sync; None, the tight width).  Row lengths vary, so the kept fraction
    is left to the plan (:class:`SparsePlan` counts it from ``kv_counts`` when first read).
    """
    mask = mass_mask(log_mass, threshold, valid=valid, min_count=min_count)
    return video_mask_lists(layout, mask, width, impl)


def mass_lists_via_mask(
    layout: TileLayout,
    log_mass: Tensor,
    threshold: float,
    min_count: int = 1,
    valid: Optional[Tensor] = None,
    width: Optional[int] = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """:func:`mass_lists` through the dense block mask (``[B, H, nb, nb]`` bool, then an argsort per
    row in :func:`.block_mask_to_lists`; ``impl`` ignored): the definition the list builder must
    equal, for tests and ``bench/selection_cost.py --cdf``."""
    mask = add_special_blocks(layout, mass_mask(log_mass, threshold, valid=valid, min_count=min_count))
    return block_mask_to_lists(mask, width=width)


def ceil_fraction(fraction: float, n: int) -> int:
    """``ceil(fraction * n)`` robust to float noise (``(1 - 0.7) * 10`` is 3, not 4), at least 1."""
    return max(1, min(n, math.ceil(round(fraction * n, 9))))


def rows_kept_fraction(layout: TileLayout, k: int) -> float:
    """Kept fraction of a plan where every video query block keeps ``k`` video key blocks plus every
    special block, and every special query block keeps everything (host arithmetic, no sync)."""
    nv, nb = layout.n_video_blocks, layout.n_blocks
    ns = nb - nv
    return float(nv * (k + ns) + ns * nb) / (nb * nb) if nb else 0.0


def triton_path(q: Tensor, impl: str) -> bool:
    """Whether a planner's auxiliary Triton kernel (Sol's centroid part, SageSLA's quantization)
    runs: always for ``impl="triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), for ``"auto"``
    on CUDA in fp16/bf16 with a head dim of 16..256 (power of two); otherwise the PyTorch path."""
    if impl == "triton":
        return True
    return (
        impl == "auto"
        and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] in (16, 32, 64, 128, 256)
    )


def select_impl(impl: str) -> str:
    """The selection stage's path for a planner's ``impl`` (the block-sparse core's choice):
    ``"reference"`` and ``"triton"`` carry over, anything else is ``"auto"``."""
    return impl if impl in ("reference", "triton") else "auto"


def topk_lists(layout: TileLayout, scores: Tensor, k: int, impl: str = "auto") -> tuple[Tensor, Tensor, float]:
    """Block lists of "each video query block keeps its ``k`` best-scoring video key blocks, plus
    every special block; each special query block keeps every block", built straight from the
    top-k (no dense mask, no wide sort on the GPU).

    ``scores``: float ``[B, H, n_video_blocks, n_video_blocks]``.  Returns ``(kv_indices,
    kv_counts, kept_fraction)`` equal to ``block_mask_to_lists(add_special_blocks(layout,
    topk_mask(scores, k)))`` (ties to the lower block id, :func:`topk_indices`) and the plan's kept
    fraction (host arithmetic).  ``kv_counts`` is a broadcast view of a cached constant: do not
    write to it.  No device synchronisation for k >= 1.

    ``impl``: ``"auto"`` (the Triton kernel of :mod:`ditattn.attention.kernels.block_select` for
    float32 CUDA scores of at most its ``MAX_TOPK_BLOCKS`` columns, else PyTorch), ``"reference"``
    (PyTorch: :func:`topk_indices`, an int32 sort of the ``k`` ids, special columns concatenated)
    or ``"triton"`` (the kernel; CUDA, or CPU under ``TRITON_INTERPRET=1``).  Both paths give
    identical lists for identical scores.
    """
    nv, nb = layout.n_video_blocks, layout.n_blocks
    ns = nb - nv
    k = max(0, min(int(k), nv))
    B, H = scores.shape[:2]
    kept = rows_kept_fraction(layout, k)
    if k == 0:  # never from VSA (k >= 1); the general path is exact here
        return *block_mask_to_lists(add_special_blocks(layout, topk_mask(scores, 0))), kept
    tail, special_rows, counts = _topk_constants(layout, scores.device, k, B, H)
    kernel = _topk_kernel(scores, impl)
    if kernel is not None:
        return kernel(scores, k, n_blocks=nb), counts, kept
    sel = topk_indices(scores, k).to(torch.int32).sort(dim=-1).values
    if ns:
        sel = torch.cat([torch.cat([sel, tail], dim=-1), special_rows], dim=2)
    return sel, counts, kept


def _topk_kernel(scores: Tensor, impl: str):
    """The Triton top-k list builder for this call, or None for the PyTorch path (see :func:`topk_lists`)."""
    return _list_kernel(
        "top-k selection", "topk_block_lists", impl, scores.is_cuda and scores.dtype == torch.float32, scores.shape[-1]
    )


@functools.lru_cache(maxsize=None)
def select_kernels():
    """:mod:`ditattn.attention.kernels.block_select`, or None when Triton is not importable."""
    try:
        return importlib.import_module("ditattn.attention.kernels.block_select")
    except ModuleNotFoundError as exc:  # no triton: the PyTorch path
        if exc.name != "triton" and not (exc.name or "").startswith("triton."):
            raise
        return None


@functools.lru_cache(maxsize=64)
def _topk_constants(layout: TileLayout, device: torch.device, k: int, B: int, H: int):
    """For :func:`topk_lists`, as broadcast int32 views: the rest of a video row ``[B, H, nv, nb - k]``
    (special block ids, then zeros), the special rows ``[B, H, ns, nb]`` (every block) and the
    counts ``[B, H, nb]`` (``k + ns`` for video rows, ``nb`` for special rows)."""
    with torch.inference_mode(False):  # cached: ordinary tensors even when first built under inference mode
        return _build_topk_constants(layout, device, k, B, H)


def _build_topk_constants(layout: TileLayout, device: torch.device, k: int, B: int, H: int):
    nv, nb = layout.n_video_blocks, layout.n_blocks
    ns = nb - nv
    row = torch.zeros(nb - k, dtype=torch.int32)
    row[:ns] = torch.arange(nv, nb, dtype=torch.int32)
    counts = torch.full((nb,), nb, dtype=torch.int32)
    counts[:nv] = k + ns
    tail = row.to(device).expand(B, H, nv, -1)
    special_rows = torch.arange(nb, dtype=torch.int32, device=device).expand(B, H, ns, -1)
    return tail, special_rows, counts.to(device).expand(B, H, -1)


def run_block_mask(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TileLayout,
    block_mask: Tensor,
    *,
    scale: Optional[float],
    return_lse: bool,
    impl: str = "auto",
    kept_fraction: Union[float, Tensor, None] = None,
    extra: Optional[dict] = None,
    q_tiled: Optional[Tensor] = None,
    k_tiled: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """Tile q/k/v (original order ``[B, S, H, D]``, k/v already expanded to q's heads), run the
    block-sparse core with ``block_mask`` (bool ``[B or 1, H or 1, n_blocks, n_blocks]``) and
    untile.  ``kept_fraction`` as in :func:`run_block_lists`.  Returns ``(out [B, S, H, D],
    lse [B, H, S] or None, plan)``."""
    idx, cnt = block_mask_to_lists(block_mask.to(q.device))
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
        kept_fraction=kept_fraction,
        extra=extra,
        q_tiled=q_tiled,
        k_tiled=k_tiled,
    )


def run_block_lists(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: TileLayout,
    kv_indices: Tensor,
    kv_counts: Tensor,
    *,
    scale: Optional[float],
    return_lse: bool,
    impl: str = "auto",
    kept_fraction: Union[float, Tensor, None] = None,
    extra: Optional[dict] = None,
    q_tiled: Optional[Tensor] = None,
    k_tiled: Optional[Tensor] = None,
    nonempty_rows: bool = False,
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """:func:`run_block_mask` with block lists (int32 ``[B or 1, H or 1, n_blocks, m]`` /
    ``[B or 1, H or 1, n_blocks]`` on q's device) instead of a mask; ``kept_fraction`` as in
    :class:`SparsePlan` (None: counted from the lists when read).  ``nonempty_rows``: the caller guarantees
    that every query block lists a key block (the FA4 path then needs no emptiness check, a device sync).
    Adds no device sync of its own."""
    qt = tile(q, layout) if q_tiled is None else q_tiled
    kt = tile(k, layout) if k_tiled is None else k_tiled
    vt = tile(v, layout)
    kv_valid = layout.kv_valid(q.shape[0], q.device)
    out_t, lse_t = block_sparse_attention(
        qt,
        kt,
        vt,
        kv_indices,
        kv_counts,
        block_size=layout.block_size,
        scale=scale,
        kv_valid=kv_valid,
        return_lse=return_lse,
        impl=impl,
        nonempty_rows=nonempty_rows,
    )
    out = untile(out_t, layout).to(q.dtype)
    lse = untile(lse_t, layout, dim=2) if lse_t is not None else None
    return out, lse, SparsePlan(layout, kv_indices, kv_counts, kept_fraction, extra or {})


def plan_token_mask(plan: SparsePlan) -> Tensor:
    """The explicit token mask of a tile-layout plan in ORIGINAL token order: bool
    ``[B or 1, H or 1, S, S]`` (True = the query token attends the key token)."""
    lay = plan.layout
    dense = block_lists_to_dense_mask(plan.kv_indices, plan.kv_counts, block_size=lay.block_size)
    dense = dense & lay.valid.to(dense.device).view(1, 1, 1, -1)
    pos = lay.position.to(dense.device)
    return dense.index_select(2, pos).index_select(3, pos)
