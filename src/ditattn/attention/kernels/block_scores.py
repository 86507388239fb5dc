"""Pooled-query block scores (Triton): ``log sum_{j in block J} exp(scale * qbar_I . k_j)``.

The selection stage of the training-free sparse planners
(:func:`ditattn.attention.sparse.block_scores.pooled_query_block_scores`): every pooled query
``qbar_I`` (the mean of a query block) against every key, reduced per key block by a log-sum-exp.
One program takes ``BLOCK_M`` pooled queries and one key block of ``BLOCK_N`` keys for one
(batch, head): one ``[BLOCK_M, D] x [D, BLOCK_N]`` tensor-core product (a second one with the
query variance against ``k^2`` when ``HAS_VAR``), the padding keys masked, a row log-sum-exp in
base 2, and ``BLOCK_M`` floats written.  The ``[M, N]`` logits never leave registers.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import LOG2E, check_device
from ditattn.errors import AttentionConfigError


@triton.jit
def _pooled_query_lse_fwd(
    Mean,
    Var,
    K,
    Valid,
    KIdx,
    Out,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_ob,
    stride_oh,
    stride_om,
    H,
    M,
    qk_scale,
    var_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_VAR: tl.constexpr,
    HAS_KIDX: tl.constexpr,
):
    pid_n = tl.program_id(0)  # key block
    pid_m = tl.program_id(1)  # chunk of pooled queries
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < M
    q_ptr = Mean + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm + offs_d[None, :]
    qm = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    if HAS_KIDX:  # the block's keys gathered from k in its own order (no tiled copy of k)
        rows = tl.load(KIdx + offs_n).to(tl.int64)
    else:
        rows = offs_n
    k = tl.load(K + b * stride_kb + h * stride_kh + rows[None, :] * stride_ks + offs_d[:, None])  # [D, BLOCK_N]
    s = tl.dot(qm, k) * qk_scale
    if HAS_VAR:
        qv = tl.load(
            Var + b * stride_mb + h * stride_mh + offs_m[:, None] * stride_mm + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        kf = k.to(tl.float32)
        s += tl.dot(qv, (kf * kf).to(qv.dtype)) * var_scale
    valid = tl.load(Valid + offs_n) != 0
    s = tl.where(valid[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.math.exp2(s - m_use[:, None]), 1)
    lse = tl.where(l == 0.0, float("-inf"), (m_use + tl.math.log2(tl.where(l == 0.0, 1.0, l))) * 0.6931471805599453)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m * stride_om + pid_n, lse, mask=row_ok)


def pooled_query_lse(
    mean: torch.Tensor,
    var: Optional[torch.Tensor],
    k: torch.Tensor,
    valid: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    block_m: int = 64,
    num_warps: int = 4,
    key_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``out[b, h, i, n] = log sum_{j in key block n, valid} exp(scale * mean_i . k_j
    (+ 0.5 scale^2 var_i . k_j^2))``.

    mean / var: ``[B, H, M, D]`` (any float; cast to k's dtype for the tensor cores; any strides with a
    contiguous last dim, e.g. a permuted ``[B, M, H, D]``: no copy; var None: no variance term);
    k: ``[B, n * block_size, H, D]`` fp16/bf16 with D a power of two 16..256; valid: bool ``[n * block_size]``
    (False keys are masked).  ``key_index`` (int ``[n * block_size]``, in ``[0, k.shape[1])``): key ``j`` of
    the blocks is ``k[:, key_index[j]]`` — k stays in its own order (a tile layout's clamped source index: no
    tiled copy of k); None: the blocks are ``k``'s rows in order.  Returns float32 ``[B, H, M, n]`` (``-inf``
    where a key block has no valid key).  CUDA, or CPU under ``TRITON_INTERPRET=1``.
    """
    what = "pooled-query block-score Triton kernel"
    check_device(mean, k, valid, *(() if var is None else (var,)), what=what)
    if k.dim() != 4 or mean.dim() != 4:
        raise AttentionConfigError(
            f"{what}: mean must be [B, H, M, D] and k [B, N, H, D]; got {tuple(mean.shape)}, {tuple(k.shape)}"
        )
    B, N, H, D = k.shape
    if key_index is not None:
        N = key_index.numel()
    M = mean.shape[2]
    if k.dtype not in (torch.float16, torch.bfloat16) or D not in (16, 32, 64, 128, 256):
        raise AttentionConfigError(
            f"{what}: k must be float16/bfloat16 with head dim 16..256 (power of two); got {k.dtype}, {D}"
        )
    if tuple(mean.shape) != (B, H, M, D) or (var is not None and var.shape != mean.shape):
        raise AttentionConfigError(f"{what}: mean/var must be [{B}, {H}, M, {D}]; got {tuple(mean.shape)}")
    if key_index is not None and (key_index.dim() != 1 or key_index.device != k.device):
        raise AttentionConfigError(f"{what}: key_index must be a 1-D integer tensor on k's device")
    if key_index is not None:
        key_index = key_index.contiguous()
    if block_size not in (16, 32, 64, 128) or N % block_size or tuple(valid.shape) != (N,):
        raise AttentionConfigError(
            f"{what}: needs block_size in 16..128 dividing N={N} and valid [{N}]; got "
            f"{block_size}, {tuple(valid.shape)}"
        )
    if k.stride(-1) != 1:
        k = k.contiguous()
    has_var = var is not None
    mean = _rows_last(mean.to(k.dtype))  # any [B, H, M] strides: a permuted view of gathered rows is not copied
    var = _rows_last(var.to(k.dtype)) if has_var else mean  # a placeholder pointer when unused
    if has_var and var.stride() != mean.stride():
        mean, var = mean.contiguous(), var.contiguous()
    valid = valid.to(torch.int8).contiguous()
    n = N // block_size
    out = torch.empty(B, H, M, n, dtype=torch.float32, device=k.device)
    grid = (n, triton.cdiv(M, block_m), B * H)
    _pooled_query_lse_fwd[grid](
        mean,
        var,
        k,
        valid,
        key_index if key_index is not None else valid,
        out,
        mean.stride(0),
        mean.stride(1),
        mean.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        H,
        M,
        float(scale) * LOG2E,
        0.5 * float(scale) ** 2 * LOG2E,
        HEAD_DIM=D,
        BLOCK_M=block_m,
        BLOCK_N=block_size,
        HAS_VAR=has_var,
        HAS_KIDX=key_index is not None,
        num_warps=num_warps,
    )
    return out


def _rows_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (the kernel takes the other strides as they are)."""
    return x if x.stride(-1) == 1 else x.contiguous()


__all__ = ["pooled_query_lse"]
