"""Warp-specialised quantized attention for Hopper (SM90), written in Triton's Gluon dialect.

The same math as :mod:`ditattn.attention.kernels.int8_attention` (SageAttention-style: K smoothed
by its token mean, Q and K in INT8 with per-token / per-block scales, online softmax in FP32,
P.V on the FP16/BF16 tensor cores), organised the way Hopper needs it to pass the bf16 roofline:

* one CTA owns 128 query rows of one (batch, head): two *consumer* warpgroups of 64 rows each, and
  one *producer* warp that streams K and V tiles into a ring of shared-memory stages with TMA
  (``cp.async.bulk.tensor``) and signals them through ``mbarrier``\\ s;
* each consumer issues its Q.K product as an asynchronous ``wgmma`` (INT8 x INT8 -> INT32) and its
  P.V product as an asynchronous ``wgmma`` with P in registers, so one warpgroup's softmax runs
  while the other warpgroup's products occupy the tensor cores;
* registers are re-balanced with ``setmaxnreg``: 240 per consumer thread, 24 for the producer.

P.V precision (config ``pv_dtype``): ``fp16`` — P rounded to V's dtype, V read in place; or ``fp8``
(SageAttention2's design) — P = ``exp2(t - m + 8)`` in (0, 256] rounded to FP8 e4m3 in registers,
V in e4m3 with one scale per channel (optionally smoothed by its channel mean, ``v_smooth``: the rows
of P sum to 1, so the mean is added back in the epilogue), stored transposed ``[D, S]`` (the FP8
``wgmma`` reads B K-major) with the tokens of every 16 permuted so that P's accumulator registers
*are* the A operand's registers (no shuffles; :func:`_p_operand`), and P.V either accumulated
directly or, with ``pv_accum`` "two_level", per key tile into a fresh FP32 accumulator added to the
main one (the FP8 tensor cores accumulate with fewer mantissa bits than FP32).  The FP8 path runs
the online softmax (a static maximum would put P outside e4m3's range) with the row sums of P (before
rounding) in FP32 on the CUDA cores, like the fp16 online softmax: an FP8 ``P x ones`` product on the
tensor cores (m64n8k32) gave wrong row sums on the H200 (docs/sage_kernel.md).

Quantization prologue: the Triton passes of :mod:`.int8_quant` (one pass over Q, one mean and one
pass over K; with config ``qk_balance`` a statistics pass over each of Q and K, K's mean from the
second, and one small launch for the balance factors, before the same two quantization passes; V is
read in place through a TMA descriptor (fp16) or quantized in two passes, channel statistics then the
transposed FP8 copy (fp8)).  Head dims 64 and 128; any lengths
(keys past the end are masked in the last tile; query rows past the end are not stored); GQA.
Non-causal only (the DiT's attention); the Triton kernel serves ``causal=True``.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ditattn.attention.kernels import check_device, check_qkv, last_dim_contiguous, launch_config, num_sms
from ditattn.attention.kernels.gluon_sm90 import (
    LOGIT_LIMIT_BF16,
    LOGIT_LIMIT_FP16,
    fp8_pack,
    issue_pv,
    ones_operand,
    rescale,
    retire_pv,
    ring_slot,
    smem_layout,
)
from ditattn.attention.kernels.int8_reference import check_qk_balance
from ditattn.errors import AttentionConfigError

SUPPORTED_HEAD_DIMS = (64, 128)
BLOCK_M = gl.constexpr(128)  # query rows per CTA (two consumer warpgroups of 64)
WG_M = gl.constexpr(64)
INT_MAGIC = gl.constexpr(0x4B400000)  # bits of 1.5 * 2^23: (x + magic) as fp32 is 12582912 + x for |x| < 2^22
INT_MAGIC_F = gl.constexpr(12582912.0)
#: FP8 P.V: P = exp2(t - m + P_SHIFT) lies in (0, 2^8], inside e4m3's normal range (max 448)
P_SHIFT = gl.constexpr(8.0)
PV_DTYPES = ("fp16", "fp8")
PV_ACCUMS = ("two_level", "direct")


def default_config(head_dim: int, pv_dtype: str = "fp16") -> dict:
    """Launch configuration used when the caller passes none (``pv_dtype`` picks the softmax: the
    static maximum for fp16 P.V, the online one for fp8).  ``qk_balance`` (alpha in (0, 1]; None: off)
    is the per-channel Q/K balance of the INT8 prologue (:func:`.int8_quant.quantize_qk`); the
    kernel itself is the same.  ``persistent``: one CTA per SM looping over the query tiles (the next
    tile's loads under the current tile's last products and epilogue) instead of one CTA per tile."""
    return {
        "block_n": 128,
        "num_stages": 2,
        "consumer_regs": 240,
        "producer_regs": 24,
        "k_granularity": "token",
        "pingpong": True,
        "tma_store": True,
        "static_max": pv_dtype == "fp16",
        "q_regs": False,
        "pv_dtype": pv_dtype,
        "pv_accum": "two_level",
        "v_smooth": False,
        "pv_overlap": pv_dtype == "fp16",
        "qk_balance": None,
        "persistent": False,
    }


@gluon.constexpr_function
def _pv_k(PV_FP8):
    """K extent of one P.V ``wgmma`` (16 for 16-bit operands, 32 for 8-bit)."""
    return 32 if PV_FP8 else 16


@gluon.constexpr_function
def _a_k_width(PV_FP8):
    """Elements of P per 32-bit register of the A operand."""
    return 4 if PV_FP8 else 2


@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    ks_desc,
    q_smem,
    k_smem,
    v_smem,
    ks_smem,
    q_bar,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    q_row,
    k_row,
    v_row,
    v_col,
    n_blocks,
    c0,
    tq,
    q_empty,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PV_FP8: gl.constexpr,
    RUNNING: gl.constexpr,
):
    """Both consumers' Q tiles, then K (with its per-token scales) and V tiles through the ring (V^T
    tiles [D, BLOCK_N] with fp8 P.V).  ``RUNNING`` (the persistent schedule): the CTA's ``tq``-th
    query tile, each Q buffer loaded once its consumer has released it (``q_empty``), the ring's
    running count ``c0`` carried over from the previous tiles."""
    for w in gl.static_range(2):
        if RUNNING:
            mbarrier.wait(q_empty.index(w), (tq & 1) ^ 1)
        mbarrier.expect(q_bar.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * WG_M, 0], q_bar.index(w), q_smem.index(w))
    for j in range(n_blocks):
        st, ph = ring_slot(c0 + j, NUM_STAGES, RUNNING)
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        if K_PER_TOKEN:
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(ks_desc, [k_row + j * BLOCK_N], k_ready.index(st), ks_smem.index(st))
        else:
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BLOCK_N, 0], k_ready.index(st), k_smem.index(st))
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
        if PV_FP8:
            tma.async_copy_global_to_shared(v_desc, [v_row, v_col + j * BLOCK_N], v_ready.index(st), v_smem.index(st))
        else:
            tma.async_copy_global_to_shared(v_desc, [v_row + j * BLOCK_N, v_col], v_ready.index(st), v_smem.index(st))


@gluon.jit
def _logits(
    s_i,
    rs,
    kblk,
    ks_buf,
    col0,
    Skv,
    MASK: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    s_layout: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Base-2 logits of one tile of INT32 scores, factored per row as ``t = u * f + g`` (``f`` and
    ``g`` per row, ``f > 0``) so that the softmax needs one FMA per score: returns ``(u, f, g)``.

    ``rs`` per row is sQ * softmax scale * log2 e.  The INT32 -> FP32 conversion is the integer-add
    trick (exact for |s_i| < 2^22; |Q8.K8| <= 128 * 127 * 127): ``(s_i + magic)`` reinterpreted as
    fp32 is ``12582912 + s_i``.  Per-token K (``kcol`` per column, from ``ks_buf``): ``u = s_i *
    kcol`` (the offset removed in the same FMA), ``f = rs``, ``g = 0``; per-block K (``kblk``): ``u``
    the offset score, ``f = rs * kblk``, ``g = -magic * f``.  Keys at or past ``Skv`` get ``u = -inf``
    when ``MASK``."""
    sf = (s_i + INT_MAGIC).to(gl.float32, bitcast=True)
    if K_PER_TOKEN:
        kcol = ks_buf.load(gl.SliceLayout(0, s_layout))
        u = gl.fma(sf, kcol[None, :], (kcol * -INT_MAGIC_F)[None, :])
        f = rs
        g = rs * 0.0
    else:
        u = sf
        f = rs * kblk
        g = f * -INT_MAGIC_F
    if MASK:
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        u = gl.where((cols < Skv)[None, :], u, float("-inf"))
    return u, f, g


