"""One process per rank for sequence-parallel runs.

``ditattn generate|serve --num-gpus N --ulysses-degree U --ring-degree R``: the pipeline's entry
point calls :func:`launch` when :func:`needs_launch` says so.  ``launch`` either

* spawns ``N`` processes (``torch.multiprocessing`` with the ``spawn`` start method, a free
  127.0.0.1 port, NCCL on CUDA devices, gloo on CPU), or
* under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) joins the job of the current
  process,

then, in every rank, initialises ``torch.distributed`` and the Ulysses/ring groups and runs the
command again with the resolved degrees.  Only rank 0 prints and writes the output; the other ranks
run the same denoise loop on their shard of the sequence.

:func:`spawn_ranks` is the same machinery for any function (tests, benchmarks).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import os
import socket
import sys
import tempfile
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ditattn.distributed.groups import (
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


def needs_launch(args: argparse.Namespace) -> bool:
    """Whether a CLI entry point must hand ``args`` to :func:`launch`: more than one rank asked for
    (``--num-gpus`` > 1) and this process is not already one of the ranks."""
    return (getattr(args, "num_gpus", 1) or 1) > 1 and not in_worker()


def dist_backend_for(device: "str | torch.device") -> str:
    """The ``torch.distributed`` backend for a device type: ``nccl`` on CUDA (and ROCm), the
    device's registered backend elsewhere, ``gloo`` on CPU."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    return dist.Backend.default_device_backend_map.get(kind, "gloo")


def _device_of(args) -> str:
    dev = getattr(args, "device", None)
    if dev:
        return str(dev)
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_devices(device: str, world_size: int) -> None:
    kind = torch.device(device).type
    if kind == "cuda":
        have = torch.cuda.device_count()
        if have < world_size:
            raise AttentionConfigError(
                f"--num-gpus {world_size} needs {world_size} CUDA devices, this machine has {have}; "
                f"use --num-gpus {max(have, 1)} or less (or --device cpu for a gloo run)"
            )


@contextlib.contextmanager
def _rank_session(rank: int, world_size: int, device: str, *, init_method: Optional[str],
                  ulysses_degree: Optional[int], ring_degree: Optional[int], local_rank: int,
                  timeout_s: Optional[float]):
    """Initialise torch.distributed + the sequence-parallel groups for one rank; tear down after."""
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
        groups = init_sequence_parallel(ulysses_degree, ring_degree)
        yield groups
        ok = True
    finally:
        destroy_sequence_parallel()
        if own_pg:
            if ok:
                dist.barrier()  # NOTES.md: barrier before destroy
            dist.destroy_process_group()


def _rank_device(device: str, local_rank: int) -> str:
    kind = torch.device(device).type
    return device if kind == "cpu" else f"{kind}:{local_rank}"


# ------------------------------------------------------------------------------------------------
# running any function on N ranks (tests, benchmarks)


def _spawn_fn_entry(rank, world_size, port, fn, fn_args, device, u, r, result_dir, timeout_s):
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        with _rank_session(rank, world_size, device, init_method=f"tcp://127.0.0.1:{port}", ulysses_degree=u,
                           ring_degree=r, local_rank=rank, timeout_s=timeout_s) as groups:
            result = fn(groups, *fn_args)
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


def spawn_ranks(fn: Callable[..., Any], world_size: int, *, args: Sequence = (), ulysses_degree: Optional[int] = None,
                ring_degree: Optional[int] = None, device: str = "cpu", timeout_s: Optional[float] = 300.0) -> list:
    """Run ``fn(groups, *args)`` on ``world_size`` spawned ranks and return each rank's result.

    Every rank initialises ``torch.distributed`` (gloo on CPU, NCCL on CUDA; rendezvous on a free
    127.0.0.1 port; ``timeout_s`` bounds each collective) and the sequence-parallel groups
    (``groups``: :class:`~ditattn.distributed.groups.SequenceParallelGroups`), then calls ``fn``.
    ``fn`` and ``args`` must be picklable (``fn`` defined at module level); results are returned
    through ``torch.save`` files, so tensors are fine.  An :class:`AttentionConfigError` raised in
    a rank is raised here with its message; any other failure raises ``RuntimeError``.
    """
    u, r = resolve_degrees(world_size, ulysses_degree, ring_degree)
    _check_devices(device, world_size)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ditattn-sp-") as tmp:
        try:
            mp.start_processes(_spawn_fn_entry, args=(world_size, free_port(), fn, tuple(args), device, u, r, tmp,
                                                      timeout_s),
                               nprocs=world_size, join=True, start_method="spawn")
        except ProcessException as exc:
            results = _collect(tmp, world_size)
            _raise_first_user_error(results)
            raise RuntimeError(f"a sequence-parallel rank failed: {exc}") from None
        results = _collect(tmp, world_size)
    _raise_first_user_error(results)
    return [None if res is None else res["ok"] for res in results]


