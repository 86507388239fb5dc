"""Image and tensor metrics for paired comparisons (torchmetrics underneath; no weight downloads).

Clips are uint8 ``[F, H, W, 3]`` arrays (what the pipelines return per prompt) or float tensors in
[0, 1].  The clip metrics are:

* ``psnr``: ``10 * log10(1 / MSE)`` over every pixel of the clip (``data_range`` 1); ``inf`` for
  identical clips;
* ``ssim``: SSIM (Gaussian window 11, sigma 1.5) per frame, averaged over frames; exactly 1 for
  identical clips;
* ``ms_ssim``: MS-SSIM per frame, averaged; the standard 5 scales with window 11 need frames of
  at least 176 pixels on the short side, so smaller frames use as many scales as fit (at least 2,
  the standard weights of those scales renormalised) and report how many were used.

Tensor metrics (attention outputs): relative L2 error ``|x - ref| / |ref|`` and cosine similarity
of the flattened tensors, both in float64.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np
import torch

Tensor = torch.Tensor
ClipLike = Union[np.ndarray, Tensor]

#: the standard MS-SSIM scale weights (Wang et al. 2003), finest scale first
MS_SSIM_BETAS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)
SSIM_KERNEL = 11


def clip_tensor(clip: ClipLike) -> Tensor:
    """A clip as float32 ``[F, 3, H, W]`` in [0, 1]: from uint8 ``[F, H, W, 3]`` (or ``[H, W, 3]``,
    one frame) arrays/tensors, or float ``[F, H, W, 3]`` already in [0, 1]."""
    x = torch.as_tensor(np.asarray(clip) if isinstance(clip, np.ndarray) else clip)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4 or x.shape[-1] != 3:
        raise ValueError(f"a clip must be [frames, height, width, 3], got shape {tuple(x.shape)}")
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    return x.permute(0, 3, 1, 2).contiguous()


def _pair(pred: ClipLike, ref: ClipLike) -> tuple[Tensor, Tensor]:
    p, r = clip_tensor(pred), clip_tensor(ref)
    if p.shape != r.shape:
        raise ValueError(f"clips differ in shape: {tuple(p.shape)} vs {tuple(r.shape)} ([F, 3, H, W])")
    return p, r


def psnr(pred: ClipLike, ref: ClipLike) -> float:
    """PSNR in dB of ``pred`` against ``ref`` over the whole clip (``inf`` when identical)."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    p, r = _pair(pred, ref)
    return float(peak_signal_noise_ratio(p, r, data_range=1.0))


def ssim(pred: ClipLike, ref: ClipLike) -> float:
    """Mean per-frame SSIM (exactly 1.0 when identical: float32's rounding gives 1 - 1e-6 there)."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    p, r = _pair(pred, ref)
    if torch.equal(p, r):
        return 1.0
    return float(structural_similarity_index_measure(p, r, data_range=1.0, kernel_size=SSIM_KERNEL))


def ms_ssim_scales(height: int, width: int) -> int:
    """How many MS-SSIM scales fit frames of ``height x width`` with window 11 (torchmetrics'
    rule: ``side // (n - 1) ** 2 > 10`` and ``side >= 2 ** n``); 0 when not even 2 fit."""
    side = min(height, width)
    for n in range(len(MS_SSIM_BETAS), 1, -1):
        if side >= 2**n and side // max(1, n - 1) ** 2 > SSIM_KERNEL - 1:
            return n
    return 0


def ms_ssim(pred: ClipLike, ref: ClipLike) -> tuple[float, int]:
    """``(mean per-frame MS-SSIM, scales used)`` (exactly 1 for identical clips); ``(nan, 0)`` for frames too
    small for 2 scales."""
    from torchmetrics.functional.image import multiscale_structural_similarity_index_measure

    p, r = _pair(pred, ref)
    n = ms_ssim_scales(p.shape[-2], p.shape[-1])
    if n == 0:
        return float("nan"), 0
    if torch.equal(p, r):
        return 1.0, n
    betas = MS_SSIM_BETAS[:n]
    betas = tuple(b / sum(betas) for b in betas)
    val = multiscale_structural_similarity_index_measure(p, r, data_range=1.0, kernel_size=SSIM_KERNEL, betas=betas)
    return float(val), n


def clip_metrics(pred: ClipLike, ref: ClipLike) -> dict:
    """``{"psnr", "ssim", "ms_ssim", "ms_ssim_scales"}`` of ``pred`` against ``ref``."""
    m, n = ms_ssim(pred, ref)
    return {"psnr": psnr(pred, ref), "ssim": ssim(pred, ref), "ms_ssim": m, "ms_ssim_scales": n}


def tensor_errors(x: Tensor, ref: Tensor) -> tuple[float, float]:
    """``(relative L2 error, cosine similarity)`` of ``x`` against ``ref`` (same shape, any dtype),
    flattened, in float64.  A zero ``ref`` gives relative error 0 for a zero ``x`` and inf
    otherwise; cosine is 1 for two zero tensors."""
    if x.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(x.shape)} vs {tuple(ref.shape)}")
    a, b = x.detach().double().flatten(), ref.detach().double().flatten()
    diff, nb, na = float((a - b).norm()), float(b.norm()), float(a.norm())
    rel = diff / nb if nb > 0 else (0.0 if diff == 0 else math.inf)
    if na == 0 and nb == 0:
        cos = 1.0
    elif na == 0 or nb == 0:
        cos = 0.0
    else:
        cos = float(torch.dot(a, b)) / (na * nb)
    return rel, cos
