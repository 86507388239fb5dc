"""Skip-softmax flash attention (BLASST), Triton kernel and PyTorch reference.

A flash-attention forward that always computes the Q.K tile, then estimates the tile's softmax
mass from its row maxima: when, for every query row of the tile, ``exp(rowmax_tile - m_running)``
is below ``threshold = threshold_scale_factor / context_length``, the tile is skipped -- no
exponentials, no softmax-state update, no P.V product, and (with ``prefetch_v=False``) no V load.
The V load sits inside the taken branch by default (``prefetch_v=False``: measured faster on the
H200 whenever tiles are skipped); ``prefetch_v=True`` issues it before the decision instead, so the
software pipeline can prefetch it.  ``tma=True`` loads Q/K/V tiles through TMA descriptors.  The first
tile of a row block is never skipped (its running maximum is -inf).  With ``threshold_scale_factor=None`` the same
kernel runs dense (the baseline the speed-up is measured against).

Self-attention of fp16/bf16 with head dim 128 or 256, unmasked (no bias, not causal).  Requests
with a mask, ring attention, torch.compile or a CUDA-graph capture are rejected by
:func:`check_skip_softmax_request` instead of silently running dense.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import LOG2E, check_device, check_qkv, last_dim_contiguous, launch_config
from ditattn.attention.kernels.skip_softmax_rules import (
    SUPPORTED_HEAD_DIMS,
    _validate_factor,
    check_skip_softmax_request,
    skip_softmax_reference,
    skip_threshold,
)
from ditattn.errors import AttentionConfigError

KERNEL_HEAD_DIMS = (64, 128, 256)  # what the kernel itself compiles for (64: tests / benches)


@triton.jit
def _skip_softmax_fwd(
    Q,
    K,
    V,
    Out,
    Lse,
    Stats,
    QD,
    KD,
    VD,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    Sq,
    Skv,
    H,
    HKV,
    qk_scale,
    log2_thr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SKIP: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    PREFETCH_V: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // (H // HKV)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_nb = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Sq
    if USE_TMA:
        # 2-D descriptors over [B * S, H * D]: rows past a batch's end belong to the next batch (or
        # are zero-filled); their scores are masked and their V rows meet p = 0
        q = QD.load([b * Sq + pid_m * BLOCK_M, h * HEAD_DIM])
    else:
        q = tl.load(
            Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    kv_row = b * Skv

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_skip = tl.zeros([], tl.int32)
    for start_n in range(0, Skv, BLOCK_N):
        offs_n = start_n + offs_nb
        col_ok = offs_n < Skv
        if USE_TMA:
            s = tl.dot(q, tl.trans(KD.load([kv_row + start_n, hk * HEAD_DIM]))) * qk_scale
        else:
            k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=col_ok[None, :], other=0.0)
            s = tl.dot(q, k) * qk_scale
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_tile = tl.max(s, 1)
        if SKIP:
            # estimated mass of the tile relative to the running max, worst row of the block
            gain = tl.max(tl.where(row_ok, m_tile - m_i, float("-inf")), 0)
            if PREFETCH_V:
                # V issued before the decision so the software pipeline can prefetch it
                if USE_TMA:
                    v = VD.load([kv_row + start_n, hk * HEAD_DIM])
                else:
                    v = tl.load(
                        v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0
                    )
            if gain >= log2_thr:
                m_new = tl.maximum(m_i, m_tile)
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
                if not PREFETCH_V:
                    if USE_TMA:
                        v = VD.load([kv_row + start_n, hk * HEAD_DIM])
                    else:
                        v = tl.load(
                            v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0
                        )
                acc = tl.dot(p.to(v.dtype), v, acc)
                m_i = m_new
            else:
                n_skip += 1
        else:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if USE_TMA:
                v = VD.load([kv_row + start_n, hk * HEAD_DIM])
            else:
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new

    l_div = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_div[:, None]
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    if RETURN_LSE:
        lse = (m_i + tl.math.log2(l_div)) * 0.6931471805599453
        tl.store(Lse + pid_bh * Sq + offs_m, lse, mask=row_ok)
    if SKIP:
        tl.store(Stats + pid_bh * tl.num_programs(0) + pid_m, n_skip)


def default_config(head_dim: int) -> dict:
    """Launch configuration used when the caller passes none (tuned on the H200, docs/benchmarks.md).

    ``prefetch_v``: issue the V tile load before the skip decision (lets Triton's software
    pipeline prefetch it; a skipped tile's V then still crosses the memory bus) instead of inside
    the taken branch (no V traffic for skipped tiles, no prefetch).  ``tma``: TMA descriptor loads
    (contiguous inputs only).
    """
    if head_dim >= 256:
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2, "prefetch_v": False, "tma": False}
    return {
        "block_m": 128,
        "block_n": 128 if head_dim >= 128 else 64,
        "num_warps": 8,
        "num_stages": 3,
        "prefetch_v": False,
        "tma": True,
    }


def skip_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    threshold_scale_factor: Optional[float] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    config: Optional[dict] = None,
    allow_any_head_dim: bool = False,
):
    """Flash attention with BLASST tile skipping (Triton).

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` fp16/bf16, ``H % H_kv == 0``, D 128 or 256
    (``allow_any_head_dim`` also admits 64, for tests and benches).  ``threshold_scale_factor``
    ``> 0`` enables skipping with threshold ``factor / S_kv``; None runs the dense path of the same
    kernel.  Returns ``(out [B, S_q, H, D] in q.dtype, lse [B, H, S_q] float32 or None,
    skipped_fraction)`` where ``skipped_fraction`` is a 0-d float32 tensor on q's device (tiles
    skipped / tiles visited; 0 on the dense path) -- ``float()`` it to read it (a device sync).
    """
    what = "skip-softmax kernel"
    _validate_factor(threshold_scale_factor)
    dims = KERNEL_HEAD_DIMS if allow_any_head_dim else SUPPORTED_HEAD_DIMS
    B, Sq, Skv, H, Hkv, D = check_qkv(q, k, v, what=what, head_dims=dims)
    check_device(q, k, v, what=what)
    if torch.compiler.is_compiling():
        raise AttentionConfigError("skip softmax cannot run under torch.compile (its tile skipping is data dependent)")
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise AttentionConfigError("skip softmax cannot run inside a captured CUDA graph")
    cfg = launch_config(default_config(D), config, what=what)
    bm, bn = int(cfg["block_m"]), int(cfg["block_n"])
    scale = D**-0.5 if scale is None else float(scale)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    skip = threshold_scale_factor is not None
    log2_thr = math.log2(skip_threshold(threshold_scale_factor, Skv)) if skip else 0.0
    nqb = triton.cdiv(Sq, bm)
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if return_lse else out
    stats = torch.zeros((B * H * nqb,), dtype=torch.int32, device=q.device) if skip else out
    use_tma = bool(cfg["tma"]) and all(t.is_contiguous() for t in (q, k, v))
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        qd = TensorDescriptor(q, [B * Sq, H * D], [H * D, 1], [bm, D])
        kd = TensorDescriptor(k, [B * Skv, Hkv * D], [Hkv * D, 1], [bn, D])
        vd = TensorDescriptor(v, [B * Skv, Hkv * D], [Hkv * D, 1], [bn, D])
    else:
        qd = kd = vd = None
    _skip_softmax_fwd[(nqb, B * H)](
        q,
        k,
        v,
        out,
        lse,
        stats,
        qd,
        kd,
        vd,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        Sq,
        Skv,
        H,
        Hkv,
        scale * LOG2E,
        log2_thr,
        HEAD_DIM=D,
        BLOCK_M=bm,
        BLOCK_N=bn,
        SKIP=skip,
        RETURN_LSE=bool(return_lse),
        PREFETCH_V=bool(cfg["prefetch_v"]),
        USE_TMA=use_tma,
        num_warps=int(cfg["num_warps"]),
        num_stages=int(cfg["num_stages"]),
    )
    if skip:
        frac = stats.sum(dtype=torch.float32) / float(stats.numel() * triton.cdiv(Skv, bn))
    else:
        frac = torch.zeros((), dtype=torch.float32, device=q.device)
    return out, (lse if return_lse else None), frac


__all__ = [
    "skip_softmax_attention",
    "skip_softmax_reference",
    "check_skip_softmax_request",
    "skip_threshold",
    "default_config",
    "SUPPORTED_HEAD_DIMS",
]
