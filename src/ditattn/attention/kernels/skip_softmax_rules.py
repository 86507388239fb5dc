"""Skip softmax (BLASST) without Triton: which requests it serves
(:func:`check_skip_softmax_request`), its threshold, and the PyTorch reference of the kernel's
tile-skipping rule (:func:`skip_softmax_reference`, the CPU path).  The Triton kernel is
:mod:`.skip_softmax`."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ditattn.attention.kernels import LOG2E
from ditattn.attention.reference import expand_kv
from ditattn.errors import AttentionConfigError

SUPPORTED_HEAD_DIMS = (128, 256)


def skip_threshold(threshold_scale_factor: float, context_length: int) -> float:
    """The per-tile mass threshold ``threshold_scale_factor / context_length`` of BLASST."""
    return float(threshold_scale_factor) / float(context_length)


def dropped_mass_bound(threshold_scale_factor: float) -> float:
    """The most attention mass one query row can lose to the tile skipping at ``threshold_scale_factor``
    ``λ``: ``λ / (1 + λ)``.  A tile is skipped only when each row's largest weight in it is below ``λ / L``
    (``L`` keys) times the row's running maximum, so the skipped tiles hold at most ``λ`` times the row's
    final maximum weight, which is itself kept.  With ``|o_skip - o| <= 2 m max|v|`` this bounds the output
    error; :func:`factor_for_budget` inverts it."""
    lam = float(threshold_scale_factor)
    return lam / (1.0 + lam)


def factor_for_budget(budget: float) -> float:
    """The largest ``threshold_scale_factor`` whose :func:`dropped_mass_bound` is at most ``budget`` (in
    (0, 1)): ``budget / (1 - budget)``."""
    b = float(budget)
    if not 0 < b < 1:
        raise AttentionConfigError(f"skip softmax: an error budget must lie in (0, 1), got {budget!r}")
    return b / (1.0 - b)


def _validate_factor(threshold_scale_factor):
    if threshold_scale_factor is None:
        return
    if (
        isinstance(threshold_scale_factor, bool)
        or not isinstance(threshold_scale_factor, (int, float))
        or not math.isfinite(threshold_scale_factor)
        or threshold_scale_factor <= 0
    ):
        raise AttentionConfigError(
            f"skip softmax: threshold_scale_factor must be a number > 0, got {threshold_scale_factor!r}"
        )


def check_skip_softmax_request(
    *,
    dtype: Optional[torch.dtype] = None,
    head_dim: Optional[int] = None,
    role: str = "self",
    has_mask: bool = False,
    causal: bool = False,
    ring_degree: int = 1,
    threshold_scale_factor=None,
    start_step: int = 0,
) -> None:
    """Raise :class:`AttentionConfigError` when skip softmax cannot serve a request.

    Rejected: cross-attention, masks/biases, causal attention, ring attention (``ring_degree > 1``),
    running under torch.compile, during a CUDA-graph capture, dtypes other than fp16/bf16, head
    dims other than 128/256, a threshold factor that is not a number > 0, a negative start step.
    """
    _validate_factor(threshold_scale_factor)
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise AttentionConfigError(f"skip softmax: start_step must be an integer >= 0, got {start_step!r}")
    if role != "self":
        raise AttentionConfigError("skip softmax serves self-attention only (this layer is cross-attention)")
    if has_mask:
        raise AttentionConfigError("skip softmax cannot run with an attention mask or bias (unmasked attention only)")
    if causal:
        raise AttentionConfigError("skip softmax cannot run causal attention (unmasked attention only)")
    if ring_degree > 1:
        raise AttentionConfigError(
            f"skip softmax cannot run with ring attention (ring degree {ring_degree}); use ring degree 1"
        )
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(
            f"skip softmax needs float16 or bfloat16 inputs, got {str(dtype).replace('torch.', '')}"
        )
    if head_dim is not None and head_dim not in SUPPORTED_HEAD_DIMS:
        raise AttentionConfigError(f"skip softmax supports head dim 128 or 256, got {head_dim}")
    if torch.compiler.is_compiling():
        raise AttentionConfigError("skip softmax cannot run under torch.compile (its tile skipping is data dependent)")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise AttentionConfigError("skip softmax cannot run inside a captured CUDA graph")


def skip_softmax_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    threshold_scale_factor: Optional[float],
    scale: Optional[float] = None,
    block_m: int = 128,
    block_n: int = 128,
    return_lse: bool = False,
):
    """The kernel's tile-skipping rule in PyTorch float32 (any device, any float dtype).

    Walks each ``block_m``-row query block over ``block_n``-key tiles in order with an online
    softmax and applies the same skip decision as the kernel.  Returns ``(out [B, S_q, H, D] in
    q.dtype, lse [B, H, S_q] float32 or None, skipped_fraction float)``.
    """
    _validate_factor(threshold_scale_factor)
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    scale = D**-0.5 if scale is None else float(scale)
    k, v = expand_kv(k, v, H)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    log2_thr = math.log2(skip_threshold(threshold_scale_factor, Skv)) if threshold_scale_factor else None
    out = torch.empty(B, H, Sq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    skipped = visited = 0
    for b in range(B):
        for h in range(H):
            for i0 in range(0, Sq, block_m):
                qb = qf[b, h, i0 : i0 + block_m]
                m = torch.full((qb.shape[0],), float("-inf"), device=q.device)
                l_ = torch.zeros(qb.shape[0], device=q.device)
                acc = torch.zeros(qb.shape[0], D, device=q.device)
                for j0 in range(0, Skv, block_n):
                    s = (qb @ kf[b, h, j0 : j0 + block_n].T) * (scale * LOG2E)
                    mt = s.amax(dim=1)
                    visited += 1
                    if log2_thr is not None and float((mt - m).max()) < log2_thr:
                        skipped += 1
                        continue
                    mn = torch.maximum(m, mt)
                    alpha = torch.exp2(m - mn)
                    p = torch.exp2(s - mn[:, None])
                    l_ = l_ * alpha + p.sum(1)
                    acc = acc * alpha[:, None] + p @ vf[b, h, j0 : j0 + block_n]
                    m = mn
                out[b, h, i0 : i0 + block_m] = acc / l_[:, None]
                lse[b, h, i0 : i0 + block_m] = (m + torch.log2(l_)) / LOG2E
    frac = skipped / visited if visited else 0.0
    return out.transpose(1, 2).to(q.dtype), (lse if return_lse else None), frac


__all__ = [
    "check_skip_softmax_request",
    "dropped_mass_bound",
    "factor_for_budget",
    "skip_softmax_reference",
    "skip_threshold",
    "SUPPORTED_HEAD_DIMS",
]
