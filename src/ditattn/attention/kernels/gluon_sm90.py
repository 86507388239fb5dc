"""Pieces shared by the SM90 Gluon kernels (:mod:`.sage_sm90`, :mod:`.block_sparse_sm90`).

* :func:`ones_operand`: the B operand of the row-sum product ``P x ones`` — with the static-max
  softmax the kernels sum each row of P on the tensor cores instead of with per-element adds;
* :func:`issue_pv` / :func:`retire_pv`: one P.V product (plus the row sums), 16-bit or FP8, direct
  or two-level accumulation, waited for with P in its dependencies; :func:`finish_pv`: the last one
  of a 16-bit consumer.  Every asynchronous product that reads P from registers must keep P in the
  ``deps`` of the wait that retires it: otherwise the register allocator may reuse P's registers
  while the product still reads them, and ptxas then serialises every ``wgmma`` of the kernel
  (warning C7513; measured: ~30 % slower).
* :func:`fp8_pack` / :func:`fp8_operand`: P in e4m3 as the A operand of an FP8 ``wgmma`` — packed into
  int32 registers (what a loop carries and what the deps keep alive) with its columns relabelled so
  that no data moves; :func:`rescale`: the online softmax's per-row rescale.
* :func:`ring_slot`: stage and phase of a K/V ring's n-th tile (the persistent schedules' running counts).
* :data:`LOGIT_LIMITS` / :data:`LOGIT_LIMIT_BF16` / :data:`LOGIT_LIMIT_FP16`: the static-max softmax's bound;
* :func:`smem_layout` (host side): the default NVMMA shared layout of a TMA block, cached (building one
  costs ~10 us of Python, and a call builds five or six: at S = 4096 the sage call is host-bound).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

#: rows whose base-2 logits are bounded by this in magnitude (Cauchy-Schwarz: |q_i| * max_j |k_j| * scale *
#: log2 e) run the softmax without a running maximum (no max, no rescale): exp2 of the raw logit, rounded to
#: P's dtype (V's), must stay finite — bf16 has fp32's exponent range (2^+-100 is safe, row sums of up to 2^20
#: keys included); fp16 overflows past 65504 = 2^15.999 (a logit above 16 gave inf in the sage kernel while
#: it shared bf16's 100), hence 2^+-15
LOGIT_LIMIT_BF16 = gl.constexpr(100.0)
LOGIT_LIMIT_FP16 = gl.constexpr(15.0)
LOGIT_LIMITS = {torch.bfloat16: LOGIT_LIMIT_BF16.value, torch.float16: LOGIT_LIMIT_FP16.value}


@functools.lru_cache(maxsize=None)
def smem_layout(block_shape: tuple, dtype) -> gl.NVMMASharedLayout:
    """``gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)``, cached per (shape, dtype)
    (host side: for the ``TensorDescriptor`` of a wrapper)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