@gluon.constexpr_function
def _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8):
    """The consumer's ``wgmma`` layouts: S (Q.K accumulator), O (P.V), L (P x ones row sums), P as the
    A operand of P.V and of the row sums."""
    s = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    o = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, _pv_k(PV_FP8)])
    l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, _pv_k(PV_FP8)])
    p = gl.DotOperandLayout(operand_index=0, parent=o, k_width=_a_k_width(PV_FP8))
    pl = gl.DotOperandLayout(operand_index=0, parent=l, k_width=_a_k_width(PV_FP8))
    return s, o, l, p, pl


@gluon.jit
def _probs(u, f, g, m_i, l_i, STATIC_MAX: gl.constexpr, PV_FP8: gl.constexpr, K_PER_TOKEN: gl.constexpr):
    """exp2 of the logits ``t = u * f + g`` (:func:`_logits`): ``(p, alpha, m_new, l_new)``.

    Static max: p = exp2(t), no rescale, the row sums come from the tensor cores (l untouched).
    Otherwise the online softmax: the running maximum from the row maxima of ``u`` (``f > 0``),
    ``p = exp2(u * f + (g - m_new))`` (one FMA; fp8 P.V: ``exp2(t - m + P_SHIFT)``, in (0, 256]),
    alpha rescales the accumulator and ``l = l * alpha + rowsum(p)`` (FP32, before any rounding)."""
    if STATIC_MAX:
        if K_PER_TOKEN:
            return gl.exp2(u * f[:, None]), m_i, m_i, l_i
        else:
            return gl.exp2(gl.fma(u, f[:, None], g[:, None])), m_i, m_i, l_i
    else:
        m_new = gl.maximum(m_i, gl.max(u, 1) * f + g)
        alpha = gl.exp2(m_i - m_new)
        if PV_FP8:
            p = gl.exp2(gl.fma(u, f[:, None], (g - m_new + P_SHIFT)[:, None]))
        else:
            p = gl.exp2(gl.fma(u, f[:, None], (g - m_new)[:, None]))
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _p_operand(p, pdt: gl.constexpr, p_layout: gl.constexpr, PV_FP8: gl.constexpr, BLOCK_N: gl.constexpr):
    """P (fp32, in the Q.K accumulator layout) for the P.V product: rounded to ``pdt`` in the A
    operand layout (16-bit: the same registers), or packed to e4m3 by :func:`fp8_pack` (its columns
    relabelled; the prologue stores V^T's tokens in the same order,
    :func:`ditattn.attention.kernels.int8_quant.quantize_v_fp8` ``permute``)."""
    if PV_FP8:
        return fp8_pack(p, BLOCK_N)
    else:
        return gl.convert_layout(p.to(pdt), p_layout)


