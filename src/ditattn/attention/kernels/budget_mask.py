"""The error budget's widening (:func:`ditattn.attention.sparse.budget.enforce_budget`) in one Triton kernel.

For each probe row of predicted block log-masses the budget keeps the fewest key blocks, largest share first,
whose shares reach ``1 - budget``, and a query block keeps the union over its probe rows.  The PyTorch path
sorts every row (``mass_mask``) and runs about ten passes over the ``[B, H, nq, R, nk]`` float32 masses, several
milliseconds at 480p with 40 heads.  Here one program per (batch, head, query block) holds each of its ``R``
rows in registers: the shares (``softmax`` of the row), each share's float bits as an int32 key (shares are
``>= 0``, so the key order is the share order), and a bitwise search, from the top bit, for the largest key
``t`` whose dropped mass ``sum(share where key < t)`` stays within the budget.  The row keeps every block with
``key >= t``: the blocks the sorted rule keeps, plus, where several shares tie exactly at the cut, the rest of
that tie (the sorted rule keeps the lower-indexed ones only).  It reads the masses once and writes the bool
union ``[B, H, nq, nk]``.  A row of ``-inf`` (no share) keeps nothing, as in the PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import check_device
from ditattn.errors import AttentionConfigError

#: widest row (key blocks) a program holds in registers; wider rows take the PyTorch path
MAX_BUDGET_BLOCKS = 8192


@triton.jit
def _budget_need(LM, Out, R, NK, drop_max, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)  # (batch, head, query block), flattened
    offs = tl.arange(0, BLOCK_N)
    valid = offs < NK
    need = offs < 0
    for r in range(0, R):
        x = tl.load(LM + (row.to(tl.int64) * R + r) * NK + offs, mask=valid, other=float("-inf"))
        m = tl.max(x, 0)
        live = m > float("-inf")
        e = tl.exp(x - tl.where(live, m, 0.0))
        p = e / tl.sum(e, 0)
        p = tl.where(p == p, p, 0.0)  # a row of -inf: no share
        key = p.to(tl.int32, bitcast=True)  # shares >= 0: int32 order == float order
        t = tl.where(live, 0, 0)
        bit = 30
        while bit >= 0:
            cand = t | (1 << bit)
            dropped = tl.sum(tl.where(key < cand, p, 0.0), 0)
            t = tl.where(dropped <= drop_max, cand, t)
            bit -= 1
        need = need | ((key >= t) & valid)  # a row of -inf: every share 0, t climbs past them all
    tl.store(Out + row.to(tl.int64) * NK + offs, need.to(tl.int8), mask=valid)


def budget_need(log_mass: torch.Tensor, budget: float) -> torch.Tensor:
    """Bool ``[B, H, nq, nk]``: per query block, the union over its probe rows of the fewest key blocks, largest
    predicted share first, whose shares reach ``1 - budget`` (exact ties at the cut all kept).

    log_mass: float32 ``[B, H, nq, R, nk]`` (``R`` probe rows per query block) or ``[B, H, nq, nk]`` (one row),
    unnormalised block log-masses (``softmax`` over the last dim is each block's share); ``0 < budget < 1``;
    ``nk <= MAX_BUDGET_BLOCKS``.  Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1``."""
    what = "error budget kernel"
    check_device(log_mass, what=what)
    if log_mass.dim() not in (4, 5) or log_mass.dtype != torch.float32:
        raise AttentionConfigError(
            f"{what}: log_mass must be float32 [B, H, nq, (R,) nk]; got {log_mass.dtype} {tuple(log_mass.shape)}"
        )
    lm = (log_mass if log_mass.dim() == 5 else log_mass.unsqueeze(-2)).contiguous()
    B, H, nq, R, nk = lm.shape
    if not 1 <= nk <= MAX_BUDGET_BLOCKS or not 0 < budget < 1:
        raise AttentionConfigError(
            f"{what}: needs 1 <= nk <= {MAX_BUDGET_BLOCKS} and 0 < budget < 1; got nk={nk}, budget={budget}"
        )
    out = torch.empty(B, H, nq, nk, dtype=torch.int8, device=lm.device)
    if out.numel() and R:
        # the PyTorch path's comparison: a sorted suffix is dropped while its sum is <= 1 - (1 - budget)
        _budget_need[(B * H * nq,)](
            lm,
            out,
            R,
            nk,
            1.0 - (1.0 - float(budget)),
            BLOCK_N=triton.next_power_of_2(nk),
            num_warps=4 if nk <= 2048 else 8,
        )
    elif out.numel():
        out.zero_()
    return out.view(torch.bool)