@gluon.jit
def ones_operand(dtype: gl.constexpr, N: gl.constexpr):
    """A K-major ``[8, N]`` tile of ones in shared memory (read as ``.permute((1, 0))``: ``[N, 8]``)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, N], dtype)
    ones = gl.allocate_shared_memory(dtype, [8, N], layout)
    # built in float32 and converted (Triton 3.6 has no fp8 scalar constants)
    ones.store(gl.full([8, N], 1.0, gl.float32, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])).to(dtype))
    fence_async_shared()
    return ones


#: the relabelling of P's columns for the FP8 A operand, as a permutation of the dims of P viewed as
#: ``[64, N // 16, 2 (c3), 2 (c2), 2 (c1), 2 (c0)]`` in bits of the column c (see :func:`fp8_pack`)
FP8_P_PERMUTE = gl.constexpr((0, 1, 3, 4, 2, 5))


@gluon.constexpr_function
def fp8_a_layout3(N):
    """``[64, N // 4, 4]`` layout of a 4-warp ``wgmma`` (m64, warps [4, 1]) whose reshape to ``[64, N]``
    is the FP8 A-operand layout (``DotOperandLayout`` k_width 4): the last dim spans the 4 bytes of
    one register; sliced along it, one int32 per register."""
    regs = [[0, 0, 1], [0, 0, 2], [8, 0, 0]] + [[0, 1 << b, 0] for b in range(2, (N // 4).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=regs,
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[64, N // 4, 4],
    )


@gluon.jit
def fp8_pack(p, N: gl.constexpr):
    """P ``[64, N]`` fp32 in a 4-warp ``wgmma`` accumulator layout -> int32 ``[64, N // 4]``, four e4m3
    (round to nearest even, saturating) per register in the FP8 A operand's order.

    The 8-bit operand holds 4 consecutive k per register where the accumulator holds column pairs 8
    apart, so P's columns are relabelled — within each 16, k = (c0, c3, c1, c2) in bits of the column
    c — which needs no data movement; the B operand's rows must follow the same order (the SM90
    kernel's prologue stores V^T so).  The packed int32 is what a loop carries and what the
    ``warpgroup_mma_wait`` deps keep alive (8-bit tensors cannot be deps; an 8-bit loop-carried
    tensor costs ~200 byte permutes per tile)."""
    pp = p.reshape([64, N // 16, 2, 2, 2, 2]).permute(FP8_P_PERMUTE.value).reshape([64, N // 4, 2, 2])
    a, b = gl.split(pp)
    a0, a1 = gl.split(a)
    b0, b1 = gl.split(b)
    x = gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r",
        [a0, b0, a1, b1],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )
    return gl.convert_layout(x, gl.SliceLayout(2, fp8_a_layout3(N)), assert_trivial=True)


@gluon.jit
def fp8_operand(px, N: gl.constexpr, a_layout: gl.constexpr):
    """The packed P of :func:`fp8_pack` as an e4m3 ``[64, N]`` tensor in ``a_layout`` (the A operand of
    an FP8 ``wgmma``), with no instructions: each int32 is broadcast to its 4 elements and an identity
    ``mov`` hands the register over as 4 packed bytes."""
    xb = gl.broadcast(gl.expand_dims(px, 2), gl.full([64, N // 4, 4], 0, gl.int32, fp8_a_layout3(N)))[0]
    y = gl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r,r,r,r", [xb.reshape([64, N])], dtype=gl.int8, is_pure=True, pack=4
    )
    return gl.convert_layout(y.to(gl.float8e4nv, bitcast=True), a_layout, assert_trivial=True)


@gluon.jit
def issue_pv(
    p,
    v_buf,
    acc,
    l_acc,
    zero_o,
    zero_l,
    ones,
    ROW_SUMS: gl.constexpr,
    PV_FP8: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    p_layout: gl.constexpr,
    pl_layout: gl.constexpr,
):
    """Issue ``p @ v_buf`` (asynchronous) and, with ``ROW_SUMS``, ``p @ ones`` (the row sums of P on
    the tensor cores).  16-bit: ``p`` in ``p_layout``, ``v_buf`` ``[N, D]``; ``PV_FP8``: ``p`` packed
    by :func:`fp8_pack`, ``v_buf`` V^T ``[D, N]`` (the FP8 ``wgmma`` reads B K-major).  ``TWO_LEVEL``:
    into fresh accumulators (``zero_o``/``zero_l``, retired by :func:`retire_pv` into
    ``acc``/``l_acc``), else into ``acc``/``l_acc``.  Returns ``(o_tok, l_tok, pl)`` (``pl``: P in
    the row-sum product's operand layout)."""
    if PV_FP8:
        v = v_buf.permute((1, 0))
        p = fp8_operand(p, v_buf.shape[1], p_layout)
    else:
        v = v_buf
    if TWO_LEVEL:
        o_tok = warpgroup_mma(p, v, zero_o, use_acc=False, is_async=True)
    else:
        o_tok = warpgroup_mma(p, v, acc, is_async=True)
    pl = p
    l_tok = o_tok
    if ROW_SUMS:
        pl = gl.convert_layout(p, pl_layout)
        if TWO_LEVEL:
            l_tok = warpgroup_mma(pl, ones.permute((1, 0)), zero_l, use_acc=False, is_async=True)
        else:
            l_tok = warpgroup_mma(pl, ones.permute((1, 0)), l_acc, is_async=True)
    return o_tok, l_tok, pl


@gluon.jit
def rescale(acc, l_acc, alpha, ROW_SUMS: gl.constexpr):
    """``acc`` (and, with ``ROW_SUMS``, ``l_acc``) times ``alpha`` per row (the online softmax)."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    if ROW_SUMS:
        l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_acc.type.layout))[:, None]
    return acc, l_acc


@gluon.jit
def retire_pv(
    o_tok,
    l_tok,
    p,
    pl,
    acc,
    l_acc,
    alpha,
    a_prev,
    ROW_SUMS: gl.constexpr,
    RESCALE: gl.constexpr,
    PENDING: gl.constexpr,
    PV_FP8: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
):
    """Wait for the products of :func:`issue_pv` (``PENDING`` later products may stay in flight) with
    P kept alive, then accumulate: ``TWO_LEVEL``: ``acc = acc * a_prev + o`` (``a_prev``: the rescale
    owed since the previous tile; the returned ``a_prev`` is ``alpha``), else ``acc = o``, times
    ``alpha`` when ``RESCALE`` (online softmax).  The same for ``l_acc`` with ``ROW_SUMS``.  Returns
    ``(acc, l_acc, a_prev)``."""
    if ROW_SUMS:
        if PV_FP8:  # p: the packed int32 registers the products read
            o, lo, _p = warpgroup_mma_wait(PENDING, deps=(o_tok, l_tok, p))
        else:
            o, lo, _p, _pl = warpgroup_mma_wait(PENDING, deps=(o_tok, l_tok, p, pl))
    else:
        o, _p = warpgroup_mma_wait(PENDING, deps=(o_tok, p))
        lo = l_acc
    if TWO_LEVEL:
        acc = acc * gl.convert_layout(a_prev, gl.SliceLayout(1, acc.type.layout))[:, None] + o
        if ROW_SUMS:
            l_acc = l_acc * gl.convert_layout(a_prev, gl.SliceLayout(1, l_acc.type.layout))[:, None] + lo
        a_prev = alpha
    else:
        acc = o
        l_acc = lo
        if RESCALE:
            acc, l_acc = rescale(acc, l_acc, alpha, ROW_SUMS)
    return acc, l_acc, a_prev


@gluon.jit
def finish_pv(
    p, v_buf, acc, l_acc, l_i, ones, ROW_SUMS: gl.constexpr, pl_layout: gl.constexpr, row_layout: gl.constexpr
):
    """``acc += p @ v_buf`` and, with ``ROW_SUMS``, ``l = rowsum(l_acc + p @ ones)`` (the 8 columns of
    the ones product are equal); returns ``(acc, l)`` (``l_i`` unchanged without ``ROW_SUMS``)."""
    # a layout read off a tensor is a plain Python object: bind it as a constexpr before passing it on
    # (Triton 3.6 cannot pass it as an argument: "'DotOperandLayout' object has no attribute '_flatten_ir'")
    p_layout: gl.constexpr = p.type.layout
    o_tok, l_tok, pl = issue_pv(p, v_buf, acc, l_acc, acc, l_acc, ones, ROW_SUMS, False, False, p_layout, pl_layout)
    acc, l_acc, _a = retire_pv(o_tok, l_tok, p, pl, acc, l_acc, l_i, l_i, ROW_SUMS, False, 0, False, False)
    if ROW_SUMS:
        l_i = gl.convert_layout(gl.max(l_acc, 1), row_layout)
    return acc, l_i


@gluon.jit
def ring_slot(j, NUM_STAGES: gl.constexpr, RUNNING: gl.constexpr):
    """Ring stage and phase of a ring's ``j``-th K/V tile; ``RUNNING``: ``j`` is a run-time count
    (a persistent schedule's, carried across tiles) — unsigned, else a signed ``%`` / ``//`` costs
    sign fix-ups per tile."""
    if RUNNING:
        ju = j.to(gl.uint32)
        return (ju % NUM_STAGES).to(gl.int32), ((ju // NUM_STAGES) & 1).to(gl.int32)
    else:
        return j % NUM_STAGES, (j // NUM_STAGES) & 1
