"""The PyTorch reference of the INT8 attention kernel (:mod:`.int8_attention`): the same
quantization on any device, without Triton — the CPU path of ``sage_attn`` (``impl=reference``)."""

from __future__ import annotations

from typing import Optional

import torch

from ditattn.attention.kernels import check_qkv
from ditattn.attention.reference import expand_kv
from ditattn.errors import AttentionConfigError

PV_MODES = ("fp16", "fp8")
Q_GRANULARITIES = ("token", "block")
#: K scale granularities: per key, per block of ``block_n`` keys, or per *thread* (SageAttention2): within each block
#: the keys a thread holds in the ``wgmma`` accumulator layout (columns 8 j + 2 t + {0, 1}, t = lane % 4) share one
#: scale, so group ``(key % 8) // 2`` — :data:`K_THREAD_GROUPS` groups of ``block_n / 4`` keys per block
K_GRANULARITIES = ("token", "block", "thread")
K_THREAD_GROUPS = 4
P_ROWSUMS = ("fp32", "fp8")
FP8_MAX = 448.0
P_SHIFT_FP8 = 8.0  # FP8 P.V: P = exp2(t - m + 8), in (0, 256]
LOG2E = 1.4426950408889634
#: bound on |log2| of the per-channel balance factors (after normalising their geometric mean to 1)
QK_BALANCE_LOG2_LIMIT = 64.0


def check_qk_balance(alpha, what: str) -> float:
    """``qk_balance`` validated: None / 0 (off) -> 0.0, else a float in (0, 1]; raises
    :class:`AttentionConfigError` for anything else."""
    if alpha is None:
        return 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (0.0 <= float(alpha) <= 1.0):
        raise AttentionConfigError(
            f"{what}: qk_balance {alpha!r} not supported (accepts None or a number in [0, 1]; 0 / None = off)"
        )
    return float(alpha)