# ------------------------------------------------------------------------------------------------
# the CLI commands


def run_command(args: argparse.Namespace) -> int:
    """Run the CLI command of ``args`` in this rank (``generate``, or ``serve`` via :func:`serve_rank`)."""
    if args.command == "serve":
        return serve_rank(args)
    from ditattn.pipelines.run import generate_main

    return generate_main(args)


def preflight(args: argparse.Namespace) -> None:
    """What can be refused before any rank starts (a refused run should not load a large model N
    times): the native pipeline is built as for ``ditattn plan`` — on the meta device, no weights —
    under the run's attention settings and degrees, so heads that do not divide by the Ulysses
    degree, ring with a backend without LSE (sparse included), bad overrides and a refused
    ``--attention-backend-override`` raise :class:`AttentionConfigError` here.  Skipped for
    ``--backend diffusers``."""
    if getattr(args, "backend", "native") != "native":
        return
    from ditattn.pipelines.run import settings_from_args, skip_softmax_from_args
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained(getattr(args, "model_path", None), settings_from_args(args),
                                             device=getattr(args, "device", None), dtype=getattr(args, "dtype", None),
                                             variant=getattr(args, "model_variant", None), load_weights=False)
    pipe.prepare_request(getattr(args, "attention_backend_override", None), skip_softmax_from_args(args))


def _rank_args(args: argparse.Namespace, rank: int, device: str, u: int, r: int) -> argparse.Namespace:
    a = copy.copy(args)
    a.device = device
    a.ulysses_degree, a.ring_degree = u, r
    if rank != 0 and hasattr(a, "save_output"):
        a.save_output = False
    return a


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


def _run_rank(rank: int, world_size: int, args, target, *, init_method: Optional[str], local_rank: int) -> int:
    device = _device_of(args)
    u, r = args.ulysses_degree, args.ring_degree
    timeout = float(os.environ.get("DITATTN_DIST_TIMEOUT_S", "1800"))
    with _rank_session(rank, world_size, device, init_method=init_method, ulysses_degree=u, ring_degree=r,
                       local_rank=local_rank, timeout_s=timeout):
        with _quiet_unless_rank0(rank):
            rc = target(_rank_args(args, rank, _rank_device(device, local_rank), u, r))
    return int(rc or 0)


def _spawn_cmd_entry(rank, world_size, port, args, target, result_dir):
    path = os.path.join(result_dir, f"rank{rank}.pt")
    try:
        rc = _run_rank(rank, world_size, args, target, init_method=f"tcp://127.0.0.1:{port}", local_rank=rank)
        torch.save({"ok": rc}, path)
    except AttentionConfigError as exc:
        torch.save({"error": str(exc)}, path)
        raise


def launch(args: argparse.Namespace, target: Optional[Callable[[argparse.Namespace], int]] = None) -> int:
    """Run the ``generate``/``serve`` command ``args`` on ``args.num_gpus`` ranks; return rank 0's
    exit status.

    Validates ``--num-gpus/--ulysses-degree/--ring-degree`` (``U × R = N``) and the device count
    first (:class:`AttentionConfigError` with what is accepted).  Under ``torchrun`` this process is
    one rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; ``WORLD_SIZE`` must equal ``--num-gpus``);
    otherwise ``N`` ranks are spawned and this process waits for them.  Each rank runs ``target``
    (default :func:`run_command`) with a copy of ``args`` whose ``device`` is the rank's device,
    whose degrees are resolved, and, on ranks other than 0, ``save_output=False`` with stdout and
    progress bars silenced.  A user error in any rank is raised here as
    :class:`AttentionConfigError`.
    """
    target = target or run_command
    n = getattr(args, "num_gpus", 1) or 1
    u, r = resolve_degrees(n, getattr(args, "ulysses_degree", None), getattr(args, "ring_degree", None))
    args = copy.copy(args)
    args.ulysses_degree, args.ring_degree = u, r
    if in_worker():
        raise RuntimeError("launch() called inside a launched rank; call the command directly (see needs_launch)")
    device = _device_of(args)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != n:
            raise AttentionConfigError(
                f"--num-gpus {n} does not match torchrun's WORLD_SIZE {world}; pass --num-gpus {world}"
            )
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if n == 1:
            return int(target(args) or 0)
        if target is run_command:
            preflight(args)
        return _run_rank(rank, n, args, target, init_method="env://", local_rank=local_rank)
    if n == 1:
        return int(target(args) or 0)
    _check_devices(device, n)
    if target is run_command:
        preflight(args)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="ditattn-sp-") as tmp:
        try:
            mp.start_processes(_spawn_cmd_entry, args=(n, free_port(), args, target, tmp), nprocs=n, join=True,
                               start_method="spawn")
        except ProcessException as exc:
            results = _collect(tmp, n)
            _raise_first_user_error(results)
            raise RuntimeError(f"a sequence-parallel rank failed: {exc}") from None
        results = _collect(tmp, n)
    _raise_first_user_error(results)
    return int(results[0]["ok"]) if results and results[0] is not None else 1


