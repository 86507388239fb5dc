"""The PyTorch reference of the INT8 attention kernel (:mod:`.int8_attention`): the same
quantization on any device, without Triton — the CPU path of ``sage_attn`` (``impl=reference``)."""
from __future__ import annotations

from typing import Optional

import torch

from ditattn.attention.backends.base import expand_kv
from ditattn.attention.kernels import check_qkv
from ditattn.errors import AttentionConfigError

PV_MODES = ("fp16", "fp8")
Q_GRANULARITIES = ("token", "block")
FP8_MAX = 448.0


def _quant_sym(x: torch.Tensor, dim) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=dim, keepdim=True)
    sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = x / sc
    xq = torch.trunc(xq + torch.where(xq >= 0, 0.5, -0.5))
    return xq, sc


def int8_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                             causal: bool = False, return_lse: bool = False, pv: str = "fp16",
                             q_granularity: str = "token", block_m: int = 128, block_n: int = 128,
                             k_granularity: str = "block"):
    """The same quantization as :func:`int8_attention`, in PyTorch (any device; the CPU path).

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` in float32, float16 or bfloat16 (any head dim).
    ``k_granularity`` "block" (one K scale per ``block_n`` keys) or "token" (one per key).
    Quantized products are exact (INT8 values held in float32), softmax in float32 with the row's
    global maximum; P.V with P and V rounded to V's dtype (float16 for float32 input) or to FP8
    e4m3 (P scaled by 2^8, V per channel).  Returns ``(out in q.dtype, lse [B, H, S_q] float32 or
    None)``; the LSE is that of the unquantized-scale scores ``scale * q . k`` (smoothing undone).
    """
    what = "int8 attention reference"
    B, Sq, Skv, H, Hkv, D = check_qkv(q, k, v, what=what, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if pv not in PV_MODES:
        raise AttentionConfigError(f"{what}: pv {pv!r} not supported (accepts {list(PV_MODES)})")
    if q_granularity not in Q_GRANULARITIES:
        raise AttentionConfigError(f"{what}: q_granularity {q_granularity!r} not supported (accepts {list(Q_GRANULARITIES)})")
    scale = D ** -0.5 if scale is None else float(scale)
    k, v = expand_kv(k, v, H)
    f32 = torch.float32
    qf = q.to(f32).transpose(1, 2)  # [B, H, Sq, D]
    kf = k.to(f32).transpose(1, 2)
    kmean = kf.mean(dim=2, keepdim=True)
    ks_ = kf - kmean
    if k_granularity not in Q_GRANULARITIES:
        raise AttentionConfigError(f"{what}: k_granularity {k_granularity!r} not supported (accepts {list(Q_GRANULARITIES)})")
    if k_granularity == "token":
        k8, ksc = _quant_sym(ks_, dim=3)
        ksc = ksc.squeeze(-1)
    else:
        nbk = -(-Skv // block_n)
        pad_k = nbk * block_n - Skv
        kp = torch.nn.functional.pad(ks_, (0, 0, 0, pad_k)).reshape(B, H, nbk, block_n, D)
        k8, ksc = _quant_sym(kp, dim=(3, 4))
        k8 = k8.reshape(B, H, nbk * block_n, D)[:, :, :Skv]
        ksc = ksc.reshape(B, H, nbk, 1).expand(B, H, nbk, block_n).reshape(B, H, nbk * block_n)[:, :, :Skv]
    if q_granularity == "token":
        q8, qsc = _quant_sym(qf, dim=3)
        qsc = qsc.squeeze(-1)
    else:
        nbq = -(-Sq // block_m)
        qp = torch.nn.functional.pad(qf, (0, 0, 0, nbq * block_m - Sq)).reshape(B, H, nbq, block_m, D)
        q8, qsc = _quant_sym(qp, dim=(3, 4))
        q8 = q8.reshape(B, H, nbq * block_m, D)[:, :, :Sq]
        qsc = qsc.reshape(B, H, nbq, 1).expand(B, H, nbq, block_m).reshape(B, H, nbq * block_m)[:, :, :Sq]
    pv_dtype = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.float16
    vf = v.transpose(1, 2)
    if pv == "fp8":
        vsc = (vf.to(f32).abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp_min(1e-30)
        vq = (vf.to(f32) / vsc).to(torch.float8_e4m3fn).to(f32)
    else:
        vq = vf.to(pv_dtype).to(f32)
    out = torch.empty(B, H, Sq, D, dtype=f32, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=f32, device=q.device)
    chunk = max(1, (1 << 24) // max(1, B * H * Skv))
    for i0 in range(0, Sq, chunk):
        i1 = min(Sq, i0 + chunk)
        s = (q8[:, :, i0:i1] @ k8.transpose(-1, -2)) * (qsc[:, :, i0:i1, None] * ksc[:, :, None, :] * scale)
        if causal:
            keep = torch.arange(i0, i1, device=q.device)[:, None] >= torch.arange(Skv, device=q.device)[None, :]
            s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        l_ = p.sum(dim=-1, keepdim=True)
        if pv == "fp8":
            pq = (p * 256.0).to(torch.float8_e4m3fn).to(f32) / 256.0
            o = (pq @ vq) * vsc
        else:
            o = p.to(pv_dtype).to(f32) @ vq
        ldiv = torch.where(l_ > 0, l_, torch.ones_like(l_))
        out[:, :, i0:i1] = o / ldiv
        lse[:, :, i0:i1] = torch.where(l_ > 0, m + torch.log(ldiv), torch.full_like(l_, float("-inf"))).squeeze(-1)
    lse = lse + scale * (qf @ kmean.transpose(-1, -2)).squeeze(-1)
    return out.transpose(1, 2).to(q.dtype), (lse if return_lse else None)


__all__ = ["int8_attention_reference", "PV_MODES", "Q_GRANULARITIES", "FP8_MAX"]
