"""Ring attention: K/V blocks rotate around the ring group and the partial outputs merge by their
log-sum-exp.

For a query row, attention over the union of key blocks ``K_1 ∪ K_2`` follows from the partial
results ``(o_i, l_i)`` (``o_i`` normalised over block ``i``, ``l_i`` its LSE)::

    l = log(exp(l_1) + exp(l_2))            (computed as logaddexp: no overflow)
    o = exp(l_1 - l) * o_1 + exp(l_2 - l) * o_2

Both weights lie in ``[0, 1]``, so the merge is stable in float32 whatever the score scale.  A row
that attends nothing has ``l = -inf`` and output 0; merging two such rows keeps ``-inf`` and 0.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ditattn.distributed.comm import RingComm

Tensor = torch.Tensor

# attend(q, k, v, causal) -> (out [B, Sq, H, D], lse [B, H, Sq] float32)
AttendFn = Callable[[Tensor, Tensor, Tensor, bool], "tuple[Tensor, Tensor]"]


def merge_partials(
    out: Optional[Tensor], lse: Optional[Tensor], out_i: Tensor, lse_i: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge the partial attention ``(out_i, lse_i)`` of one key block into the running
    ``(out, lse)`` (None = nothing merged yet).

    out, out_i: ``[B, Sq, H, D]``; lse, lse_i: ``[B, H, Sq]`` natural log.  Returns the merged
    ``(out float32 [B, Sq, H, D], lse float32 [B, H, Sq])``.
    """
    out_i = out_i.float()
    lse_i = lse_i.float()
    if out is None:
        return out_i, lse_i
    new = torch.logaddexp(lse, lse_i)
    # rows where both are -inf stay -inf with weight 0 (avoid -inf - -inf = nan)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_a = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)  # [B, Sq, H, 1]
    w_b = torch.exp(lse_i - safe).transpose(1, 2).unsqueeze(-1)
    return out * w_a + out_i * w_b, new


def merge_all(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge a list of partial ``(out, lse)`` pairs (see :func:`merge_partials`)."""
    out = lse = None
    for o, l in parts:
        out, lse = merge_partials(out, lse, o, l)
    if out is None:
        raise ValueError("merge_all needs at least one partial result")
    return out, lse


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attend: AttendFn,
    comm: RingComm,
    *,
    block_valid: Optional[Sequence[int]] = None,
    q_valid: Optional[int] = None,
    extra_kv: Optional[tuple[Tensor, Tensor]] = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries over the K/V blocks of every ring rank.

    q: ``[B, Sq, H, D]`` — the queries of this rank's sequence block (its first ``q_valid`` rows
    are real tokens of block ``comm.ring_rank``; rows after ``q_valid`` are extra queries, e.g.
    replicated text, which attend every block but take no part in the causal mask).
    k, v: ``[B, Sb, Hkv, D]`` — this rank's K/V block (every ring rank's block has the same
    ``Sb``, padded at the end); ``block_valid[j]``: the real tokens of block ``j`` (default
    ``Sb`` for every block).  extra_kv: ``(k, v)`` ``[B, Se, Hkv, D]`` attended once by every row
    (replicated tokens; added at the first step, never sent).  causal: block-causal over the ring
    order (block ``j`` > own block is skipped, the own block is causal).

    attend: the backend call ``(q, k, v, causal) -> (out, lse)``.  Rotation is overlapped with
    compute: the next block is in flight while the current one is attended.
    Returns ``(out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] float32)``; rows that attended
    nothing are 0 with LSE ``-inf``.
    """
    R = comm.size
    me = comm.ring_rank
    sb = k.shape[1]
    valid = list(block_valid) if block_valid is not None else [sb] * R
    if len(valid) != R:
        raise ValueError(f"block_valid has {len(valid)} entries for a ring of {R}")
    nq = q.shape[1]
    qv = valid[me] if q_valid is None else q_valid
    if causal and qv != nq:
        raise ValueError("causal ring attention cannot take extra (replicated) query rows")
    out = lse = None
    kv = torch.stack([k, v]) if R > 1 else None  # one message per step
    cur_k, cur_v = k, v
    for step in range(R):
        if step + 1 < R:
            comm.start(kv)
        src = (me - step) % R  # the ring rank whose block is held now
        n = valid[src]
        parts_k, parts_v = [], []
        if n > 0 and not (causal and src > me):
            parts_k.append(cur_k[:, :n])
            parts_v.append(cur_v[:, :n])
        if step == 0 and extra_kv is not None and extra_kv[0].shape[1] > 0:
            parts_k.append(extra_kv[0])
            parts_v.append(extra_kv[1])
        if parts_k and nq > 0:
            kk = parts_k[0] if len(parts_k) == 1 else torch.cat(parts_k, dim=1)
            vv = parts_v[0] if len(parts_v) == 1 else torch.cat(parts_v, dim=1)
            o, l = attend(q, kk, vv, causal and src == me)
            out, lse = merge_partials(out, lse, o, l)
        if step + 1 < R:
            kv = comm.wait()
            cur_k, cur_v = kv[0], kv[1]
    if out is None:  # nothing to attend (e.g. a block of padding only)
        b, _, h, d = q.shape
        return q.new_zeros(b, nq, h, d), torch.full((b, h, nq), float("-inf"), device=q.device)
    return out.to(q.dtype), lse