@gluon.jit
def _step(
    WG: gl.constexpr,
    j,
    c0,
    q,
    acc,
    l_acc,
    l_i,
    p_prev,
    m_i,
    a_prev,
    rs,
    zero_s,
    zero_o,
    zero_l,
    kblk_ptr,
    k_smem,
    v_smem,
    ks_smem,
    ones_smem,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    turn,
    Skv,
    MASK: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PINGPONG: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PV_FP8: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
    RUNNING: gl.constexpr,
):
    """Key tile ``j >= 1``: returns ``(acc, l_acc, l, P(j) as the next A operand, m, alpha owed to acc)``.
    ``c0``: the K/V tiles the ring delivered before this query tile (0, or with ``RUNNING`` the
    persistent schedule's running count): tile j sits in ring slot ``c0 + j``, and the ping-pong turn
    count runs on with it.

    ``PV_OVERLAP``: issue Q.K(j), then P(j-1).V(j-1) (and, with the static max, P(j-1) x ones for
    the row sums), and run the softmax of tile j while the products run (FA3's
    intra-warpgroup overlap).  Otherwise P(j-1).V(j-1) goes first and is retired while Q.K(j) runs,
    before the softmax: a two-level accumulator is then dead during the softmax (fewer live
    registers), the softmax overlaps only the other consumer's products."""
    s_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[0]
    p_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[3]
    pl_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[4]
    ROW_SUMS: gl.constexpr = STATIC_MAX  # P x ones on the tensor cores
    st, ph = ring_slot(c0 + j, NUM_STAGES, RUNNING)
    sp, php = ring_slot(c0 + j - 1, NUM_STAGES, RUNNING)
    kblk = 1.0
    if not K_PER_TOKEN:
        kblk = gl.load(kblk_ptr + j)
    mbarrier.wait(k_ready.index(st), ph)
    mbarrier.wait(v_ready.index(sp), php)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), ((c0 + j) & 1) ^ (1 - WG))
    if PV_OVERLAP:
        s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    o_tok, l_tok, pl = issue_pv(
        p_prev,
        v_smem.index(sp),
        acc,
        l_acc,
        zero_o,
        zero_l,
        ones_smem,
        ROW_SUMS,
        PV_FP8,
        TWO_LEVEL,
        p_layout,
        pl_layout,
    )
    if not PV_OVERLAP:
        s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    if PV_OVERLAP:
        if ROW_SUMS:
            s_i = warpgroup_mma_wait(2, deps=(s_tok,))
        else:
            s_i = warpgroup_mma_wait(1, deps=(s_tok,))
    else:  # P(j-1).V retired first (Q.K(j) still in flight); the online rescale waits for the softmax
        acc, l_acc, a_prev = retire_pv(
            o_tok, l_tok, p_prev, pl, acc, l_acc, a_prev, a_prev, ROW_SUMS, False, 1, PV_FP8, TWO_LEVEL
        )
        mbarrier.arrive(v_empty.index(sp), count=1)
        s_i = warpgroup_mma_wait(0, deps=(s_tok,))
    u, f, g = _logits(s_i, rs, kblk, ks_smem.index(st), j * BLOCK_N, Skv, MASK, K_PER_TOKEN, s_layout, BLOCK_N)
    mbarrier.arrive(k_empty.index(st), count=1)
    p, alpha, m_i, l_i = _probs(u, f, g, m_i, l_i, STATIC_MAX, PV_FP8, K_PER_TOKEN)
    p_next = _p_operand(p, v_smem.dtype, p_layout, PV_FP8, BLOCK_N)
    if PV_OVERLAP:
        acc, l_acc, a_prev = retire_pv(
            o_tok, l_tok, p_prev, pl, acc, l_acc, alpha, a_prev, ROW_SUMS, not STATIC_MAX, 0, PV_FP8, TWO_LEVEL
        )
        mbarrier.arrive(v_empty.index(sp), count=1)
    elif TWO_LEVEL:
        a_prev = alpha
    elif not STATIC_MAX:
        acc, l_acc = rescale(acc, l_acc, alpha, ROW_SUMS)
    return acc, l_acc, l_i, p_next, m_i, a_prev


