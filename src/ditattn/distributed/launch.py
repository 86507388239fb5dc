"""Running any callable on N ranks: one process per rank, ``torch.distributed`` and the
sequence-parallel groups initialised in each.

:func:`launch` runs ``fn(rank, *args)`` (``rank``: :class:`RankInfo`) in every rank and returns the
per-rank results.  It either

* spawns ``N`` processes (``torch.multiprocessing`` with the ``spawn`` start method, a free
  127.0.0.1 port, NCCL on CUDA devices, gloo on CPU), or
* under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) joins the job as the current
  process's rank.

:func:`spawn_ranks` is the same for functions that take the groups (``fn(groups, *args)``; tests,
benchmarks).  This module knows nothing of what runs: the commands built on it (``ditattn generate
/ serve --num-gpus N``) live in :mod:`ditattn.entrypoints`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ditattn.distributed.cfg import CFGParallelGroups, destroy_cfg_parallel, get_cfg_parallel, init_cfg_parallel
from ditattn.distributed.groups import (
    SequenceParallelGroups,
    destroy_sequence_parallel,
    get_sequence_parallel,
    init_sequence_parallel,
    resolve_degrees,
)
from ditattn.errors import AttentionConfigError

try:
    from torch.multiprocessing.spawn import ProcessException
except ImportError:  # pragma: no cover - older torch
    ProcessException = Exception

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the rendezvous)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    """True when the environment describes a ``torchrun``-style job (``RANK`` and ``WORLD_SIZE``)."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def in_worker() -> bool:
    """True inside a rank started by :func:`launch` / :func:`spawn_ranks` (groups initialised)."""
    return get_sequence_parallel() is not None


def dist_backend_for(device: "str | torch.device") -> str:
    """The ``torch.distributed`` backend for a device type: ``nccl`` on CUDA (and ROCm), the
    device's registered backend elsewhere, ``gloo`` on CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    return dist.Backend.default_device_backend_map.get(kind, "gloo")


def check_devices(device: str, world_size: int) -> None:
    """Raise :class:`AttentionConfigError` when ``device`` has fewer than ``world_size`` GPUs."""
    kind = torch.device(device).type
    if kind == "cuda":
        have = torch.cuda.device_count()
        if have < world_size:
            raise AttentionConfigError(
                f"--num-gpus {world_size} needs {world_size} CUDA devices, this machine has {have}; "
                f"use --num-gpus {max(have, 1)} or less (or --device cpu for a gloo run)"
            )


@contextlib.contextmanager
def _rank_session(
    rank: int,
    world_size: int,
    device: str,
    *,
    init_method: Optional[str],
    ulysses_degree: Optional[int],
    ring_degree: Optional[int],
    local_rank: int,
    timeout_s: Optional[float],
    cfg_degree: int = 1,
):
    """Initialise torch.distributed + the sequence-parallel (and CFG) groups for one rank; tear down after."""
    kind = torch.device(device).type
    if kind == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    elif kind == "cuda":
        torch.cuda.set_device(local_rank)
    own_pg = not dist.is_initialized()
    if own_pg:
        kw: dict[str, Any] = {"backend": dist_backend_for(device), "rank": rank, "world_size": world_size}
        if init_method:
            kw["init_method"] = init_method
        if timeout_s:
            kw["timeout"] = datetime.timedelta(seconds=timeout_s)
        if kind == "cuda":
            kw["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(**kw)
    ok = False
    try:
        groups = init_sequence_parallel(ulysses_degree, ring_degree, cfg_degree=cfg_degree)
        init_cfg_parallel(cfg_degree)
        yield groups
        ok = True
    finally:
        destroy_cfg_parallel()
        destroy_sequence_parallel()
        if own_pg:
            if ok:
                dist.barrier()  # a barrier before destroy: a rank that destroys early aborts its peers
            dist.destroy_process_group()


def _rank_device(device: str, local_rank: int) -> str:
    kind = torch.device(device).type
    return device if kind == "cpu" else f"{kind}:{local_rank}"


# ------------------------------------------------------------------------------------------------
# running a function on N ranks


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Where ``fn`` runs: its ``rank`` of ``world_size``, its ``local_rank`` on this host, its
    ``device`` (``cuda:<local_rank>`` on GPUs, the launch device otherwise), the sequence-parallel
    ``groups`` and, under CFG parallelism, the ``cfg`` groups (:mod:`ditattn.distributed.cfg`)."""

    rank: int
    world_size: int
    local_rank: int
    device: str
    groups: SequenceParallelGroups
    cfg: Optional[CFGParallelGroups] = None


