"""The INT8 / FP8 quantization prologue of ``sage_attn``'s kernels (Triton): Q and K to INT8 (K smoothed by
its mean over keys, per token or per block scales, optionally balanced per channel by ``qk_balance``), V to
FP8 e4m3 per channel (the FP8 P.V path).  Used by :mod:`.int8_attention` (the portable Triton kernel) and
:mod:`.sage_sm90` (the Hopper kernel); the math is that of
:func:`~ditattn.attention.kernels.int8_reference.int8_attention_reference`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import LOG2E, check_device
from ditattn.attention.kernels.int8_reference import FP8_MAX, check_qk_balance


@triton.jit
def _load_row_block(X, stride_xb, stride_xs, stride_xh, S, HEAD_DIM: tl.constexpr, BLK: tl.constexpr):
    # the program's block of BLK rows of head program_id(1), batch program_id(2), as float32 (rows past S: 0)
    pid_blk = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = pid_blk * BLK + tl.arange(0, BLK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s < S
    x = tl.load(
        X + b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs + offs_d[None, :], mask=ok[:, None], other=0.0
    ).to(tl.float32)
    return pid_blk, h, b, offs_s, offs_d, ok, x


@triton.jit
def _quant_int8_rows(
    X,
    KMean,
    Out,
    Scale,
    Qkm,
    Norm,
    Bal,
    stride_xb,
    stride_xs,
    stride_xh,
    stride_mb,
    stride_mh,
    S,
    S_pad,
    H,
    GROUP,
    mult,
    qkm_mult,
    HEAD_DIM: tl.constexpr,
    BLK: tl.constexpr,
    SUB_MEAN: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    WRITE_QKM: tl.constexpr,
    NORM: tl.constexpr,
    BALANCE: tl.constexpr,
):
    # NORM 1: per row |x8|_2 * scale (Q's logit bound factor); NORM 2: per program max of that (K's).
    # BALANCE: multiply the channels by Bal [B, H / GROUP, D] (qk_balance's cq for Q, ck for K; after the
    # smoothing, and after Q's LSE term, which is that of the unbalanced Q)
    pid_blk, h, b, offs_s, offs_d, ok, x = _load_row_block(X, stride_xb, stride_xs, stride_xh, S, HEAD_DIM, BLK)
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
    X,
    Sum,
    Max,
    Min,
    stride_xb,
    stride_xs,
    stride_xh,
    S,
    H,
    NCH,
    ROWS,
    HEAD_DIM: tl.constexpr,
    BLK: tl.constexpr,
    ABS: tl.constexpr,
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
    QMax,
    KSum,
    KMax,
    KMin,
    KMean,
    Cq,
    Ck,
    Skv,
    HKV,
    GROUP,
    NCQ,
    NCK,
    alpha,
    one_minus_alpha,
    log2_limit,
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
    _qk_channel_stats[(ncq, H, B)](
        q,
        qmax,
        qmax,
        qmax,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        Sq,
        H,
        ncq,
        rows,
        HEAD_DIM=D,
        BLK=blk,
        ABS=True,
        num_warps=4,
    )
    ksum, kmax, kmin = (torch.empty((B, Hkv, nck, D), dtype=torch.float32, device=dev) for _ in range(3))
    _qk_channel_stats[(nck, Hkv, B)](
        k,
        ksum,
        kmax,
        kmin,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        Skv,
        Hkv,
        nck,
        rows,
        HEAD_DIM=D,
        BLK=blk,
        ABS=False,
        num_warps=4,
    )
    kmean, cq, ck = (torch.empty((B, Hkv, D), dtype=torch.float32, device=dev) for _ in range(3))
    _qk_balance_factors[(Hkv, B)](
        qmax,
        ksum,
        kmax,
        kmin,
        kmean,
        cq,
        ck,
        Skv,
        Hkv,
        H // Hkv,
        ncq,
        nck,
        float(alpha),
        1.0 - float(alpha),
        QK_BALANCE_LOG2_LIMIT,
        HEAD_DIM=D,
        num_warps=4,
    )
    return kmean, cq, ck


@triton.jit
def _v_channel_stats(
    V,
    Sum,
    Max,
    Min,
    stride_vb,
    stride_vs,
    stride_vh,
    S,
    HKV,
    NCH,
    HEAD_DIM: tl.constexpr,
    BLK: tl.constexpr,
):
    # per (chunk of BLK tokens, head, batch): the channel sums, maxima and minima of V
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = pid * BLK + tl.arange(0, BLK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (offs_s < S)[:, None]
    x = tl.load(
        V + b * stride_vb + h * stride_vh + offs_s[:, None] * stride_vs + offs_d[None, :], mask=ok, other=0.0
    ).to(tl.float32)
    out = ((b * HKV + h) * NCH + pid) * HEAD_DIM + offs_d
    tl.store(Sum + out, tl.sum(x, 0))
    tl.store(Max + out, tl.max(tl.where(ok, x, float("-inf")), 0))
    tl.store(Min + out, tl.min(tl.where(ok, x, float("inf")), 0))


@triton.jit
def _quant_v_fp8_t(
    V,
    VScale,
    VMean,
    Out,
    stride_vb,
    stride_vs,
    stride_vh,
    S,
    S_pad,
    HKV,
    HEAD_DIM: tl.constexpr,
    BLK: tl.constexpr,
    SUB_MEAN: tl.constexpr,
    PERMUTE: tl.constexpr,
):
    pid_blk, h, b, offs_s, offs_d, ok, x = _load_row_block(V, stride_vb, stride_vs, stride_vh, S, HEAD_DIM, BLK)
    if SUB_MEAN:
        x = tl.where(ok[:, None], x - tl.load(VMean + (b * HKV + h) * HEAD_DIM + offs_d)[None, :], 0.0)
    sc = tl.load(VScale + (b * HKV + h) * HEAD_DIM + offs_d)
    xq = x / sc[None, :]
    pos = offs_s
    if PERMUTE:  # token c of each 16 at k = (c0, c3, c1, c2) in bits: the FP8 P operand's order
        pos = (offs_s & ~15) | (offs_s & 1) | ((offs_s >> 2) & 2) | ((offs_s << 1) & 12)
    base = Out + (b * HKV + h) * HEAD_DIM * S_pad
    tl.store(
        base + offs_d[None, :] * S_pad + pos[:, None],
        xq.to(tl.float8e4nv, fp_downcast_rounding="rtne"),
        mask=(offs_s < S_pad)[:, None],
    )


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
    _v_channel_stats[(nch, Hkv, B)](
        v, sums, maxs, mins, v.stride(0), v.stride(1), v.stride(2), S, Hkv, nch, HEAD_DIM=D, BLK=blk, num_warps=4
    )
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
        v,
        vs,
        vm,
        vt,
        v.stride(0),
        v.stride(1),
        v.stride(2),
        S,
        s_pad,
        Hkv,
        HEAD_DIM=D,
        BLK=blk,
        SUB_MEAN=bool(smooth),
        PERMUTE=bool(permute),
        num_warps=4,
    )
    return vt, vs, vm.contiguous()


def quantize_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    block_m: int,
    block_n: int,
    need_qkm: bool,
    per_token: bool = True,
    k_per_token: bool = False,
    norms: bool = False,
    qk_balance: Optional[float] = None,
):
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
        q,
        kmean,
        q8,
        qs,
        qkm,
        qn,
        cq,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kmean.stride(0),
        kmean.stride(1),
        Sq,
        sq_pad,
        H,
        H // Hkv,
        scale * LOG2E,
        scale,
        HEAD_DIM=D,
        BLK=qblk,
        SUB_MEAN=False,
        PER_TOKEN=per_token,
        WRITE_QKM=bool(need_qkm),
        NORM=1 if norms else 0,
        BALANCE=alpha > 0,
        num_warps=4,
    )
    k8 = torch.empty((B, Hkv, skv_pad, D), dtype=torch.int8, device=dev)
    ks = torch.empty((B, Hkv, skv_pad if k_per_token else skv_pad // bn), dtype=torch.float32, device=dev)
    kblk = 64 if k_per_token else bn
    knp = torch.empty((B, Hkv, skv_pad // kblk), dtype=torch.float32, device=dev) if norms else ks
    _quant_int8_rows[(skv_pad // kblk, Hkv, B)](
        k,
        kmean,
        k8,
        ks,
        ks,
        knp,
        ck,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        kmean.stride(0),
        kmean.stride(1),
        Skv,
        skv_pad,
        Hkv,
        1,
        1.0,
        1.0,
        HEAD_DIM=D,
        BLK=kblk,
        SUB_MEAN=True,
        PER_TOKEN=k_per_token,
        WRITE_QKM=False,
        NORM=2 if norms else 0,
        BALANCE=alpha > 0,
        num_warps=4,
    )
    if norms:
        return q8, qs, qkm, k8, ks, sq_pad, skv_pad, qn, knp.amax(dim=-1).contiguous()
    return q8, qs, qkm, k8, ks, sq_pad, skv_pad
