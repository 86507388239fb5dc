"""Quantized dense attention (SageAttention-style), Triton kernel and PyTorch reference.

Math (per batch b, query head h, key/value head g = h // (H / H_kv)):

1. Smooth K: ``K~ = K - mean_s(K)`` (per channel, over all keys).  Every score of a query row
   shifts by the same ``q . mean(K)``, so the softmax (and the output) is unchanged; the LSE is
   corrected back by ``scale * q . mean(K)``.
2. Quantize Q to INT8 per token (or per block of ``block_m`` rows) and K~ to INT8 per block of
   ``block_n`` rows, symmetric, ``scale = amax / 127``, round half away from zero.
3. ``S = (Q8 K8^T) * sQ * sK * scale`` -- the product on the INT8 tensor cores (INT32 accumulate,
   exact), the dequantization one multiply per score (folded with ``log2 e`` for ``exp2``).
4. Online softmax in FP32, ``P . V`` on the tensor cores either in FP16/BF16 (``pv="fp16"``: P in
   V's dtype, FP32 accumulate) or in FP8 e4m3 (``pv="fp8"``: P scaled by 2^8 so that it uses the
   normal FP8 range, V per-channel scaled to +-448 and stored transposed, accumulation promoted to
   FP32 every tile).

Accuracy on random normal inputs (relative L2 error against float32): about 1.2-1.4 % with
``pv="fp16"``; about 4 % with ``pv="fp8"`` (3 mantissa bits on P and V), so ``fp8`` is opt-in.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import LOG2E, check_device, check_qkv, last_dim_contiguous, launch_config
from ditattn.attention.kernels.int8_reference import (FP8_MAX, PV_MODES, Q_GRANULARITIES, check_qk_balance,
                                                       int8_attention_reference)
from ditattn.errors import AttentionConfigError

SUPPORTED_HEAD_DIMS = (32, 64, 128)
P_SHIFT_FP8 = 8.0  # P is computed as exp2(s - m + 8) = 256 * softmax numerator on the FP8 path


# ------------------------------------------------------------------------------------------------
# quantization pre-passes


@triton.jit
def _quant_int8_rows(
    X, KMean, Out, Scale, Qkm, Norm, Bal,
    stride_xb, stride_xs, stride_xh,
    stride_mb, stride_mh,
    S, S_pad, H, GROUP, mult, qkm_mult,
    HEAD_DIM: tl.constexpr, BLK: tl.constexpr,
    SUB_MEAN: tl.constexpr, PER_TOKEN: tl.constexpr, WRITE_QKM: tl.constexpr, NORM: tl.constexpr,
    BALANCE: tl.constexpr,
):
    # NORM 1: per row |x8|_2 * scale (Q's logit bound factor); NORM 2: per program max of that (K's).
    # BALANCE: multiply the channels by Bal [B, H / GROUP, D] (qk_balance's cq for Q, ck for K; after the
    # smoothing, and after Q's LSE term, which is that of the unbalanced Q)
    pid_blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = pid_blk * BLK + tl.arange(0, BLK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s < S
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs + offs_d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    row = (b * H + h) * S_pad + offs_s
    if SUB_MEAN or WRITE_QKM:
        mean = tl.load(KMean + b * stride_mb + (h // GROUP) * stride_mh + offs_d)
        if SUB_MEAN:
            x = tl.where(ok[:, None], x - mean[None, :], 0.0)
        if WRITE_QKM:
            tl.store(Qkm + row, tl.sum(x * mean[None, :], 1) * qkm_mult)
    if BALANCE:
        x = x * tl.load(Bal + ((b * H + h) // GROUP) * HEAD_DIM + offs_d)[None, :]
    if PER_TOKEN:
        amax = tl.max(tl.abs(x), 1)
        sc = tl.where(amax > 0.0, amax / 127.0, 1.0)
        xq = x / sc[:, None]
        tl.store(Scale + row, sc * mult)
    else:
        amax = tl.max(tl.max(tl.abs(x), 1), 0)
        sc = tl.where(amax > 0.0, amax / 127.0, 1.0)
        xq = x / sc
        tl.store(Scale + (b * H + h) * (S_pad // BLK) + pid_blk, sc * mult)
    xq = xq + tl.where(xq >= 0.0, 0.5, -0.5)
    x8 = xq.to(tl.int8)
    tl.store(Out + row[:, None] * HEAD_DIM + offs_d[None, :], x8)
    if NORM > 0:
        xf = x8.to(tl.float32)
        nrm = tl.sqrt(tl.sum(xf * xf, 1)) * (sc * mult)
        if NORM == 1:
            tl.store(Norm + row, nrm)
        else:
            tl.store(Norm + (b * H + h) * (S_pad // BLK) + pid_blk, tl.max(nrm, 0))


@triton.jit
def _qk_channel_stats(
    X, Sum, Max, Min,
    stride_xb, stride_xs, stride_xh,
    S, H, NCH, ROWS,
    HEAD_DIM: tl.constexpr, BLK: tl.constexpr, ABS: tl.constexpr,
):
    # per (chunk of ROWS tokens, head, batch): the channel maxima of |X| (ABS: Q) or the channel sums,
    # maxima and minima (K: its mean and, with it, the maxima of |K - mean|), [B, H, NCH, D]
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_d = tl.arange(0, HEAD_DIM)
    base = X + b * stride_xb + h * stride_xh
    mx = tl.full([HEAD_DIM], float("-inf"), tl.float32)
    mn = tl.full([HEAD_DIM], float("inf"), tl.float32)
    sm = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(pid * ROWS, tl.minimum(S, (pid + 1) * ROWS), BLK):
        offs_s = s0 + tl.arange(0, BLK)
        ok = (offs_s < S)[:, None]
        x = tl.load(base + offs_s[:, None] * stride_xs + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        if ABS:
            mx = tl.maximum(mx, tl.max(tl.abs(x), 0))  # masked rows load 0: no effect on a maximum of |x|
        else:
            sm += tl.sum(x, 0)
            mx = tl.maximum(mx, tl.max(tl.where(ok, x, float("-inf")), 0))
            mn = tl.minimum(mn, tl.min(tl.where(ok, x, float("inf")), 0))
    out = ((b * H + h) * NCH + pid) * HEAD_DIM + offs_d
    tl.store(Max + out, mx)
    if not ABS:
        tl.store(Sum + out, sm)
        tl.store(Min + out, mn)


@triton.jit
def _qk_balance_factors(
    QMax, KSum, KMax, KMin, KMean, Cq, Ck,
    Skv, HKV, GROUP, NCQ, NCK, alpha, one_minus_alpha, log2_limit,
    HEAD_DIM: tl.constexpr,
):
    # per (K/V head, batch): K's channel mean (stored: the smoothing and Q's LSE term use it), the channel
    # maxima of |K - mean| and of |Q| over the GROUP query heads, then int8_reference.qk_balance_factors
    # step by step (live channels, log2 c, geometric-mean normalisation, the cap, c and 1 / c)
    hk = tl.program_id(0)
    b = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    bhk = b * HKV + hk
    ks = tl.zeros([HEAD_DIM], tl.float32)
    kx = tl.full([HEAD_DIM], float("-inf"), tl.float32)
    kn = tl.full([HEAD_DIM], float("inf"), tl.float32)
    for c in range(0, NCK):
        p = (bhk * NCK + c) * HEAD_DIM + offs_d
        ks += tl.load(KSum + p)
        kx = tl.maximum(kx, tl.load(KMax + p))
        kn = tl.minimum(kn, tl.load(KMin + p))
    mean = ks / Skv
    tl.store(KMean + bhk * HEAD_DIM + offs_d, mean)
    # max_s |k_s - mean| = max(max_s k_s - mean, mean - min_s k_s): float32 rounding is monotonic
    ak = tl.maximum(kx - mean, mean - kn)
    aq = tl.zeros([HEAD_DIM], tl.float32)
    for c in range(0, GROUP * NCQ):  # the group's query heads are adjacent: rows bhk * GROUP * NCQ + ...
        aq = tl.maximum(aq, tl.load(QMax + (bhk * GROUP * NCQ + c) * HEAD_DIM + offs_d))
    live = (aq > 0.0) & (ak > 0.0)
    lc = alpha * tl.math.log2(tl.where(live, ak, 1.0)) - one_minus_alpha * tl.math.log2(tl.where(live, aq, 1.0))
    n = tl.maximum(tl.sum(live.to(tl.int32), 0), 1)
    lc = lc - tl.sum(tl.where(live, lc, 0.0), 0) / n.to(tl.float32)
    lc = tl.minimum(tl.maximum(lc, -log2_limit), log2_limit)
    cf = tl.math.exp2(lc)
    tl.store(Cq + bhk * HEAD_DIM + offs_d, tl.where(live, cf, 0.0))
    tl.store(Ck + bhk * HEAD_DIM + offs_d, tl.where(live, 1.0 / cf, 0.0))


def qk_balance_prologue(q: torch.Tensor, k: torch.Tensor, alpha: float, *, rows: int = 512):
    """``qk_balance``'s statistics on the GPU (three Triton launches: one read of Q, one of K, which gives
    K's mean too).

    q ``[B, S_q, H, D]``, k ``[B, S_kv, H_kv, D]`` fp16/bf16 (last dim contiguous), ``alpha`` in (0, 1].
    Returns ``(kmean, cq, ck)``, each ``[B, H_kv, D]`` float32: K's channel mean over its keys (from the
    same pass as K's channel maxima and minima, which replaces the separate mean of the unbalanced
    prologue) and :func:`~ditattn.attention.kernels.int8_reference.qk_balance_factors` of the channel
    maxima of ``|Q|`` (over the tokens of the query heads of each K/V head's group) and of ``|K - kmean|``,
    computed with the reference's steps in float32 (on the GPU ``log2`` / ``exp2`` are the approximate
    instructions: c within about 2e-7 relative of the reference's).  ``rows``: tokens per program of the
    statistics passes."""
    from ditattn.attention.kernels.int8_reference import QK_BALANCE_LOG2_LIMIT

    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    dev = q.device
    blk = 64
    ncq, nck = triton.cdiv(Sq, rows), triton.cdiv(Skv, rows)
    qmax = torch.empty((B, H, ncq, D), dtype=torch.float32, device=dev)
    _qk_channel_stats[(ncq, H, B)](q, qmax, qmax, qmax, q.stride(0), q.stride(1), q.stride(2), Sq, H, ncq, rows,
                                   HEAD_DIM=D, BLK=blk, ABS=True, num_warps=4)
    ksum, kmax, kmin = (torch.empty((B, Hkv, nck, D), dtype=torch.float32, device=dev) for _ in range(3))
    _qk_channel_stats[(nck, Hkv, B)](k, ksum, kmax, kmin, k.stride(0), k.stride(1), k.stride(2), Skv, Hkv, nck,
                                     rows, HEAD_DIM=D, BLK=blk, ABS=False, num_warps=4)
    kmean, cq, ck = (torch.empty((B, Hkv, D), dtype=torch.float32, device=dev) for _ in range(3))
    _qk_balance_factors[(Hkv, B)](qmax, ksum, kmax, kmin, kmean, cq, ck, Skv, Hkv, H // Hkv, ncq, nck,
                                  float(alpha), 1.0 - float(alpha), QK_BALANCE_LOG2_LIMIT, HEAD_DIM=D, num_warps=4)
    return kmean, cq, ck


@triton.jit
def _v_channel_stats(
    V, Sum, Max, Min,
    stride_vb, stride_vs, stride_vh,
    S, HKV, NCH,
    HEAD_DIM: tl.constexpr, BLK: tl.constexpr,
):
    # per (chunk of BLK tokens, head, batch): the channel sums, maxima and minima of V
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = pid * BLK + tl.arange(0, BLK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (offs_s < S)[:, None]
    x = tl.load(V + b * stride_vb + h * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :],
                mask=ok, other=0.0).to(tl.float32)
    out = ((b * HKV + h) * NCH + pid) * HEAD_DIM + offs_d
    tl.store(Sum + out, tl.sum(x, 0))
    tl.store(Max + out, tl.max(tl.where(ok, x, float("-inf")), 0))
    tl.store(Min + out, tl.min(tl.where(ok, x, float("inf")), 0))


@triton.jit
def _quant_v_fp8_t(
    V, VScale, VMean, Out,
    stride_vb, stride_vs, stride_vh,
    S, S_pad, HKV,
    HEAD_DIM: tl.constexpr, BLK: tl.constexpr, SUB_MEAN: tl.constexpr, PERMUTE: tl.constexpr,
):
    pid_blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = pid_blk * BLK + tl.arange(0, BLK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s < S
    x = tl.load(V + b * stride_vb + h * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    if SUB_MEAN:
        x = tl.where(ok[:, None], x - tl.load(VMean + (b * HKV + h) * HEAD_DIM + offs_d)[None, :], 0.0)
    sc = tl.load(VScale + (b * HKV + h) * HEAD_DIM + offs_d)
    xq = x / sc[None, :]
    pos = offs_s
    if PERMUTE:  # token c of each 16 at k = (c0, c3, c1, c2) in bits: the FP8 P operand's order
        pos = (offs_s & ~15) | (offs_s & 1) | ((offs_s >> 2) & 2) | ((offs_s << 1) & 12)
    base = Out + (b * HKV + h) * HEAD_DIM * S_pad
    tl.store(base + offs_d[None, :] * S_pad + pos[:, None], xq.to(tl.float8e4nv, fp_downcast_rounding="rtne"),
             mask=(offs_s < S_pad)[:, None])


def quantize_v_fp8(v: torch.Tensor, *, s_pad: int, smooth: bool = False, permute: bool = False):
    """V in FP8 e4m3 with one scale per channel, transposed (the FP8 P.V prologue: two Triton passes).

    v ``[B, S, H_kv, D]`` fp16/bf16 (last dim contiguous); ``s_pad`` >= S, a multiple of 16.  Returns
    ``(vt, vs, vm)``: ``vt [B, H_kv, D, s_pad]`` float8_e4m3fn = ``(V - vm) / vs`` rounded to nearest
    even (padded tokens 0); ``vs [B, H_kv, D]`` float32 = ``amax_s |V - vm| / 448``; ``vm [B, H_kv,
    D]`` the channel means over the S tokens with ``smooth`` (the rows of P sum to 1, so the kernel
    adds ``vm`` back to its output), else zeros.  ``permute``: within every 16 tokens, token c is
    stored at position (c0, c3, c1, c2) in bits — the order in which the SM90 kernel's FP8 P operand
    holds its columns (``sage_sm90._p_operand``)."""
    check_device(v, what="FP8 V prologue")
    B, S, Hkv, D = v.shape
    blk = 64
    nch = triton.cdiv(S, blk)
    sums, maxs, mins = (torch.empty((B, Hkv, nch, D), dtype=torch.float32, device=v.device) for _ in range(3))
    _v_channel_stats[(nch, Hkv, B)](v, sums, maxs, mins, v.stride(0), v.stride(1), v.stride(2), S, Hkv, nch,
                                    HEAD_DIM=D, BLK=blk, num_warps=4)
    vmax, vmin = maxs.amax(dim=2), mins.amin(dim=2)
    if smooth:
        vm = sums.sum(dim=2) / S
        amax = torch.maximum(vmax - vm, vm - vmin)
    else:
        vm = torch.zeros_like(vmax)
        amax = torch.maximum(vmax, -vmin)
    vs = (amax / FP8_MAX).clamp_min(1e-30).contiguous()
    vt = torch.empty((B, Hkv, D, s_pad), dtype=torch.float8_e4m3fn, device=v.device)
    _quant_v_fp8_t[(triton.cdiv(s_pad, blk), Hkv, B)](
        v, vs, vm, vt, v.stride(0), v.stride(1), v.stride(2), S, s_pad, Hkv,
        HEAD_DIM=D, BLK=blk, SUB_MEAN=bool(smooth), PERMUTE=bool(permute), num_warps=4,
    )
    return vt, vs, vm.contiguous()


# ------------------------------------------------------------------------------------------------
# attention kernel


@triton.jit
def _int8_attn_inner(
    acc, l_i, m_i, q, rs, k_base, ks_base, v_base, stride_vs, start, end, offs_m, Skv, Skv_pad,
    KD, VD, k_row, v_row, v_col,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    PV_FP8: tl.constexpr, FP8_ACC: tl.constexpr, INT_TRICK: tl.constexpr, PSHIFT: tl.constexpr,
    WS: tl.constexpr, USE_TMA: tl.constexpr,
):
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WS):
        offs_n = start_n + offs_nb
        if USE_TMA:
            k = tl.trans(KD.load([k_row + start_n, 0]))
        else:
            k = tl.load(k_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None])
        ks = tl.load(ks_base + start_n // BLOCK_N)
        s_i = tl.dot(q, k)
        if INT_TRICK:
            # exact int32 -> fp32 for |x| < 2^22 (|Q8.K8| <= 128*127*127): integer add + float subtract
            sf = (s_i + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
        else:
            sf = s_i.to(tl.float32)
        r = rs * ks
        if MASK:
            s = sf * r[:, None]
            ok = offs_n[None, :] < Skv
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - (m_use - PSHIFT)[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s_i, 1).to(tl.float32) * r)
            m_use = m_new
            p = tl.math.exp2(sf * r[:, None] - (m_use - PSHIFT)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if PV_FP8:
            if USE_TMA:
                vt = VD.load([v_row, start_n])
            else:
                vt = tl.load(v_base + offs_d[:, None] * Skv_pad + offs_n[None, :])
            if FP8_ACC > 0:
                acc = tl.dot(p.to(tl.float8e4nv, fp_downcast_rounding="rtne"), tl.trans(vt), acc, max_num_imprecise_acc=FP8_ACC)
            else:
                acc = tl.dot(p.to(tl.float8e4nv, fp_downcast_rounding="rtne"), tl.trans(vt), acc)
        else:
            if USE_TMA:
                v = VD.load([v_row + start_n, v_col])
            elif MASK:
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :],
                            mask=offs_n[:, None] < Skv, other=0.0)
            else:
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _int8_attn_fwd(
    Q8, QS, Qkm, K8, KS, V, VS, Out, Lse, QD, KD, VD,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    Sq, Skv, Sq_pad, Skv_pad, H, HKV,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    Q_PER_TOKEN: tl.constexpr, PV_FP8: tl.constexpr, FP8_ACC: tl.constexpr, INT_TRICK: tl.constexpr,
    CAUSAL: tl.constexpr, RETURN_LSE: tl.constexpr, PSHIFT: tl.constexpr, WS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // (H // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)

    if USE_TMA:
        q = QD.load([pid_bh * Sq_pad + pid_m * BLOCK_M, 0])
    else:
        q = tl.load(Q8 + (pid_bh * Sq_pad + offs_m[:, None]) * HEAD_DIM + offs_d[None, :])
    if Q_PER_TOKEN:
        rs = tl.load(QS + pid_bh * Sq_pad + offs_m)
    else:
        rs = tl.zeros([BLOCK_M], tl.float32) + tl.load(QS + pid_bh * (Sq_pad // BLOCK_M) + pid_m)
    bhk = b * HKV + hk
    k_base = K8 + bhk * Skv_pad * HEAD_DIM
    ks_base = KS + bhk * (Skv_pad // BLOCK_N)
    k_row = bhk * Skv_pad
    if PV_FP8:
        v_base = V + bhk * HEAD_DIM * Skv_pad
        v_row = bhk * HEAD_DIM
        v_col = 0
    else:
        v_base = V + b * stride_vb + hk * stride_vh
        v_row = b * Skv  # descriptor over [B * Skv, H_kv * D]; tail rows meet p = 0
        v_col = hk * HEAD_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = (Skv // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(Skv, (pid_m + 1) * BLOCK_M)
        lo_diag = tl.minimum(full_end, ((pid_m * BLOCK_M) // BLOCK_N) * BLOCK_N)
        acc, l_i, m_i = _int8_attn_inner(acc, l_i, m_i, q, rs, k_base, ks_base, v_base, stride_vs,
                                         0, lo_diag, offs_m, Skv, Skv_pad, KD, VD, k_row, v_row, v_col, BLOCK_N, HEAD_DIM, False, True,
                                         PV_FP8, FP8_ACC, INT_TRICK, PSHIFT, WS, USE_TMA)
        acc, l_i, m_i = _int8_attn_inner(acc, l_i, m_i, q, rs, k_base, ks_base, v_base, stride_vs,
                                         lo_diag, hi, offs_m, Skv, Skv_pad, KD, VD, k_row, v_row, v_col, BLOCK_N, HEAD_DIM, True, True,
                                         PV_FP8, FP8_ACC, INT_TRICK, PSHIFT, WS, USE_TMA)
    else:
        acc, l_i, m_i = _int8_attn_inner(acc, l_i, m_i, q, rs, k_base, ks_base, v_base, stride_vs,
                                         0, full_end, offs_m, Skv, Skv_pad, KD, VD, k_row, v_row, v_col, BLOCK_N, HEAD_DIM, False, False,
                                         PV_FP8, FP8_ACC, INT_TRICK, PSHIFT, WS, USE_TMA)
        acc, l_i, m_i = _int8_attn_inner(acc, l_i, m_i, q, rs, k_base, ks_base, v_base, stride_vs,
                                         full_end, Skv, offs_m, Skv, Skv_pad, KD, VD, k_row, v_row, v_col, BLOCK_N, HEAD_DIM, True, False,
                                         PV_FP8, FP8_ACC, INT_TRICK, PSHIFT, WS, USE_TMA)

    l_div = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_div[:, None]
    if PV_FP8:
        out = out * tl.load(VS + bhk * HEAD_DIM + offs_d)[None, :]
    row_ok = offs_m < Sq
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(l_div) - PSHIFT) * 0.6931471805599453 + tl.load(Qkm + pid_bh * Sq_pad + offs_m)
        lse = tl.where(l_i == 0.0, float("-inf"), lse)
        tl.store(Lse + pid_bh * Sq + offs_m, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------------
# public entry points


def default_config(head_dim: int, pv: str = "fp16") -> dict:
    """Launch configuration used when the caller passes none (tuned on the H200; see
    docs/benchmarks.md).  ``tma``: load tiles through TMA descriptors (used when V is contiguous;
    otherwise the pointer path runs, with ``block_n`` 64 unless the caller set it);
    ``warp_specialize`` asks Triton to warp-specialize the key loop (no gain measured)."""
    if pv == "fp8":
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "int_trick": True,
                "fp8_acc": 128, "warp_specialize": False, "tma": False}
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3, "int_trick": True,
            "fp8_acc": 0, "warp_specialize": False, "tma": True}


def _check_common(q, k, v, pv, q_granularity, what):
    dims = check_qkv(q, k, v, what=what, head_dims=SUPPORTED_HEAD_DIMS)
    if pv not in PV_MODES:
        raise AttentionConfigError(f"{what}: pv {pv!r} not supported (accepts {list(PV_MODES)})")
    if q_granularity not in Q_GRANULARITIES:
        raise AttentionConfigError(f"{what}: q_granularity {q_granularity!r} not supported (accepts {list(Q_GRANULARITIES)})")
    return dims


def quantize_qk(q: torch.Tensor, k: torch.Tensor, *, scale: float, block_m: int, block_n: int,
                need_qkm: bool, per_token: bool = True, k_per_token: bool = False, norms: bool = False,
                qk_balance: Optional[float] = None):
    """The INT8 prologue of the quantized kernels (two Triton passes and one mean over K).

    q ``[B, S_q, H, D]``, k ``[B, S_kv, H_kv, D]`` fp16/bf16 (last dim contiguous).  Returns
    ``(q8, qs, qkm, k8, ks, sq_pad, skv_pad)``: ``q8 [B, H, sq_pad, D]`` int8 with ``sq_pad`` =
    S_q rounded up to ``block_m``; ``qs`` float32 Q scales times ``scale * log2 e``, ``[B, H, sq_pad]``
    per token (or ``[B, H, sq_pad // block_m]`` per block); ``qkm [B, H, sq_pad]`` = ``scale * q .
    mean(K)`` (the LSE correction of the smoothing; ``qs`` again when ``need_qkm`` is false);
    ``k8 [B, H_kv, skv_pad, D]`` int8 of ``K - mean_s(K)`` and ``ks`` its scales, per block of
    ``block_n`` keys ``[B, H_kv, skv_pad // block_n]`` or, with ``k_per_token``, per key
    ``[B, H_kv, skv_pad]``.  Padded rows are zero.  With ``norms`` (per-token Q only) it also
    returns ``(qn, kn)``: ``qn [B, H, sq_pad]`` = ``|q8_i|_2 * qs_i`` and ``kn [B, H_kv]`` = ``max_j
    |k8_j|_2 * sK_j``, so that ``qn_i * kn`` bounds every base-2 logit of row i (Cauchy-Schwarz).

    ``qk_balance`` (alpha in (0, 1]; None / 0: off): Q's channels times ``cq`` and smoothed K's times
    ``ck`` inside the two passes, the factors from :func:`qk_balance_prologue` (which also gives K's
    mean, in place of the separate mean: three launches, one more read of Q), as
    :func:`~ditattn.attention.kernels.int8_reference.int8_attention_reference` does with the same
    option; ``qkm`` stays that of the unbalanced Q (``Q' . K'`` = ``Q . (K - mean)``), the norms are
    those of the balanced INT8 rows (what the kernel multiplies).
    """
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    dev = q.device
    sq_pad = triton.cdiv(Sq, block_m) * block_m
    skv_pad = triton.cdiv(Skv, block_n) * block_n
    bm, bn = block_m, block_n
    alpha = check_qk_balance(qk_balance, "INT8 prologue")
    if alpha > 0:
        kmean, cq, ck = qk_balance_prologue(q, k, alpha)  # [B, Hkv, D] each
    else:
        kmean = k.mean(dim=1, dtype=torch.float32).contiguous()  # [B, Hkv, D]
        cq = ck = kmean  # not read
    q8 = torch.empty((B, H, sq_pad, D), dtype=torch.int8, device=dev)
    qs = torch.empty((B, H, sq_pad if per_token else sq_pad // bm), dtype=torch.float32, device=dev)
    qkm = torch.empty((B, H, sq_pad), dtype=torch.float32, device=dev) if need_qkm else qs
    qblk = 64 if per_token else bm
    qn = torch.empty((B, H, sq_pad), dtype=torch.float32, device=dev) if norms else qs
    _quant_int8_rows[(sq_pad // qblk, H, B)](
        q, kmean, q8, qs, qkm, qn, cq, q.stride(0), q.stride(1), q.stride(2), kmean.stride(0), kmean.stride(1),
        Sq, sq_pad, H, H // Hkv, scale * LOG2E, scale,
        HEAD_DIM=D, BLK=qblk, SUB_MEAN=False, PER_TOKEN=per_token, WRITE_QKM=bool(need_qkm),
        NORM=1 if norms else 0, BALANCE=alpha > 0, num_warps=4,
    )
    k8 = torch.empty((B, Hkv, skv_pad, D), dtype=torch.int8, device=dev)
    ks = torch.empty((B, Hkv, skv_pad if k_per_token else skv_pad // bn), dtype=torch.float32, device=dev)
    kblk = 64 if k_per_token else bn
    knp = torch.empty((B, Hkv, skv_pad // kblk), dtype=torch.float32, device=dev) if norms else ks
    _quant_int8_rows[(skv_pad // kblk, Hkv, B)](
        k, kmean, k8, ks, ks, knp, ck, k.stride(0), k.stride(1), k.stride(2), kmean.stride(0), kmean.stride(1),
        Skv, skv_pad, Hkv, 1, 1.0, 1.0,
        HEAD_DIM=D, BLK=kblk, SUB_MEAN=True, PER_TOKEN=k_per_token, WRITE_QKM=False,
        NORM=2 if norms else 0, BALANCE=alpha > 0, num_warps=4,
    )
    if norms:
        return q8, qs, qkm, k8, ks, sq_pad, skv_pad, qn, knp.amax(dim=-1).contiguous()
    return q8, qs, qkm, k8, ks, sq_pad, skv_pad


def int8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                   causal: bool = False, return_lse: bool = False, pv: str = "fp16",
                   q_granularity: str = "token", config: Optional[dict] = None,
                   qk_balance: Optional[float] = None):
    """Quantized attention on the GPU (Triton): INT8 Q.K with smoothed K, FP16/BF16 or FP8 P.V.

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` fp16/bf16, ``H % H_kv == 0``, D in 32/64/128;
    ``causal`` is top-left aligned (query i sees keys j <= i); ``scale`` defaults to ``D ** -0.5``;
    ``pv`` "fp16" (P in V's dtype) or "fp8" (e4m3); ``q_granularity`` "token" (one Q scale per
    row) or "block" (one per ``block_m`` rows).  ``config`` overrides keys of
    :func:`default_config`.  ``qk_balance`` (alpha in (0, 1]; None: off): the per-channel Q/K
    balance of :func:`quantize_qk` (the reference's option of the same name, with ``k_granularity``
    "block" and this call's ``block_n``).  Returns ``(out [B, S_q, H, D] in q.dtype, lse [B, H, S_q]
    float32 natural log or None)``.  The inputs are not modified.
    """
    what = "int8 attention kernel"
    B, Sq, Skv, H, Hkv, D = _check_common(q, k, v, pv, q_granularity, what)
    check_qk_balance(qk_balance, what)
    check_device(q, k, v, what=what)
    cfg = launch_config(default_config(D, pv), config, what=what)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    use_tma = bool(cfg["tma"]) and (pv == "fp8" or v.is_contiguous())
    if cfg["tma"] and not use_tma and not (config and "block_n" in config):
        cfg["block_n"] = 64  # the pointer path's tuned tile
    bm, bn = int(cfg["block_m"]), int(cfg["block_n"])
    scale = D ** -0.5 if scale is None else float(scale)
    dev = q.device
    per_token = q_granularity == "token"

    q8, qs, qkm, k8, ks, sq_pad, skv_pad = quantize_qk(q, k, scale=scale, block_m=bm, block_n=bn,
                                                        need_qkm=bool(return_lse), per_token=per_token,
                                                        qk_balance=qk_balance)
    if pv == "fp8":
        vk, vs, _ = quantize_v_fp8(v, s_pad=skv_pad)
        sv = (0, 0, 0)
    else:
        vs, vk = ks, v
        sv = (v.stride(0), v.stride(1), v.stride(2))
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=dev) if return_lse else out
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        qd = TensorDescriptor(q8, [B * H * sq_pad, D], [D, 1], [bm, D])
        kd = TensorDescriptor(k8, [B * Hkv * skv_pad, D], [D, 1], [bn, D])
        if pv == "fp8":
            vd = TensorDescriptor(vk, [B * Hkv * D, skv_pad], [skv_pad, 1], [D, bn])
        else:
            vd = TensorDescriptor(v, [B * Skv, Hkv * D], [Hkv * D, 1], [bn, D])
    else:
        qd = kd = vd = None
    _int8_attn_fwd[(sq_pad // bm, B * H)](
        q8, qs, qkm, k8, ks, vk, vs, out, lse, qd, kd, vd,
        sv[0], sv[1], sv[2], out.stride(0), out.stride(1), out.stride(2),
        Sq, Skv, sq_pad, skv_pad, H, Hkv,
        BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, Q_PER_TOKEN=per_token, PV_FP8=pv == "fp8",
        FP8_ACC=min(int(cfg["fp8_acc"]), bn) if pv == "fp8" else 0, INT_TRICK=bool(cfg["int_trick"]),
        CAUSAL=bool(causal), RETURN_LSE=bool(return_lse), PSHIFT=P_SHIFT_FP8 if pv == "fp8" else 0.0,
        WS=bool(cfg["warp_specialize"]), USE_TMA=use_tma,
        num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
    )
    return out, (lse if return_lse else None)


__all__ = ["int8_attention", "quantize_qk", "qk_balance_prologue", "quantize_v_fp8", "int8_attention_reference", "default_config", "SUPPORTED_HEAD_DIMS", "PV_MODES"]
