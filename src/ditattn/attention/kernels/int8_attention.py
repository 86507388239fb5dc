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

from ditattn.attention.kernels import check_device, check_qkv, last_dim_contiguous, launch_config
from ditattn.attention.kernels.int8_quant import qk_balance_prologue, quantize_qk, quantize_v_fp8
from ditattn.attention.kernels.int8_reference import (
    PV_MODES,
    Q_GRANULARITIES,
    check_qk_balance,
    int8_attention_reference,
)
from ditattn.errors import AttentionConfigError

SUPPORTED_HEAD_DIMS = (32, 64, 128)
P_SHIFT_FP8 = 8.0  # P is computed as exp2(s - m + 8) = 256 * softmax numerator on the FP8 path


@triton.jit
def _int8_attn_inner(
    acc,
    l_i,
    m_i,
    q,
    rs,
    k_base,
    ks_base,
    v_base,
    stride_vs,
    start,
    end,
    offs_m,
    Skv,
    Skv_pad,
    KD,
    VD,
    k_row,
    v_row,
    v_col,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    PV_FP8: tl.constexpr,
    FP8_ACC: tl.constexpr,
    INT_TRICK: tl.constexpr,
    PSHIFT: tl.constexpr,
    WS: tl.constexpr,
    USE_TMA: tl.constexpr,
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
                acc = tl.dot(
                    p.to(tl.float8e4nv, fp_downcast_rounding="rtne"), tl.trans(vt), acc, max_num_imprecise_acc=FP8_ACC
                )
            else:
                acc = tl.dot(p.to(tl.float8e4nv, fp_downcast_rounding="rtne"), tl.trans(vt), acc)
        else:
            if USE_TMA:
                v = VD.load([v_row + start_n, v_col])
            elif MASK:
                v = tl.load(
                    v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=offs_n[:, None] < Skv, other=0.0
                )
            else:
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _int8_attn_fwd(
    Q8,
    QS,
    Qkm,
    K8,
    KS,
    V,
    VS,
    Out,
    Lse,
    QD,
    KD,
    VD,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    Sq,
    Skv,
    Sq_pad,
    Skv_pad,
    H,
    HKV,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    Q_PER_TOKEN: tl.constexpr,
    PV_FP8: tl.constexpr,
    FP8_ACC: tl.constexpr,
    INT_TRICK: tl.constexpr,
    CAUSAL: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    PSHIFT: tl.constexpr,
    WS: tl.constexpr,
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
        acc, l_i, m_i = _int8_attn_inner(
            acc,
            l_i,
            m_i,
            q,
            rs,
            k_base,
            ks_base,
            v_base,
            stride_vs,
            0,
            lo_diag,
            offs_m,
            Skv,
            Skv_pad,
            KD,
            VD,
            k_row,
            v_row,
            v_col,
            BLOCK_N,
            HEAD_DIM,
            False,
            True,
            PV_FP8,
            FP8_ACC,
            INT_TRICK,
            PSHIFT,
            WS,
            USE_TMA,
        )
        acc, l_i, m_i = _int8_attn_inner(
            acc,
            l_i,
            m_i,
            q,
            rs,
            k_base,
            ks_base,
            v_base,
            stride_vs,
            lo_diag,
            hi,
            offs_m,
            Skv,
            Skv_pad,
            KD,
            VD,
            k_row,
            v_row,
            v_col,
            BLOCK_N,
            HEAD_DIM,
            True,
            True,
            PV_FP8,
            FP8_ACC,
            INT_TRICK,
            PSHIFT,
            WS,
            USE_TMA,
        )
    else:
        acc, l_i, m_i = _int8_attn_inner(
            acc,
            l_i,
            m_i,
            q,
            rs,
            k_base,
            ks_base,
            v_base,
            stride_vs,
            0,
            full_end,
            offs_m,
            Skv,
            Skv_pad,
            KD,
            VD,
            k_row,
            v_row,
            v_col,
            BLOCK_N,
            HEAD_DIM,
            False,
            False,
            PV_FP8,
            FP8_ACC,
            INT_TRICK,
            PSHIFT,
            WS,
            USE_TMA,
        )
        acc, l_i, m_i = _int8_attn_inner(
            acc,
            l_i,
            m_i,
            q,
            rs,
            k_base,
            ks_base,
            v_base,
            stride_vs,
            full_end,
            Skv,
            offs_m,
            Skv,
            Skv_pad,
            KD,
            VD,
            k_row,
            v_row,
            v_col,
            BLOCK_N,
            HEAD_DIM,
            True,
            False,
            PV_FP8,
            FP8_ACC,
            INT_TRICK,
            PSHIFT,
            WS,
            USE_TMA,
        )

    l_div = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_div[:, None]
    if PV_FP8:
        out = out * tl.load(VS + bhk * HEAD_DIM + offs_d)[None, :]
    row_ok = offs_m < Sq
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
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
        return {
            "block_m": 128,
            "block_n": 128,
            "num_warps": 8,
            "num_stages": 3,
            "int_trick": True,
            "fp8_acc": 128,
            "warp_specialize": False,
            "tma": False,
        }
    return {
        "block_m": 128,
        "block_n": 128,
        "num_warps": 8,
        "num_stages": 3,
        "int_trick": True,
        "fp8_acc": 0,
        "warp_specialize": False,
        "tma": True,
    }


def _check_common(q, k, v, pv, q_granularity, what):
    dims = check_qkv(q, k, v, what=what, head_dims=SUPPORTED_HEAD_DIMS)
    if pv not in PV_MODES:
        raise AttentionConfigError(f"{what}: pv {pv!r} not supported (accepts {list(PV_MODES)})")
    if q_granularity not in Q_GRANULARITIES:
        raise AttentionConfigError(
            f"{what}: q_granularity {q_granularity!r} not supported (accepts {list(Q_GRANULARITIES)})"
        )
    return dims


def int8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    return_lse: bool = False,
    pv: str = "fp16",
    q_granularity: str = "token",
    config: Optional[dict] = None,
    qk_balance: Optional[float] = None,
):
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
    scale = D**-0.5 if scale is None else float(scale)
    dev = q.device
    per_token = q_granularity == "token"

    q8, qs, qkm, k8, ks, sq_pad, skv_pad = quantize_qk(
        q,
        k,
        scale=scale,
        block_m=bm,
        block_n=bn,
        need_qkm=bool(return_lse),
        per_token=per_token,
        qk_balance=qk_balance,
    )
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
        q8,
        qs,
        qkm,
        k8,
        ks,
        vk,
        vs,
        out,
        lse,
        qd,
        kd,
        vd,
        sv[0],
        sv[1],
        sv[2],
        out.stride(0),
        out.stride(1),
        out.stride(2),
        Sq,
        Skv,
        sq_pad,
        skv_pad,
        H,
        Hkv,
        BLOCK_M=bm,
        BLOCK_N=bn,
        HEAD_DIM=D,
        Q_PER_TOKEN=per_token,
        PV_FP8=pv == "fp8",
        FP8_ACC=min(int(cfg["fp8_acc"]), bn) if pv == "fp8" else 0,
        INT_TRICK=bool(cfg["int_trick"]),
        CAUSAL=bool(causal),
        RETURN_LSE=bool(return_lse),
        PSHIFT=P_SHIFT_FP8 if pv == "fp8" else 0.0,
        WS=bool(cfg["warp_specialize"]),
        USE_TMA=use_tma,
        num_warps=int(cfg["num_warps"]),
        num_stages=int(cfg["num_stages"]),
    )
    return out, (lse if return_lse else None)


__all__ = [
    "int8_attention",
    "quantize_qk",
    "qk_balance_prologue",
    "quantize_v_fp8",
    "int8_attention_reference",
    "default_config",
    "SUPPORTED_HEAD_DIMS",
    "PV_MODES",
]