# ------------------------------------------------------------------------------------------------
# serve: rank 0 runs the HTTP server, the other ranks replay its pipeline calls


class PipelineRelay:
    """Keeps every rank's pipeline calls in step for ``ditattn serve --num-gpus N``.

    Rank 0 (the leader, inside :meth:`leading`) broadcasts a picklable description of each
    ``WanPipelineNative.generate`` call on a gloo control group before running it; calls are
    serialised by a lock, so every rank issues the same collectives in the same order.  The other
    ranks (:meth:`follow`) replay each call on their own pipeline, re-preparing the request's
    attention override / skip softmax locally (the prepared tables hold process-local objects), and
    return when the leader stops.  While idle the leader sends a heartbeat every ``heartbeat_s``
    seconds so that the followers' waits never reach the control group's timeout.

    The control group is created collectively: construct the relay on every rank, in the same order.
    """

    def __init__(self, heartbeat_s: float = 60.0, timeout_s: float = 3600.0):
        import threading

        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.heartbeat_s = heartbeat_s
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def _send(self, msg) -> None:
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.group)

    def _recv(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    @staticmethod
    def describe_call(args: tuple, kwargs: dict) -> dict:
        """The picklable part of a ``generate(*args, **kwargs)`` call: the request state becomes its
        override name and skip-softmax parameters; callbacks and progress bars are dropped."""
        kw = dict(kwargs)
        state = kw.pop("request_state", None)
        kw.pop("on_step", None)
        kw.pop("progress", None)
        msg = {"op": "generate", "args": args, "kwargs": kw, "override": None, "skip_softmax": None}
        if state is not None:
            msg["override"] = state.override.value if state.override is not None else None
            ss = state.skip_softmax
            msg["skip_softmax"] = None if ss is None else {"threshold_scale_factor": ss.threshold_scale_factor,
                                                           "start_step": ss.start_step}
        return msg

    @contextlib.contextmanager
    def leading(self, pipeline_cls=None):
        """Rank 0: relay every ``pipeline_cls.generate`` call (default ``WanPipelineNative``) made
        inside the block; tell the followers to stop on exit."""
        import threading

        if pipeline_cls is None:
            from ditattn.pipelines.wan import WanPipelineNative as pipeline_cls
        orig = pipeline_cls.__dict__["generate"]
        relay = self

        def generate(pipe, *a, **kw):
            with relay.lock:
                relay._send(relay.describe_call(a, kw))
                return orig(pipe, *a, **kw)

        def heartbeat():
            while not relay._stop.wait(relay.heartbeat_s):
                if relay.lock.acquire(blocking=False):
                    try:
                        if not relay._stop.is_set():
                            relay._send({"op": "noop"})
                    finally:
                        relay.lock.release()

        pipeline_cls.generate = generate
        beat = threading.Thread(target=heartbeat, name="ditattn-sp-heartbeat", daemon=True)
        beat.start()
        try:
            yield self
        finally:
            pipeline_cls.generate = orig
            self._stop.set()
            beat.join()
            with self.lock:
                try:
                    self._send({"op": "stop"})
                except Exception:  # followers already gone (e.g. Ctrl-C reached them first)
                    pass

    def follow(self, pipe) -> int:
        """Ranks other than 0: replay the leader's calls on ``pipe`` until it stops; returns the
        number of calls replayed.  A call that fails here fails identically on the leader (same
        inputs, same checks), so the error is logged and the loop goes on."""
        import logging

        done = 0
        while True:
            msg = self._recv()
            op = msg.get("op") if isinstance(msg, dict) else None
            if op == "stop":
                return done
            if op != "generate":
                continue
            try:
                state = pipe.prepare_request(msg["override"], msg["skip_softmax"])
                pipe.generate(*msg["args"], **msg["kwargs"], request_state=state, progress=False)
            except AttentionConfigError as exc:
                logging.getLogger("ditattn.distributed").info("rank %d: relayed call refused: %s", self.rank, exc)
            done += 1


def serve_rank(args: argparse.Namespace) -> int:
    """``ditattn serve`` in one rank: rank 0 runs the HTTP server (``serve_main``) with its
    pipeline calls relayed; the other ranks build the same pipeline and follow."""
    relay = PipelineRelay()
    if dist.get_rank() == 0:
        from ditattn.server.app import serve_main

        with relay.leading():
            return serve_main(args)
    from ditattn.pipelines.run import settings_from_args
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained(args.model_path, settings_from_args(args), device=args.device,
                                             dtype=args.dtype, variant=getattr(args, "model_variant", None))
    relay.follow(pipe)
    return 0
