"""Sequence parallelism on ``torch.distributed``: Ulysses, ring and USP attention.

* :mod:`~ditattn.distributed.groups` — the rank grid (``U × R = N``) and its process groups;
* :mod:`~ditattn.distributed.comm` — all-to-all between sequence and head shards, ring rotation,
  sharding and gathering a model's token sequence;
* :mod:`~ditattn.distributed.ring` — ring attention with the LSE merge;
* :mod:`~ditattn.distributed.attention` — ``UlyssesAttention`` / ``USPAttention`` modules;
* :mod:`~ditattn.distributed.cfg` — CFG parallelism: the conditional and unconditional passes on two
  halves of the ranks, predictions all-gathered;
* :mod:`~ditattn.distributed.vae` — the VAE's tiled decode with its tiles spread over the ranks;
* :mod:`~ditattn.distributed.launch` — run any callable on N ranks (spawn, or ``torchrun``);
* :mod:`~ditattn.distributed.relay` — replay rank 0's pipeline calls on the other ranks (``serve``).

A model supports sequence parallelism by building ``USPAttention`` for self-attention, sharding
its token sequence with :func:`shard_sequence` before the blocks and gathering it with
:func:`gather_sequence` after them; with one rank all of this is the identity.
"""

from ditattn.distributed.comm import gather_sequence, shard_length, shard_sequence
from ditattn.distributed.groups import (
    SequenceParallelGroups,
    destroy_sequence_parallel,
    get_sequence_parallel,
    init_sequence_parallel,
    resolve_degrees,
    sequence_parallel_rank,
    sequence_parallel_world_size,
)


def __getattr__(name):  # the nn.Modules import the attention layer stack lazily
    if name in ("USPAttention", "UlyssesAttention"):
        from ditattn.distributed import attention as _a

        return getattr(_a, name)
    raise AttributeError(f"module 'ditattn.distributed' has no attribute {name!r}")


__all__ = [
    "SequenceParallelGroups",
    "USPAttention",
    "UlyssesAttention",
    "destroy_sequence_parallel",
    "gather_sequence",
    "get_sequence_parallel",
    "init_sequence_parallel",
    "resolve_degrees",
    "sequence_parallel_rank",
    "sequence_parallel_world_size",
    "shard_length",
    "shard_sequence",
]