def qk_balance_factors(amax_q: torch.Tensor, amax_k: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel balance factors of ``qk_balance`` (SmoothQuant-style migration between Q and K).

    ``amax_q`` / ``amax_k`` ``[..., D]`` float32: the channel maxima of ``|Q|`` (over the tokens of all
    the query heads that share one K/V head) and of ``|K - mean_s(K)|`` (over the keys of that head).
    Returns ``(cq, ck)`` ``[..., D]`` float32 with ``Q' = Q * cq``, ``K' = (K - mean) * ck``:
    ``c_d = amax_k_d ** alpha / amax_q_d ** (1 - alpha)``, normalised so that the geometric mean of c
    over the channels where both maxima are > 0 is 1 and ``|log2 c_d| <=`` :data:`QK_BALANCE_LOG2_LIMIT`,
    then ``cq = c``, ``ck = 1 / c``; a channel where either maximum is 0 contributes nothing to any
    product and gets ``cq = ck = 0``.  After it the channel maxima are ``amax_q' = (aq ak)^alpha / g``,
    ``amax_k' = (aq ak)^(1 - alpha) * g`` (g the normaliser): alpha 1 makes K flat across channels (all
    the spread in Q, which has a scale per token), 0.5 gives both the same spread.  ``Q' . K'`` equals
    ``Q . (K - mean)`` up to the float32 rounding of ``c`` and ``1 / c`` (relative 1e-7)."""
    live = (amax_q > 0) & (amax_k > 0)
    one = torch.ones_like(amax_q)
    lc = alpha * torch.log2(torch.where(live, amax_k, one)) - (1.0 - alpha) * torch.log2(
        torch.where(live, amax_q, one)
    )
    n = live.sum(dim=-1, keepdim=True).clamp_min(1)
    lc = lc - torch.where(live, lc, torch.zeros_like(lc)).sum(dim=-1, keepdim=True) / n
    lc = lc.clamp(-QK_BALANCE_LOG2_LIMIT, QK_BALANCE_LOG2_LIMIT)
    c = torch.exp2(lc)
    zero = torch.zeros_like(c)
    return torch.where(live, c, zero), torch.where(live, 1.0 / c, zero)


def _quant_sym(x: torch.Tensor, dim) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=dim, keepdim=True)
    sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = x / sc
    xq = torch.trunc(xq + torch.where(xq >= 0, 0.5, -0.5))
    return xq, sc


def int8_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
    pv: str = "fp16",
    q_granularity: str = "token",
    block_m: int = 128,
    block_n: int = 128,
    k_granularity: str = "block",
    v_smooth: bool = False,
    p_rowsum: str = "fp32",
    qk_balance: Optional[float] = None,
):
    """The same quantization as :func:`int8_attention`, in PyTorch (any device; the CPU path).

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` in float32, float16 or bfloat16 (any head dim).
    ``k_granularity`` "block" (one K scale per ``block_n`` keys), "token" (one per key) or "thread"
    (:func:`k_thread_groups`: within each block of ``block_n`` keys, one scale per group ``(key % 8) // 2``).
    Quantized products are exact (INT8 values held in float32), softmax in float32.  ``pv`` "fp16":
    P (from the row's global maximum) and V rounded to V's dtype (float16 for float32 input).
    ``pv`` "fp8", as the GPU kernels compute it: the keys in blocks of ``block_n`` with a running
    maximum m (base 2), P = exp2(t - m + 8) rounded to e4m3 per block, each block's P.V exact in
    float32 and added with the running-max rescale (two-level accumulation); V per channel in e4m3
    (scale amax / 448), with ``v_smooth`` after subtracting its channel mean over the keys (added
    back to the output); the row sums of P before rounding (``p_rowsum`` "fp32", the Triton kernel)
    or after (``"fp8"``, the SM90 kernel, which sums P on the tensor cores).  Returns ``(out in
    q.dtype, lse [B, H, S_q] float32 or None)``; the LSE is that of the unquantized-scale scores
    ``scale * q . k`` (smoothing undone).

    ``qk_balance`` (alpha in (0, 1]; None or 0: off): before quantizing, multiply Q's channels by c and
    divide smoothed K's by c (:func:`qk_balance_factors`; the exact product ``Q . K~`` is unchanged, only
    the INT8 rounding moves), c per (batch, K/V head) from the channel maxima of ``|K - mean_s(K)|``
    over its keys and of ``|Q|`` over the tokens of every query head of its group (with GQA the query
    heads that share a K/V head share its c).
    """
    what = "int8 attention reference"
    B, Sq, Skv, H, Hkv, D = check_qkv(q, k, v, what=what, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if pv not in PV_MODES:
        raise AttentionConfigError(f"{what}: pv {pv!r} not supported (accepts {list(PV_MODES)})")
    if q_granularity not in Q_GRANULARITIES:
        raise AttentionConfigError(
            f"{what}: q_granularity {q_granularity!r} not supported (accepts {list(Q_GRANULARITIES)})"
        )
    if p_rowsum not in P_ROWSUMS:
        raise AttentionConfigError(f"{what}: p_rowsum {p_rowsum!r} not supported (accepts {list(P_ROWSUMS)})")
    scale = D**-0.5 if scale is None else float(scale)
    if k_granularity not in K_GRANULARITIES:
        raise AttentionConfigError(
            f"{what}: k_granularity {k_granularity!r} not supported (accepts {list(K_GRANULARITIES)})"
        )
    alpha = check_qk_balance(qk_balance, what)
    k, v = expand_kv(k, v, H)
    f32 = torch.float32
    qf = q.to(f32).transpose(1, 2)  # [B, H, Sq, D]
    kf = k.to(f32).transpose(1, 2)
    kmean = kf.mean(dim=2, keepdim=True)
    ks_ = kf - kmean
    qb = qf
    if alpha > 0:
        G = H // Hkv  # the heads of a group are adjacent (expand_kv: head h reads K/V head h // G)
        aq = qf.abs().amax(dim=2).reshape(B, Hkv, G, D).amax(dim=2)
        ak = ks_.abs().amax(dim=2).reshape(B, Hkv, G, D).amax(dim=2)  # the G copies are equal
        cq, ck = (c.repeat_interleave(G, dim=1)[:, :, None, :] for c in qk_balance_factors(aq, ak, alpha))
        qb, ks_ = qf * cq, ks_ * ck
    if k_granularity == "token":
        k8, ksc = _quant_sym(ks_, dim=3)
        ksc = ksc.squeeze(-1)
    elif k_granularity == "thread":
        k8, ksc = _quant_k_thread(ks_, block_n, what)
    else:
        nbk = -(-Skv // block_n)
        pad_k = nbk * block_n - Skv
        kp = torch.nn.functional.pad(ks_, (0, 0, 0, pad_k)).reshape(B, H, nbk, block_n, D)
        k8, ksc = _quant_sym(kp, dim=(3, 4))
        k8 = k8.reshape(B, H, nbk * block_n, D)[:, :, :Skv]
        ksc = ksc.reshape(B, H, nbk, 1).expand(B, H, nbk, block_n).reshape(B, H, nbk * block_n)[:, :, :Skv]
    if q_granularity == "token":
        q8, qsc = _quant_sym(qb, dim=3)
        qsc = qsc.squeeze(-1)
    else:
        nbq = -(-Sq // block_m)
        qp = torch.nn.functional.pad(qb, (0, 0, 0, nbq * block_m - Sq)).reshape(B, H, nbq, block_m, D)
        q8, qsc = _quant_sym(qp, dim=(3, 4))
        q8 = q8.reshape(B, H, nbq * block_m, D)[:, :, :Sq]
        qsc = qsc.reshape(B, H, nbq, 1).expand(B, H, nbq, block_m).reshape(B, H, nbq * block_m)[:, :, :Sq]
    pv_dtype = v.dtype if v.dtype in (torch.float16, torch.bfloat16) else torch.float16
    vf = v.transpose(1, 2)
    if pv == "fp8":
        vf32 = vf.to(f32)
        vmean = vf32.mean(dim=2, keepdim=True) if v_smooth else torch.zeros_like(vf32[:, :, :1])
        vsc = ((vf32 - vmean).abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp_min(1e-30)
        vq = ((vf32 - vmean) / vsc).to(torch.float8_e4m3fn).to(f32)
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
        if pv == "fp8":
            o, l_, m2 = _fp8_pv_blocks(s * LOG2E, vq, block_n, p_rowsum)
            ldiv = torch.where(l_ > 0, l_, torch.ones_like(l_))
            out[:, :, i0:i1] = o / ldiv * vsc + vmean
            lse2 = m2 + torch.log2(ldiv) - P_SHIFT_FP8
            lse[:, :, i0:i1] = torch.where(l_ > 0, lse2 / LOG2E, torch.full_like(l_, float("-inf"))).squeeze(-1)
            continue
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        l_ = p.sum(dim=-1, keepdim=True)
        o = p.to(pv_dtype).to(f32) @ vq
        ldiv = torch.where(l_ > 0, l_, torch.ones_like(l_))
        out[:, :, i0:i1] = o / ldiv
        lse[:, :, i0:i1] = torch.where(l_ > 0, m + torch.log(ldiv), torch.full_like(l_, float("-inf"))).squeeze(-1)
    lse = lse + scale * (qf @ kmean.transpose(-1, -2)).squeeze(-1)
    return out.transpose(1, 2).to(q.dtype), (lse if return_lse else None)


def k_thread_groups(n: int, block_n: int = 128) -> torch.Tensor:
    """Scale index of each of ``n`` keys under ``k_granularity`` "thread": key i uses scale
    ``(i // block_n) * 4 + (i % 8) // 2`` — in the m64nNk* ``wgmma`` accumulator a thread (lane l) holds
    the key columns ``8 j + 2 (l % 4) + {0, 1}`` of a tile, so the keys of one group are the ones one
    thread multiplies (``int64 [n]``)."""
    i = torch.arange(n)
    return (i // block_n) * K_THREAD_GROUPS + (i % 8) // 2


def _quant_k_thread(x: torch.Tensor, block_n: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 of ``x [B, H, S, D]`` with one scale per :func:`k_thread_groups` group (the
    keys past S count as zeros): ``(x8 [B, H, S, D], per-key scale [B, H, S])``."""
    if block_n % 8:
        raise AttentionConfigError(f"{what}: k_granularity 'thread' needs block_n a multiple of 8, not {block_n}")
    B, H, S, D = x.shape
    nb = -(-S // block_n)
    xp = torch.nn.functional.pad(x, (0, 0, 0, nb * block_n - S))
    # [B, H, block, j, group, pair, D]: key = block * block_n + 8 j + 2 group + pair
    xg = xp.reshape(B, H, nb, block_n // 8, K_THREAD_GROUPS, 2, D)
    amax = xg.abs().amax(dim=(3, 5, 6), keepdim=True)
    sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xq = xg / sc
    xq = torch.trunc(xq + torch.where(xq >= 0, 0.5, -0.5))
    sc = sc.expand(B, H, nb, block_n // 8, K_THREAD_GROUPS, 2, 1)
    return xq.reshape(B, H, nb * block_n, D)[:, :, :S], sc.reshape(B, H, nb * block_n)[:, :, :S]


def _fp8_pv_blocks(t: torch.Tensor, vq: torch.Tensor, block_n: int, p_rowsum: str):
    """FP8 P.V of base-2 logits ``t [B, H, n, S_kv]`` (-inf = masked) with ``vq [B, H, S_kv, D]`` (e4m3
    values in float32), key block by key block as the kernels do: running maximum m_j after block j,
    P_j = e4m3(exp2(t - m_j + 8)), ``o = sum_j exp2(m_j - m_last) P_j V_j`` (the online rescale, exact
    in float32).  Returns ``(o [B, H, n, D], l [B, H, n, 1], m_last [B, H, n, 1])``."""
    B, H, n, S = t.shape
    nb = -(-S // block_n)
    tb = torch.nn.functional.pad(t, (0, nb * block_n - S), value=float("-inf")).reshape(B, H, n, nb, block_n)
    m = torch.cummax(tb.amax(dim=-1), dim=-1).values  # [B, H, n, nb]
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp2(tb - (m - P_SHIFT_FP8)[..., None])
    pq = p.to(torch.float8_e4m3fn).to(torch.float32)
    w = torch.exp2(m - m[..., -1:])[..., None]
    o = (pq * w).reshape(B, H, n, nb * block_n)[..., :S] @ vq
    l_ = ((pq if p_rowsum == "fp8" else p) * w).sum(dim=(-1, -2))[..., None]
    return o, l_, m[..., -1:]


__all__ = [
    "int8_attention_reference",
    "k_thread_groups",
    "qk_balance_factors",
    "check_qk_balance",
    "PV_MODES",
    "Q_GRANULARITIES",
    "K_GRANULARITIES",
    "K_THREAD_GROUPS",
    "P_ROWSUMS",
    "FP8_MAX",
]
