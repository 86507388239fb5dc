"""Warp-specialised block-sparse attention forward for Hopper (SM90) at 64-token tiles (Gluon).

The same contract as :func:`ditattn.attention.kernels.block_sparse_triton.block_sparse_attention_triton`
(per query block, exact attention over its listed key blocks; padded keys masked; LSE; GQA; an
empty list gives zeros and LSE -inf), organised for 64-row query tiles, where one warpgroup's
m64 products are too small to hide the softmax on their own:

* one CTA owns two query blocks of one (batch, head): two *consumer* warpgroups, each with its own
  query block, its own key-block list and its own ring of K/V shared-memory stages;
* one *producer* warp gathers the listed K and V tiles of both lists with TMA into the two rings
  (``mbarrier`` ready/empty pairs per stage), so the loads of one warpgroup's next tiles overlap
  both warpgroups' math;
* each consumer issues Q.K(j) before P(j-1).V(j-1) (asynchronous ``wgmma``), so its softmax runs
  under its own P.V product, and the two consumers' products interleave on the tensor cores.

bf16/fp16, head dim 64/128, block size 64.  Padding keys (``kv_valid``) are masked only in key
blocks flagged as holding padding.
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ditattn.attention.kernels.gluon_sm90 import finish_pv, ones_operand
from ditattn.attention.kernels import LOG2E, launch_config

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (64,)
BLOCK = gl.constexpr(64)


def default_config(head_dim: int) -> dict:
    """Launch configuration used when the caller passes none."""
    return {"num_stages": 2, "consumer_regs": 232, "producer_regs": 40, "static_max": True}


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, slot, ph, row, col):
    mbarrier.wait(k_empty.index(slot), ph ^ 1)
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(slot), k_smem.index(slot))
    mbarrier.wait(v_empty.index(slot), ph ^ 1)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              idx0_ptr, idx1_ptr, n0, n1, has1, q_row, q_col, kv_row, kv_col, NUM_STAGES: gl.constexpr):
    """Q tiles of the CTA's query blocks, then the listed K/V tiles of both lists, interleaved, into
    their rings (ring w, stage st is slot ``w * NUM_STAGES + st``)."""
    mbarrier.expect(q_bar.index(0), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar.index(0), q_smem.index(0))
    if has1:
        mbarrier.expect(q_bar.index(1), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + BLOCK, q_col], q_bar.index(1), q_smem.index(1))
    for i in range(gl.maximum(n0, n1)):
        st = i % NUM_STAGES
        ph = (i // NUM_STAGES) & 1
        if i < n0:
            kb = gl.load(idx0_ptr + i)
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, st, ph,
                     kv_row + kb * BLOCK, kv_col)
        if i < n1:
            kb = gl.load(idx1_ptr + i)
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, NUM_STAGES + st, ph,
                     kv_row + kb * BLOCK, kv_col)


@gluon.jit
def _scores(s, idx_ptr, valid_ptr, partial_ptr, i, HAS_VALID: gl.constexpr, s_layout: gl.constexpr):
    """Mask the padding keys of listed key block ``i`` (only when its 'holds padding' flag is set)."""
    if HAS_VALID:
        kb = gl.load(idx_ptr + i)
        if gl.load(partial_ptr + kb) != 0:
            ok = gl.load(valid_ptr + kb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))) != 0
            s = gl.where(ok[None, :], s, float("-inf"))
    return s


#: rows whose base-2 logits are bounded by this in magnitude (|q_i| * max_j |k_j| * scale * log2 e) run the
#: softmax without a running maximum: exp2 of the raw logit must stay inside the range of P's dtype —
#: bf16 has fp32's exponent range (2^±100 is safe, row sums of up to 2^20 keys included); fp16 overflows
#: past 65504 = 2^15.999 and loses precision below 2^-14, so its bound is 2^±15
LOGIT_LIMITS = {torch.bfloat16: 100.0, torch.float16: 15.0}


def kernel_constexprs(cfg: dict, head_dim: int, dtype: torch.dtype, *, has_valid: bool, return_lse: bool) -> dict:
    """The compile-time arguments of ``_bs_fwd_sm90`` for one call (``cfg``: a full launch config)."""
    return dict(HEAD_DIM=head_dim, NUM_STAGES=int(cfg["num_stages"]), HAS_VALID=bool(has_valid),
                RETURN_LSE=bool(return_lse), CONSUMER_REGS=int(cfg["consumer_regs"]),
                PRODUCER_REGS=int(cfg["producer_regs"]), STATIC_MAX=bool(cfg["static_max"]),
                LOGIT_LIMIT=LOGIT_LIMITS[dtype])


@gluon.jit
def _probs(s, m_i, l_i, qk_scale, STATIC_MAX: gl.constexpr):
    """exp2 of one tile of raw scores ``s`` (``-inf`` masked): ``(p, alpha, m, l)``.

    Static max: p = exp2(s * qk_scale), no rescale (alpha 1), the row sums come from the tensor cores.
    Otherwise one online-softmax step in base 2 (``m`` in raw-score units; a row with no key yet
    stays at m = -inf, l = 0, no NaN)."""
    if STATIC_MAX:
        return gl.exp2(s * qk_scale), m_i, m_i, l_i
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(gl.fma(s, qk_scale, -(m_use * qk_scale)[:, None]))
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _kv_loop(WG: gl.constexpr, q, n, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty, idx_ptr,
             valid_ptr, partial_ptr, qk_scale, STATIC_MAX: gl.constexpr, HEAD_DIM: gl.constexpr,
             NUM_STAGES: gl.constexpr, HAS_VALID: gl.constexpr):
    """The ``n >= 1`` listed key blocks of one query block: ``(acc [64, D], l [64], m [64])``.

    Q.K(i) is issued before P(i-1).V(i-1) (and, with the static max, P(i-1) x ones for the row sums),
    so the softmax of block i runs under the products of block i-1."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dt: gl.constexpr = v_smem.dtype
    base: gl.constexpr = WG * NUM_STAGES

    m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_s)
    if STATIC_MAX:
        m_i = gl.zeros([BLOCK], gl.float32, row_s)
    l_i = gl.zeros([BLOCK], gl.float32, row_s)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)
    l_acc = gl.zeros([BLOCK, 8], gl.float32, l_layout)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)

    mbarrier.wait(k_ready.index(base), 0)
    s_tok = warpgroup_mma(q, k_smem.index(base).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(base), count=1)
    s = _scores(s, idx_ptr, valid_ptr, partial_ptr, 0, HAS_VALID, s_layout)
    p, alpha, m_i, l_i = _probs(s, m_i, l_i, qk_scale, STATIC_MAX)
    p_prev = gl.convert_layout(p.to(dt), p_layout)
    for i in range(1, n):
        st = base + i % NUM_STAGES
        sp = base + (i - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(st), (i // NUM_STAGES) & 1)
        mbarrier.wait(v_ready.index(sp), ((i - 1) // NUM_STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_prev, v_smem.index(sp), acc, is_async=True)
        if STATIC_MAX:
            pl = gl.convert_layout(p_prev, pl_layout)
            l_tok = warpgroup_mma(pl, ones_smem.permute((1, 0)), l_acc, is_async=True)
            s = warpgroup_mma_wait(2, deps=(s_tok,))
        else:
            s = warpgroup_mma_wait(1, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(st), count=1)
        s = _scores(s, idx_ptr, valid_ptr, partial_ptr, i, HAS_VALID, s_layout)
        p, alpha, m_i, l_i = _probs(s, m_i, l_i, qk_scale, STATIC_MAX)
        p_next = gl.convert_layout(p.to(dt), p_layout)
        # P(i-1) stays in deps until its products are done (else ptxas serialises every wgmma)
        if STATIC_MAX:
            acc, l_acc, _p, _pl = warpgroup_mma_wait(0, deps=(o_tok, l_tok, p_prev, pl))
        else:
            acc, _p = warpgroup_mma_wait(0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(sp), count=1)
        if not STATIC_MAX:
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_prev = p_next
    sp = base + (n - 1) % NUM_STAGES
    mbarrier.wait(v_ready.index(sp), ((n - 1) // NUM_STAGES) & 1)
    acc, l_i = finish_pv(p_prev, v_smem.index(sp), acc, l_acc, l_i, ones_smem, STATIC_MAX, pl_layout, row_s)
    mbarrier.arrive(v_empty.index(sp), count=1)
    return acc, l_i, m_i


@gluon.jit
def _consumer(WG: gl.constexpr, q_smem, k_smem, v_smem, ones_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              o_desc, idx_ptr, n, live, valid_ptr, partial_ptr, lse_ptr, qn_ptr, kn, o_row, o_col, qk_scale,
              HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_VALID: gl.constexpr, RETURN_LSE: gl.constexpr,
              STATIC_MAX: gl.constexpr, LOGIT_LIMIT: gl.constexpr):
    """One query block (64 rows) over its ``n`` listed key blocks, then the epilogue.  With
    ``STATIC_MAX`` the rows' logit bound (``qn_i * kn``) decides once whether the loop runs without a
    running maximum (bound <= ``LOGIT_LIMIT``, see :data:`LOGIT_LIMITS`)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK], gl.float32, row_s)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)
    q = q_smem.index(WG)
    rows = gl.arange(0, BLOCK, layout=row_s)
    if live:
        mbarrier.wait(q_bar.index(WG), 0)
    if n > 0:
        if STATIC_MAX:
            if gl.max(gl.load(qn_ptr + rows), 0) * kn <= LOGIT_LIMIT:
                acc, l_i, m_i = _kv_loop(WG, q, n, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
                                         idx_ptr, valid_ptr, partial_ptr, qk_scale, True, HEAD_DIM, NUM_STAGES,
                                         HAS_VALID)
            else:
                acc, l_i, m_i = _kv_loop(WG, q, n, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
                                         idx_ptr, valid_ptr, partial_ptr, qk_scale, False, HEAD_DIM, NUM_STAGES,
                                         HAS_VALID)
        else:
            acc, l_i, m_i = _kv_loop(WG, q, n, k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty,
                                     idx_ptr, valid_ptr, partial_ptr, qk_scale, False, HEAD_DIM, NUM_STAGES,
                                     HAS_VALID)
    if live:
        l_o = gl.convert_layout(l_i, row_o)
        out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
        q.store(out.to(o_desc.dtype))  # the Q tile's buffer holds the output tile
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [o_row, o_col], q)
        if RETURN_LSE:
            m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
            lse = gl.where(l_i == 0.0, float("-inf"), (m_fin * qk_scale + gl.log2(l_i)) * 0.6931471805599453)
            gl.store(lse_ptr + rows, lse)
        tma.store_wait(0)


@gluon.jit
def _bs_fwd_sm90(q_desc, k_desc, v_desc, o_desc, idx_ptr, cnt_ptr, valid_ptr, partial_ptr, lse_ptr, qn_ptr, kn_ptr,
                 H, GROUP, nq, Sq, Skv, qk_scale, stride_ib, stride_ih, stride_im, stride_cb, stride_ch,
                 stride_vb, stride_pb,
                 HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_VALID: gl.constexpr,
                 RETURN_LSE: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                 STATIC_MAX: gl.constexpr, LOGIT_LIMIT: gl.constexpr):
    pid = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    qb0 = 2 * pid
    has1 = qb0 + 1 < nq
    cnt_row = cnt_ptr + b * stride_cb + h * stride_ch
    n0 = gl.load(cnt_row + qb0)
    n1 = gl.load(cnt_row + qb0 + 1, mask=has1, other=0)
    idx0 = idx_ptr + b * stride_ib + h * stride_ih + qb0 * stride_im
    idx1 = idx0 + stride_im

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2 * NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2 * NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    # the B operand of the row-sum product P x ones (K-major [8, BLOCK], read transposed)
    ones_smem = k_smem.index(0)  # placeholder (rank 2), unused without the static max
    if STATIC_MAX:
        ones_smem = ones_operand(v_desc.dtype, BLOCK)  # row sums of P on the tensor cores
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
    for i in gl.static_range(2 * NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)

    q_row = b * Sq + qb0 * BLOCK
    valid_b = valid_ptr + b * stride_vb
    partial_b = partial_ptr + b * stride_pb
    lse_row = lse_ptr + pid_bh * Sq + qb0 * BLOCK
    qn_row = qn_ptr + pid_bh * Sq + qb0 * BLOCK
    kn = 0.0
    if STATIC_MAX:
        kn = gl.load(kn_ptr + b * (H // GROUP) + hk)
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, ones_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, idx0,
                     n0, True, valid_b, partial_b, lse_row, qn_row, kn, q_row, h * HEAD_DIM, qk_scale, HEAD_DIM,
                     NUM_STAGES, HAS_VALID, RETURN_LSE, STATIC_MAX, LOGIT_LIMIT)),
        (_consumer, (1, q_smem, k_smem, v_smem, ones_smem, q_bar, k_ready, k_empty, v_ready, v_empty, o_desc, idx1,
                     n1, has1, valid_b, partial_b, lse_row + BLOCK, qn_row + BLOCK, kn, q_row + BLOCK,
                     h * HEAD_DIM, qk_scale, HEAD_DIM, NUM_STAGES, HAS_VALID, RETURN_LSE, STATIC_MAX, LOGIT_LIMIT)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                     idx0, idx1, n0, n1, has1, q_row, h * HEAD_DIM, b * Skv, hk * HEAD_DIM, NUM_STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def why_not(q: torch.Tensor, block_size: int) -> Optional[str]:
    """Why this kernel cannot serve a call (None: it can)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "needs an SM90 (Hopper) GPU"
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block size {block_size} (accepts {list(SUPPORTED_BLOCK_SIZES)})"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[-1]} (accepts {list(SUPPORTED_HEAD_DIMS)})"
    return None


def launch(q, k, v, kv_indices, kv_counts, valid, partial, *, scale: float, return_lse: bool,
           config: Optional[dict] = None):
    """Launch on validated inputs: q/k/v ``[B, S, H|H_kv, D]`` (last dim contiguous), lists expanded to
    ``[B, H, ...]`` int32 with unit last stride, ``valid`` int8 ``[B, S_kv]`` and ``partial`` int8
    ``[B, S_kv / 64]`` (or both None without padding keys).  Returns ``(out, lse | None)``."""
    what = "block-sparse SM90 kernel"
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    cfg = launch_config(default_config(D), config, what=what)
    q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
    nq = Sq // BLOCK.value
    has_valid = valid is not None
    if not has_valid:
        valid = partial = kv_counts  # unused placeholders
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if return_lse else out
    static = bool(cfg["static_max"])
    if static:  # logit bound factors: |q_i| * scale * log2 e per row [B, H, Sq], max_j |k_j| per (b, kv head)
        qn = (torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32) * (scale * LOG2E)).transpose(1, 2).contiguous()
        kn = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax(dim=1).contiguous()
    else:
        qn = kn = lse
    gdt = gl.float16 if q.dtype == torch.float16 else gl.bfloat16
    bs = BLOCK.value
    lay = gl.NVMMASharedLayout.get_default_for([bs, D], gdt)
    qd = TensorDescriptor(q, [B * Sq, H * D], [H * D, 1], [bs, D], lay)
    kd = TensorDescriptor(k, [B * Skv, Hkv * D], [Hkv * D, 1], [bs, D], lay)
    vd = TensorDescriptor(v, [B * Skv, Hkv * D], [Hkv * D, 1], [bs, D], lay)
    od = TensorDescriptor(out, [B * Sq, H * D], [H * D, 1], [bs, D], lay)
    _bs_fwd_sm90[((nq + 1) // 2, B * H)](
        qd, kd, vd, od, kv_indices, kv_counts, valid, partial, lse, qn, kn,
        H, H // Hkv, nq, Sq, Skv, scale * LOG2E,
        kv_indices.stride(0), kv_indices.stride(1), kv_indices.stride(2), kv_counts.stride(0), kv_counts.stride(1),
        valid.stride(0) if has_valid else 0, partial.stride(0) if has_valid else 0,
        **kernel_constexprs(cfg, D, q.dtype, has_valid=has_valid, return_lse=return_lse), num_warps=4, maxnreg=168,
    )
    return out, (lse if return_lse else None)


__all__ = ["launch", "why_not", "default_config", "kernel_constexprs", "LOGIT_LIMITS", "SUPPORTED_BLOCK_SIZES",
           "SUPPORTED_HEAD_DIMS"]
