"""CFG parallelism: the conditional and unconditional halves of classifier-free guidance on two
groups of ranks.

Under classifier-free guidance every denoising step runs the DiT twice, on the prompt and on the
negative prompt.  With CFG parallelism the world of ``2 × N`` ranks is split into two halves of
``N`` sequence-parallel ranks each (:mod:`ditattn.distributed.groups` lays them out: global rank
``c * N + r``); half ``c = 0`` computes the conditional prediction and half ``c = 1`` the
unconditional one, each with its own Ulysses / ring groups.  A **CFG group** is the two ranks that
hold the same sequence position in the two halves (``{r, N + r}``); after each forward they
all-gather their predictions over it, so every rank holds both halves and combines them, and the
scheduler steps identically on every rank.

:func:`resolve_parallel` checks a run's rank arithmetic (``num_gpus = cfg × ulysses × ring``) up
front; :func:`init_cfg_parallel` creates the CFG groups after the sequence-parallel ones
(:func:`~ditattn.distributed.groups.init_sequence_parallel` with the same ``cfg_degree``);
:func:`get_cfg_parallel` reads this process's state (None when CFG parallelism is off).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ditattn.distributed.groups import resolve_degrees
from ditattn.errors import AttentionConfigError

#: the guidance halves, in CFG-rank order (and in the order of a batched ``[cond; uncond]`` forward)
BRANCHES = ("cond", "uncond")


def resolve_parallel(
    num_gpus: int,
    ulysses_degree: Optional[int] = None,
    ring_degree: Optional[int] = None,
    *,
    cfg_parallel: bool = False,
    vae_parallel: bool = False,
) -> tuple[int, int, int]:
    """``(cfg, ulysses, ring)`` of a run on ``num_gpus`` ranks: ``cfg`` is 2 with ``cfg_parallel``
    (else 1) and ``cfg × ulysses × ring == num_gpus``; the sequence degrees left None take the rest
    (:func:`~ditattn.distributed.groups.resolve_degrees`).  ``vae_parallel`` needs two ranks or
    more.  Raises :class:`AttentionConfigError` with a one-line message naming the flags."""
    cfg = 2 if cfg_parallel else 1
    if cfg_parallel and (isinstance(num_gpus, int) and not isinstance(num_gpus, bool)) and num_gpus % 2:
        raise AttentionConfigError(
            f"--cfg-parallel needs an even --num-gpus (the conditional and unconditional passes each run on half "
            f"of the ranks), got --num-gpus {num_gpus}; use --num-gpus {num_gpus + 1}"
            + (f" or {num_gpus - 1}" if num_gpus > 1 else "")
        )
    if vae_parallel and isinstance(num_gpus, int) and num_gpus < 2:
        raise AttentionConfigError(
            "--vae-parallel splits the VAE decode over the ranks and needs --num-gpus 2 or "
            f"more, got --num-gpus {num_gpus}"
        )
    if cfg == 1:
        u, r = resolve_degrees(num_gpus, ulysses_degree, ring_degree)
    else:
        u, r = resolve_degrees(
            num_gpus // cfg, ulysses_degree, ring_degree, ranks_name=f"--num-gpus {num_gpus} / 2 (--cfg-parallel)"
        )
    return cfg, u, r


@dataclasses.dataclass(frozen=True)
class CFGParallelGroups:
    """This rank's place among the CFG halves.

    degree: the number of halves (2); rank: which half this rank computes (0: conditional, 1:
    unconditional); group: the process group of the ranks that hold this rank's sequence position
    in every half; ranks: its members as global ranks, in CFG-rank order.
    """

    degree: int
    rank: int
    group: Optional[object]
    ranks: tuple[int, ...]

    @property
    def branch(self) -> str:
        """``"cond"`` or ``"uncond"``: the half this rank's forwards compute (``ForwardContext.branch``)."""
        return BRANCHES[self.rank]

    def gather(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """All-gather this rank's prediction ``out [N, ...]`` over the CFG group: every half's
        prediction, in :data:`BRANCHES` order (``(cond, uncond)``), identical on both ranks."""
        parts = [torch.empty_like(out) for _ in range(self.degree)]
        dist.all_gather(parts, out.contiguous(), group=self.group)
        return tuple(parts)


_state: list[Optional[CFGParallelGroups]] = [None]


def init_cfg_parallel(cfg_degree: int) -> Optional[CFGParallelGroups]:
    """Create the CFG groups of a world split into ``cfg_degree`` halves and make them current
    (collective: every rank calls it, after ``init_sequence_parallel(..., cfg_degree=cfg_degree)``).
    ``cfg_degree`` 1: nothing to create, the state stays None."""
    _state[0] = None
    if cfg_degree == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if cfg_degree < 1 or world % cfg_degree:
        raise AttentionConfigError(f"cfg_degree {cfg_degree!r} must be a positive divisor of the world size {world}")
    sp = world // cfg_degree
    mine, handle = None, None
    for pos in range(sp):  # group creation is collective: every rank creates every group, in the same order
        ranks = [c * sp + pos for c in range(cfg_degree)]
        g = dist.group.WORLD if sp == 1 else dist.new_group(ranks)
        if rank in ranks:
            mine, handle = ranks, g
    state = CFGParallelGroups(degree=cfg_degree, rank=rank // sp, group=handle, ranks=tuple(mine))
    _state[0] = state
    return state


def get_cfg_parallel() -> Optional[CFGParallelGroups]:
    """The current CFG groups, or None when CFG parallelism is off in this process."""
    return _state[0]


def destroy_cfg_parallel() -> None:
    """Forget the current CFG groups (the groups go with ``torch.distributed.destroy_process_group()``)."""
    _state[0] = None
