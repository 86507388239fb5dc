"""Floors of block-sparse attention: the K/V tile gather alone (no math), the math alone (no gather).

A block-sparse flash kernel must bring every listed (key tile, value tile) pair from L2 into the
SM once per query tile that lists it (without sharing between query tiles, which independent lists
do not allow).  :func:`gather_kv` runs exactly that load pattern — one program per (head, query
block), walking the same ``kv_indices``/``kv_counts`` lists and reading the same ``[block, D]`` K and
V tiles — and only sums what it loads (so the loads cannot be optimised away).  Its time is a lower
bound for any kernel with that load pattern on this GPU; ``bytes / time`` is the L2-to-SM bandwidth
the pattern gets.  :func:`math_only` is the other half: the block-sparse kernel's loop (same tile
shapes, the same online-softmax step, two tensor-core products per listed block) over one K/V tile
loaded once, so almost nothing moves — the time the math and softmax of that tiling need on their
own.  ``bench/sparse.py`` reports both next to the attention kernels.

Shapes: k, v ``[1, S, H, D]`` (bf16/fp16, contiguous); kv_indices int32 ``[1, H, S/block, max]``,
kv_counts int32 ``[1, H, S/block]``.  Returns float32 ``[H, S/block, block]``: per query block, the
row sums of the sum of its gathered K and V tiles (checked against PyTorch in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import LOG2E, check_device
from ditattn.attention.kernels.block_sparse_triton import softmax_finish, softmax_step


@triton.jit
def _gather_kv(
    K,
    V,
    Out,
    KvIdx,
    KvCnt,
    stride_s,
    stride_h,
    stride_ih,
    stride_im,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_TMA: tl.constexpr,
    KD,
    VD,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    cnt = tl.load(KvCnt + h * stride_ch + pid_m)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    for j in range(0, cnt):
        kb = tl.load(KvIdx + h * stride_ih + pid_m * stride_im + j)
        if USE_TMA:
            k = KD.load([kb * BLOCK, h * HEAD_DIM])
            v = VD.load([kb * BLOCK, h * HEAD_DIM])
        else:
            ptr = (kb * BLOCK + offs_r)[:, None] * stride_s + h * stride_h + offs_d[None, :]
            k = tl.load(K + ptr)
            v = tl.load(V + ptr)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(Out + (h * tl.num_programs(0) + pid_m) * BLOCK + offs_r, tl.sum(acc, 1))


def gather_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_size: int,
    num_warps: int = 4,
    tma: bool = False,
) -> torch.Tensor:
    """Gather every listed K/V tile once per query block (see the module docstring)."""
    check_device(k, v, kv_indices, kv_counts, what="gather_kv")  # CPU: the interpreter's bf16 fixes
    _, S, H, D = k.shape
    nq = kv_counts.shape[-1]
    out = torch.empty((H, nq, block_size), dtype=torch.float32, device=k.device)
    idx, cnt = kv_indices[0].contiguous(), kv_counts[0].contiguous()
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = tuple(TensorDescriptor(t, [S, H * D], [H * D, 1], [block_size, D]) for t in (k, v))
    else:
        descs = (k, v)  # unused placeholders
    _gather_kv[(nq, H)](
        k,
        v,
        out,
        idx,
        cnt,
        k.stride(1),
        k.stride(2),
        idx.stride(0),
        idx.stride(1),
        cnt.stride(0),
        HEAD_DIM=D,
        BLOCK=block_size,
        USE_TMA=tma,
        KD=descs[0],
        VD=descs[1],
        num_warps=num_warps,
    )
    return out


def gather_kv_reference(k, v, kv_indices, kv_counts, *, block_size: int) -> torch.Tensor:
    """PyTorch version of :func:`gather_kv` (float32)."""
    _, S, H, D = k.shape
    kt = (k[0].float() + v[0].float()).view(S // block_size, block_size, H, D).permute(2, 0, 1, 3)  # [H, nb, blk, D]
    width = kv_indices.shape[-1]
    live = torch.arange(width, device=k.device) < kv_counts[0][..., None]  # [H, nq, width]
    idx = kv_indices[0].long().clamp_min(0)
    tiles = kt[torch.arange(H, device=k.device)[:, None, None], idx]  # [H, nq, width, blk, D]
    return (tiles * live[..., None, None]).sum(dim=(2, 4))


def bytes_moved(k: torch.Tensor, kv_counts: torch.Tensor, block_size: int) -> int:
    """K and V bytes the gather (and a block-sparse kernel without sharing) reads."""
    return int(kv_counts.sum()) * 2 * block_size * k.shape[-1] * k.element_size()


@triton.jit
def _math_only(
    Q, K, V, Out, KvCnt, stride_s, stride_h, stride_ch, qk_scale, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (pid_m * BLOCK + offs_r)[:, None] * stride_s + h * stride_h + offs_d[None, :]
    q = tl.load(Q + rows)
    kt = tl.load(K + (pid_m * BLOCK + offs_r)[None, :] * stride_s + h * stride_h + offs_d[:, None])  # [D, BLOCK]
    v = tl.load(V + rows)  # the diagonal K/V tile, loaded once
    cnt = tl.load(KvCnt + h * stride_ch + pid_m)
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    for _ in range(0, cnt):
        # the zero bias depends on the loop-carried l_i, so Q K^T cannot be hoisted out of the loop
        bias = tl.broadcast_to((l_i * 0.0)[:, None], [BLOCK, BLOCK])
        s = tl.dot(q, kt, bias) * qk_scale
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    out, _ = softmax_finish(acc, m_i, l_i)
    tl.store(Out + rows, out.to(Out.dtype.element_ty))


def math_only(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_size: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """``kv_counts[0, h, i]`` flash steps of query block i against its own (diagonal) K/V tile, which is
    read once: the attention math of a block-sparse call without its data movement.  q/k/v
    ``[1, S, H, D]`` contiguous; returns ``[1, S, H, D]`` — equal to attention of each query block
    over its diagonal tile alone (tested), whatever the count (a repeated key block does not change
    softmax weights)."""
    check_device(q, k, v, kv_counts, what="math_only")  # CPU: the interpreter's bf16 fixes
    _, S, H, D = q.shape
    out = torch.empty_like(q)
    cnt = kv_counts[0].contiguous()
    _math_only[(S // block_size, H)](
        q,
        k,
        v,
        out,
        cnt,
        q.stride(1),
        q.stride(2),
        cnt.stride(0),
        D**-0.5 * LOG2E,
        HEAD_DIM=D,
        BLOCK=block_size,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