@contextlib.contextmanager
def _quiet_unless_rank0(rank: int):
    """Ranks other than 0 print nothing to stdout and show no progress bar."""
    if rank == 0:
        yield
        return
    os.environ["TQDM_DISABLE"] = "1"
    saved = sys.stdout
    with open(os.devnull, "w") as null:
        sys.stdout = null
        try:
            yield
        finally:
            sys.stdout = saved


def _run_rank(fn, args, rank, world_size, device, u, r, *, init_method, local_rank, timeout_s, quiet, cfg=1):
    with _rank_session(
        rank,
        world_size,
        device,
        init_method=init_method,
        ulysses_degree=u,
        ring_degree=r,
        local_rank=local_rank,
        timeout_s=timeout_s,
        cfg_degree=cfg,
    ) as groups:
        info = RankInfo(rank, world_size, local_rank, _rank_device(device, local_rank), groups, get_cfg_parallel())
        with _quiet_unless_rank0(rank) if quiet else contextlib.nullcontext():
            return fn(info, *args)


def _spawn_entry(rank, world_size, port, fn, args, device, u, r, result_dir, timeout_s, quiet, cfg=1):
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        result = _run_rank(
            fn,
            args,
            rank,
            world_size,
            device,
            u,
            r,
            init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            timeout_s=timeout_s,
            quiet=quiet,
            cfg=cfg,
        )
        torch.save({"ok": result}, path)
    except AttentionConfigError as exc:
        torch.save({"error": str(exc)}, path)
        raise


def _collect(result_dir: str, world_size: int) -> list:
    out = []
    for rank in range(world_size):
        path = os.path.join(result_dir, f"rank{rank}.pt")
        out.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return out


