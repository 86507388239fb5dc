"""Process groups of sequence parallelism: world, Ulysses groups and ring groups.

``N`` ranks are laid out as a ``R × U`` grid (``U`` = Ulysses degree, ``R`` = ring degree,
``U × R = N``)::

    rank = ring_rank * U + ulysses_rank

With CFG parallelism (:mod:`ditattn.distributed.cfg`, ``C`` = 2 guidance halves) the world of
``C × N`` ranks holds ``C`` such grids one after the other: global rank ``c * N + rank`` is
sequence-parallel rank ``rank`` of half ``c``, and each half has its own Ulysses, ring and
sequence groups (``rank`` below is always the position inside the half).

* a **Ulysses group** is the ``U`` consecutive ranks that share a ``ring_rank`` (the all-to-all
  traffic, the heavier one, stays between neighbouring devices, usually on one NVLink island);
* a **ring group** is the ``R`` ranks that share a ``ulysses_rank`` (``K``/``V`` blocks rotate
  around it with point-to-point sends).

The sequence is cut into ``N`` equal chunks and rank ``r`` holds chunk ``r``.  After the Ulysses
all-to-all inside a Ulysses group, a rank holds the contiguous block ``ring_rank`` of ``R`` blocks
(``U`` chunks long) for ``H / U`` heads, so the ring runs over contiguous sequence blocks.

The state is per process (one process per rank): :func:`init_sequence_parallel` creates it after
``torch.distributed`` is initialised, :func:`get_sequence_parallel` reads it (None when sequence
parallelism is off), :func:`destroy_sequence_parallel` clears it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.distributed as dist

from ditattn.errors import AttentionConfigError


def _pairs(n: int) -> str:
    return ", ".join(f"{u}x{n // u}" for u in range(1, n + 1) if n % u == 0)


def resolve_degrees(
    num_gpus: int,
    ulysses_degree: Optional[int] = None,
    ring_degree: Optional[int] = None,
    *,
    ranks_name: Optional[str] = None,
) -> tuple[int, int]:
    """The ``(ulysses_degree, ring_degree)`` of a run on ``num_gpus`` ranks.

    A degree left as None takes the rest of ``num_gpus`` (both None: all Ulysses, ring 1).
    Raises :class:`AttentionConfigError` unless every value is a positive integer and
    ``ulysses_degree × ring_degree == num_gpus``.  ``ranks_name``: how messages name the rank
    count (default ``--num-gpus N``).
    """
    for flag, val in (("--num-gpus", num_gpus), ("--ulysses-degree", ulysses_degree), ("--ring-degree", ring_degree)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise AttentionConfigError(f"{flag} must be a positive integer, got {val!r}")
    n = num_gpus
    name = ranks_name or f"--num-gpus {n}"
    u, r = ulysses_degree, ring_degree
    if u is None and r is None:
        u, r = n, 1
    elif u is None:
        if n % r:
            raise AttentionConfigError(
                f"--ring-degree {r} does not divide {name}; the Ulysses degree × ring degree must equal "
                f"{name} (accepted U x R for {n}: {_pairs(n)})"
            )
        u = n // r
    elif r is None:
        if n % u:
            raise AttentionConfigError(
                f"--ulysses-degree {u} does not divide {name}; the Ulysses degree × ring degree must equal "
                f"{name} (accepted U x R for {n}: {_pairs(n)})"
            )
        r = n // u
    if u * r != n:
        raise AttentionConfigError(
            f"--ulysses-degree {u} × --ring-degree {r} = {u * r} does not equal {name}; "
            f"accepted U x R for {n}: {_pairs(n)}"
        )
    return u, r


def check_heads_divisible(num_heads: int, ulysses_degree: int, where: str = "attention layer") -> None:
    """Raise :class:`AttentionConfigError` unless ``num_heads`` divides by ``ulysses_degree``
    (Ulysses gives every rank of a Ulysses group ``num_heads / ulysses_degree`` whole heads)."""
    if ulysses_degree > 1 and num_heads % ulysses_degree:
        ok = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise AttentionConfigError(
            f"{where}: {num_heads} attention heads do not divide by the Ulysses degree {ulysses_degree}; "
            f"accepted Ulysses degrees for this model: {', '.join(map(str, ok))} "
            f"(put the rest of --num-gpus into --ring-degree)"
        )


def rank_layout(
    world_size: int, ulysses_degree: int, ring_degree: int, offset: int = 0
) -> tuple[list[list[int]], list[list[int]]]:
    """``(ulysses_groups, ring_groups)`` as lists of global ranks for the grid layout above.

    ``ulysses_groups[g]`` are the ranks of ring position ``g`` (ordered by Ulysses rank);
    ``ring_groups[u]`` are the ranks of Ulysses position ``u`` (ordered by ring rank).
    ``offset``: the global rank of the grid's rank 0 (a CFG half's first rank).
    """
    u, r = resolve_degrees(world_size, ulysses_degree, ring_degree)
    ulysses_groups = [[offset + g * u + j for j in range(u)] for g in range(r)]
    ring_groups = [[offset + g * u + j for g in range(r)] for j in range(u)]
    return ulysses_groups, ring_groups


@dataclasses.dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's place in the sequence-parallel grid.

    world_size / rank: the ranks that share one sequence and this rank's position among them;
    ulysses_group / ring_group: the process groups (None where the degree is 1);
    ulysses_ranks / ring_ranks: their members as global ranks, in group-rank order;
    backend: the ``torch.distributed`` backend (``nccl`` or ``gloo``);
    group: the process group of all ``world_size`` ranks (None: the default group, i.e. the
    sequence-parallel ranks are the whole world; a group of its own under CFG parallelism).
    """

    world_size: int
    rank: int
    ulysses_degree: int
    ring_degree: int
    ulysses_group: Optional[object]
    ring_group: Optional[object]
    ulysses_ranks: tuple[int, ...]
    ring_ranks: tuple[int, ...]
    backend: str = "gloo"
    group: Optional[object] = None

    @property
    def ulysses_rank(self) -> int:
        """Position inside the Ulysses group (which ``1/U`` of the heads this rank owns)."""
        return self.rank % self.ulysses_degree

    @property
    def ring_rank(self) -> int:
        """Position inside the ring group (which contiguous sequence block this rank owns)."""
        return self.rank // self.ulysses_degree

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (ulysses {self.ulysses_rank}/{self.ulysses_degree}, "
            f"ring {self.ring_rank}/{self.ring_degree}, {self.backend})"
        )