@gluon.jit
def _mainloop(
    WG: gl.constexpr,
    q,
    rs,
    kblk_ptr,
    k_smem,
    v_smem,
    ks_smem,
    ones_smem,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    turn,
    Skv,
    n_full,
    n_blocks,
    c0,
    q_free,
    STATIC_MAX: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PINGPONG: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PV_FP8: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
    RUNNING: gl.constexpr,
):
    """All key tiles of one consumer: returns ``(acc [64, D], l [64], m [64])`` (base-2 max).

    The next tile's Q.K product is issued before this tile's P.V (and the row sums, a P x ones
    product on the tensor cores), so the softmax of tile j runs while the tensor cores do
    P(j-1).V(j-1) (FA3's intra-warpgroup overlap); with ``PINGPONG`` the two consumers take turns
    issuing their products (``turn`` mbarriers).  Full tiles run in the loop, a partial last tile
    once after it with the key mask.  ``RUNNING`` (the persistent schedule): ring slots and turns
    count on from ``c0`` (see :func:`_step`), and Q's buffer is released (``q_free``) once the last
    Q.K is done, before the last P.V, so that the next query tile loads during the epilogue."""
    s_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[0]
    o_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[1]
    l_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[2]
    p_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[3]
    pl_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[4]
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    ROW_SUMS: gl.constexpr = STATIC_MAX  # P x ones on the tensor cores

    m_i = gl.full([WG_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([WG_M], gl.float32, row_s)
    acc = gl.zeros([WG_M, HEAD_DIM], gl.float32, o_layout)
    l_acc = gl.zeros([WG_M, 8], gl.float32, l_layout)
    zero_s = gl.zeros([WG_M, BLOCK_N], gl.int32, s_layout)
    if STATIC_MAX:
        m_i = gl.zeros([WG_M], gl.float32, row_s)

    # tile 0: Q.K and the softmax, no P.V yet
    kblk = 1.0
    if not K_PER_TOKEN:
        kblk = gl.load(kblk_ptr)
    st0, ph0 = ring_slot(c0, NUM_STAGES, RUNNING)
    mbarrier.wait(k_ready.index(st0), ph0)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (c0 & 1) ^ (1 - WG))
    s_tok = warpgroup_mma(q, k_smem.index(st0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)
    s_i = warpgroup_mma_wait(0, deps=(s_tok,))
    if n_full > 0:
        u, f, g = _logits(s_i, rs, kblk, ks_smem.index(st0), 0, Skv, False, K_PER_TOKEN, s_layout, BLOCK_N)
    else:
        u, f, g = _logits(s_i, rs, kblk, ks_smem.index(st0), 0, Skv, True, K_PER_TOKEN, s_layout, BLOCK_N)
    mbarrier.arrive(k_empty.index(st0), count=1)
    p, a_prev, m_i, l_i = _probs(u, f, g, m_i, l_i, STATIC_MAX, PV_FP8, K_PER_TOKEN)
    p_prev = _p_operand(p, v_smem.dtype, p_layout, PV_FP8, BLOCK_N)
    zero_o = acc
    zero_l = l_acc

    for j in range(1, n_full):
        acc, l_acc, l_i, p_prev, m_i, a_prev = _step(
            WG,
            j,
            c0,
            q,
            acc,
            l_acc,
            l_i,
            p_prev,
            m_i,
            a_prev,
            rs,
            zero_s,
            zero_o,
            zero_l,
            kblk_ptr,
            k_smem,
            v_smem,
            ks_smem,
            ones_smem,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            turn,
            Skv,
            False,
            STATIC_MAX,
            K_PER_TOKEN,
            PINGPONG,
            NUM_STAGES,
            BLOCK_N,
            HEAD_DIM,
            PV_FP8,
            TWO_LEVEL,
            PV_OVERLAP,
            RUNNING,
        )
    if n_full < n_blocks and n_full > 0:
        acc, l_acc, l_i, p_prev, m_i, a_prev = _step(
            WG,
            n_full,
            c0,
            q,
            acc,
            l_acc,
            l_i,
            p_prev,
            m_i,
            a_prev,
            rs,
            zero_s,
            zero_o,
            zero_l,
            kblk_ptr,
            k_smem,
            v_smem,
            ks_smem,
            ones_smem,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            turn,
            Skv,
            True,
            STATIC_MAX,
            K_PER_TOKEN,
            PINGPONG,
            NUM_STAGES,
            BLOCK_N,
            HEAD_DIM,
            PV_FP8,
            TWO_LEVEL,
            PV_OVERLAP,
            RUNNING,
        )
    if RUNNING:  # the last Q.K has been waited for: Q's buffer is free for the next query tile
        mbarrier.arrive(q_free, count=1)
    sp, php = ring_slot(c0 + n_blocks - 1, NUM_STAGES, RUNNING)
    mbarrier.wait(v_ready.index(sp), php)
    o_tok, l_tok, pl = issue_pv(
        p_prev,
        v_smem.index(sp),
        acc,
        l_acc,
        zero_o,
        zero_l,
        ones_smem,
        ROW_SUMS,
        PV_FP8,
        TWO_LEVEL,
        p_layout,
        pl_layout,
    )
    acc, l_acc, a_prev = retire_pv(
        o_tok, l_tok, p_prev, pl, acc, l_acc, a_prev, a_prev, ROW_SUMS, False, 0, PV_FP8, TWO_LEVEL
    )
    mbarrier.arrive(v_empty.index(sp), count=1)
    if ROW_SUMS:  # the 8 columns of the ones product are equal
        l_i = gl.convert_layout(gl.max(l_acc, 1), row_s)
    return acc, l_i, m_i


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    q_smem,
    k_smem,
    v_smem,
    ks_smem,
    o_smem,
    ones_smem,
    q_bar,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    turn,
    o_desc,
    qs_ptr,
    qn_ptr,
    kn_ptr,
    ks_ptr,
    qkm_ptr,
    vs_ptr,
    vm_ptr,
    o_ptr,
    lse_ptr,
    m0,
    o_b,
    o_col,
    Sq,
    Skv,
    stride_os,
    n_full,
    n_blocks,
    c0,
    tq,
    q_free,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PINGPONG: gl.constexpr,
    TMA_STORE: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    Q_REGS: gl.constexpr,
    PV_FP8: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    V_SMOOTH: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
    RUNNING: gl.constexpr,
):
    """One consumer warpgroup: 64 query rows over all keys, then the epilogue.  ``RUNNING`` (the
    persistent schedule, :func:`_consumer_persistent`): the CTA's ``tq``-th query tile, the ring's
    running count ``c0``, Q's buffer released to ``q_free`` after the last Q.K.

    With ``STATIC_MAX`` the warpgroup checks once whether every row's logits are bounded by
    P's dtype's limit (``qn_i * kn``, :data:`.gluon_sm90.LOGIT_LIMITS`); if so it runs the loop without a
    running maximum, else the online softmax."""
    s_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[0]
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    m_start = m0 + WG * WG_M
    rows = m_start + gl.arange(0, WG_M, layout=row_s)
    rs = gl.load(qs_ptr + rows)
    mbarrier.wait(q_bar.index(WG), tq & 1)
    q = q_smem.index(WG)
    if Q_REGS:  # the Q.K product's A operand from registers: no shared-memory reads of Q per product
        q = q.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4))
    static = False
    if STATIC_MAX:
        bound = gl.max(gl.load(qn_ptr + rows), 0) * gl.load(kn_ptr)
        if v_smem.dtype == gl.float16:  # P is rounded to V's dtype (gluon_sm90.LOGIT_LIMITS)
            static = bound <= LOGIT_LIMIT_FP16
        else:
            static = bound <= LOGIT_LIMIT_BF16
    if static:
        acc, l_i, m_i = _mainloop(
            WG,
            q,
            rs,
            ks_ptr,
            k_smem,
            v_smem,
            ks_smem,
            ones_smem,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            turn,
            Skv,
            n_full,
            n_blocks,
            c0,
            q_free,
            True,
            K_PER_TOKEN,
            PINGPONG,
            NUM_STAGES,
            BLOCK_N,
            HEAD_DIM,
            PV_FP8,
            TWO_LEVEL,
            PV_OVERLAP,
            RUNNING,
        )
    else:
        acc, l_i, m_i = _mainloop(
            WG,
            q,
            rs,
            ks_ptr,
            k_smem,
            v_smem,
            ks_smem,
            ones_smem,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            turn,
            Skv,
            n_full,
            n_blocks,
            c0,
            q_free,
            False,
            K_PER_TOKEN,
            PINGPONG,
            NUM_STAGES,
            BLOCK_N,
            HEAD_DIM,
            PV_FP8,
            TWO_LEVEL,
            PV_OVERLAP,
            RUNNING,
        )
    _epilogue(
        WG,
        acc,
        l_i,
        m_i,
        rows,
        o_smem,
        o_desc,
        o_ptr,
        lse_ptr,
        qkm_ptr,
        vs_ptr,
        vm_ptr,
        m_start,
        o_b,
        o_col,
        Sq,
        stride_os,
        BLOCK_N,
        HEAD_DIM,
        RETURN_LSE,
        TMA_STORE,
        PV_FP8,
        V_SMOOTH,
        RUNNING,
    )


