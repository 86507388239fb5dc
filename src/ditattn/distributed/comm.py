"""Communication of sequence parallelism.

* Ulysses all-to-all between sequence shards and head shards (:func:`seq_to_head`,
  :func:`head_to_seq`), and the head all-gather for replicated tokens (:func:`gather_heads`);
* ring rotation of K/V blocks with plain ``isend``/``irecv`` (:class:`RingComm`);
* sharding a model's token sequence across ranks and gathering it back (:func:`shard_sequence`,
  :func:`gather_sequence`), padding at the end when the length does not divide.

Tensors use the attention layout ``[batch, seq, heads, head_dim]`` unless stated otherwise.
Every function is a no-op passthrough when its group has one member.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ditattn.distributed.groups import SequenceParallelGroups, get_sequence_parallel

Tensor = torch.Tensor


def _group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


# ------------------------------------------------------------------------------------------------
# Ulysses


def seq_to_head(x: Tensor, group, degree: Optional[int] = None) -> Tensor:
    """All-to-all from sequence shards to head shards.

    x: ``[B, s, H, D]`` — this rank's sequence chunk (chunk ``i`` on group rank ``i``), all heads.
    Returns ``[B, U*s, H/U, D]`` — the concatenated chunks of every group rank (in group-rank
    order), for this rank's contiguous ``1/U`` of the heads (group rank ``j`` gets heads
    ``[j*H/U, (j+1)*H/U)``).  ``U`` = group size; ``H`` must divide by ``U``.
    """
    u = degree or _group_size(group)
    if u == 1:
        return x
    b, s, h, d = x.shape
    if h % u:
        raise ValueError(f"seq_to_head: {h} heads do not divide by the group size {u}")
    # [B, s, U, h/U, D] -> [U, B, s, h/U, D]: slice j goes to group rank j
    send = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] is group rank j's sequence chunk for my heads -> [B, U*s, h/U, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)


def head_to_seq(x: Tensor, group, degree: Optional[int] = None) -> Tensor:
    """The inverse of :func:`seq_to_head`.

    x: ``[B, U*s, h, D]`` — the whole block for this rank's ``h`` heads.  Returns ``[B, s, U*h,
    D]`` — this rank's sequence chunk for all heads (heads in group-rank order).
    """
    u = degree or _group_size(group)
    if u == 1:
        return x
    b, S, h, d = x.shape
    if S % u:
        raise ValueError(f"head_to_seq: sequence {S} does not divide by the group size {u}")
    s = S // u
    send = x.reshape(b, u, s, h, d).permute(1, 0, 2, 3, 4).contiguous()  # [U, B, s, h, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] = my chunk for group rank j's heads -> [B, s, U, h, D] -> [B, s, U*h, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, u * h, d)


def gather_heads(x: Tensor, group, degree: Optional[int] = None) -> Tensor:
    """All-gather along the head dimension: ``[B, S, h, D]`` on each of ``U`` group ranks ->
    ``[B, S, U*h, D]`` (heads in group-rank order).  Used for replicated tokens, whose queries
    every rank already holds, so only their (small) outputs travel."""
    u = degree or _group_size(group)
    if u == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(u)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


# ------------------------------------------------------------------------------------------------
# ring


class RingComm:
    """Rotates one tensor per step around a ring group: send to the next ring rank, receive from
    the previous one, with plain ``isend``/``irecv`` (``batch_isend_irecv`` followed by
    ``destroy_process_group`` was seen to abort gloo ranks).

    Even ring ranks post the send first and odd ones the receive first, so that on NCCL, where the
    two directions between the same pair of ranks share one stream, a ring of two never waits on
    itself.

    ``ranks``: the ring's global ranks in ring order; ``ring_rank``: this rank's position.
    """

    def __init__(self, group, ranks: "tuple[int, ...] | list[int]", ring_rank: int):
        self.group = group
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.ring_rank = ring_rank
        self.next = self.ranks[(ring_rank + 1) % self.size]
        self.prev = self.ranks[(ring_rank - 1) % self.size]
        self._pending: list = []
        self._recv: Optional[Tensor] = None

    def start(self, send: Tensor, recv: Optional[Tensor] = None) -> None:
        """Post the exchange: ``send`` goes to the next rank; a tensor of the same shape arrives
        from the previous one (into ``recv`` when given).  Call :meth:`wait` before reusing
        ``send`` or reading the result."""
        if self._pending:
            raise RuntimeError("RingComm.start called twice without wait()")
        send = send.contiguous()
        recv = torch.empty_like(send) if recv is None else recv
        if self.ring_rank % 2 == 0:
            ops = [
                dist.isend(send, dst=self.next, group=self.group),
                dist.irecv(recv, src=self.prev, group=self.group),
            ]
        else:
            ops = [
                dist.irecv(recv, src=self.prev, group=self.group),
                dist.isend(send, dst=self.next, group=self.group),
            ]
        self._pending = [op for op in ops if op is not None]
        self._recv = recv

    def wait(self) -> Tensor:
        """Wait for the exchange posted by :meth:`start` and return the received tensor."""
        for op in self._pending:
            op.wait()
        self._pending = []
        out, self._recv = self._recv, None
        return out


# ------------------------------------------------------------------------------------------------
# sharding a model's token sequence


def shard_length(seq_len: int, world_size: int) -> int:
    """Tokens per rank when ``seq_len`` tokens are split over ``world_size`` ranks: ``ceil(seq_len
    / world_size)`` (the last ranks hold padding when it does not divide)."""
    return math.ceil(seq_len / world_size)


def shard_sequence(x: Tensor, dim: int = 1, groups: Optional[SequenceParallelGroups] = None) -> Tensor:
    """This rank's chunk of ``x`` along ``dim``.

    ``x`` is the full sequence, identical on every rank.  It is zero-padded at the end to
    ``world_size * ceil(L / world_size)`` and cut into equal chunks; rank ``r`` gets chunk ``r``.
    Without sequence parallelism (or world size 1) ``x`` is returned unchanged.
    """
    groups = groups if groups is not None else get_sequence_parallel()
    if groups is None or groups.world_size == 1:
        return x
    n = groups.world_size
    length = x.shape[dim]
    c = shard_length(length, n)
    pad = c * n - length
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return x.narrow(dim, groups.rank * c, c).contiguous()


def gather_sequence(x: Tensor, seq_len: int, dim: int = 1, groups: Optional[SequenceParallelGroups] = None) -> Tensor:
    """Inverse of :func:`shard_sequence`: all-gather every rank's chunk along ``dim`` (over the
    sequence-parallel ranks) and drop the padding, giving the first ``seq_len`` positions on every rank."""
    groups = groups if groups is not None else get_sequence_parallel()
    if groups is None or groups.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(groups.world_size)]
    dist.all_gather(parts, x.contiguous(), group=groups.group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, seq_len)


def pad_seq(x: Tensor, length: int, value: float = 0.0) -> Tensor:
    """Pad ``x [B, S, ...]`` with ``value`` along dim 1 up to ``length`` (no copy when already there)."""
    extra = length - x.shape[1]
    if extra <= 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, extra]
    return F.pad(x, pad, value=value)