_state: list[Optional[SequenceParallelGroups]] = [None]


def _create_groups(all_groups, mine, degree: int, world: int):
    """Create every group of one kind (collective: all ranks, same order); return this rank's
    (None for degree 1, the world group when one group spans every rank)."""
    if degree == 1:
        return None
    if degree == world == dist.get_world_size():
        return dist.group.WORLD
    handle = None
    for ranks in all_groups:
        g = dist.new_group(ranks)
        if ranks == mine:
            handle = g
    return handle


def init_sequence_parallel(
    ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None, *, cfg_degree: int = 1
) -> SequenceParallelGroups:
    """Create the Ulysses and ring process groups of this run and make them current.

    ``torch.distributed`` must be initialised (every rank calls this, in the same order: group
    creation is collective).  ``cfg_degree``: how many CFG halves the world is split into (each
    half one sequence-parallel grid of ``world / cfg_degree`` ranks; the CFG groups themselves:
    :func:`ditattn.distributed.cfg.init_cfg_parallel`).  Degrees left None take the rest of the
    half's ranks (see :func:`resolve_degrees`).  Raises :class:`AttentionConfigError` for degrees
    that do not multiply to the world size.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise AttentionConfigError(
            "sequence parallelism needs torch.distributed to be initialised first "
            "(use ditattn.distributed.launch.launch, torchrun, or torch.distributed.init_process_group)"
        )
    world, global_rank = dist.get_world_size(), dist.get_rank()
    if isinstance(cfg_degree, bool) or not isinstance(cfg_degree, int) or cfg_degree < 1 or world % cfg_degree:
        raise AttentionConfigError(f"cfg_degree {cfg_degree!r} must be a positive divisor of the world size {world}")
    sp = world // cfg_degree
    half, rank = divmod(global_rank, sp)
    u, r = resolve_degrees(
        sp,
        ulysses_degree,
        ring_degree,
        ranks_name=None if cfg_degree == 1 else f"--num-gpus {world} / {cfg_degree} (--cfg-parallel)",
    )
    layouts = [rank_layout(sp, u, r, offset=c * sp) for c in range(cfg_degree)]
    # group creation is collective: every rank creates every group, in the same order
    mine_u = layouts[half][0][rank // u]
    mine_r = layouts[half][1][rank % u]
    u_handle = _create_groups([g for lay in layouts for g in lay[0]], mine_u, u, world)
    r_handle = _create_groups([g for lay in layouts for g in lay[1]], mine_r, r, world)
    sp_handle = None
    if cfg_degree > 1:
        halves = [list(range(c * sp, (c + 1) * sp)) for c in range(cfg_degree)]
        sp_handle = _create_groups(halves, halves[half], sp, world)
    state = SequenceParallelGroups(
        world_size=sp,
        rank=rank,
        ulysses_degree=u,
        ring_degree=r,
        ulysses_group=u_handle,
        ring_group=r_handle,
        ulysses_ranks=tuple(mine_u),
        ring_ranks=tuple(mine_r),
        backend=str(dist.get_backend()),
        group=sp_handle,
    )
    _state[0] = state
    return state


def get_sequence_parallel() -> Optional[SequenceParallelGroups]:
    """The current groups, or None when sequence parallelism is not initialised in this process."""
    return _state[0]


def sequence_parallel_world_size() -> int:
    """Ranks that share one sequence (1 when sequence parallelism is off)."""
    s = _state[0]
    return 1 if s is None else s.world_size


def sequence_parallel_rank() -> int:
    """This rank's index among :func:`sequence_parallel_world_size` ranks (0 when off)."""
    s = _state[0]
    return 0 if s is None else s.rank


def destroy_sequence_parallel() -> None:
    """Forget the current groups.  The subgroups go with ``torch.distributed.destroy_process_group()``,
    which the owner of the default group calls (after a barrier)."""
    _state[0] = None
