"""Plain PyTorch attention math shared below the backends: GQA K/V expansion and the float32 /
float64 reference every kernel is checked against (q ``[B, Sq, H, D]``, k/v ``[B, Skv, Hkv, D]``)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def expand_kv(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Repeat K/V heads for grouped-query attention: ``[B, S, Hkv, D] -> [B, S, heads, D]``."""
    hkv = k.shape[2]
    if hkv == heads:
        return k, v
    rep = heads // hkv
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def reference_attention(
    q, k, v, *, causal=False, scale=None, attn_bias=None, mask=None, dtype=torch.float32
) -> tuple[Tensor, Tensor]:
    """Plain math attention in ``dtype`` (float32 or float64): the reference for every kernel.

    ``mask``: optional boolean ``[B or 1, H or 1, Sq, Skv]``, True = attend (a boolean ``attn_bias`` is
    such a mask, as SDPA reads it; a float one is added to the scores). Rows with no allowed key give
    zeros and LSE ``-inf``. Returns ``(out [B, Sq, H, D] in dtype, lse [B, H, Sq] in dtype)``.
    """
    heads = q.shape[2]
    k, v = expand_kv(k, v, heads)
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (qf @ kf.transpose(-1, -2)) * scale
    if attn_bias is not None and attn_bias.dtype == torch.bool:  # a boolean mask (True = attend), as SDPA reads it
        mask = attn_bias if mask is None else (mask.to(torch.bool) & attn_bias)
    elif attn_bias is not None:
        s = s + attn_bias.to(dtype)
    if causal:
        sq, skv = s.shape[-2:]
        keep = torch.ones(sq, skv, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask.to(torch.bool), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # fully masked rows: exp(-inf) = 0
    out = torch.exp(s - shift.unsqueeze(-1)) @ vf
    return out.transpose(1, 2), lse
