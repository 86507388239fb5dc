"""The block selection stage of the pooled sparse planners (VSA, Sparge, SLA) in three Triton kernels,
and Sol's block moments.

**Pooling** (:func:`pool_qk_blocks`): one program per (video block, batch x head) loads the
``[block_size, D]`` tile of tiled q and of tiled k, sums each in float32, divides by the block's
real-token count (padding rows are zero, as :func:`ditattn.attention.sparse.tiling.tile` leaves
them) and multiplies the q mean by the attention scale. Pooled q and k come from one launch, with
no float32 copies, permutes or scaling passes.

**Block moments** (:func:`pool_block_moments`, Sol's routing and centroids): the same program shape
over one tensor, writing each block's mean and, for the keys, the per-channel variance from the same
read (the PyTorch path squares a float32 copy of the whole tensor).

**Top-k to block lists** (:func:`topk_block_lists`): one program per (batch, head, query block).
It loads the query block's row of ``nv`` float32 scores and maps each score to an int32 key with
the same order (sign-magnitude to two's complement; ``-0.0`` counts as ``+0.0``, NaN as the largest
value). A bitwise search over the key, with one count per step, finds the k-th largest key ``T``:
at most 32 steps, fewer when the count reaches exactly ``k`` earlier (about 15 at 513 blocks,
k = 52, random q/k). The row keeps every key above ``T``, plus the lowest-indexed keys equal to
``T`` until ``k`` are kept, so ties go to the lower block index, deterministically. A prefix sum
places the kept block ids in ascending order. The program then appends the special blocks and zeros, so it writes
the final int32 ``kv_indices`` row directly. Special query rows get every block. The kernel has no
sort, no ``[B, H, nv, k]`` int64 intermediate, no casts and no concatenation.

**Video mask to block lists** (:func:`mask_block_lists`, Sparge's ``cdfthreshd`` rows of varying
length): one program per (batch, head, query block) loads the query block's row of the video
block mask (the rule's output, :func:`ditattn.attention.sparse.common.mass_mask`), places the True
block ids in ascending order with an integer prefix sum, appends the special blocks and zeros and
writes the row's count: the final ``kv_indices`` / ``kv_counts`` of one launch, in place of the
widened ``[nb, nb]`` mask and its per-row argsort.  Integer arithmetic only, so it equals the
PyTorch path bit for bit.

:func:`ditattn.attention.sparse.common.topk_lists` (reference: a stable descending sort),
:func:`ditattn.attention.sparse.common.video_mask_lists` and
:func:`ditattn.attention.sparse.tiling.pooled_blocks` are the PyTorch paths of the same
contracts. On identical inputs the paths give identical blocks.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import check_device
from ditattn.attention.kernels.block_quant import block_head_program
from ditattn.errors import AttentionConfigError

# row width (video blocks) one top-k program holds in registers; wider rows take the PyTorch path
MAX_TOPK_BLOCKS = 8192
POOL_HEAD_DIMS = (16, 32, 64, 128, 256)
POOL_BLOCK_SIZES = (16, 32, 64, 128)


@triton.jit
def _pool_qk(
    Q,
    K,
    Count,
    PQ,
    PK,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    H,
    NV,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    blk, bh, b, h, offs_s, offs_d = block_head_program(H, BLOCK, HEAD_DIM)
    cnt = tl.load(Count + blk)  # float32, clamped to >= 1
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_s[:, None] * stride_qs + offs_d[None, :])
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_s[:, None] * stride_ks + offs_d[None, :])
    out = (bh * NV + blk) * HEAD_DIM + offs_d  # [B, H, NV, D] contiguous
    # the PyTorch path's operations in its order: sum, divide (IEEE), then the scale
    tl.store(PQ + out, tl.div_rn(tl.sum(q.to(tl.float32), 0), cnt) * scale)
    tl.store(PK + out, tl.div_rn(tl.sum(k.to(tl.float32), 0), cnt))


@triton.jit
def _pool_moments(
    X,
    Count,
    Mean,
    Var,
    stride_xb,
    stride_xs,
    stride_xh,
    H,
    NV,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    VARIANCE: tl.constexpr,
):
    blk, bh, b, h, offs_s, offs_d = block_head_program(H, BLOCK, HEAD_DIM)
    cnt = tl.load(Count + blk)  # float32, clamped to >= 1
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs + offs_d[None, :]).to(tl.float32)
    out = (bh * NV + blk) * HEAD_DIM + offs_d  # [B, H, NV, D] contiguous
    mean = tl.div_rn(tl.sum(x, 0), cnt)
    tl.store(Mean + out, mean)
    if VARIANCE:  # padding rows are zero: the sums run over the real tokens
        tl.store(Var + out, tl.maximum(tl.div_rn(tl.sum(x * x, 0), cnt) - mean * mean, 0.0))


@triton.jit
def _list_program(Out, H, NB, W):
    """A list-building program's (query block ``i``, batch ``b``, head ``h``, ``bh``, its output row)."""
    i = tl.program_id(0)  # query block
    bh = tl.program_id(1)
    return i, bh // H, bh % H, bh, Out + (bh * NB + i) * W