@gluon.jit
def _epilogue(
    WG: gl.constexpr,
    acc,
    l_i,
    m_i,
    rows,
    o_smem,
    o_desc,
    o_ptr,
    lse_ptr,
    qkm_ptr,
    vs_ptr,
    vm_ptr,
    m_start,
    o_b,
    o_col,
    Sq,
    stride_os,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    TMA_STORE: gl.constexpr,
    PV_FP8: gl.constexpr,
    V_SMOOTH: gl.constexpr,
    RUNNING: gl.constexpr,
):
    """Normalise and store one consumer's 64 output rows (rows past ``Sq`` are not written) and
    their LSE (natural log, the K smoothing undone by ``qkm``).  FP8 P.V: times V's channel scales
    (``vs_ptr``) plus, with ``V_SMOOTH``, its channel means (``vm_ptr``); the LSE less ``P_SHIFT``.
    The TMA store is waited for at the end, or with ``RUNNING`` (persistent: one tile per call, the
    staging buffer reused by the next) only before the buffer is written again."""
    o_layout: gl.constexpr = _mma_layouts(BLOCK_N, HEAD_DIM, PV_FP8)[1]
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    if PV_FP8:
        cols = gl.arange(0, HEAD_DIM, layout=col_o)
        out = acc * (1.0 / gl.convert_layout(l_i, row_o))[:, None] * gl.load(vs_ptr + cols)[None, :]
        if V_SMOOTH:
            out = out + gl.load(vm_ptr + cols)[None, :]
        m_i = m_i - P_SHIFT
    else:
        out = acc / gl.convert_layout(l_i, row_o)[:, None]
    if TMA_STORE:
        buf = o_smem.index(WG)
        if RUNNING:  # the previous tile's output has left the buffer
            tma.store_wait(0)
        buf.reshape([WG_M, HEAD_DIM]).store(out.to(o_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [o_b, m_start, o_col], buf)
    else:
        rows_o = m_start + gl.arange(0, WG_M, layout=row_o)
        cols_o = gl.arange(0, HEAD_DIM, layout=col_o)
        gl.store(
            o_ptr + rows_o[:, None] * stride_os + cols_o[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=(rows_o < Sq)[:, None],
        )
    if RETURN_LSE:
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453 + gl.load(qkm_ptr + rows)
        gl.store(lse_ptr + rows, lse, mask=rows < Sq)
    if TMA_STORE and not RUNNING:
        tma.store_wait(0)


@gluon.jit
def _head(
    bh,
    H,
    HKV,
    qs_ptr,
    qn_ptr,
    kn_ptr,
    ks_ptr,
    qkm_ptr,
    vs_ptr,
    vm_ptr,
    o_ptr,
    lse_ptr,
    Sq,
    Skv,
    Sq_pad,
    Skv_pad,
    stride_ob,
    stride_oh,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PV_FP8: gl.constexpr,
):
    """What one (batch, head) ``bh = b * H + h`` reads and writes: ``(b, h, b * HKV + kv head, Q scale,
    Q norm, K norm, K scale, LSE correction, V channel scale and mean, output and LSE bases, V's row
    and column in its descriptor)``."""
    b = bh // H
    h = bh % H
    hk = h // (H // HKV)
    bhk = b * HKV + hk
    if PV_FP8:  # V^T [B * H_kv * D, Skv_pad]
        v_row = bhk * HEAD_DIM
        v_col = 0
    else:  # V in place, [B * Skv, H_kv * D]
        v_row = b * Skv
        v_col = hk * HEAD_DIM
    return (
        b,
        h,
        bhk,
        qs_ptr + bh * Sq_pad,
        qn_ptr + bh * Sq_pad,
        kn_ptr + bhk,
        ks_ptr + bhk * (Skv_pad if K_PER_TOKEN else Skv_pad // BLOCK_N),
        qkm_ptr + bh * Sq_pad,
        vs_ptr + bhk * HEAD_DIM,
        vm_ptr + bhk * HEAD_DIM,
        o_ptr + b * stride_ob + h * stride_oh,
        lse_ptr + bh * Sq,
        v_row,
        v_col,
    )


@gluon.jit
def _producer_persistent(
    q_desc,
    k_desc,
    v_desc,
    ks_desc,
    q_smem,
    k_smem,
    v_smem,
    ks_smem,
    q_bar,
    q_empty,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    qs_ptr,
    qn_ptr,
    kn_ptr,
    ks_ptr,
    qkm_ptr,
    vs_ptr,
    vm_ptr,
    o_ptr,
    lse_ptr,
    Sq,
    Skv,
    Sq_pad,
    Skv_pad,
    H,
    HKV,
    stride_ob,
    stride_oh,
    num_tiles,
    n_blocks,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PV_FP8: gl.constexpr,
):
    """The loads of the CTA's tiles ``pid, pid + grid, ...`` (tile ``t = (b * H + h) * m_tiles + m``, the
    query tile fastest): :func:`_producer` per tile with the ring's running count and Q's phase
    carried over, so the next tile's Q and first K/V tiles load while the consumers finish the
    current one."""
    m_tiles = Sq_pad // BLOCK_M
    c = 0  # K/V tiles loaded so far
    tq = 0  # query tiles loaded so far
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh = t // m_tiles
        b, h, bhk, qs_row, qn_row, kn_h, ks_row, qkm_row, vs_h, vm_h, o_base, lse_row, v_row, v_col = _head(
            bh,
            H,
            HKV,
            qs_ptr,
            qn_ptr,
            kn_ptr,
            ks_ptr,
            qkm_ptr,
            vs_ptr,
            vm_ptr,
            o_ptr,
            lse_ptr,
            Sq,
            Skv,
            Sq_pad,
            Skv_pad,
            stride_ob,
            stride_oh,
            BLOCK_N,
            HEAD_DIM,
            K_PER_TOKEN,
            PV_FP8,
        )
        _producer(
            q_desc,
            k_desc,
            v_desc,
            ks_desc,
            q_smem,
            k_smem,
            v_smem,
            ks_smem,
            q_bar,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            bh * Sq_pad + (t - bh * m_tiles) * BLOCK_M,
            bhk * Skv_pad,
            v_row,
            v_col,
            n_blocks,
            c,
            tq,
            q_empty,
            BLOCK_N,
            NUM_STAGES,
            K_PER_TOKEN,
            PV_FP8,
            True,
        )
        c += n_blocks
        tq += 1


@gluon.jit
def _consumer_persistent(
    WG: gl.constexpr,
    q_smem,
    k_smem,
    v_smem,
    ks_smem,
    o_smem,
    ones_smem,
    q_bar,
    q_empty,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    turn,
    o_desc,
    qs_ptr,
    qn_ptr,
    kn_ptr,
    ks_ptr,
    qkm_ptr,
    vs_ptr,
    vm_ptr,
    o_ptr,
    lse_ptr,
    Sq,
    Skv,
    Sq_pad,
    Skv_pad,
    H,
    HKV,
    stride_ob,
    stride_os,
    stride_oh,
    num_tiles,
    n_full,
    n_blocks,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PINGPONG: gl.constexpr,
    TMA_STORE: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    Q_REGS: gl.constexpr,
    PV_FP8: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    V_SMOOTH: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
):
    """One consumer warpgroup over the CTA's tiles (the producer's sequence): :func:`_consumer` per tile
    with the ring's running count and Q's phase carried over; its output staging buffer is waited
    for only before its next use, and once at the end."""
    m_tiles = Sq_pad // BLOCK_M
    c = 0  # K/V tiles consumed so far
    tq = 0  # query tiles consumed so far
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh = t // m_tiles
        b, h, bhk, qs_row, qn_row, kn_h, ks_row, qkm_row, vs_h, vm_h, o_base, lse_row, v_row, v_col = _head(
            bh,
            H,
            HKV,
            qs_ptr,
            qn_ptr,
            kn_ptr,
            ks_ptr,
            qkm_ptr,
            vs_ptr,
            vm_ptr,
            o_ptr,
            lse_ptr,
            Sq,
            Skv,
            Sq_pad,
            Skv_pad,
            stride_ob,
            stride_oh,
            BLOCK_N,
            HEAD_DIM,
            K_PER_TOKEN,
            PV_FP8,
        )
        _consumer(
            WG,
            q_smem,
            k_smem,
            v_smem,
            ks_smem,
            o_smem,
            ones_smem,
            q_bar,
            k_ready,
            k_empty,
            v_ready,
            v_empty,
            turn,
            o_desc,
            qs_row,
            qn_row,
            kn_h,
            ks_row,
            qkm_row,
            vs_h,
            vm_h,
            o_base,
            lse_row,
            (t - bh * m_tiles) * BLOCK_M,
            b,
            h * HEAD_DIM,
            Sq,
            Skv,
            stride_os,
            n_full,
            n_blocks,
            c,
            tq,
            q_empty.index(WG),
            BLOCK_N,
            HEAD_DIM,
            NUM_STAGES,
            RETURN_LSE,
            K_PER_TOKEN,
            PINGPONG,
            TMA_STORE,
            STATIC_MAX,
            Q_REGS,
            PV_FP8,
            TWO_LEVEL,
            V_SMOOTH,
            PV_OVERLAP,
            True,
        )
        c += n_blocks
        tq += 1
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _sage_fwd_sm90(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    ks_desc,
    qs_ptr,
    qn_ptr,
    kn_ptr,
    ks_ptr,
    qkm_ptr,
    vs_ptr,
    vm_ptr,
    o_ptr,
    lse_ptr,
    Sq,
    Skv,
    Sq_pad,
    Skv_pad,
    H,
    HKV,
    stride_ob,
    stride_os,
    stride_oh,
    num_tiles,
    BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    K_PER_TOKEN: gl.constexpr,
    PINGPONG: gl.constexpr,
    TMA_STORE: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    Q_REGS: gl.constexpr,
    PV_FP8: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    V_SMOOTH: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
    PERSISTENT: gl.constexpr,
):
    """Grid ``(Sq_pad / 128, B * H)``: one CTA per 128-row query tile of one (batch, head); or, with
    ``PERSISTENT``, ``(min(num_tiles, SMs),)``: each CTA loops over tiles ``pid, pid + grid, ...`` in
    the order ``t = (b * H + h) * (Sq_pad / 128) + m`` — the query tile fastest, the one-CTA-per-tile
    grid's launch order, so the tiles in flight share their head's K/V in L2.  The persistent
    schedule keeps the ring, the barriers and the two consumers' ping-pong running across tiles, and
    adds a ``q_empty`` barrier per Q buffer (released after the tile's last Q.K): the next tile's Q
    and first K/V tiles load during the current tile's last P.V and epilogue, and the output's TMA
    store is waited for only before its staging buffer is reused."""
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    # (one CTA per tile; unused by the persistent schedule)
    b, h, bhk, qs_row, qn_row, kn_h, ks_row, qkm_row, vs_h, vm_h, o_base, lse_row, v_row, v_col = _head(
        pid_bh,
        H,
        HKV,
        qs_ptr,
        qn_ptr,
        kn_ptr,
        ks_ptr,
        qkm_ptr,
        vs_ptr,
        vm_ptr,
        o_ptr,
        lse_ptr,
        Sq,
        Skv,
        Sq_pad,
        Skv_pad,
        stride_ob,
        stride_oh,
        BLOCK_N,
        HEAD_DIM,
        K_PER_TOKEN,
        PV_FP8,
    )
    m0 = pid_m * BLOCK_M
    n_blocks = gl.cdiv(Skv, BLOCK_N)
    n_full = Skv // BLOCK_N

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    if K_PER_TOKEN:
        ks_smem = gl.allocate_shared_memory(ks_desc.dtype, [NUM_STAGES] + ks_desc.block_type.shape, ks_desc.layout)
    else:
        ks_smem = k_smem
    if TMA_STORE:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    else:
        o_smem = q_smem
    ones_smem = ones_operand(v_desc.dtype, BLOCK_N)  # row sums of P on the tensor cores (static max only)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)

    if PERSISTENT:
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for w in gl.static_range(2):
            mbarrier.init(q_empty.index(w), count=1)
        gl.warp_specialize(
            [
                (
                    _consumer_persistent,
                    (
                        0,
                        q_smem,
                        k_smem,
                        v_smem,
                        ks_smem,
                        o_smem,
                        ones_smem,
                        q_bar,
                        q_empty,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        turn,
                        o_desc,
                        qs_ptr,
                        qn_ptr,
                        kn_ptr,
                        ks_ptr,
                        qkm_ptr,
                        vs_ptr,
                        vm_ptr,
                        o_ptr,
                        lse_ptr,
                        Sq,
                        Skv,
                        Sq_pad,
                        Skv_pad,
                        H,
                        HKV,
                        stride_ob,
                        stride_os,
                        stride_oh,
                        num_tiles,
                        n_full,
                        n_blocks,
                        BLOCK_N,
                        HEAD_DIM,
                        NUM_STAGES,
                        RETURN_LSE,
                        K_PER_TOKEN,
                        PINGPONG,
                        TMA_STORE,
                        STATIC_MAX,
                        Q_REGS,
                        PV_FP8,
                        TWO_LEVEL,
                        V_SMOOTH,
                        PV_OVERLAP,
                    ),
                ),
                (
                    _consumer_persistent,
                    (
                        1,
                        q_smem,
                        k_smem,
                        v_smem,
                        ks_smem,
                        o_smem,
                        ones_smem,
                        q_bar,
                        q_empty,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        turn,
                        o_desc,
                        qs_ptr,
                        qn_ptr,
                        kn_ptr,
                        ks_ptr,
                        qkm_ptr,
                        vs_ptr,
                        vm_ptr,
                        o_ptr,
                        lse_ptr,
                        Sq,
                        Skv,
                        Sq_pad,
                        Skv_pad,
                        H,
                        HKV,
                        stride_ob,
                        stride_os,
                        stride_oh,
                        num_tiles,
                        n_full,
                        n_blocks,
                        BLOCK_N,
                        HEAD_DIM,
                        NUM_STAGES,
                        RETURN_LSE,
                        K_PER_TOKEN,
                        PINGPONG,
                        TMA_STORE,
                        STATIC_MAX,
                        Q_REGS,
                        PV_FP8,
                        TWO_LEVEL,
                        V_SMOOTH,
                        PV_OVERLAP,
                    ),
                ),
                (
                    _producer_persistent,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        ks_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        ks_smem,
                        q_bar,
                        q_empty,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        qs_ptr,
                        qn_ptr,
                        kn_ptr,
                        ks_ptr,
                        qkm_ptr,
                        vs_ptr,
                        vm_ptr,
                        o_ptr,
                        lse_ptr,
                        Sq,
                        Skv,
                        Sq_pad,
                        Skv_pad,
                        H,
                        HKV,
                        stride_ob,
                        stride_oh,
                        num_tiles,
                        n_blocks,
                        BLOCK_N,
                        HEAD_DIM,
                        NUM_STAGES,
                        K_PER_TOKEN,
                        PV_FP8,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        # constexpr arguments must be written into each partition's tuple (a tuple variable drops them)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        0,
                        q_smem,
                        k_smem,
                        v_smem,
                        ks_smem,
                        o_smem,
                        ones_smem,
                        q_bar,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        turn,
                        o_desc,
                        qs_row,
                        qn_row,
                        kn_h,
                        ks_row,
                        qkm_row,
                        vs_h,
                        vm_h,
                        o_base,
                        lse_row,
                        m0,
                        b,
                        h * HEAD_DIM,
                        Sq,
                        Skv,
                        stride_os,
                        n_full,
                        n_blocks,
                        0,
                        0,
                        q_bar,
                        BLOCK_N,
                        HEAD_DIM,
                        NUM_STAGES,
                        RETURN_LSE,
                        K_PER_TOKEN,
                        PINGPONG,
                        TMA_STORE,
                        STATIC_MAX,
                        Q_REGS,
                        PV_FP8,
                        TWO_LEVEL,
                        V_SMOOTH,
                        PV_OVERLAP,
                        False,
                    ),
                ),
                (
                    _consumer,
                    (
                        1,
                        q_smem,
                        k_smem,
                        v_smem,
                        ks_smem,
                        o_smem,
                        ones_smem,
                        q_bar,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        turn,
                        o_desc,
                        qs_row,
                        qn_row,
                        kn_h,
                        ks_row,
                        qkm_row,
                        vs_h,
                        vm_h,
                        o_base,
                        lse_row,
                        m0,
                        b,
                        h * HEAD_DIM,
                        Sq,
                        Skv,
                        stride_os,
                        n_full,
                        n_blocks,
                        0,
                        0,
                        q_bar,
                        BLOCK_N,
                        HEAD_DIM,
                        NUM_STAGES,
                        RETURN_LSE,
                        K_PER_TOKEN,
                        PINGPONG,
                        TMA_STORE,
                        STATIC_MAX,
                        Q_REGS,
                        PV_FP8,
                        TWO_LEVEL,
                        V_SMOOTH,
                        PV_OVERLAP,
                        False,
                    ),
                ),
                (
                    _producer,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        ks_desc,
                        q_smem,
                        k_smem,
                        v_smem,
                        ks_smem,
                        q_bar,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        pid_bh * Sq_pad + m0,
                        bhk * Skv_pad,
                        v_row,
                        v_col,
                        n_blocks,
                        0,
                        0,
                        q_bar,
                        BLOCK_N,
                        NUM_STAGES,
                        K_PER_TOKEN,
                        PV_FP8,
                        False,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


def sage_attention_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    return_lse: bool = False,
    config: Optional[dict] = None,
):
    """INT8 Q.K / FP16-BF16 or FP8 P.V attention on SM90 (Gluon, warp-specialised).

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` fp16/bf16 on one CUDA device, ``H % H_kv == 0``,
    D in 64/128, non-causal; ``scale`` defaults to ``D ** -0.5``.  Q is quantized per token, K
    (smoothed by its mean over keys) per key (``k_granularity`` "token") or per block of ``block_n``
    keys.  ``config`` keys (:func:`default_config`): ``pv_dtype`` "fp16" (P rounded to V's dtype) or
    "fp8" (P and V in e4m3, V per channel and, with ``v_smooth``, smoothed by its channel mean;
    ``pv_accum`` "two_level" or "direct"; online softmax only); ``qk_balance`` (alpha in (0, 1]) balances
    Q's and smoothed K's channels before the INT8 rounding (``int8_attention_reference``'s option of
    the same name); ``persistent`` (bool, default False: on the H200 +2-3 % at S = 4096, -6-8 % at
    32k) runs one CTA per SM, each looping over the 128-row query tiles (see ``_sage_fwd_sm90``).
    Returns ``(out [B, S_q, H, D] in q.dtype, lse [B, H, S_q] float32 natural log or None)``.
    """
    from ditattn.attention.kernels.int8_quant import quantize_qk, quantize_v_fp8

    what = "sage_attn SM90 kernel"
    B, Sq, Skv, H, Hkv, D = check_qkv(q, k, v, what=what, head_dims=SUPPORTED_HEAD_DIMS)
    check_device(q, k, v, what=what)
    cfg = kernel_config(D, config, what=what)
    bn = int(cfg["block_n"])
    pv_fp8 = cfg["pv_dtype"] == "fp8"
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    if not v.is_contiguous():
        v = v.contiguous()
    scale = D**-0.5 if scale is None else float(scale)
    k_tok = cfg["k_granularity"] == "token"
    q8, qs, qkm, k8, ks, sq_pad, skv_pad, qn, kn = quantize_qk(
        q,
        k,
        scale=scale,
        block_m=BLOCK_M.value,
        block_n=bn,
        need_qkm=return_lse,
        k_per_token=k_tok,
        norms=True,
        qk_balance=cfg["qk_balance"],
    )
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device) if return_lse else out
    gdt = gl.float16 if v.dtype == torch.float16 else gl.bfloat16
    q_layout = smem_layout((WG_M.value, D), gl.int8)
    k_layout = smem_layout((bn, D), gl.int8)
    qd = TensorDescriptor(q8, [B * H * sq_pad, D], [D, 1], [WG_M.value, D], q_layout)
    kd = TensorDescriptor(k8, [B * Hkv * skv_pad, D], [D, 1], [bn, D], k_layout)
    if pv_fp8:
        vt, vs, vm = quantize_v_fp8(v, s_pad=skv_pad, smooth=bool(cfg["v_smooth"]), permute=True)
        vd = TensorDescriptor(vt, [B * Hkv * D, skv_pad], [skv_pad, 1], [D, bn], smem_layout((D, bn), gl.float8e4nv))
    else:
        vs = vm = qs
        vd = TensorDescriptor(v, [B * Skv, Hkv * D], [Hkv * D, 1], [bn, D], smem_layout((bn, D), gdt))
    tma_store = bool(cfg["tma_store"]) and out.is_contiguous()
    o_layout = smem_layout((1, WG_M.value, D), gdt)
    od = TensorDescriptor(out, [B, Sq, H * D], [Sq * H * D, H * D, 1], [1, WG_M.value, D], o_layout)
    ks_flat = ks.view(-1)
    ksd = TensorDescriptor(ks_flat, [ks_flat.numel()], [1], [bn], smem_layout((bn,), gl.float32))
    num_tiles = sq_pad // BLOCK_M.value * B * H
    if cfg["persistent"]:
        grid = (min(num_tiles, num_sms(q.device)),)
    else:
        grid = (sq_pad // BLOCK_M.value, B * H)
    _sage_fwd_sm90[grid](
        qd,
        kd,
        vd,
        od,
        ksd,
        qs,
        qn,
        kn,
        ks,
        qkm,
        vs,
        vm,
        out,
        lse,
        Sq,
        Skv,
        sq_pad,
        skv_pad,
        H,
        Hkv,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        num_tiles,
        **kernel_constexprs(cfg, D, return_lse=bool(return_lse), tma_store=tma_store),
        num_warps=4,
        maxnreg=168,
    )
    return out, (lse if return_lse else None)


def kernel_config(head_dim: int, config: Optional[dict], *, what: str = "sage_attn SM90 kernel") -> dict:
    """:func:`default_config` (for the requested ``pv_dtype``) updated with ``config``, validated:
    unknown keys and values outside the accepted sets raise :class:`AttentionConfigError`."""
    pv = (config or {}).get("pv_dtype", "fp16")
    if pv not in PV_DTYPES:
        raise AttentionConfigError(f"{what}: pv_dtype {pv!r} not supported (accepts {list(PV_DTYPES)})")
    cfg = launch_config(default_config(head_dim, pv), config, what=what)
    if cfg["k_granularity"] not in ("token", "block"):
        raise AttentionConfigError(
            f"{what}: k_granularity {cfg['k_granularity']!r} not supported (accepts 'token', 'block')"
        )
    check_qk_balance(cfg["qk_balance"], what)
    if not isinstance(cfg["persistent"], bool):
        raise AttentionConfigError(f"{what}: persistent must be True or False, got {cfg['persistent']!r}")
    if cfg["pv_accum"] not in PV_ACCUMS:
        raise AttentionConfigError(f"{what}: pv_accum {cfg['pv_accum']!r} not supported (accepts {list(PV_ACCUMS)})")
    if pv == "fp8" and cfg["static_max"]:
        raise AttentionConfigError(
            f"{what}: static_max needs pv_dtype fp16 (exp2 of the raw logits spans "
            "2^-100..2^100, beyond FP8 e4m3; fp8 P.V runs the online softmax)"
        )
    if pv == "fp16" and (cfg["pv_accum"] != "two_level" or cfg["v_smooth"]):
        raise AttentionConfigError(
            f"{what}: pv_accum and v_smooth apply to pv_dtype fp8 only "
            "(fp16 P.V accumulates in FP32 and reads V as it is)"
        )
    return cfg


def kernel_constexprs(cfg: dict, head_dim: int, *, return_lse: bool, tma_store: bool) -> dict:
    """The compile-time arguments of ``_sage_fwd_sm90`` for a :func:`kernel_config` result."""
    pv_fp8 = cfg["pv_dtype"] == "fp8"
    return dict(
        BLOCK_N=int(cfg["block_n"]),
        HEAD_DIM=head_dim,
        NUM_STAGES=int(cfg["num_stages"]),
        RETURN_LSE=return_lse,
        CONSUMER_REGS=int(cfg["consumer_regs"]),
        PRODUCER_REGS=int(cfg["producer_regs"]),
        K_PER_TOKEN=cfg["k_granularity"] == "token",
        PINGPONG=bool(cfg["pingpong"]),
        TMA_STORE=tma_store,
        STATIC_MAX=bool(cfg["static_max"]),
        Q_REGS=bool(cfg["q_regs"]),
        PV_FP8=pv_fp8,
        TWO_LEVEL=pv_fp8 and cfg["pv_accum"] == "two_level",
        V_SMOOTH=pv_fp8 and bool(cfg["v_smooth"]),
        PV_OVERLAP=bool(cfg["pv_overlap"]),
        PERSISTENT=cfg["persistent"],
    )


__all__ = ["sage_attention_sm90", "default_config", "kernel_config", "SUPPORTED_HEAD_DIMS", "PV_DTYPES", "PV_ACCUMS"]