def _raise_first_user_error(results: list) -> None:
    for res in results:
        if res is not None and "error" in res:
            raise AttentionConfigError(res["error"])


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence = (),
    device: str = "cpu",
    ulysses_degree: Optional[int] = None,
    ring_degree: Optional[int] = None,
    timeout_s: Optional[float] = 300.0,
    quiet_followers: bool = False,
    cfg_degree: int = 1,
) -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks (``rank``: :class:`RankInfo`); return the
    results by rank.

    Every rank initialises ``torch.distributed`` (gloo on CPU, NCCL on CUDA; ``timeout_s`` bounds
    each collective) and the sequence-parallel groups of degrees ``ulysses_degree × ring_degree =
    world_size / cfg_degree`` (a missing degree takes the rest; ``cfg_degree`` 2: CFG parallelism,
    :mod:`ditattn.distributed.cfg`, whose groups are created too), then calls ``fn``.  Spawned ranks rendezvous on
    a free 127.0.0.1 port; ``fn`` and ``args`` must be picklable (``fn`` defined at module level)
    and results come back through ``torch.save`` files, so tensors are fine.  Under ``torchrun``
    this process runs only its own rank (``RANK``, ``LOCAL_RANK``; ``WORLD_SIZE`` must equal
    ``world_size``) and the other ranks' slots are None.  ``quiet_followers``: ranks other than 0
    print nothing to stdout and show no progress bar.  An :class:`AttentionConfigError` raised in a
    rank is raised here with its message; any other failure raises ``RuntimeError``.
    """
    if cfg_degree not in (1, 2) or world_size % cfg_degree:
        raise AttentionConfigError(f"cfg_degree must be 1 or 2 and divide the {world_size} ranks, got {cfg_degree!r}")
    u, r = resolve_degrees(world_size // cfg_degree, ulysses_degree, ring_degree)
    if in_worker():
        raise RuntimeError("launch() called inside a launched rank; call the function directly (see in_worker)")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != world_size:
            raise AttentionConfigError(
                f"--num-gpus {world_size} does not match torchrun's WORLD_SIZE {world}; pass --num-gpus {world}"
            )
        rank = int(os.environ["RANK"])
        out: list = [None] * world_size
        out[rank] = _run_rank(
            fn,
            tuple(args),
            rank,
            world_size,
            device,
            u,
            r,
            init_method="env://",
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            timeout_s=timeout_s,
            quiet=quiet_followers,
            cfg=cfg_degree,
        )
        return out
    check_devices(device, world_size)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ditattn-sp-") as tmp:
        try:
            mp.start_processes(
                _spawn_entry,
                args=(
                    world_size,
                    free_port(),
                    fn,
                    tuple(args),
                    device,
                    u,
                    r,
                    tmp,
                    timeout_s,
                    quiet_followers,
                    cfg_degree,
                ),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except ProcessException as exc:
            results = _collect(tmp, world_size)
            _raise_first_user_error(results)
            raise RuntimeError(f"a sequence-parallel rank failed: {exc}") from None
        results = _collect(tmp, world_size)
    _raise_first_user_error(results)
    return [None if res is None else res["ok"] for res in results]


def _follower_entry(i, world_size, port, fn, args, device, u, r, timeout_s, cfg, leader_pid):
    """Rank ``i + 1`` of a :func:`lead_ranks` group: ends itself when the leader process is gone."""
    import threading

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != leader_pid:
                os._exit(1)

    threading.Thread(target=watch, name="ditattn-leader-watch", daemon=True).start()
    _run_rank(
        fn,
        args,
        i + 1,
        world_size,
        device,
        u,
        r,
        init_method=f"tcp://127.0.0.1:{port}",
        local_rank=i + 1,
        timeout_s=timeout_s,
        quiet=True,
        cfg=cfg,
    )


@contextlib.contextmanager
def lead_ranks(
    follower: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence = (),
    device: str = "cpu",
    ulysses_degree: Optional[int] = None,
    ring_degree: Optional[int] = None,
    cfg_degree: int = 1,
    timeout_s: Optional[float] = 300.0,
):
    """This process as rank 0 of ``world_size`` ranks: spawns ranks 1..N-1, which run
    ``follower(rank, *args)`` (``rank``: :class:`RankInfo`; module-level, picklable), initialises
    ``torch.distributed`` and the groups here as in :func:`launch`, and yields rank 0's
    :class:`RankInfo`.  For a process that must stay the one doing the work (a server replica):
    the followers typically replay its calls (:class:`~ditattn.distributed.relay.PipelineRelay`) and
    must return once the block's work ends.  On exit the groups are torn down and the followers
    joined; a follower whose leader process died exits by itself.  ``RuntimeError`` inside a
    launched rank or when a follower fails."""
    if cfg_degree not in (1, 2) or world_size % cfg_degree:
        raise AttentionConfigError(f"cfg_degree must be 1 or 2 and divide the {world_size} ranks, got {cfg_degree!r}")
    u, r = resolve_degrees(world_size // cfg_degree, ulysses_degree, ring_degree)
    if in_worker() or dist.is_initialized():
        raise RuntimeError("lead_ranks() in a process that already has a process group")
    check_devices(device, world_size)
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.start_processes(
        _follower_entry,
        args=(world_size, port, follower, tuple(args), device, u, r, timeout_s, cfg_degree, os.getpid()),
        nprocs=world_size - 1,
        join=False,
        start_method="spawn",
    )
    try:
        with _rank_session(
            0,
            world_size,
            device,
            init_method=f"tcp://127.0.0.1:{port}",
            ulysses_degree=u,
            ring_degree=r,
            local_rank=0,
            timeout_s=timeout_s,
            cfg_degree=cfg_degree,
        ) as groups:
            yield RankInfo(0, world_size, 0, _rank_device(device, 0), groups, get_cfg_parallel())
        deadline = time.monotonic() + (timeout_s or 300.0)
        try:
            while not ctx.join(max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the followers of rank 0 did not stop within {timeout_s} s")
        except ProcessException as exc:
            raise RuntimeError(f"a sequence-parallel rank failed: {exc}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def own_result(results: list):
    """The result this process reports after :func:`launch`: its own rank's under ``torchrun``,
    rank 0's after a spawn."""
    return results[int(os.environ["RANK"]) if under_torchrun() else 0]


def _call_with_groups(rank: RankInfo, fn, *args):
    return fn(rank.groups, *args)


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence = (),
    ulysses_degree: Optional[int] = None,
    ring_degree: Optional[int] = None,
    device: str = "cpu",
    timeout_s: Optional[float] = 300.0,
    cfg_degree: int = 1,
) -> list:
    """:func:`launch` for a function that takes the groups: ``fn(groups, *args)`` on each rank
    (``groups``: :class:`~ditattn.distributed.groups.SequenceParallelGroups`); returns each rank's result."""
    return launch(
        _call_with_groups,
        world_size,
        args=(fn, *args),
        device=device,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        timeout_s=timeout_s,
        cfg_degree=cfg_degree,
    )
