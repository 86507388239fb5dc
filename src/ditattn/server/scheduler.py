"""Dynamic batching: a bounded FIFO queue and one worker thread that runs batches on the runner.

A :class:`GenerationJob` is one request (an image request with ``n`` images, or one video job). Its
:meth:`GenerationJob.signature` holds everything that must be equal for requests to share one
denoise call: model, width, height, frames, steps, guidance scale, negative prompt, the attention
override and the skip-softmax parameters. The worker takes the oldest queued job and adds the
following queued jobs with the same signature, in arrival order, up to ``max_batch_size`` requests
(image-to-video jobs batch with each other, each with its own first frame, never with text-only ones;
the LoRA scales and the low-noise expert's guidance scale are part of the signature) —
so requests with different attention settings never share a batch, and the oldest job is always
served next (no starvation).

The batch runs inside ``request_scope(state)`` (a context variable set in the worker thread), where
``state`` is the :class:`~ditattn.attention.context.RequestState` prepared and validated for the
batch's attention settings; leaving the scope restores the server default for the next batch.

A batch that raises is re-run one job at a time, so a failing request fails alone. Jobs whose
deadline passes while queued fail with :class:`JobTimeout` without running; jobs cancelled while
queued are dropped. ``submit`` raises :class:`QueueFull` when ``max_queue`` jobs are already waiting.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from ditattn.attention.context import RequestState, SkipSoftmaxParams, request_scope

log = logging.getLogger("ditattn.server")


class QueueFull(Exception):
    """The queue already holds ``max_queue`` waiting jobs."""


class JobTimeout(Exception):
    """The job's deadline passed before it could run."""


class SchedulerStopped(Exception):
    """The scheduler was stopped before the job ran."""


@dataclasses.dataclass
class GenerationResult:
    """What a runner returns for one job.

    frames: uint8 ``[n, num_frames, height, width, 3]`` (RGB); attention_backends: the DiT backend
    value(s) that ran, sorted; stats: JSON-safe request statistics (e.g. skip-softmax tile counts).
    """

    frames: np.ndarray
    attention_backends: list
    stats: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


@dataclasses.dataclass(eq=False)
class GenerationJob:
    """One validated generation request.

    kind: ``"image"`` or ``"video"``; n: samples (images) to produce, each with seed ``seed + i``;
    override: the canonical backend value of ``attention_backend_override`` or None; skip_softmax:
    parsed parameters or None; state: the RequestState prepared for these settings (None for
    runners that need none); deadline: ``time.monotonic()`` value after which it must not start;
    image: the first frame of an image-to-video job (a PIL image) or None; lora: the LoRA scales
    ``((name, scale), ...)`` sorted by name, or None for the server's defaults; guidance_scale_2:
    the low-noise expert's guidance scale (two-expert checkpoints) or None.
    """

    kind: str
    prompt: str
    width: int
    height: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    model: str = ""
    negative_prompt: Optional[str] = None
    seed: int = 0
    n: int = 1
    fps: int = 16
    override: Optional[str] = None
    skip_softmax: Optional[SkipSoftmaxParams] = None
    state: Optional[RequestState] = None
    deadline: Optional[float] = None
    image: Any = None
    lora: Optional[tuple] = None
    guidance_scale_2: Optional[float] = None
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: float = dataclasses.field(default_factory=time.time)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    on_start: Optional[Callable[["GenerationJob"], None]] = None
    on_progress: Optional[Callable[["GenerationJob", float], None]] = None

    def signature(self) -> tuple:
        """The dynamic-batching key: jobs share a batch only if these are all equal."""
        ss = None if self.skip_softmax is None else (self.skip_softmax.threshold_scale_factor,
                                                     self.skip_softmax.start_step)
        return (self.model, self.width, self.height, self.num_frames, self.num_inference_steps,
                float(self.guidance_scale), self.negative_prompt or "", self.override, ss,
                self.image is not None, self.lora, self.guidance_scale_2)


class Runner(Protocol):
    """What the server needs from a model (see :class:`ditattn.server.runner.PipelineRunner`)."""

    model_id: str

    def prepare(self, override: Optional[str], skip_softmax: Optional[dict]) -> RequestState:
        """Validate a request's attention settings (raise AttentionConfigError with the reason)."""

    def run_batch(self, jobs: Sequence[GenerationJob]) -> list:
        """Run jobs that share one signature, inside their request scope; one GenerationResult each."""


