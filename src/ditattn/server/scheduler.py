"""Dynamic batching: a bounded FIFO queue and one worker thread that runs batches on the runner.

The worker takes the oldest queued :class:`~ditattn.server.jobs.GenerationJob` and adds the
following queued jobs with the same :meth:`~ditattn.server.jobs.GenerationJob.signature`, in
arrival order, up to ``max_batch_size`` requests — so requests with different attention settings
never share a batch, and the oldest job is always served next (no starvation).  The jobs, their
results and how they end live in :mod:`ditattn.server.jobs`.

The batch runs inside ``request_scope(state)`` (a context variable set in the worker thread), where
``state`` is the :class:`~ditattn.attention.context.RequestState` prepared and validated for the
batch's attention settings; leaving the scope restores the server default for the next batch.

A batch that raises is re-run one job at a time, so a failing request fails alone. ``submit``
raises :class:`QueueFull` when ``max_queue`` jobs are already waiting.

Stopping work: a job past its deadline, or cancelled (:meth:`Scheduler.cancel`: a client that
disconnected, a deleted video job), is dropped from the queue at once; when it is running it is
marked, and the runner's ``should_stop`` callable (:func:`batch_stop_reason`, handed to the
pipeline) stops the batch at its next denoising step once every job in it must stop
(:class:`~ditattn.errors.GenerationCancelled`); a job cancelled inside a batch that runs on for the
others loses its result.  Such a job ends with :class:`JobCancelled` (its reason),
:class:`JobTimeout` or, for a shutdown, :class:`SchedulerStopped`, and ``on_cancel(job, reason,
stage)`` reports it.  :meth:`Scheduler.pause` (graceful shutdown) takes no new batch: the running
one finishes or is stopped (:meth:`Scheduler.stop_running`), queued jobs stay queued
(:meth:`Scheduler.pending`) unless the caller drops them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable, Optional

from ditattn.attention.context import request_scope
from ditattn.errors import GenerationCancelled

# the jobs this module queues (re-exported: importable from here as before)
from ditattn.server.jobs import (
    SHUTDOWN,
    TIMEOUT,
    GenerationJob,
    GenerationResult,
    JobCancelled,
    JobTimeout,
    QueueFull,
    Runner,
    SchedulerStopped,
    batch_stop_reason,
    stop_error,
)

log = logging.getLogger("ditattn.server")

__all__ = [
    "Scheduler",
    "SHUTDOWN",
    "TIMEOUT",
    "GenerationJob",
    "GenerationResult",
    "JobCancelled",
    "JobTimeout",
    "QueueFull",
    "Runner",
    "SchedulerStopped",
    "batch_stop_reason",
    "stop_error",
]


class Scheduler:
    """Bounded queue + worker thread grouping jobs by :meth:`GenerationJob.signature`.

    runner: object with ``run_batch(jobs) -> list[GenerationResult]``; max_batch_size: requests per
    batch; max_queue: waiting jobs before :class:`QueueFull`; batch_window_s: after taking a head
    job whose batch is not full, wait this long once for more matching jobs to arrive;
    on_batch: callback ``(jobs, seconds, error)`` after each run (metrics); on_cancel: callback
    ``(job, reason, stage)`` when a job ends cancelled, timed out or stopped by a shutdown, stage
    ``queued`` or ``running``.
    """

    def __init__(
        self,
        runner,
        *,
        max_batch_size: int = 4,
        max_queue: int = 64,
        batch_window_s: float = 0.01,
        on_batch: Optional[Callable[[list, float, Optional[BaseException]], None]] = None,
        on_cancel: Optional[Callable[[GenerationJob, str, str], None]] = None,
    ):
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be >= 1")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch_window_s = batch_window_s
        self.on_batch = on_batch
        self.on_cancel = on_cancel
        self._pending: list[GenerationJob] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._paused = False
        self._running: list[GenerationJob] = []
        self._running_since: Optional[float] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ditattn-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker (after its running batch); jobs still queued fail with SchedulerStopped."""
        with self._cond:
            self._stopped = True
            left, self._pending = self._pending, []
            self._cond.notify_all()
        for job in left:
            self._end(job, SHUTDOWN, "queued")
        if self._thread is not None:
            self._thread.join(timeout)

    def pause(self, keep: Callable[[GenerationJob], bool] = lambda job: True) -> list[GenerationJob]:
        """Take no new batch (graceful shutdown); ``submit`` raises SchedulerStopped from now on.
        Queued jobs for which ``keep(job)`` is false end now with SchedulerStopped (and are
        returned); the others stay queued (:meth:`pending`)."""
        with self._cond:
            self._paused = True
            dropped = [j for j in self._pending if not keep(j)]
            self._pending = [j for j in self._pending if keep(j)]
            self._cond.notify_all()
        for job in dropped:
            self._end(job, SHUTDOWN, "queued")
        return dropped

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no batch runs (True), at most ``timeout`` seconds (False)."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._running:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def pending(self) -> list[GenerationJob]:
        """The queued jobs, oldest first."""
        with self._cond:
            return list(self._pending)

    # -- queue -------------------------------------------------------------------------------
    def submit(self, job: GenerationJob, *, restore: bool = False) -> concurrent.futures.Future:
        """Queue ``job``; its future resolves to a GenerationResult or raises the job's error.
        ``restore``: a job reloaded from the job store, queued even beyond ``max_queue``."""
        with self._cond:
            if self._stopped or self._paused:
                raise SchedulerStopped("the server is shutting down")
            if len(self._pending) >= self.max_queue and not restore:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future

    def cancel(self, job: GenerationJob, reason: str) -> Optional[str]:
        """Cancel ``job`` for ``reason``: a queued job ends at once (returns ``"queued"``); a running
        one is marked and stops at its next denoising step, or loses its result if others in its
        batch go on (``"running"``); None when it has already finished."""
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
            elif job in self._running:
                job.stop_reason = job.stop_reason or reason
                return "running"
            else:
                return None
        self._end(job, reason, "queued")
        return "queued"

    def stop_running(self, reason: str) -> int:
        """Mark every running job to stop for ``reason`` at its next step; returns how many."""
        with self._cond:
            for job in self._running:
                job.stop_reason = job.stop_reason or reason
            return len(self._running)

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def running(self) -> int:
        with self._cond:
            return sum(j.n for j in self._running)

    def running_jobs(self) -> tuple[list[GenerationJob], Optional[float]]:
        """The running batch's jobs and when it started (``time.monotonic()``; None when idle)."""
        with self._cond:
            return list(self._running), self._running_since

    # -- worker ------------------------------------------------------------------------------
    def _take_batch(self) -> Optional[list[GenerationJob]]:
        wait_until: Optional[float] = None
        with self._cond:
            while True:
                while (not self._pending or self._paused) and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return None
                now = time.monotonic()
                live, expired = [], []
                for job in self._pending:
                    if job.future.done():
                        continue
                    (expired if job.should_stop(now) else live).append(job)
                self._pending = live
                for job in expired:  # (the condition's lock is re-entrant: the callbacks may read the queue)
                    self._end(job, job.should_stop(now) or TIMEOUT, "queued")
                if not live:
                    wait_until = None
                    continue
                sig = live[0].signature()
                batch = [j for j in live if j.signature() == sig][: self.max_batch_size]
                if len(batch) < self.max_batch_size and self.batch_window_s > 0:
                    # give concurrent arrivals a short window to join the head's batch
                    if wait_until is None:
                        wait_until = now + self.batch_window_s
                    if now < wait_until:
                        self._cond.wait(wait_until - now)
                        continue
                taken = []
                for j in batch:
                    self._pending.remove(j)
                    if j.future.set_running_or_notify_cancel():
                        taken.append(j)
                wait_until = None
                if not taken:
                    continue
                start = time.monotonic()
                for j in taken:
                    if j.run_timeout_s is not None:
                        j.deadline = start + j.run_timeout_s
                self._running, self._running_since = taken, start
                return taken

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._run(batch)
            except BaseException:  # noqa: BLE001 - the worker must survive whatever a batch does
                log.exception("scheduler worker: unexpected error around a batch")
                for job in batch:
                    _fail(job, RuntimeError("internal scheduler error"))
            finally:
                with self._cond:
                    self._running, self._running_since = [], None
                    self._cond.notify_all()

    def _run(self, batch: list[GenerationJob]) -> None:
        for job in batch:
            if job.on_start is not None:
                try:
                    job.on_start(job)
                except Exception:  # a callback must not take the worker down
                    log.exception("on_start callback failed")
        results, error = self._attempt(batch)
        if error is None:
            for job, res in zip(batch, results):
                self._deliver(job, res)
            return
        if results is not None:  # stopped: every job has ended
            return
        if len(batch) == 1:
            self._failed(batch[0], error)
            return
        log.warning(
            "batch of %d failed (%s: %s); re-running its requests one by one", len(batch), type(error).__name__, error
        )
        for job in batch:  # outside the except block: a failure's traceback is its own, not chained
            if job.should_stop():
                self._end(job, job.should_stop(), "running")
                continue
            results, error = self._attempt([job])
            if error is None:
                self._deliver(job, results[0])
            elif results is None:
                self._failed(job, error)

    def _attempt(self, batch: list[GenerationJob]) -> tuple[Optional[list], Optional[BaseException]]:
        """Run ``batch`` once: ``(results, None)``; ``([], exc)`` when it was stopped (each job
        already ended with its reason); ``(None, exc)`` when it failed."""
        t0 = time.perf_counter()
        try:
            results = self._call(batch)
        except GenerationCancelled as exc:
            self._notify(batch, time.perf_counter() - t0, exc)
            for job in batch:
                self._end(job, job.should_stop() or SHUTDOWN, "running")
            return [], exc
        except BaseException as exc:  # noqa: BLE001 - isolated per job by the caller
            self._notify(batch, time.perf_counter() - t0, exc)
            return None, exc
        self._notify(batch, time.perf_counter() - t0, None)
        return results, None

    def _deliver(self, job: GenerationJob, result: Any) -> None:
        """The job's result, unless it was cancelled meanwhile (its batch ran on for others).  A job
        asked to stop by a shutdown keeps a result it finished (its frames are not thrown away)."""
        if job.stop_reason is not None and job.stop_reason != SHUTDOWN:
            self._end(job, job.stop_reason, "running")
        elif not job.future.done():
            job.future.set_result(result)

    def _failed(self, job: GenerationJob, exc: BaseException) -> None:
        """One log line (with the traceback for unexpected errors) per failed job, then its error."""
        from ditattn.errors import AttentionConfigError

        if isinstance(exc, AttentionConfigError):
            log.warning("request %s refused while running: %s", job.id, exc)
        else:
            log.error(
                "request %s failed (reference %s): %s: %s", job.id, job.id[:12], type(exc).__name__, exc, exc_info=exc
            )
        _fail(job, exc)

    def _end(self, job: GenerationJob, reason: str, stage: str) -> None:
        """End ``job`` stopped for ``reason`` (cancelled, timed out, shutdown) and report it."""
        if job.future.done():
            return
        _fail(job, stop_error(reason))
        if self.on_cancel is not None:
            try:
                self.on_cancel(job, reason, stage)
            except Exception:
                log.exception("on_cancel callback failed")

    def _call(self, batch: list[GenerationJob]) -> list:
        state = batch[0].state
        if state is None:
            results = self.runner.run_batch(batch)
        else:
            with request_scope(state):
                results = self.runner.run_batch(batch)
        if not isinstance(results, (list, tuple)) or len(results) != len(batch):
            raise RuntimeError(
                f"runner returned {len(results) if isinstance(results, (list, tuple)) else results!r} "
                f"results for a batch of {len(batch)}"
            )
        return list(results)

    def _notify(self, batch, seconds, error) -> None:
        if self.on_batch is not None:
            try:
                self.on_batch(batch, seconds, error)
            except Exception:
                log.exception("on_batch callback failed")


def _fail(job: GenerationJob, exc: BaseException) -> None:
    fut = job.future
    if fut.done():
        return
    if not fut.running():
        if not fut.set_running_or_notify_cancel():
            return
    fut.set_exception(exc)