@triton.jit
def _store_tail(out_row, offs, count, NV, NB, W):
    """After a video row's ``count`` ids: the special blocks (ids NV..NB-1), then zeros up to ``W``."""
    rest = offs - count
    tl.store(out_row + offs, tl.where(rest < NB - NV, NV + rest, 0), mask=(rest >= 0) & (offs < W))


@triton.jit
def _topk_lists(
    S,
    Out,
    stride_sb,
    stride_sh,
    stride_si,
    H,
    NV,
    NB,
    K,
    W,
    BLOCK_N: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    i, b, h, bh, out_row = _list_program(Out, H, NB, W)
    offs = tl.arange(0, BLOCK_N)
    if i < NV:
        valid = offs < NV
        s = tl.load(S + b * stride_sb + h * stride_sh + i * stride_si + offs, mask=valid, other=0.0)
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 ranks as +0.0
        s = tl.where(s != s, float("nan"), s)  # one NaN, above +inf
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order == float order
        key = tl.where(valid, key, -2147483648)
        # t -> the k-th largest key (the largest t with count(key >= t) >= K), built from the top bit;
        # stop early once count(key >= t) == K: then no tie crosses the cut and {key >= t} is the answer
        c0 = tl.sum((key >= 0).to(tl.int32), 0)
        t = tl.where(c0 >= K, 0, -2147483648)
        c = tl.where(c0 >= K, c0, NV)  # count(key >= t)
        bit = 30
        while (bit >= 0) & (c != K):
            cand = t | (1 << bit)
            cc = tl.sum((key >= cand).to(tl.int32), 0)
            t = tl.where(cc >= K, cand, t)
            c = tl.where(cc >= K, cc, c)
            bit -= 1
        above = key > t
        tied = (key == t) & valid
        take = tied & (tl.cumsum(tied.to(tl.int32), 0) <= K - tl.sum(above.to(tl.int32), 0))
        sel = above | take
        slot = tl.cumsum(sel.to(tl.int32), 0) - 1  # ascending block ids
        tl.store(out_row + slot, offs, mask=sel)
        if HAS_TAIL:
            _store_tail(out_row, offs, K, NV, NB, W)
    else:  # a special query block attends every block
        tl.store(out_row + offs, offs, mask=offs < NB)


@triton.jit
def _mask_lists(
    M,
    Out,
    Cnt,
    stride_mb,
    stride_mh,
    stride_mi,
    H,
    NV,
    NB,
    W,
    BLOCK_N: tl.constexpr,
):
    i, b, h, bh, out_row = _list_program(Out, H, NB, W)
    offs = tl.arange(0, BLOCK_N)
    if i < NV:
        m = tl.load(M + b * stride_mb + h * stride_mh + i * stride_mi + offs, mask=offs < NV, other=0)
        sel = m != 0
        run = tl.cumsum(sel.to(tl.int32), 0)  # True blocks up to and including each column
        c = tl.sum(sel.to(tl.int32), 0)
        tl.store(out_row + run - 1, offs, mask=sel & (run <= W))  # ascending block ids, cut at W
        _store_tail(out_row, offs, c, NV, NB, W)
        tl.store(Cnt + bh * NB + i, c + NB - NV)
    else:  # a special query block attends every block
        tl.store(out_row + offs, offs, mask=offs < W)
        tl.store(Cnt + bh * NB + i, NB)


def _check_pool_shape(what: str, D: int, P: int, count: torch.Tensor, *, n_blocks: int, block_size: int) -> None:
    """The pooling kernels' shared limits: head dim, block size, the blocks within the ``P`` tiled rows, and the
    float32 real-token count per block."""
    if D not in POOL_HEAD_DIMS or block_size not in POOL_BLOCK_SIZES or n_blocks * block_size > P:
        raise AttentionConfigError(
            f"{what}: needs head dim in {list(POOL_HEAD_DIMS)}, block_size in 16..128 (power "
            f"of two) and {n_blocks} blocks within {P} rows; got D={D}, block_size={block_size}"
        )
    if count.dtype != torch.float32 or count.dim() != 1 or count.numel() < n_blocks:
        raise AttentionConfigError(f"{what}: count must be float32 [>= {n_blocks}]")


def pool_qk_blocks(
    q_tiled: torch.Tensor, k_tiled: torch.Tensor, count: torch.Tensor, *, n_blocks: int, block_size: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale * mean(q), mean(k))`` per block: float32 ``[B, H, n_blocks, D]`` each.

    q_tiled / k_tiled: ``[B, P, H, D]`` fp16/bf16/fp32 in tile order (same shape, ``P >= n_blocks *
    block_size``, padding rows zero); count: float32 ``[>= n_blocks]``, the real tokens per block
    clamped to >= 1; block_size a power of two 16..128; D a power of two 16..256.  Runs on CUDA, or
    on CPU under ``TRITON_INTERPRET=1``.
    """
    what = "block pooling kernel"
    check_device(q_tiled, k_tiled, count, what=what)
    if q_tiled.dim() != 4 or q_tiled.shape != k_tiled.shape:
        raise AttentionConfigError(
            f"{what}: q and k must be one shape [B, P, H, D]; got {tuple(q_tiled.shape)}, {tuple(k_tiled.shape)}"
        )
    B, P, H, D = q_tiled.shape
    if q_tiled.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k_tiled.dtype != q_tiled.dtype:
        raise AttentionConfigError(
            f"{what}: q/k must share float16, bfloat16 or float32; got {q_tiled.dtype}, {k_tiled.dtype}"
        )
    _check_pool_shape(what, D, P, count, n_blocks=n_blocks, block_size=block_size)
    q_tiled, k_tiled = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_tiled, k_tiled))
    pq = torch.empty(B, H, n_blocks, D, dtype=torch.float32, device=q_tiled.device)
    pk = torch.empty_like(pq)
    if pq.numel():
        _pool_qk[(n_blocks, B * H)](
            q_tiled,
            k_tiled,
            count,
            pq,
            pk,
            q_tiled.stride(0),
            q_tiled.stride(1),
            q_tiled.stride(2),
            k_tiled.stride(0),
            k_tiled.stride(1),
            k_tiled.stride(2),
            H,
            n_blocks,
            float(scale),
            HEAD_DIM=D,
            BLOCK=block_size,
            num_warps=4,
        )
    return pq, pk


def pool_block_moments(
    x_tiled: torch.Tensor, count: torch.Tensor, *, n_blocks: int, block_size: int, variance: bool = False
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(mean, per-channel variance or None)`` of the real tokens of each of the first ``n_blocks``
    blocks: float32 ``[B, H, n_blocks, D]`` each, from one read of the tile (no float32 copy of it).

    x_tiled: ``[B, P, H, D]`` fp16/bf16/fp32 in tile order (``P >= n_blocks * block_size``, padding rows
    zero, unit stride on D); count: float32 ``[>= n_blocks]``, the real tokens per block clamped to
    >= 1; block_size a power of two 16..128; D a power of two 16..256.  The variance is the population
    one, ``max(mean(x^2) - mean(x)^2, 0)``, summed in float32 as the PyTorch path
    (:func:`ditattn.attention.sparse.block_scores.pooled_query_features`) does.  Runs on CUDA, or on CPU
    under ``TRITON_INTERPRET=1``.
    """
    what = "block moments kernel"
    check_device(x_tiled, count, what=what)
    if x_tiled.dim() != 4 or x_tiled.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise AttentionConfigError(
            f"{what}: x must be float16, bfloat16 or float32 [B, P, H, D]; got {x_tiled.dtype} {tuple(x_tiled.shape)}"
        )
    B, P, H, D = x_tiled.shape
    _check_pool_shape(what, D, P, count, n_blocks=n_blocks, block_size=block_size)
    x_tiled = x_tiled if x_tiled.stride(-1) == 1 else x_tiled.contiguous()
    mean = torch.empty(B, H, n_blocks, D, dtype=torch.float32, device=x_tiled.device)
    var = torch.empty_like(mean) if variance else None
    if mean.numel():
        _pool_moments[(n_blocks, B * H)](
            x_tiled,
            count,
            mean,
            var if variance else mean,  # a placeholder pointer when unused
            x_tiled.stride(0),
            x_tiled.stride(1),
            x_tiled.stride(2),
            H,
            n_blocks,
            HEAD_DIM=D,
            BLOCK=block_size,
            VARIANCE=bool(variance),
            num_warps=4,
        )
    return mean, var


def topk_block_lists(scores: torch.Tensor, k: int, *, n_blocks: int) -> torch.Tensor:
    """``kv_indices`` int32 ``[B, H, n_blocks, W]`` of "video query block ``i`` keeps its ``k``
    best-scoring video key blocks (ties: the lower block id), ascending, then the special blocks
    ``nv .. n_blocks - 1``, then zeros; a special query block keeps every block".

    scores: float32 ``[B, H, nv, nv]`` (last dim contiguous); ``1 <= k <= nv <= MAX_TOPK_BLOCKS``;
    ``n_blocks >= nv`` (``ns = n_blocks - nv`` special blocks); ``W = k`` without special blocks,
    else ``n_blocks`` (the width of :func:`ditattn.attention.sparse.block_sparse.block_mask_to_lists`).
    Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
    """
    what = "top-k block selection kernel"
    check_device(scores, what=what)
    if scores.dim() != 4 or scores.dtype != torch.float32 or scores.shape[2] != scores.shape[3]:
        raise AttentionConfigError(
            f"{what}: scores must be float32 [B, H, nv, nv]; got {scores.dtype} {tuple(scores.shape)}"
        )
    B, H, nv, _ = scores.shape
    if not 1 <= nv <= MAX_TOPK_BLOCKS or not 1 <= k <= nv or n_blocks < nv:
        raise AttentionConfigError(
            f"{what}: needs 1 <= k <= nv <= {MAX_TOPK_BLOCKS} and n_blocks >= nv; got k={k}, "
            f"nv={nv}, n_blocks={n_blocks}"
        )
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    width = k if n_blocks == nv else n_blocks
    out = torch.empty(B, H, n_blocks, width, dtype=torch.int32, device=scores.device)
    block_n = triton.next_power_of_2(max(n_blocks, 16))
    if out.numel():
        _topk_lists[(n_blocks, B * H)](
            scores,
            out,
            scores.stride(0),
            scores.stride(1),
            scores.stride(2),
            H,
            nv,
            n_blocks,
            int(k),
            width,
            BLOCK_N=block_n,
            HAS_TAIL=width > k,
            num_warps=max(1, min(16, block_n // 256)),
        )
    return out


def mask_block_lists(video_mask: torch.Tensor, *, n_blocks: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_indices int32 [B, H, n_blocks, width], kv_counts int32 [B, H, n_blocks])`` of "video query
    block ``i`` keeps the video key blocks ``j`` with ``video_mask[b, h, i, j]``, ascending, then the
    special blocks ``nv .. n_blocks - 1``, then zeros (rows cut at ``width``, counts kept); a special
    query block keeps every block" — :func:`ditattn.attention.sparse.common.video_mask_lists`.

    video_mask: bool ``[B, H, nv, nv]`` (last dim contiguous); ``1 <= nv <= n_blocks <=
    MAX_TOPK_BLOCKS``; ``1 <= width <= n_blocks``.  Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``.
    """
    what = "block-mask list kernel"
    check_device(video_mask, what=what)
    if video_mask.dim() != 4 or video_mask.dtype != torch.bool or video_mask.shape[2] != video_mask.shape[3]:
        raise AttentionConfigError(
            f"{what}: video_mask must be bool [B, H, nv, nv]; got {video_mask.dtype} {tuple(video_mask.shape)}"
        )
    B, H, nv, _ = video_mask.shape
    if not 1 <= nv <= n_blocks <= MAX_TOPK_BLOCKS or not 1 <= width <= n_blocks:
        raise AttentionConfigError(
            f"{what}: needs 1 <= nv <= n_blocks <= {MAX_TOPK_BLOCKS} and 1 <= width <= "
            f"n_blocks; got nv={nv}, n_blocks={n_blocks}, width={width}"
        )
    if video_mask.stride(-1) != 1:
        video_mask = video_mask.contiguous()
    m = video_mask.view(torch.uint8)
    out = torch.empty(B, H, n_blocks, width, dtype=torch.int32, device=video_mask.device)
    cnt = torch.empty(B, H, n_blocks, dtype=torch.int32, device=video_mask.device)
    block_n = triton.next_power_of_2(max(n_blocks, 16))
    if out.numel():
        _mask_lists[(n_blocks, B * H)](
            m,
            out,
            cnt,
            m.stride(0),
            m.stride(1),
            m.stride(2),
            H,
            nv,
            n_blocks,
            int(width),
            BLOCK_N=block_n,
            num_warps=max(1, min(16, block_n // 256)),
        )
    return out, cnt


__all__ = [
    "pool_qk_blocks",
    "topk_block_lists",
    "mask_block_lists",
    "MAX_TOPK_BLOCKS",
    "POOL_HEAD_DIMS",
    "POOL_BLOCK_SIZES",
]
