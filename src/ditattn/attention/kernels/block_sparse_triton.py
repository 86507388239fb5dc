"""Fused block-sparse flash-attention forward (Triton).

One program computes one query block of ``block_size`` rows for one (batch, head): it walks the
block's key-block list with a run-time loop (``kv_counts[b, h, i]`` iterations), and for each
listed key block does the flash-attention step: ``S = Q K^T`` on the tensor cores, online softmax
in base 2 (``exp2`` with the ``log2(e)``-prescaled scale), ``acc += P V``.  Blocks that are not
listed cost nothing: no loads, no math.  With ``kv_per_iter = n > 1`` one loop iteration gathers
``n`` listed key blocks into one ``n * block_size``-wide tile (larger tensor-core tiles for small
blocks such as the 64-token 4x4x4 video tiles); an odd tail is masked.  Padding keys (``kv_valid``)
are masked only in the key blocks that hold some: the others cost one flag load.

Block-list format: ``kv_indices`` int32 ``[B, H, n_q_blocks, max_kv_blocks]``, ``kv_counts`` int32
``[B, H, n_q_blocks]`` (B and H may be 1: broadcast); the first ``kv_counts`` entries of a row are
the key blocks that query block attends (distinct, in ``[0, S_kv / block_size)``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import (
    FA4_AUTO_BLOCK_SIZES,
    LOG2E,
    SM90_AUTO_MIN_TOKENS,
    check_device,
    check_qkv,
    identity_cached,
    interpreting,
    last_dim_contiguous,
    launch_config,
)
from ditattn.errors import AttentionConfigError

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax step in base 2 over a score tile ``s [M, N]`` (``-inf`` = masked):
    ``(p, alpha, m_new, l_new)``; rescale the accumulator by ``alpha`` and add ``p @ V``.  Rows
    with no key yet stay at ``m = -inf, l = 0`` (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def softmax_finish(acc, m_i, l_i):
    """``(out = acc / l, lse in natural log)``; a row with no key gives zeros and LSE ``-inf``."""
    l_div = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_div)) * 0.6931471805599453)
    return acc / l_div[:, None], lse


@triton.jit
def _bs_attn_fwd(
    Q,
    K,
    V,
    Out,
    Lse,
    KvIdx,
    KvCnt,
    KvValid,
    KvPartial,
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
    stride_ib,
    stride_ih,
    stride_im,
    stride_cb,
    stride_ch,
    stride_valid_b,
    stride_partial_b,
    H,
    GROUP,
    qk_scale,
    Sq,
    Skv,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    KV_PER_ITER: tl.constexpr,
    HAS_VALID: tl.constexpr,
    RETURN_LSE: tl.constexpr,
    USE_TMA: tl.constexpr,
    WS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    BN: tl.constexpr = BLOCK * KV_PER_ITER

    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_r = tl.arange(0, BN)

    if USE_TMA:  # 2-D descriptors over [B * S, H * D] (S a multiple of BLOCK: tiles never cross a batch)
        q = QD.load([b * Sq + pid_m * BLOCK, h * HEAD_DIM])
    else:
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :])
    cnt = tl.load(KvCnt + b * stride_cb + h * stride_ch + pid_m)
    idx_base = KvIdx + b * stride_ib + h * stride_ih + pid_m * stride_im
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)

    for j in tl.range(0, cnt, KV_PER_ITER, warp_specialize=WS):
        if KV_PER_ITER == 1:
            kb = tl.load(idx_base + j)
            offs_n = kb * BLOCK + offs_r
        else:
            slot = offs_r // BLOCK
            live = (j + slot) < cnt
            kbv = tl.load(idx_base + j + slot, mask=live, other=0)
            offs_n = kbv * BLOCK + (offs_r % BLOCK)
            col_ok = live
        if USE_TMA:
            s = tl.dot(q, tl.trans(KD.load([b * Skv + kb * BLOCK, hk * HEAD_DIM]))) * qk_scale
        else:
            k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None])
            s = tl.dot(q, k) * qk_scale
        if KV_PER_ITER > 1:
            if HAS_VALID:
                col_ok = col_ok & (tl.load(KvValid + b * stride_valid_b + offs_n) != 0)
            s = tl.where(col_ok[None, :], s, float("-inf"))
        elif HAS_VALID:
            # only key blocks that hold padding pay for the per-key mask (one flag load otherwise)
            if tl.load(KvPartial + b * stride_partial_b + kb) != 0:
                kv_ok = tl.load(KvValid + b * stride_valid_b + offs_n) != 0
                s = tl.where(kv_ok[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = VD.load([b * Skv + kb * BLOCK, hk * HEAD_DIM])
        else:
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    out, lse = softmax_finish(acc, m_i, l_i)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        out.to(Out.dtype.element_ty),
    )
    if RETURN_LSE:
        tl.store(Lse + pid_bh * (tl.num_programs(0) * BLOCK) + offs_m, lse)


def default_config(block_size: int, head_dim: int) -> dict:
    """Launch configuration used when the caller passes none (tuned on the H200, see
    docs/benchmarks.md): ``kv_per_iter`` key blocks per loop iteration, ``num_warps``,
    ``num_stages``, ``tma`` (Q/K/V tiles through TMA descriptors; CUDA SM90+, one key block per
    iteration, contiguous q/k/v; otherwise pointer loads), ``warp_specialize`` (ask Triton to split
    the key loop into load and compute warps)."""
    if head_dim > 128:
        cfg = {"kv_per_iter": 1, "num_warps": 8 if block_size >= 128 else 4, "num_stages": 1}
    elif block_size >= 128:
        cfg = {"kv_per_iter": 1, "num_warps": 8, "num_stages": 3}
    elif block_size == 64:  # TMA, one stage: more programs resident per SM beat a deeper pipeline (H200)
        cfg = {"kv_per_iter": 1, "num_warps": 4, "num_stages": 1, "tma": True}
    else:
        cfg = {"kv_per_iter": 128 // block_size // 2, "num_warps": 4, "num_stages": 2}
    cfg.setdefault("tma", False)
    cfg["warp_specialize"] = False  # measured: no gain at 128, 1.6-1.8x slower at 64 (Triton 3.6, H200)
    return cfg


_POINTER_STAGES = 3  # pointer loads when a TMA default cannot run: one stage is slow there (H200: 1.90 vs 1.70x)
IMPLS = ("auto", "triton", "fa4", "sm90")
_PROBE_CACHE: dict = {}
_VALID_CACHE: dict = {}  # kv_valid -> (int8 mask, per key block 'holds padding' flags)


def _sm90_auto(q: torch.Tensor, block_size: int) -> bool:
    """Whether ``impl="auto"`` routes a call to the SM90 kernel: 64-token tiles, at least
    :data:`SM90_AUTO_MIN_TOKENS` query tokens, and the kernel can take it (SM90, head dim 64/128, a
    Triton with Gluon's Hopper API)."""
    if not q.is_cuda or block_size != 64 or q.shape[1] < SM90_AUTO_MIN_TOKENS:
        return False
    try:
        from ditattn.attention.kernels import block_sparse_sm90
    except ImportError:  # a Triton without Gluon's Hopper API: the Triton kernel serves
        return False
    return block_sparse_sm90.why_not(q, block_size) is None


def _probe_uncached(kv_valid, kv_counts, skv):
    if kv_counts is None:  # the caller vouches that no query block is empty
        empty = torch.zeros((), dtype=torch.bool, device=kv_valid.device)
    else:
        empty = (kv_counts == 0).any()
    if kv_valid is None:
        return skv, bool(empty)
    n = kv_valid[0].sum()
    bad = (kv_valid != (torch.arange(skv, device=kv_valid.device) < n)).any()
    n, bad, empty = torch.stack([n, bad.long(), empty.long()]).tolist()
    return (None if bad else int(n)), bool(empty)


def _probe(
    kv_valid: Optional[torch.Tensor], kv_counts: Optional[torch.Tensor], skv: int
) -> tuple[Optional[int], bool]:
    """``(valid prefix length or None, any empty query block)``; ``kv_counts`` None: the caller
    guarantees that every query block lists a key block (then only ``kv_valid`` is probed).

    Costs one device sync the first time a given ``(kv_valid, kv_counts)`` pair of tensor objects is
    seen; later calls with the same, unmodified objects (the usual case: a layer reuses its plan)
    hit a cache keyed by object identity and in-place version, so they do not sync.  With
    ``kv_counts`` None, new lists on every call (a planner that re-plans each step) cost no sync
    once their ``kv_valid`` object has been seen.
    """
    if kv_valid is None and kv_counts is None:
        return skv, False
    return identity_cached(
        _PROBE_CACHE, (kv_valid, kv_counts), (skv,), lambda: _probe_uncached(kv_valid, kv_counts, skv)
    )


def block_sparse_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_counts: torch.Tensor,
    *,
    block_size: int = 64,
    scale: Optional[float] = None,
    kv_valid: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    config: Optional[dict] = None,
    impl: str = "auto",
    nonempty_rows: bool = False,
):
    """Exact attention of each query block over its listed key blocks, fused in one kernel.

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` (fp16/bf16; ``H % H_kv == 0``; ``S_q`` and
    ``S_kv`` multiples of ``block_size``; D in 16/32/64/128/256); ``kv_indices`` int32
    ``[B|1, H|1, S_q/block_size, max_kv_blocks]`` and ``kv_counts`` int32 ``[B|1, H|1, S_q/block_size]``
    (entries past the count are ignored; listed entries must be distinct and in range: they are
    not bounds-checked on the device); ``kv_valid`` optional bool ``[B, S_kv]`` (False = padding key,
    masked).  ``scale`` defaults to ``D ** -0.5``.  ``config`` overrides the launch configuration
    (keys of :func:`default_config`; with ``impl="sm90"`` those of ``block_sparse_sm90.default_config``,
    checked by ``block_sparse_sm90.kernel_config`` on any device).
    Returns ``(out [B, S_q, H, D] in q.dtype, lse [B, H, S_q] float32 natural log, or None)``; a query
    row with no valid key gives zeros and LSE ``-inf``.

    ``impl``: ``"triton"`` runs the kernel of this module; ``"sm90"`` the warp-specialised Gluon kernel
    of :mod:`.block_sparse_sm90` (SM90, block size 64, head dim 64/128); ``nonempty_rows``: the caller
    guarantees ``kv_counts >= 1`` for every query block (the FA4 path then skips its emptiness check, a
    device sync for lists it has not seen); ``"fa4"`` runs FlashAttention-4's
    block-sparse forward with the same lists (SM90/SM100, block size 64 or 128, head dim <= 128,
    ``kv_valid`` None, one valid prefix shared by the batch, or padding inside blocks shared by the batch:
    :mod:`.block_sparse_fa4`); ``"auto"`` (default) takes FA4 for
    block size 128 when installed and the call fits (measured 1.11-1.35x faster than the Triton
    kernel on the H200, docs/benchmarks.md), the SM90 kernel for block size 64 from
    :data:`SM90_AUTO_MIN_TOKENS` query tokens on (no ``config`` given), else Triton (block size 64: ours,
    with its one-stage TMA default, measured 0-14 % faster than FA4's).
    """
    what = "block-sparse Triton kernel"
    if impl not in IMPLS:
        raise AttentionConfigError(f"{what}: impl {impl!r} not supported (accepts {list(IMPLS)})")
    B, Sq, Skv, H, Hkv, D = check_qkv(q, k, v, what=what, head_dims=SUPPORTED_HEAD_DIMS)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise AttentionConfigError(
            f"{what}: block_size {block_size} not supported (accepts {list(SUPPORTED_BLOCK_SIZES)})"
        )
    if impl == "sm90":  # config errors first, whatever the device: the SM90 kernel's own keys and values
        from ditattn.attention.kernels import block_sparse_sm90

        block_sparse_sm90.kernel_config(D, config)
    else:
        cfg = launch_config(default_config(block_size, D), config, what=what)
        kvpi = int(cfg["kv_per_iter"])
        if kvpi < 1 or kvpi & (kvpi - 1):
            raise AttentionConfigError(f"{what}: kv_per_iter must be a power of two >= 1, got {kvpi}")
    check_device(q, k, v, kv_indices, kv_counts, what=what)
    if Sq % block_size or Skv % block_size:
        raise AttentionConfigError(
            f"{what}: sequence lengths ({Sq}, {Skv}) must be multiples of block_size {block_size}; pad them "
            "and mark padded keys with kv_valid"
        )
    nq = Sq // block_size
    if kv_indices.dim() != 4 or kv_counts.dim() != 3 or kv_indices.shape[2] != nq or kv_counts.shape[2] != nq:
        raise AttentionConfigError(
            f"{what}: kv_indices must be [B, H, {nq}, max_kv_blocks] and kv_counts [B, H, {nq}]; got "
            f"{tuple(kv_indices.shape)} and {tuple(kv_counts.shape)}"
        )
    for t, name in ((kv_indices, "kv_indices"), (kv_counts, "kv_counts")):
        if t.dtype != torch.int32:
            raise AttentionConfigError(f"{what}: {name} must be int32, got {t.dtype}")
        if t.shape[0] not in (1, B) or t.shape[1] not in (1, H):
            raise AttentionConfigError(
                f"{what}: {name} batch/head dims {tuple(t.shape[:2])} must be ({B} or 1, {H} or 1)"
            )
    if kv_valid is not None and (kv_valid.dtype != torch.bool or tuple(kv_valid.shape) != (B, Skv)):
        raise AttentionConfigError(
            f"{what}: kv_valid must be bool [{B}, {Skv}], got {kv_valid.dtype} {tuple(kv_valid.shape)}"
        )
    if kv_indices.shape[3] == 0:
        kv_indices = torch.zeros(*kv_indices.shape[:3], 1, dtype=torch.int32, device=q.device)
    if impl == "auto" and config is None and _sm90_auto(q, block_size):
        impl = "sm90"
    elif impl == "sm90":
        why = block_sparse_sm90.why_not(q, block_size)
        if why:
            raise AttentionConfigError(f"{what}: impl 'sm90' cannot take this call: {why}")

    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    scale = D**-0.5 if scale is None else float(scale)
    if impl == "fa4" or (impl == "auto" and q.is_cuda and block_size in FA4_AUTO_BLOCK_SIZES):
        from ditattn.attention.kernels import block_sparse_fa4 as fa4

        why = fa4.fits(q, block_size)
        if why is None:
            # the path's only device sync (none for lists vouched non-empty once kv_valid has been seen)
            n, any_empty = _probe(kv_valid, None if nonempty_rows else kv_counts, Skv)
            if n is not None and Skv - n >= block_size:
                n = None  # a whole key block of padding: the mask path keeps the lists in range
            why = None if n is not None else fa4.shared_validity(kv_valid)
        if why is None:
            return fa4.call(
                q,
                k,
                v,
                kv_indices,
                kv_counts,
                block_size=block_size,
                scale=scale,
                kv_valid=kv_valid,
                valid_len=n,
                any_empty=any_empty,
                return_lse=return_lse,
            )
        if impl == "fa4":
            raise AttentionConfigError(f"{what}: impl 'fa4' cannot take this call: {why}")
    kv_indices = kv_indices.expand(B, H, -1, -1)
    kv_counts = kv_counts.expand(B, H, -1)
    if kv_indices.stride(-1) != 1:
        kv_indices = kv_indices.contiguous()
    if kv_counts.stride(-1) != 1:
        kv_counts = kv_counts.contiguous()
    if kv_valid is not None:  # int8 key mask + per key block "holds padding" flags, once per plan
        valid, partial = identity_cached(
            _VALID_CACHE,
            (kv_valid,),
            (block_size,),
            lambda: (kv_valid.to(torch.int8).contiguous(), (~kv_valid.view(B, -1, block_size).all(-1)).to(torch.int8)),
        )
    else:
        valid = partial = None
    if impl == "sm90":
        from ditattn.attention.kernels import block_sparse_sm90

        return block_sparse_sm90.launch(
            q, k, v, kv_indices, kv_counts, valid, partial, scale=scale, return_lse=return_lse, config=config
        )
    if valid is None:
        valid = partial = kv_counts  # unused placeholders
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if return_lse else out
    use_tma = (
        bool(cfg["tma"])
        and kvpi == 1
        and all(t.is_contiguous() for t in (q, k, v))
        and (interpreting() or torch.cuda.get_device_capability(q.device)[0] >= 9)
    )
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = (
            TensorDescriptor(q, [B * Sq, H * D], [H * D, 1], [block_size, D]),
            TensorDescriptor(k, [B * Skv, Hkv * D], [Hkv * D, 1], [block_size, D]),
            TensorDescriptor(v, [B * Skv, Hkv * D], [Hkv * D, 1], [block_size, D]),
        )
    else:
        descs = (q, k, v)  # unused placeholders
    grid = (nq, B * H)
    args = (
        q,
        k,
        v,
        out,
        lse,
        kv_indices,
        kv_counts,
        valid,
        partial,
        *descs,
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
        kv_indices.stride(0),
        kv_indices.stride(1),
        kv_indices.stride(2),
        kv_counts.stride(0),
        kv_counts.stride(1),
        valid.stride(0) if kv_valid is not None else 0,
        partial.stride(0) if kv_valid is not None else 0,
        H,
        H // Hkv,
        scale * LOG2E,
        Sq,
        Skv,
    )
    meta = dict(
        HEAD_DIM=D,
        BLOCK=block_size,
        KV_PER_ITER=kvpi,
        HAS_VALID=kv_valid is not None,
        RETURN_LSE=bool(return_lse),
        USE_TMA=use_tma,
        WS=bool(cfg["warp_specialize"]),
        num_warps=int(cfg["num_warps"]),
    )
    stages = int(cfg["num_stages"])
    if cfg["tma"] and not use_tma and "num_stages" not in (config or {}):
        stages = _POINTER_STAGES
    try:
        _bs_attn_fwd[grid](*args, **meta, num_stages=stages)
    except triton.runtime.errors.OutOfResources:
        _bs_attn_fwd[grid](*args, **meta, num_stages=1)
    return out, (lse if return_lse else None)


__all__ = [
    "block_sparse_attention_triton",
    "default_config",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_DIMS",
    "IMPLS",
]
