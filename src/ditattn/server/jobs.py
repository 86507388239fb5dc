"""Generation jobs and how they end: what the scheduler queues, batches and stops.

A :class:`GenerationJob` is one validated request (an image request with ``n`` images, or one video
job).  Its :meth:`GenerationJob.signature` holds everything that must be equal for requests to share
one denoise call: model, width, height, frames, steps, guidance scale, negative prompt, the attention
override and the skip-softmax parameters (image-to-video jobs batch with each other, each with its
own first frame, never with text-only ones; the LoRA scales and the low-noise expert's guidance scale
are part of the signature).  A runner (:class:`Runner`) returns one :class:`GenerationResult` per job.

A job stops early for a reason: its cancel reason (``client_disconnected``, ``deleted``),
:data:`TIMEOUT` past its deadline or :data:`SHUTDOWN`; it then ends with :class:`JobCancelled`,
:class:`JobTimeout` or :class:`SchedulerStopped` (:func:`stop_error`).  :func:`batch_stop_reason` is
the ``should_stop`` callable a runner hands to the pipeline: a running batch stops once every job in
it must.  :class:`QueueFull` is the refusal of a full queue.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from ditattn.attention.context import RequestState, SkipSoftmaxParams

SHUTDOWN = "shutdown"
TIMEOUT = "timeout"


class QueueFull(Exception):
    """The queue already holds ``max_queue`` waiting jobs."""


class JobTimeout(Exception):
    """The job reached its deadline (while queued, or running: stopped at its next step)."""


class SchedulerStopped(Exception):
    """The server is shutting down: the job was not started, or was stopped."""


class JobCancelled(Exception):
    """The job was cancelled; ``reason``: ``client_disconnected`` or ``deleted``."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"the request was cancelled ({reason.replace('_', ' ')})")

    def __reduce__(self):  # pickled with its reason, not its message
        return type(self), (self.reason,)


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
    cache: Optional[dict] = None  # the step cache's report of the batch's run (None: no cache)


@dataclasses.dataclass(eq=False)
class GenerationJob:
    """One validated generation request.

    kind: ``"image"`` or ``"video"``; n: samples (images) to produce, each with seed ``seed + i``;
    override: the canonical backend value of ``attention_backend_override`` or None; skip_softmax:
    parsed parameters or None; state: the RequestState prepared for these settings (None for
    runners that need none); deadline: ``time.monotonic()`` value after which the job is stopped
    (queued: dropped; running: at its next denoising step); run_timeout_s: when set, the deadline
    is reset to start + run_timeout_s when the job starts (video jobs bound their wait in the
    queue and their run separately); stop_reason: set by :meth:`Scheduler.cancel`; image: the first
    frame of an image-to-video job (a PIL image) or None; lora: the LoRA scales ``((name, scale),
    ...)`` sorted by name, or None for the server's defaults; guidance_scale_2: the low-noise
    expert's guidance scale (two-expert checkpoints) or None; scheduler, flow_shift, timesteps,
    cfg_interval: the request's sampler fields (None: the server's defaults).
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
    run_timeout_s: Optional[float] = None
    stop_reason: Optional[str] = None
    image: Any = None
    lora: Optional[tuple] = None
    guidance_scale_2: Optional[float] = None
    scheduler: Optional[str] = None
    flow_shift: Optional[float] = None
    timesteps: Optional[tuple] = None
    cfg_interval: Optional[tuple] = None
    cache: Any = None  # the step cache (ditattn.cache.CacheSetting) or None: a cached job runs in a batch of its own
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: float = dataclasses.field(default_factory=time.time)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    on_start: Optional[Callable[["GenerationJob"], None]] = None
    on_progress: Optional[Callable[["GenerationJob", float], None]] = None
    denoised: bool = False  # set by the runner once every denoising step ran (decoding: frames worth keeping)

    def should_stop(self, now: Optional[float] = None) -> Optional[str]:
        """Why this job must stop now (its cancel reason, or ``timeout`` past its deadline), else None."""
        if self.stop_reason is not None:
            return self.stop_reason
        if self.deadline is not None and (time.monotonic() if now is None else now) > self.deadline:
            return TIMEOUT
        return None

    def signature(self) -> tuple:
        """The dynamic-batching key: jobs share a batch only if these are all equal."""
        ss = (
            None
            if self.skip_softmax is None
            else (self.skip_softmax.threshold_scale_factor, self.skip_softmax.start_step)
        )
        return (
            self.model,
            self.width,
            self.height,
            self.num_frames,
            self.num_inference_steps,
            float(self.guidance_scale),
            self.negative_prompt or "",
            self.override,
            ss,
            self.image is not None,
            self.lora,
            self.guidance_scale_2,
            self.scheduler,
            self.flow_shift,
            self.timesteps,
            self.cfg_interval,
            # a step cache decides each step for the whole batch (its change summed over the clips), so a cached
            # job never shares a batch: its output and its cache report are its own, whatever else is queued
            None if self.cache is None else self.id,
        )


def batch_stop_reason(jobs: Sequence[GenerationJob]) -> Optional[str]:
    """Why a running batch must stop — every job in it must (cancelled, timed out, shutdown) — else
    None: the ``should_stop`` callable runners hand to the pipeline."""
    now = time.monotonic()
    reasons = [j.should_stop(now) for j in jobs]
    if not reasons or not all(reasons):
        return None
    return SHUTDOWN if SHUTDOWN in reasons else reasons[0]


def stop_error(reason: str) -> BaseException:
    """The exception a job stopped for ``reason`` ends with."""
    if reason == TIMEOUT:
        return JobTimeout("the request reached the server's request timeout and was stopped")
    if reason == SHUTDOWN:
        return SchedulerStopped("the server is shutting down")
    return JobCancelled(reason)


class Runner(Protocol):
    """What the server needs from a model (see :class:`ditattn.server.runner.PipelineRunner`)."""

    model_id: str

    def prepare(self, override: Optional[str], skip_softmax: Optional[dict]) -> RequestState:
        """Validate a request's attention settings (raise AttentionConfigError with the reason)."""

    def run_batch(self, jobs: Sequence[GenerationJob]) -> list:
        """Run jobs that share one signature, inside their request scope; one GenerationResult each.
        Runners that can stop between steps pass ``lambda: batch_stop_reason(jobs)`` down."""