class Scheduler:
    """Bounded queue + worker thread grouping jobs by :meth:`GenerationJob.signature`.

    runner: object with ``run_batch(jobs) -> list[GenerationResult]``; max_batch_size: requests per
    batch; max_queue: waiting jobs before :class:`QueueFull`; batch_window_s: after taking a head
    job whose batch is not full, wait this long once for more matching jobs to arrive;
    on_batch: callback ``(jobs, seconds, error)`` after each run (metrics).
    """

    def __init__(self, runner, *, max_batch_size: int = 4, max_queue: int = 64, batch_window_s: float = 0.01,
                 on_batch: Optional[Callable[[list, float, Optional[BaseException]], None]] = None):
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be >= 1")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch_window_s = batch_window_s
        self.on_batch = on_batch
        self._pending: list[GenerationJob] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._running: list[GenerationJob] = []
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ditattn-scheduler", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker; jobs still queued fail with SchedulerStopped."""
        with self._cond:
            self._stopped = True
            left, self._pending = self._pending, []
            self._cond.notify_all()
        for job in left:
            _fail(job, SchedulerStopped("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- queue -------------------------------------------------------------------------------
    def submit(self, job: GenerationJob) -> concurrent.futures.Future:
        """Queue ``job``; its future resolves to a GenerationResult or raises the job's error."""
        with self._cond:
            if self._stopped:
                raise SchedulerStopped("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._pending.append(job)
            self._cond.notify_all()
        return job.future

    def cancel(self, job: GenerationJob) -> bool:
        """Remove a queued job (True) — a running job cannot be cancelled (False)."""
        with self._cond:
            if job in self._pending:
                self._pending.remove(job)
                job.future.cancel()
                return True
        return False

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._pending)

    @property
    def running(self) -> int:
        with self._cond:
            return sum(j.n for j in self._running)

    # -- worker ------------------------------------------------------------------------------
    def _take_batch(self) -> Optional[list[GenerationJob]]:
        wait_until: Optional[float] = None
        with self._cond:
            while True:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return None
                now = time.monotonic()
                live = []
                for job in self._pending:
                    if job.future.cancelled():
                        continue
                    if job.deadline is not None and now > job.deadline:
                        _fail(job, JobTimeout("the request timed out while queued"))
                        continue
                    live.append(job)
                self._pending = live
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
                self._running = taken
                return taken

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._running = []

    def _run(self, batch: list[GenerationJob]) -> None:
        for job in batch:
            if job.on_start is not None:
                try:
                    job.on_start(job)
                except Exception:  # a callback must not take the worker down
                    log.exception("on_start callback failed")
        t0 = time.perf_counter()
        try:
            results = self._call(batch)
        except BaseException as exc:  # noqa: BLE001 - isolate, then report per job
            dt = time.perf_counter() - t0
            self._notify(batch, dt, exc)
            if len(batch) == 1:
                log.warning("request %s failed: %s", batch[0].id, exc)
                _fail(batch[0], exc)
                return
            log.warning("batch of %d failed (%s); re-running its requests one by one", len(batch), exc)
            for job in batch:
                t1 = time.perf_counter()
                try:
                    res = self._call([job])
                except BaseException as exc1:  # noqa: BLE001
                    self._notify([job], time.perf_counter() - t1, exc1)
                    log.warning("request %s failed: %s", job.id, exc1)
                    _fail(job, exc1)
                else:
                    self._notify([job], time.perf_counter() - t1, None)
                    _resolve(job, res[0])
            return
        self._notify(batch, time.perf_counter() - t0, None)
        for job, res in zip(batch, results):
            _resolve(job, res)

    def _call(self, batch: list[GenerationJob]) -> list:
        state = batch[0].state
        if state is None:
            results = self.runner.run_batch(batch)
        else:
            with request_scope(state):
                results = self.runner.run_batch(batch)
        if not isinstance(results, (list, tuple)) or len(results) != len(batch):
            raise RuntimeError(f"runner returned {len(results) if isinstance(results, (list, tuple)) else results!r} "
                               f"results for a batch of {len(batch)}")
        return list(results)

    def _notify(self, batch, seconds, error) -> None:
        if self.on_batch is not None:
            try:
                self.on_batch(batch, seconds, error)
            except Exception:
                log.exception("on_batch callback failed")


def _resolve(job: GenerationJob, result: Any) -> None:
    if not job.future.done():
        job.future.set_result(result)


def _fail(job: GenerationJob, exc: BaseException) -> None:
    fut = job.future
    if fut.done():
        return
    if not fut.running():
        if not fut.set_running_or_notify_cancel():
            return
    fut.set_exception(exc)
