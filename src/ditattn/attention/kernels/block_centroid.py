"""Attention over per-block centroid keys, continuing a block-sparse pass (Triton).

Sol attention (``ditattn.attention.sparse.sol``) routes each (query block, key block) pair either
to exact attention or to one *virtual key*: the key block's mean ``kc_j`` with value ``vc_j`` and
additive log-weight ``logw_j = log |block j|``.  The exact part runs in the block-sparse kernel
and returns ``(o1, lse1)``; this kernel adds the virtual keys of every query block's approximate
blocks to the same online softmax, starting from ``(o1, lse1)``: the merge of the two parts is
fused in (no float32 ``[B, H, S, n_blocks]`` score matrix, no separate merge passes).

One program: one query block of ``block_size`` rows for one (batch, head); it walks all virtual
keys in chunks of ``BLOCK_N``, masks the chunk with the query block's route row (``approx[b, h,
i, j]``), and continues ``m, l, acc`` in base 2.  With the blocks' key variance ``kvar`` (Sol's
``centroid_variance``) a second product ``q^2 . kvar_j`` adds ``0.5 * scale^2`` times it to the score.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import LOG2E, check_device
from ditattn.attention.kernels.block_sparse_triton import softmax_finish, softmax_step
from ditattn.errors import AttentionConfigError


@triton.jit
def _centroid_fwd(
    Q,
    Kc,
    Vc,
    Kvar,
    LogW,
    Approx,
    O1,
    L1,
    Out,
    Lse,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_ab,
    stride_ah,
    stride_ai,
    H,
    NV,
    qk_scale,
    var_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_VAR: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, BLOCK_N)
    row = b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]  # q / o1 / out share a layout
    q = tl.load(Q + row)
    if HAS_VAR:
        qf = q.to(tl.float32)
        q2 = (qf * qf).to(q.dtype)
    if HAS_INIT:  # the exact part's state: m = lse1 (base 2), l = 1, acc = o1; rows with no key start empty
        l1 = tl.load(L1 + pid_bh * (tl.num_programs(0) * BLOCK_M) + offs_m) * 1.4426950408889634
        live = l1 > float("-inf")
        m_i = l1
        l_i = tl.where(live, 1.0, 0.0)
        acc = tl.where(live[:, None], tl.load(O1 + row).to(tl.float32), 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = Kc + b * stride_kb + h * stride_kh
    v_base = Vc + b * stride_kb + h * stride_kh
    a_base = Approx + b * stride_ab + h * stride_ah + pid_m * stride_ai
    for n0 in range(0, NV, BLOCK_N):
        offs_n = n0 + offs_r
        in_range = offs_n < NV
        routed = (tl.load(a_base + offs_n, mask=in_range, other=0) != 0) & in_range
        if tl.max(routed.to(tl.int32), 0) > 0:  # skip chunks where this query block has no virtual key
            k = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None], mask=in_range[None, :], other=0.0)
            w = tl.load(LogW + offs_n, mask=in_range, other=0.0) * 1.4426950408889634
            s = tl.dot(q, k) * qk_scale + w[None, :]
            if HAS_VAR:
                kv = tl.load(
                    Kvar + b * stride_kb + h * stride_kh + offs_n[None, :] * stride_kn + offs_d[:, None],
                    mask=in_range[None, :],
                    other=0.0,
                )
                s += tl.dot(q2, kv) * var_scale
            s = tl.where(routed[None, :], s, float("-inf"))
            p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
            v = tl.load(v_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=in_range[:, None], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    out, lse = softmax_finish(acc, m_i, l_i)
    tl.store(Out + row, out.to(Out.dtype.element_ty))
    tl.store(Lse + pid_bh * (tl.num_programs(0) * BLOCK_M) + offs_m, lse)


def block_centroid_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    logw: torch.Tensor,
    approx: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    o_init: Optional[torch.Tensor] = None,
    lse_init: Optional[torch.Tensor] = None,
    kvar: Optional[torch.Tensor] = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over (the state ``o_init``/``lse_init``) ∪ (each query block's routed virtual keys).

    q ``[B, P, H, D]`` fp16/bf16 (P a multiple of ``block_size``; D a power of two 16..256);
    kc, vc ``[B, H, NV, D]`` (cast to q's dtype); logw float ``[NV]`` (added to the scaled score);
    approx bool ``[B, H, P / block_size, NV]`` (True: the query block sees virtual key j);
    o_init ``[B, P, H, D]`` q.dtype and lse_init float32 ``[B, H, P]`` (natural log; ``-inf`` = no
    exact key) — both or neither; kvar ``[B, H, NV, D]`` or None: per-channel key variance of each
    block (adds ``0.5 * scale^2 * q^2 . kvar_j`` to the score of virtual key j).  Returns ``(out [B, P, H, D] q.dtype,
    lse [B, H, P] float32)``;
    a row with neither exact nor virtual keys gives zeros and LSE ``-inf``.  Runs on CUDA, or on CPU
    under ``TRITON_INTERPRET=1``.
    """
    what = "block-centroid Triton kernel"
    check_device(q, kc, vc, logw, approx, what=what)
    if q.dim() != 4 or kc.dim() != 4 or kc.shape != vc.shape:
        raise AttentionConfigError(
            f"{what}: q must be [B, P, H, D] and kc/vc [B, H, NV, D]; got "
            f"{tuple(q.shape)}, {tuple(kc.shape)}, {tuple(vc.shape)}"
        )
    B, P, H, D = q.shape
    NV = kc.shape[2]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(f"{what}: q must be float16 or bfloat16, got {q.dtype}")
    if tuple(kc.shape) != (B, H, NV, D) or D not in (16, 32, 64, 128, 256):
        raise AttentionConfigError(
            f"{what}: kc/vc must be [{B}, {H}, NV, {D}] with D in 16..256 (power of two); got {tuple(kc.shape)}"
        )
    if P % block_size or tuple(approx.shape) != (B, H, P // block_size, NV) or tuple(logw.shape) != (NV,):
        raise AttentionConfigError(
            f"{what}: expects approx [{B}, {H}, {P // block_size if block_size else '?'}, {NV}] and logw [{NV}] "
            f"with P={P} a multiple of block_size={block_size}; got {tuple(approx.shape)}, {tuple(logw.shape)}"
        )
    if (o_init is None) != (lse_init is None):
        raise AttentionConfigError(f"{what}: pass both o_init and lse_init, or neither")
    q = q.contiguous()
    kc = kc.to(q.dtype).contiguous()
    vc = vc.to(q.dtype).contiguous()
    if kvar is not None and tuple(kvar.shape) != tuple(kc.shape):
        raise AttentionConfigError(f"{what}: kvar must be {tuple(kc.shape)} like kc; got {tuple(kvar.shape)}")
    has_var = kvar is not None
    kvar = kvar.to(q.dtype).contiguous() if has_var else kc  # a placeholder pointer when unused
    logw = logw.float().contiguous()
    approx = approx.to(torch.int8).contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((B, H, P), dtype=torch.float32, device=q.device)
    if o_init is not None:
        o_init = o_init.to(q.dtype).contiguous()
        lse_init = lse_init.float().contiguous()
        if o_init.shape != q.shape or tuple(lse_init.shape) != (B, H, P):
            raise AttentionConfigError(f"{what}: o_init must be {tuple(q.shape)} and lse_init [{B}, {H}, {P}]")
    grid = (P // block_size, B * H)
    _centroid_fwd[grid](
        q,
        kc,
        vc,
        kvar,
        logw,
        approx,
        o_init if o_init is not None else q,
        lse_init if lse_init is not None else lse,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        approx.stride(0),
        approx.stride(1),
        approx.stride(2),
        H,
        NV,
        float(scale) * LOG2E,
        0.5 * float(scale) ** 2 * LOG2E,
        HEAD_DIM=D,
        BLOCK_M=block_size,
        BLOCK_N=block_n,
        HAS_INIT=o_init is not None,
        HAS_VAR=has_var,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, lse


__all__ = ["block_centroid_attention"]
