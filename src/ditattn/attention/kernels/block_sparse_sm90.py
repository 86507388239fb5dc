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

Config ``persistent`` (default off: on the H200 at most 0.06x of ideal faster at 480p, slower at
720p): one CTA per SM instead of one per tile, each looping over (batch, head, query-block pair)
tiles; one producer warp per ring loads the next tile's Q and K/V while its consumer finishes the
current one (ring counts run on across tiles), and
the two warpgroups' tile sequences run independently (see :func:`_bs_fwd_sm90`).

bf16/fp16, head dim 64/128, block size 64.  Padding keys (``kv_valid``) are masked only in key
blocks flagged as holding padding.
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

from ditattn.attention.kernels import LOG2E, launch_config, num_sms
from ditattn.attention.kernels.gluon_sm90 import LOGIT_LIMITS, finish_pv, ones_operand, ring_slot, smem_layout
from ditattn.errors import AttentionConfigError

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (64,)
BLOCK = gl.constexpr(64)


def default_config(head_dim: int) -> dict:
    """Launch configuration used when the caller passes none.

    ``num_stages``: K/V stages per warpgroup ring; ``consumer_regs`` / ``producer_regs``: registers per
    thread of the consumer warpgroups / producer warps (``setmaxnreg``); ``static_max``: the softmax
    without a running maximum where the rows' logit bound allows it (:data:`LOGIT_LIMITS`);
    ``persistent``: one CTA per SM looping over the (batch, head, query-block pair) tiles (see
    :func:`_bs_fwd_sm90`) instead of one CTA per tile."""
    return {"num_stages": 2, "consumer_regs": 232, "producer_regs": 40, "static_max": True, "persistent": False}


#: dynamic shared memory of one SM90 CTA (H100/H200: 227 KiB)
SMEM_LIMIT = 232448
#: what the kernel allocates besides the Q / output / K / V tiles and the ones operand (mbarriers,
#: layout-conversion scratch): at most 568 B in the 68 offline builds
#: (tests/sm90_offline.py --kernel block_sparse --matrix), 2 KiB kept
SMEM_SLACK = 2048


def smem_bytes(head_dim: int, num_stages: int, *, static_max: bool, out_buffer: bool) -> int:
    """Shared memory of ``_bs_fwd_sm90`` (bf16/fp16) without the small items of :data:`SMEM_SLACK`: two Q
    tiles, two rings of ``num_stages`` K and V tiles, with ``out_buffer`` two output staging tiles
    (else the output is staged in Q's buffer), the ones tile of the static-max row sums."""
    tile = BLOCK.value * head_dim * 2
    return tile * (2 + 4 * num_stages + (2 if out_buffer else 0)) + (8 * BLOCK.value * 2 if static_max else 0)


def kernel_config(head_dim: int, config: Optional[dict], *, what: str = "block-sparse SM90 kernel") -> dict:
    """:func:`default_config` updated with ``config``, validated: unknown keys and values outside the
    accepted sets raise :class:`AttentionConfigError` (on any device: nothing here needs the GPU)."""
    cfg = launch_config(default_config(head_dim), config, what=what)
    for key in ("static_max", "persistent"):
        if not isinstance(cfg[key], bool):
            raise AttentionConfigError(f"{what}: {key} must be True or False, got {cfg[key]!r}")
    for key in ("num_stages", "consumer_regs", "producer_regs"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int):
            raise AttentionConfigError(f"{what}: {key} must be an int, got {cfg[key]!r}")
    for key in ("consumer_regs", "producer_regs"):  # setmaxnreg takes multiples of 8 in [24, 256]
        if not (24 <= cfg[key] <= 256 and cfg[key] % 8 == 0):
            raise AttentionConfigError(f"{what}: {key} must be a multiple of 8 in [24, 256], got {cfg[key]}")
    if cfg["num_stages"] < 1:
        raise AttentionConfigError(f"{what}: num_stages must be >= 1, got {cfg['num_stages']}")
    need = smem_bytes(head_dim, cfg["num_stages"], static_max=cfg["static_max"], out_buffer=False) + SMEM_SLACK
    if head_dim in SUPPORTED_HEAD_DIMS and need > SMEM_LIMIT:  # (other head dims: why_not says why)
        raise AttentionConfigError(
            f"{what}: num_stages {cfg['num_stages']} at head dim {head_dim} needs ~{need:,} B "
            f"of shared memory, over the {SMEM_LIMIT:,} B of an SM90 CTA"
        )
    return cfg


