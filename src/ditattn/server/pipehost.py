"""A Ray Serve replica's pipeline in a child process of its own (``--replica-process``, the default).

A Ray worker process runs Ray's own threads beside the replica's code; a pipeline there shares the GIL with
them at every kernel launch.  Measured on an H100 (one GPU, 16 cores; 256x256 ``ditattn:shapes`` images,
20 steps, 50 alternating rounds, paired means against the same pipeline in the driver process): the
pipeline in a plain Ray actor +21.3 +- 10.6 ms, in a spawned child process of that actor -21.0 +- 10.7 ms
(docs/serving.md, "The pipeline in a child process").  :class:`HostedRunner` is the runner a replica serves
with then: it holds no model, and forwards every call of the runner interface
(:class:`ditattn.server.runner.PipelineRunner`) to the child, which holds the pipeline and runs it in its
main thread.

Two pipes connect them, so that checking a new request never waits for a running batch:

* the *control* pipe (a thread of the child answers it): ``prepare``, ``prepare_cache``, ``check_lora``,
  ``check_sampling``;
* the *run* pipe (the child's main thread): one batch at a time.  While a batch runs the child sends its
  progress, and the parent (which holds the jobs, their deadlines and cancellations) sends their stop reasons
  whenever they change; the child reads them at each step, as the in-process runner asks the jobs, without a
  round trip.  The results (frames as numpy arrays) come back pickled.

A request's attention state is prepared twice: in the child at admission (its validation, and the backends
it reports), and again in the child for the run (the prepared tables hold objects of that process; the
parent keeps only the override's name and the skip-softmax parameters).  The child exits when the parent's
end of the control pipe closes (the replica stopped or died), so a killed replica leaves no pipeline behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

log = logging.getLogger("ditattn.server")

#: the job fields a batch's run reads (``PipelineRunner.run_batch`` and its ``sampling_for``)
JOB_FIELDS = (
    "n",
    "prompt",
    "negative_prompt",
    "seed",
    "image",
    "lora",
    "cache",
    "height",
    "width",
    "num_frames",
    "num_inference_steps",
    "guidance_scale",
    "guidance_scale_2",
    "scheduler",
    "flow_shift",
    "timesteps",
    "cfg_interval",
)
#: seconds between the parent's looks at a running batch's stop reasons (cancellations, deadlines, shutdown)
STOP_CHECK_S = 0.05
#: the runner's request checks the child answers on the control pipe
CONTROL_OPS = ("prepare", "prepare_cache", "check_lora", "check_sampling")


class PipelineProcessDied(RuntimeError):
    """The pipeline's process ended (crashed, killed, or out of memory) while the replica needed it."""


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` when it survives pickling (its type and message reach the parent), else a RuntimeError with
    its type and message."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _skip_dict(skip) -> Optional[dict]:
    """A prepared request's skip-softmax parameters as the ``skip_softmax`` argument of ``prepare``."""
    return None if skip is None else {f.name: getattr(skip, f.name) for f in dataclasses.fields(skip)}


class _Job:
    """A job as the child's runner sees it: the fields of :data:`JOB_FIELDS`, its progress sent to the
    parent, and its stop reason the latest the parent sent (read without waiting, by the batch's first job)."""

    def __init__(self, fields: dict, i: int, batch: "_Batch"):
        self.__dict__.update(fields)
        self.i, self.batch = i, batch
        self.denoised = False
        self.on_progress = batch.progress

    def should_stop(self, now: float) -> Optional[str]:
        if self.i == 0:
            self.batch.read_reasons()
        return self.batch.reasons[self.i]


class _Batch:
    def __init__(self, conn, reasons: list):
        self.conn, self.reasons = conn, reasons

    def read_reasons(self) -> None:
        """Take the stop reasons the parent sent since the last look (no round trip: it sends them when
        they change)."""
        while self.conn.poll():
            kind, reasons = self.conn.recv()
            assert kind == "reasons", kind
            self.reasons = reasons

    def progress(self, job: _Job, fraction: float) -> None:
        self.conn.send(("progress", job.i, fraction))


def _meta(runner) -> dict:
    """What the parent serves from without asking the child."""
    import torch

    return {
        "model_id": runner.model_id,
        "aliases": set(runner.aliases),
        "defaults": runner.defaults,
        "default_backends": list(runner.default_backends()),
        "adapters": runner.adapters(),
        "default_negative_prompt": runner.default_negative_prompt,
        "default_sampling": dict(runner.default_sampling),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
    }


def _answer_checks(runner, conn) -> None:
    """The child's control thread: answer the request checks until the parent's end closes (the replica is
    gone; the main thread finds its pipe closed too, and ends the process after closing the ranks)."""
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op not in CONTROL_OPS:
                raise ValueError(f"pipeline process: unknown request check {op!r}; accepted: {', '.join(CONTROL_OPS)}")
            value = getattr(runner, op)(*args)
            if op == "prepare":  # the parent keeps the names; the tables stay here
                value = (
                    value.override.value if value.override is not None else None,
                    value.skip_softmax,
                    runner.backends_for(value),
                )
            conn.send(("ok", value))
        except Exception as exc:
            conn.send(("error", _sendable(exc)))


def _run(runner, conn, fields: list, override: Optional[str], skip: Optional[dict], reasons: list) -> list:
    from ditattn.attention.context import request_scope

    batch = _Batch(conn, reasons)
    jobs = [_Job(f, i, batch) for i, f in enumerate(fields)]
    state = runner.prepare(override, skip)  # this process's tables, for this run
    with request_scope(state):
        return runner.run_batch(jobs)


def host_main(run_conn, control_conn) -> None:
    """The child process: receive the replica's config and torch threads on the control pipe, load the
    pipeline (:func:`ditattn.server.runner.open_runner`), report ready (or the load's error), answer the
    control pipe in a thread and run batches in the main thread until the parent says stop or goes away."""
    import torch

    from ditattn.server import gcpause
    from ditattn.server.runner import open_runner

    try:
        cfg, threads = control_conn.recv()
    except (EOFError, OSError):
        return
    if threads:
        torch.set_num_threads(threads)
    stack = contextlib.ExitStack()
    try:
        runner = open_runner(cfg, stack)
    except BaseException as exc:
        control_conn.send(("error", _sendable(exc)))
        return
    gcpause.freeze_loaded()  # later collections skip the pipeline (as in ditattn serve)
    control_conn.send(("ready", _meta(runner)))
    threading.Thread(target=_answer_checks, args=(runner, control_conn), name="ditattn-control", daemon=True).start()
    with stack:
        while True:
            try:
                msg = run_conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "stop":
                return
            _, fields, override, skip, reasons = msg
            try:
                run_conn.send(("done", _run(runner, run_conn, fields, override, skip, reasons)))
            except (BrokenPipeError, EOFError):
                return
            except Exception as exc:
                run_conn.send(("error", _sendable(exc)))


def _start(cfg, threads: Optional[int]):
    """``(process, run pipe, control pipe)`` of a new pipeline process: ``python -m ditattn.server.pipehost``
    with the two socket pairs' far ends as inherited descriptors (a fresh interpreter, not a fork of a Ray worker
    with its threads, and without re-running the parent's ``__main__`` as multiprocessing's spawn would), on the
    parent's ``sys.path``; the config and threads are the control pipe's first message."""
    run_here, run_there = socket.socketpair()
    control_here, control_there = socket.socketpair()
    fds = (run_there.fileno(), control_there.fileno())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ditattn.server.pipehost", *map(str, fds)], pass_fds=fds, env=env, close_fds=True
        )
    finally:
        run_there.close()
        control_there.close()
    run, control = Connection(run_here.detach()), Connection(control_here.detach())
    control.send((cfg, threads))
    return proc, run, control


class HostedRunner:
    """The runner of a replica whose pipeline runs in a child process (:func:`host_main`): the
    runner interface of :class:`~ditattn.server.runner.PipelineRunner`, each call forwarded.

    ``cfg``: the replica's :class:`~ditattn.runconfig.RunConfig`; ``threads``: the child's torch CPU threads
    (None: its environment's ``OMP_NUM_THREADS``, inherited).  Blocks until the child has loaded the
    pipeline; raises the load's error (an :class:`~ditattn.errors.AttentionConfigError` for bad settings) or
    :class:`PipelineProcessDied`.  :meth:`close` stops the child."""

    def __init__(self, cfg, threads: Optional[int] = None):
        self._proc, self._run_conn, self._control_conn = _start(cfg, threads)
        self._run_lock, self._control_lock = threading.Lock(), threading.Lock()
        kind, value = self._recv(self._control_conn, "loading the model")
        if kind == "error":
            self._proc.wait(10)
            raise value
        for key in ("model_id", "aliases", "defaults", "default_negative_prompt", "default_sampling"):
            setattr(self, key, value[key])
        self._default_backends, self._adapters, self.pid = value["default_backends"], value["adapters"], value["pid"]
        self._backends: dict = {}  # (override, skip) of a prepared state -> the backends it runs
        log.info("replica: the pipeline runs in process %d (%d torch CPU threads)", self.pid, value["threads"])

    # -- the child ------------------------------------------------------------------------------------------
    def _recv(self, conn, doing: str):
        try:
            return conn.recv()
        except (EOFError, OSError):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            raise PipelineProcessDied(
                f"the pipeline process (pid {self._proc.pid}) ended while {doing} (exit code {self._proc.returncode})"
            ) from None

    def alive(self) -> bool:
        return self._proc.poll() is None

    def exit_reason(self) -> Optional[str]:
        """Why the replica cannot serve (its pipeline process ended), None while it runs."""
        code = self._proc.poll()
        return None if code is None else f"the pipeline process (pid {self._proc.pid}) exited with code {code}"

    def _control(self, op: str, *args):
        with self._control_lock:
            try:
                self._control_conn.send((op, args))
            except (BrokenPipeError, OSError):
                raise PipelineProcessDied(self.exit_reason() or "the pipeline process is not answering") from None
            kind, value = self._recv(self._control_conn, op)
        if kind == "error":
            raise value
        return value

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the child once its current batch (if one runs) has ended and wait for it; kill it when that takes
        longer than ``timeout_s`` in all."""
        deadline = time.monotonic() + timeout_s
        if self._proc.poll() is None:
            if self._run_lock.acquire(timeout=timeout_s):  # the run pipe is the batch's until it ends
                try:
                    with contextlib.suppress(OSError):
                        self._run_conn.send(("stop",))
                finally:
                    self._run_lock.release()
            try:
                self._proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("the pipeline process (pid %d) did not stop in %.0f s; killed", self._proc.pid, timeout_s)
                self._proc.kill()
                self._proc.wait(5)
        for conn in (self._run_conn, self._control_conn):
            conn.close()

    # -- the runner interface ---------------------------------------------------------------------------------
    def prepare(self, override: Optional[str], skip_softmax: Optional[dict]):
        """Validate a request's attention settings in the child (AttentionConfigError with the reason); the
        parent's RequestState carries the override's name and the skip-softmax parameters."""
        from ditattn.attention.context import RequestState
        from ditattn.attention.names import AttentionBackendEnum

        name, skip, backends = self._control("prepare", override, skip_softmax)
        key = (name, repr(skip))
        if key not in self._backends and len(self._backends) < 1024:
            self._backends[key] = backends
        return RequestState(override=None if name is None else AttentionBackendEnum(name), skip_softmax=skip)

    def backends_for(self, state) -> list:
        name = state.override.value if state.override is not None else None
        found = self._backends.get((name, repr(state.skip_softmax)))
        return list(found) if found is not None else self._control("prepare", name, _skip_dict(state.skip_softmax))[2]

    def default_backends(self) -> list:
        return list(self._default_backends)

    def adapters(self) -> list:
        return [dict(a) for a in self._adapters]

    def prepare_cache(self, backend, config):
        return self._control("prepare_cache", backend, config)

    def check_lora(self, lora):
        return self._control("check_lora", lora)

    def check_sampling(self, sampling: dict) -> None:
        self._control("check_sampling", sampling)

    def _push_reasons(self, jobs, sent: list) -> list:
        """The jobs' stop reasons now, sent to the child when they differ from ``sent`` (a dead child is
        reported by the next receive)."""
        now = time.monotonic()
        latest = [j.should_stop(now) for j in jobs]
        if latest != sent:
            with contextlib.suppress(OSError):
                self._run_conn.send(("reasons", latest))
        return latest

    def run_batch(self, jobs) -> list:
        """Run ``jobs`` (one signature) in the child: their progress reported; their stop reasons (cancelled,
        timed out, shutdown) sent to the child whenever they change, looked at after each step's progress and
        every :data:`STOP_CHECK_S` seconds, which the child reads at each step without waiting (a stop lands
        at the next step or the one after); the results as the in-process runner
        returns them."""
        head = jobs[0]
        fields = [{k: getattr(j, k, None) for k in JOB_FIELDS} for j in jobs]
        state = head.state
        override = state.override.value if state is not None and state.override is not None else None
        skip = _skip_dict(state.skip_softmax) if state is not None else None
        with self._run_lock:
            reasons = [j.should_stop(time.monotonic()) for j in jobs]
            try:
                self._run_conn.send(("run", fields, override, skip, reasons))
            except (BrokenPipeError, OSError):
                raise PipelineProcessDied(self.exit_reason() or "the pipeline process is not answering") from None
            while True:
                if not self._run_conn.poll(STOP_CHECK_S):
                    reasons = self._push_reasons(jobs, reasons)
                    if self._proc.poll() is None:
                        continue
                msg = self._recv(self._run_conn, "running a batch")
                if msg[0] == "progress":
                    job, fraction = jobs[msg[1]], msg[2]
                    job.denoised = fraction >= 1.0
                    if job.on_progress is not None:
                        job.on_progress(job, fraction)
                    reasons = self._push_reasons(jobs, reasons)  # a step ended: look now too
                elif msg[0] == "done":
                    return msg[1]
                else:
                    raise msg[1]


if __name__ == "__main__":  # the pipeline process (:func:`_start`): the two descriptors of its pipes
    host_main(Connection(int(sys.argv[1])), Connection(int(sys.argv[2])))
