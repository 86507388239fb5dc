"""Pieces shared by the SM90 Gluon kernels (:mod:`.sage_sm90`, :mod:`.block_sparse_sm90`).

* :func:`ones_operand`: the B operand of the row-sum product ``P x ones`` — with the static-max
  softmax the kernels sum each row of P on the tensor cores instead of with per-element adds;
* :func:`finish_pv`: the last P.V product of a consumer (plus the row sums), waited for with P in
  its dependencies.  Every asynchronous product that reads P from registers must keep P in the
  ``deps`` of the wait that retires it: otherwise the register allocator may reuse P's registers
  while the product still reads them, and ptxas then serialises every ``wgmma`` of the kernel
  (warning C7513; measured: ~30 % slower).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def ones_operand(dtype: gl.constexpr, N: gl.constexpr):
    """A K-major ``[8, N]`` tile of ones in shared memory (read as ``.permute((1, 0))``: ``[N, 8]``)."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([8, N], dtype)
    ones = gl.allocate_shared_memory(dtype, [8, N], layout)
    ones.store(gl.full([8, N], 1.0, dtype, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])))
    fence_async_shared()
    return ones


@gluon.jit
def finish_pv(p, v_buf, acc, l_acc, l_i, ones, ROW_SUMS: gl.constexpr, pl_layout: gl.constexpr,
              row_layout: gl.constexpr):
    """``acc += p @ v_buf`` and, with ``ROW_SUMS``, ``l = rowsum(l_acc + p @ ones)`` (the 8 columns of
    the ones product are equal); returns ``(acc, l)`` (``l_i`` unchanged without ``ROW_SUMS``)."""
    o_tok = warpgroup_mma(p, v_buf, acc, is_async=True)
    if ROW_SUMS:
        pl = gl.convert_layout(p, pl_layout)
        l_tok = warpgroup_mma(pl, ones.permute((1, 0)), l_acc, is_async=True)
        acc, l_acc, _p, _pl = warpgroup_mma_wait(0, deps=(o_tok, l_tok, p, pl))
        l_i = gl.convert_layout(gl.max(l_acc, 1), row_layout)
    else:
        acc, _p = warpgroup_mma_wait(0, deps=(o_tok, p))
    return acc, l_i