def out_buffer(cfg: dict, head_dim: int) -> bool:
    """Whether the persistent schedule stages the output in its own tiles (they fit in shared memory:
    head dim 128 with 2 stages, head dim 64 up to 6), so that Q's buffer is free for the next query
    tile as soon as the last Q.K is done; else the output goes through Q's buffer, which is released
    only once its TMA store has read it."""
    return (
        bool(cfg["persistent"])
        and smem_bytes(head_dim, int(cfg["num_stages"]), static_max=bool(cfg["static_max"]), out_buffer=True)
        + SMEM_SLACK
        <= SMEM_LIMIT
    )


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, slot, ph, row, col):
    mbarrier.wait(k_empty.index(slot), ph ^ 1)
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(slot), k_smem.index(slot))
    mbarrier.wait(v_empty.index(slot), ph ^ 1)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_bar,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    idx0_ptr,
    idx1_ptr,
    n0,
    n1,
    has1,
    q_row,
    q_col,
    kv_row,
    kv_col,
    NUM_STAGES: gl.constexpr,
):
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
            _load_kv(
                k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, st, ph, kv_row + kb * BLOCK, kv_col
            )
        if i < n1:
            kb = gl.load(idx1_ptr + i)
            _load_kv(
                k_desc,
                v_desc,
                k_smem,
                v_smem,
                k_ready,
                k_empty,
                v_ready,
                v_empty,
                NUM_STAGES + st,
                ph,
                kv_row + kb * BLOCK,
                kv_col,
            )


@gluon.jit
def _scores(s, idx_ptr, valid_ptr, partial_ptr, i, HAS_VALID: gl.constexpr, s_layout: gl.constexpr):
    """Mask the padding keys of listed key block ``i`` (only when its 'holds padding' flag is set)."""
    if HAS_VALID:
        kb = gl.load(idx_ptr + i)
        if gl.load(partial_ptr + kb) != 0:
            ok = gl.load(valid_ptr + kb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))) != 0
            s = gl.where(ok[None, :], s, float("-inf"))
    return s


def kernel_constexprs(cfg: dict, head_dim: int, dtype: torch.dtype, *, has_valid: bool, return_lse: bool) -> dict:
    """The compile-time arguments of ``_bs_fwd_sm90`` for one call (``cfg``: a :func:`kernel_config` result)."""
    return dict(
        HEAD_DIM=head_dim,
        NUM_STAGES=int(cfg["num_stages"]),
        HAS_VALID=bool(has_valid),
        RETURN_LSE=bool(return_lse),
        CONSUMER_REGS=int(cfg["consumer_regs"]),
        PRODUCER_REGS=int(cfg["producer_regs"]),
        STATIC_MAX=bool(cfg["static_max"]),
        LOGIT_LIMIT=LOGIT_LIMITS[dtype],
        PERSISTENT=bool(cfg["persistent"]),
        OUT_BUFFER=out_buffer(cfg, head_dim),
    )


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
def _kv_loop(
    WG: gl.constexpr,
    q,
    n,
    c0,
    k_smem,
    v_smem,
    ones_smem,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    q_free,
    idx_ptr,
    valid_ptr,
    partial_ptr,
    qk_scale,
    STATIC_MAX: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_VALID: gl.constexpr,
    RUNNING: gl.constexpr,
    RELEASE_Q: gl.constexpr,
):
    """The ``n >= 1`` listed key blocks of one query block: ``(acc [64, D], l [64], m [64])``.

    Q.K(i) is issued before P(i-1).V(i-1) (and, with the static max, P(i-1) x ones for the row sums),
    so the softmax of block i runs under the products of block i-1.  ``c0``: the K/V tiles this
    warpgroup's ring has delivered before — 0 for one query block per CTA; with ``RUNNING``, the
    persistent schedule's running count — so block i sits in stage ``(c0 + i) % NUM_STAGES`` with
    phase ``(c0 + i) // NUM_STAGES & 1``.  ``RELEASE_Q``: arrive on ``q_free`` once the last Q.K is
    done (before the last P.V), so the producer may load the next query tile into Q's buffer.

    With ``RUNNING`` and the static max, P crosses the loop's back edge in float32 and is rounded at
    the top of the next iteration: carried as 16-bit halves inside the persistent tile loop, ptxas
    packs them swapped and adds 16 byte permutes (PRMT) per key block (offline SASS, Triton 3.6)."""
    P_F32: gl.constexpr = RUNNING and STATIC_MAX
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
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

    r, ph = ring_slot(c0, NUM_STAGES, RUNNING)
    st = base + r
    mbarrier.wait(k_ready.index(st), ph)
    s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(st), count=1)
    s = _scores(s, idx_ptr, valid_ptr, partial_ptr, 0, HAS_VALID, s_layout)
    p, alpha, m_i, l_i = _probs(s, m_i, l_i, qk_scale, STATIC_MAX)
    p_prev = gl.convert_layout(p.to(dt), p_layout)
    p32 = p
    for i in range(1, n):
        r, ph = ring_slot(c0 + i, NUM_STAGES, RUNNING)
        rp, php = ring_slot(c0 + i - 1, NUM_STAGES, RUNNING)
        st = base + r
        sp = base + rp
        mbarrier.wait(k_ready.index(st), ph)
        mbarrier.wait(v_ready.index(sp), php)
        s_tok = warpgroup_mma(q, k_smem.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if P_F32:
            p_prev = gl.convert_layout(p32.to(dt), p_layout)
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
        if not P_F32:
            p_next = gl.convert_layout(p.to(dt), p_layout)
        # P(i-1) stays in deps until its products are done (else ptxas serialises every wgmma)
        if STATIC_MAX:
            acc, l_acc, _p, _pl = warpgroup_mma_wait(0, deps=(o_tok, l_tok, p_prev, pl))
        else:
            acc, _p = warpgroup_mma_wait(0, deps=(o_tok, p_prev))
        mbarrier.arrive(v_empty.index(sp), count=1)
        if not STATIC_MAX:
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        if P_F32:
            p32 = p
        else:
            p_prev = p_next
    if RELEASE_Q:  # the last Q.K has been waited for: Q's buffer is free
        mbarrier.arrive(q_free, count=1)
    rp, php = ring_slot(c0 + n - 1, NUM_STAGES, RUNNING)
    sp = base + rp
    mbarrier.wait(v_ready.index(sp), php)
    if P_F32:
        p_prev = gl.convert_layout(p32.to(dt), p_layout)
    acc, l_i = finish_pv(p_prev, v_smem.index(sp), acc, l_acc, l_i, ones_smem, STATIC_MAX, pl_layout, row_s)
    mbarrier.arrive(v_empty.index(sp), count=1)
    return acc, l_i, m_i


@gluon.jit
def _consumer(
    WG: gl.constexpr,
    q_smem,
    k_smem,
    v_smem,
    ones_smem,
    q_bar,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    o_desc,
    idx_ptr,
    n,
    live,
    valid_ptr,
    partial_ptr,
    lse_ptr,
    qn_ptr,
    kn,
    o_row,
    o_col,
    qk_scale,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_VALID: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    LOGIT_LIMIT: gl.constexpr,
):
    """One query block (64 rows) over its ``n`` listed key blocks, then the epilogue.  With
    ``STATIC_MAX`` the rows' logit bound (``qn_i * kn``) decides once whether the loop runs without a
    running maximum (bound <= ``LOGIT_LIMIT``, see :data:`LOGIT_LIMITS`)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
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
                acc, l_i, m_i = _kv_loop(
                    WG,
                    q,
                    n,
                    0,
                    k_smem,
                    v_smem,
                    ones_smem,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    q_bar.index(WG),
                    idx_ptr,
                    valid_ptr,
                    partial_ptr,
                    qk_scale,
                    True,
                    HEAD_DIM,
                    NUM_STAGES,
                    HAS_VALID,
                    False,
                    False,
                )
            else:
                acc, l_i, m_i = _kv_loop(
                    WG,
                    q,
                    n,
                    0,
                    k_smem,
                    v_smem,
                    ones_smem,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    q_bar.index(WG),
                    idx_ptr,
                    valid_ptr,
                    partial_ptr,
                    qk_scale,
                    False,
                    HEAD_DIM,
                    NUM_STAGES,
                    HAS_VALID,
                    False,
                    False,
                )
        else:
            acc, l_i, m_i = _kv_loop(
                WG,
                q,
                n,
                0,
                k_smem,
                v_smem,
                ones_smem,
                k_ready,
                k_empty,
                v_ready,
                v_empty,
                q_bar.index(WG),
                idx_ptr,
                valid_ptr,
                partial_ptr,
                qk_scale,
                False,
                HEAD_DIM,
                NUM_STAGES,
                HAS_VALID,
                False,
                False,
            )
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
def _tile(t, npairs, H, GROUP):
    """Tile ``t`` of the persistent schedule: ``(b * H + h, b, h, kv head, query-block pair)``, the pair
    index fastest (see :func:`_bs_fwd_sm90`)."""
    bh = t // npairs
    b = bh // H
    h = bh - b * H
    return bh, b, h, h // GROUP, t - bh * npairs


@gluon.jit
def _load_q(q_desc, q_smem, q_ready, q_empty, WG: gl.constexpr, tq, row, col):
    """The ``tq``-th query tile of warpgroup ``WG`` into its Q buffer, once the previous one is released."""
    mbarrier.wait(q_empty.index(WG), (tq & 1) ^ 1)
    mbarrier.expect(q_ready.index(WG), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(WG), q_smem.index(WG))


@gluon.jit
def _producer_persistent(
    WG: gl.constexpr,
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_empty,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    idx_ptr,
    cnt_ptr,
    num_tiles,
    H,
    GROUP,
    nq,
    Sq,
    Skv,
    stride_ib,
    stride_ih,
    stride_im,
    stride_cb,
    stride_ch,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    OUT_BUFFER: gl.constexpr,
):
    """Warpgroup ``WG``'s loads over the CTA's tiles: per tile its query block's Q (once the consumer has
    released Q's buffer) and its listed K/V tiles.  The ring's running count ``c`` carries over from
    tile to tile, so the loads of the next tile start as soon as ring stages free up — during the
    consumer's last products and epilogue of the current one.  With ``OUT_BUFFER`` Q is released after
    the last Q.K and goes first; else Q's buffer holds the output until its store has read it, and
    the first ``min(n, NUM_STAGES)`` K/V tiles go before Q, so that they load during the epilogue (no
    deadlock: their stages are freed by the current tile alone).  One producer warp per ring: the two
    warpgroups' tile sequences run independently (a short list does not wait for the other's long one)."""
    npairs = (nq + 1) // 2
    base: gl.constexpr = WG * NUM_STAGES
    c = 0  # K/V tiles loaded into this ring so far
    tq = 0  # query tiles loaded so far
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, b, h, hk, pair = _tile(t, npairs, H, GROUP)
        qb = 2 * pair + WG
        if qb < nq:  # (WG 1 of the last pair of an odd number of query blocks has none)
            n = gl.load(cnt_ptr + b * stride_cb + h * stride_ch + qb)
            idx = idx_ptr + b * stride_ib + h * stride_ih + qb * stride_im
            q_at = 0  # Q goes before K/V tile q_at (after the loop if q_at == n)
            if not OUT_BUFFER:
                q_at = gl.minimum(n, NUM_STAGES)
            for i in range(n):
                if i == q_at:
                    _load_q(q_desc, q_smem, q_ready, q_empty, WG, tq, b * Sq + qb * BLOCK, h * HEAD_DIM)
                kb = gl.load(idx + i)
                _load_kv(
                    k_desc,
                    v_desc,
                    k_smem,
                    v_smem,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    base + c % NUM_STAGES,
                    (c // NUM_STAGES) & 1,
                    b * Skv + kb * BLOCK,
                    hk * HEAD_DIM,
                )
                c += 1
            if q_at == n:
                _load_q(q_desc, q_smem, q_ready, q_empty, WG, tq, b * Sq + qb * BLOCK, h * HEAD_DIM)
            tq += 1


@gluon.jit
def _consumer_persistent(
    WG: gl.constexpr,
    q_smem,
    o_smem,
    k_smem,
    v_smem,
    ones_smem,
    q_ready,
    q_empty,
    k_ready,
    k_empty,
    v_ready,
    v_empty,
    o_desc,
    idx_ptr,
    cnt_ptr,
    valid_ptr,
    partial_ptr,
    lse_ptr,
    qn_ptr,
    kn_ptr,
    num_tiles,
    H,
    GROUP,
    nq,
    Sq,
    qk_scale,
    stride_ib,
    stride_ih,
    stride_im,
    stride_cb,
    stride_ch,
    stride_vb,
    stride_pb,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_VALID: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    LOGIT_LIMIT: gl.constexpr,
    OUT_BUFFER: gl.constexpr,
):
    """Warpgroup ``WG``'s query block of each of the CTA's tiles (the same sequence as its producer's):
    what :func:`_consumer` does for one, with the ring's running count ``c`` and Q's phase carried
    across tiles.  ``OUT_BUFFER``: the output is staged in ``o_smem`` (Q's buffer is released after the
    last Q.K, the TMA store is waited for only before the buffer's next use, one tile later); else in
    Q's buffer, released to the producer once the store has read it."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    npairs = (nq + 1) // 2
    q = q_smem.index(WG)
    ob = q
    if OUT_BUFFER:
        ob = o_smem.index(WG)
    rows = gl.arange(0, BLOCK, layout=row_s)
    c = 0  # K/V tiles consumed from this ring so far
    tq = 0  # query tiles consumed so far
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        bh, b, h, hk, pair = _tile(t, npairs, H, GROUP)
        qb = 2 * pair + WG
        if qb < nq:
            # the tile's scalars are loaded before the wait for Q (usually loaded already): their latency
            # overlaps it instead of adding to it
            n = gl.load(cnt_ptr + b * stride_cb + h * stride_ch + qb)
            idx = idx_ptr + b * stride_ib + h * stride_ih + qb * stride_im
            valid_b = valid_ptr + b * stride_vb
            partial_b = partial_ptr + b * stride_pb
            bound = 0.0
            if STATIC_MAX:
                kn = gl.load(kn_ptr + b * (H // GROUP) + hk)
                bound = gl.max(gl.load(qn_ptr + bh * Sq + qb * BLOCK + rows), 0) * kn
            m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_s)
            l_i = gl.zeros([BLOCK], gl.float32, row_s)
            acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)
            mbarrier.wait(q_ready.index(WG), tq & 1)
            tq += 1
            if OUT_BUFFER:  # an empty list never reads Q
                mbarrier.arrive(q_empty.index(WG), count=1, pred=n == 0)
            if n > 0:
                if STATIC_MAX:
                    if bound <= LOGIT_LIMIT:
                        acc, l_i, m_i = _kv_loop(
                            WG,
                            q,
                            n,
                            c,
                            k_smem,
                            v_smem,
                            ones_smem,
                            k_ready,
                            k_empty,
                            v_ready,
                            v_empty,
                            q_empty.index(WG),
                            idx,
                            valid_b,
                            partial_b,
                            qk_scale,
                            True,
                            HEAD_DIM,
                            NUM_STAGES,
                            HAS_VALID,
                            True,
                            OUT_BUFFER,
                        )
                    else:
                        acc, l_i, m_i = _kv_loop(
                            WG,
                            q,
                            n,
                            c,
                            k_smem,
                            v_smem,
                            ones_smem,
                            k_ready,
                            k_empty,
                            v_ready,
                            v_empty,
                            q_empty.index(WG),
                            idx,
                            valid_b,
                            partial_b,
                            qk_scale,
                            False,
                            HEAD_DIM,
                            NUM_STAGES,
                            HAS_VALID,
                            True,
                            OUT_BUFFER,
                        )
                else:
                    acc, l_i, m_i = _kv_loop(
                        WG,
                        q,
                        n,
                        c,
                        k_smem,
                        v_smem,
                        ones_smem,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        q_empty.index(WG),
                        idx,
                        valid_b,
                        partial_b,
                        qk_scale,
                        False,
                        HEAD_DIM,
                        NUM_STAGES,
                        HAS_VALID,
                        True,
                        OUT_BUFFER,
                    )
                c += n
            l_o = gl.convert_layout(l_i, row_o)
            out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
            if OUT_BUFFER:
                tma.store_wait(0)  # the previous tile's output has left the buffer
            ob.store(out.to(o_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [b * Sq + qb * BLOCK, h * HEAD_DIM], ob)
            if RETURN_LSE:
                m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
                lse = gl.where(l_i == 0.0, float("-inf"), (m_fin * qk_scale + gl.log2(l_i)) * 0.6931471805599453)
                gl.store(lse_ptr + bh * Sq + qb * BLOCK + rows, lse)
            if not OUT_BUFFER:  # Q's buffer held the output: free once the store has read it
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(WG), count=1)
    tma.store_wait(0)


@gluon.jit
def _bs_fwd_sm90(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    idx_ptr,
    cnt_ptr,
    valid_ptr,
    partial_ptr,
    lse_ptr,
    qn_ptr,
    kn_ptr,
    H,
    GROUP,
    nq,
    Sq,
    Skv,
    qk_scale,
    stride_ib,
    stride_ih,
    stride_im,
    stride_cb,
    stride_ch,
    stride_vb,
    stride_pb,
    num_tiles,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_VALID: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    LOGIT_LIMIT: gl.constexpr,
    PERSISTENT: gl.constexpr,
    OUT_BUFFER: gl.constexpr,
):
    """Grid ``(ceil(nq / 2), B * H)``: one CTA per (batch, head, query-block pair) tile; or, with
    ``PERSISTENT``, ``(min(num_tiles, SMs),)``: each CTA loops over tiles ``pid, pid + grid, ...``.

    Persistent tile order: ``t = (b * H + h) * ceil(nq / 2) + pair`` — the pair fastest, as the
    one-CTA-per-tile grid's launch order, to keep K/V in L2.  The ~132 tiles in flight at a time (one
    per SM, the CTAs advancing at about the same rate) are consecutive query-block pairs of one or
    two heads (256 pairs per head at 480p, 591 at 720p), and with GQA consecutive heads share their
    K/V head, so what they gather (lists of blocks anywhere in the sequence) is the K and V of one
    or two heads: 2 x 32,760 x 128 x 2 B = 16.8 MB per head at 480p, inside the 50 MB L2 even for
    two; 38.7 MB per head at 720p, about the L2 — as for the one-CTA-per-tile grid.  Head-fastest
    order would keep all 40 heads' K/V in flight (670 MB at 480p) and every query block would read
    its K/V from HBM."""
    if PERSISTENT:
        _bs_fwd_persistent(
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            idx_ptr,
            cnt_ptr,
            valid_ptr,
            partial_ptr,
            lse_ptr,
            qn_ptr,
            kn_ptr,
            H,
            GROUP,
            nq,
            Sq,
            Skv,
            qk_scale,
            stride_ib,
            stride_ih,
            stride_im,
            stride_cb,
            stride_ch,
            stride_vb,
            stride_pb,
            num_tiles,
            HEAD_DIM,
            NUM_STAGES,
            HAS_VALID,
            RETURN_LSE,
            CONSUMER_REGS,
            PRODUCER_REGS,
            STATIC_MAX,
            LOGIT_LIMIT,
            OUT_BUFFER,
        )
    else:
        _bs_fwd_tile(
            q_desc,
            k_desc,
            v_desc,
            o_desc,
            idx_ptr,
            cnt_ptr,
            valid_ptr,
            partial_ptr,
            lse_ptr,
            qn_ptr,
            kn_ptr,
            H,
            GROUP,
            nq,
            Sq,
            Skv,
            qk_scale,
            stride_ib,
            stride_ih,
            stride_im,
            stride_cb,
            stride_ch,
            stride_vb,
            stride_pb,
            HEAD_DIM,
            NUM_STAGES,
            HAS_VALID,
            RETURN_LSE,
            CONSUMER_REGS,
            PRODUCER_REGS,
            STATIC_MAX,
            LOGIT_LIMIT,
        )


@gluon.jit
def _kv_rings(k_desc, v_desc, NUM_STAGES: gl.constexpr, STATIC_MAX: gl.constexpr):
    """Both schedules' K/V rings (two warpgroups x ``NUM_STAGES`` slots: ring w, stage st is slot
    ``w * NUM_STAGES + st``) with their ready / empty barriers initialised, and the B operand of the row-sum
    product P x ones (K-major ``[8, BLOCK]``, read transposed; a placeholder without the static max):
    ``(k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty)``."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2 * NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2 * NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
    ones_smem = k_smem.index(0)  # placeholder (rank 2), unused without the static max
    if STATIC_MAX:
        ones_smem = ones_operand(v_desc.dtype, BLOCK)  # row sums of P on the tensor cores
    k_ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    return k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty


@gluon.jit
def _bs_fwd_persistent(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    idx_ptr,
    cnt_ptr,
    valid_ptr,
    partial_ptr,
    lse_ptr,
    qn_ptr,
    kn_ptr,
    H,
    GROUP,
    nq,
    Sq,
    Skv,
    qk_scale,
    stride_ib,
    stride_ih,
    stride_im,
    stride_cb,
    stride_ch,
    stride_vb,
    stride_pb,
    num_tiles,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_VALID: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    LOGIT_LIMIT: gl.constexpr,
    OUT_BUFFER: gl.constexpr,
):
    """The persistent schedule: two consumer warpgroups and two producer warps (one per ring)."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    o_smem = q_smem  # placeholder: the output goes through Q's buffer
    if OUT_BUFFER:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty = _kv_rings(k_desc, v_desc, NUM_STAGES, STATIC_MAX)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
    gl.warp_specialize(
        [
            (
                _consumer_persistent,
                (
                    0,
                    q_smem,
                    o_smem,
                    k_smem,
                    v_smem,
                    ones_smem,
                    q_ready,
                    q_empty,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    o_desc,
                    idx_ptr,
                    cnt_ptr,
                    valid_ptr,
                    partial_ptr,
                    lse_ptr,
                    qn_ptr,
                    kn_ptr,
                    num_tiles,
                    H,
                    GROUP,
                    nq,
                    Sq,
                    qk_scale,
                    stride_ib,
                    stride_ih,
                    stride_im,
                    stride_cb,
                    stride_ch,
                    stride_vb,
                    stride_pb,
                    HEAD_DIM,
                    NUM_STAGES,
                    HAS_VALID,
                    RETURN_LSE,
                    STATIC_MAX,
                    LOGIT_LIMIT,
                    OUT_BUFFER,
                ),
            ),
            (
                _consumer_persistent,
                (
                    1,
                    q_smem,
                    o_smem,
                    k_smem,
                    v_smem,
                    ones_smem,
                    q_ready,
                    q_empty,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    o_desc,
                    idx_ptr,
                    cnt_ptr,
                    valid_ptr,
                    partial_ptr,
                    lse_ptr,
                    qn_ptr,
                    kn_ptr,
                    num_tiles,
                    H,
                    GROUP,
                    nq,
                    Sq,
                    qk_scale,
                    stride_ib,
                    stride_ih,
                    stride_im,
                    stride_cb,
                    stride_ch,
                    stride_vb,
                    stride_pb,
                    HEAD_DIM,
                    NUM_STAGES,
                    HAS_VALID,
                    RETURN_LSE,
                    STATIC_MAX,
                    LOGIT_LIMIT,
                    OUT_BUFFER,
                ),
            ),
            (
                _producer_persistent,
                (
                    0,
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_ready,
                    q_empty,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    idx_ptr,
                    cnt_ptr,
                    num_tiles,
                    H,
                    GROUP,
                    nq,
                    Sq,
                    Skv,
                    stride_ib,
                    stride_ih,
                    stride_im,
                    stride_cb,
                    stride_ch,
                    HEAD_DIM,
                    NUM_STAGES,
                    OUT_BUFFER,
                ),
            ),
            (
                _producer_persistent,
                (
                    1,
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_ready,
                    q_empty,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    idx_ptr,
                    cnt_ptr,
                    num_tiles,
                    H,
                    GROUP,
                    nq,
                    Sq,
                    Skv,
                    stride_ib,
                    stride_ih,
                    stride_im,
                    stride_cb,
                    stride_ch,
                    HEAD_DIM,
                    NUM_STAGES,
                    OUT_BUFFER,
                ),
            ),
        ],
        [4, 1, 1],
        [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS],
    )


@gluon.jit
def _bs_fwd_tile(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    idx_ptr,
    cnt_ptr,
    valid_ptr,
    partial_ptr,
    lse_ptr,
    qn_ptr,
    kn_ptr,
    H,
    GROUP,
    nq,
    Sq,
    Skv,
    qk_scale,
    stride_ib,
    stride_ih,
    stride_im,
    stride_cb,
    stride_ch,
    stride_vb,
    stride_pb,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_VALID: gl.constexpr,
    RETURN_LSE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    STATIC_MAX: gl.constexpr,
    LOGIT_LIMIT: gl.constexpr,
):
    """One CTA per tile (the default schedule)."""
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
    k_smem, v_smem, ones_smem, k_ready, k_empty, v_ready, v_empty = _kv_rings(k_desc, v_desc, NUM_STAGES, STATIC_MAX)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_bar.index(w), count=1)

    q_row = b * Sq + qb0 * BLOCK
    valid_b = valid_ptr + b * stride_vb
    partial_b = partial_ptr + b * stride_pb
    lse_row = lse_ptr + pid_bh * Sq + qb0 * BLOCK
    qn_row = qn_ptr + pid_bh * Sq + qb0 * BLOCK
    kn = 0.0
    if STATIC_MAX:
        kn = gl.load(kn_ptr + b * (H // GROUP) + hk)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    0,
                    q_smem,
                    k_smem,
                    v_smem,
                    ones_smem,
                    q_bar,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    o_desc,
                    idx0,
                    n0,
                    True,
                    valid_b,
                    partial_b,
                    lse_row,
                    qn_row,
                    kn,
                    q_row,
                    h * HEAD_DIM,
                    qk_scale,
                    HEAD_DIM,
                    NUM_STAGES,
                    HAS_VALID,
                    RETURN_LSE,
                    STATIC_MAX,
                    LOGIT_LIMIT,
                ),
            ),
            (
                _consumer,
                (
                    1,
                    q_smem,
                    k_smem,
                    v_smem,
                    ones_smem,
                    q_bar,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    o_desc,
                    idx1,
                    n1,
                    has1,
                    valid_b,
                    partial_b,
                    lse_row + BLOCK,
                    qn_row + BLOCK,
                    kn,
                    q_row + BLOCK,
                    h * HEAD_DIM,
                    qk_scale,
                    HEAD_DIM,
                    NUM_STAGES,
                    HAS_VALID,
                    RETURN_LSE,
                    STATIC_MAX,
                    LOGIT_LIMIT,
                ),
            ),
            (
                _producer,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_smem,
                    v_smem,
                    q_bar,
                    k_ready,
                    k_empty,
                    v_ready,
                    v_empty,
                    idx0,
                    idx1,
                    n0,
                    n1,
                    has1,
                    q_row,
                    h * HEAD_DIM,
                    b * Skv,
                    hk * HEAD_DIM,
                    NUM_STAGES,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def why_not(q: torch.Tensor, block_size: int) -> Optional[str]:
    """Why this kernel cannot serve a call (None: it can)."""
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "needs an SM90 (Hopper) GPU"
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block size {block_size} (accepts {list(SUPPORTED_BLOCK_SIZES)})"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[-1]} (accepts {list(SUPPORTED_HEAD_DIMS)})"
    return None


def launch(
    q, k, v, kv_indices, kv_counts, valid, partial, *, scale: float, return_lse: bool, config: Optional[dict] = None
):
    """Launch on validated inputs: q/k/v ``[B, S, H|H_kv, D]`` (last dim contiguous), lists expanded to
    ``[B, H, ...]`` int32 with unit last stride, ``valid`` int8 ``[B, S_kv]`` and ``partial`` int8
    ``[B, S_kv / 64]`` (or both None without padding keys).  Returns ``(out, lse | None)``."""
    what = "block-sparse SM90 kernel"
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    cfg = kernel_config(D, config, what=what)
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
    lay = smem_layout((bs, D), gdt)
    qd = TensorDescriptor(q, [B * Sq, H * D], [H * D, 1], [bs, D], lay)
    kd = TensorDescriptor(k, [B * Skv, Hkv * D], [Hkv * D, 1], [bs, D], lay)
    vd = TensorDescriptor(v, [B * Skv, Hkv * D], [Hkv * D, 1], [bs, D], lay)
    od = TensorDescriptor(out, [B * Sq, H * D], [H * D, 1], [bs, D], lay)
    num_tiles = (nq + 1) // 2 * B * H
    if cfg["persistent"]:
        grid = (min(num_tiles, num_sms(q.device)),)
    else:
        grid = ((nq + 1) // 2, B * H)
    _bs_fwd_sm90[grid](
        qd,
        kd,
        vd,
        od,
        kv_indices,
        kv_counts,
        valid,
        partial,
        lse,
        qn,
        kn,
        H,
        H // Hkv,
        nq,
        Sq,
        Skv,
        scale * LOG2E,
        kv_indices.stride(0),
        kv_indices.stride(1),
        kv_indices.stride(2),
        kv_counts.stride(0),
        kv_counts.stride(1),
        valid.stride(0) if has_valid else 0,
        partial.stride(0) if has_valid else 0,
        num_tiles,
        **kernel_constexprs(cfg, D, q.dtype, has_valid=has_valid, return_lse=return_lse),
        num_warps=4,
        maxnreg=168,
    )
    return out, (lse if return_lse else None)


__all__ = [
    "launch",
    "why_not",
    "default_config",
    "kernel_config",
    "kernel_constexprs",
    "smem_bytes",
    "out_buffer",
    "num_sms",
    "LOGIT_LIMITS",
    "SMEM_LIMIT",
    "SMEM_SLACK",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_HEAD_DIMS",
]
