"""What the request handlers share (:class:`ServerState`, at ``app.state.server``): the runner, the
scheduler, the metrics, the video and image stores, the encoder pool and the output folder, with
the request checks (:mod:`ditattn.server.admission`), the job building and submission every
generating endpoint uses, the wait for a result (timeout, client disconnect), the health report and
the graceful drain."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Optional

from fastapi import Request

from ditattn.errors import AttentionConfigError, GenerationCancelled
from ditattn.runconfig import ServerConfig
from ditattn.server.admission import RequestChecks
from ditattn.server.jobs import (
    SHUTDOWN,
    GenerationJob,
    GenerationResult,
    JobCancelled,
    JobTimeout,
    QueueFull,
    SchedulerStopped,
)
from ditattn.server.metrics import Metrics
from ditattn.server.protocol import RequestError
from ditattn.server.scheduler import Scheduler
from ditattn.server.store import ImageStore, VideoStore

BACKEND_HEADER = "x-ditattn-attention-backend"
DISCONNECTED = "client_disconnected"
STOP_GRACE_S = 10.0  # after the drain time: how long a stopped job's current step may still take
DECODE_GRACE_S = 300.0  # then, for a batch past its last step: how long its decode may take (its frames are kept)

log = logging.getLogger("ditattn.server")


class ClientGone(Exception):
    """The client of a waiting request disconnected; its job was cancelled."""


def job_work(job) -> float:
    """A job's work for the queue's time estimate: samples × pixels × frames × denoising steps."""
    try:
        return float(job.n * job.width * job.height * max(1, job.num_frames) * max(1, job.num_inference_steps))
    except (AttributeError, TypeError):
        return 0.0


class ServerState(RequestChecks):
    """Everything the handlers share; built by :func:`ditattn.server.app.create_app`."""

    def __init__(self, runner, config: ServerConfig):
        self.runner = runner
        self.config = config
        self.draining = False
        self._drain_lock = threading.Lock()
        self._batch_seconds = 0.0  # running mean of a batch's wall time, for Retry-After
        self._seconds_per_work = 0.0  # running mean of a batch's seconds per unit of job_work, for Retry-After
        self.scheduler = Scheduler(
            runner,
            max_batch_size=config.max_batch_size,
            max_queue=config.max_queue,
            batch_window_s=config.batch_window_s,
            on_batch=self._on_batch,
            on_cancel=self._on_cancel,
        )
        self.metrics = Metrics(
            queue_depth=lambda: self.scheduler.queue_depth,
            running=lambda: self.scheduler.running,
            running_age=lambda: self.running_age() or 0.0,
            draining=lambda: float(self.draining),
        )
        self._own_dir = config.output_dir is None
        self.output_dir = (
            os.path.abspath(config.output_dir) if config.output_dir else tempfile.mkdtemp(prefix="ditattn-serve-")
        )
        for sub in ("videos", "images"):
            try:
                os.makedirs(os.path.join(self.output_dir, sub), exist_ok=True)
            except OSError as exc:
                raise AttentionConfigError(
                    f"--output-dir {self.output_dir}: cannot create {sub}/ ({exc.strerror or exc})"
                ) from None
        jobs = None if self._own_dir else self.open_job_store()
        self.videos = VideoStore(config.max_videos_kept, jobs, self.output_dir)
        self.images = ImageStore(os.path.join(self.output_dir, "images"), config.max_videos_kept * 4)
        self.encoder = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ditattn-encode")
        self._encodes: set = set()
        self._encodes_lock = threading.Lock()
        self.started = time.time()

    def open_job_store(self):
        """The job store of ``--output-dir`` (``--job-store``: SQLite there by default)."""
        from ditattn.server.jobstores import open_job_store

        return open_job_store(self.config.job_store, self.output_dir)

    def encode_later(self, fn) -> concurrent.futures.Future:
        """Run ``fn`` on the encoder pool; the drain waits for it (RuntimeError once shut down)."""
        fut = self.encoder.submit(fn)
        with self._encodes_lock:
            self._encodes.add(fut)
        fut.add_done_callback(self._encode_done)
        return fut

    def _encode_done(self, fut) -> None:
        with self._encodes_lock:
            self._encodes.discard(fut)

    # -- callbacks of the scheduler ---------------------------------------------------------------
    def _on_batch(self, jobs, seconds, error) -> None:
        m = self.metrics
        outcome = "ok" if error is None else "cancelled" if isinstance(error, GenerationCancelled) else "error"
        m.batches.labels(outcome=outcome).inc()
        m.batch_size.observe(len(jobs))
        m.generation_seconds.observe(seconds)
        self._batch_seconds = seconds if self._batch_seconds == 0 else 0.8 * self._batch_seconds + 0.2 * seconds
        work = sum(job_work(j) for j in jobs)
        if error is None and work > 0:  # seconds per unit of work: a queue of videos is not one of images
            rate = seconds / work
            self._seconds_per_work = rate if not self._seconds_per_work else 0.8 * self._seconds_per_work + 0.2 * rate

    def _on_cancel(self, job: GenerationJob, reason: str, stage: str) -> None:
        self.metrics.cancelled.labels(kind=job.kind, reason=reason, stage=stage).inc()
        if reason == SHUTDOWN and job.kind == "video" and self.videos.jobs is not None:
            return  # its one line: "stays queued for the next start" (routes.videos)
        log.log(
            logging.WARNING if reason == "timeout" else logging.INFO,
            "request %s (%s) %s while %s",
            job.id,
            job.kind,
            "reached the request timeout" if reason == "timeout" else f"stopped: {reason.replace('_', ' ')}",
            stage,
        )

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.scheduler.start()

    def begin_drain(self) -> None:
        """Stop taking work (new generation requests get 503): queued image requests end now
        (503); queued video jobs stay queued, and in the job store for the next start."""
        with self._drain_lock:
            if self.draining:
                return
            self.draining = True
        keep_videos = self.videos.jobs is not None
        self.scheduler.pause(keep=lambda job: job.kind == "video" and keep_videos)

    def drain(self, timeout: float) -> bool:
        """:meth:`begin_drain`, then give the running batch ``timeout`` seconds to finish; past that
        it is stopped at its next denoising step (a video job goes back to ``queued``), waiting up to
        ``STOP_GRACE_S`` more for that step (``DECODE_GRACE_S`` for a batch past its last step: its
        decode finishes and its frames are kept); then wait for MP4 encodes.  True when nothing was left
        running."""
        self.begin_drain()
        t0 = time.monotonic()
        idle = self.scheduler.wait_idle(timeout)
        if not idle:
            n = self.scheduler.stop_running(SHUTDOWN)
            log.warning(
                "drain: the running batch (%d request(s)) did not finish within %.0f s; stopping it at its "
                "next denoising step",
                n,
                timeout,
            )
            idle = self.scheduler.wait_idle(STOP_GRACE_S)
            running, _ = self.scheduler.running_jobs()
            if not idle and running and all(j.denoised for j in running):
                log.warning(
                    "drain: the running batch is decoding finished frames; waiting up to %.0f s more so "
                    "that they are kept",
                    DECODE_GRACE_S,
                )
                idle = self.scheduler.wait_idle(DECODE_GRACE_S)
            if not idle:
                log.error(
                    "drain: the running step did not end within %.0f s more; exiting without it (a video job "
                    "stays in_progress in the job store and is re-queued by the next start)",
                    STOP_GRACE_S,
                )
        with self._encodes_lock:
            encodes = list(self._encodes)
        concurrent.futures.wait(encodes)  # MP4s of jobs that finished are written before the exit
        left = [j.id for j in self.scheduler.pending()]
        log.warning(
            "drained in %.1f s: %s; %d video job(s) stay queued%s",
            time.monotonic() - t0,
            "nothing running" if idle else "a step still running",
            len(left),
            f" in the job store {self.videos.jobs.path}" if self.videos.jobs is not None else "",
        )
        return idle

    def render_metrics(self) -> bytes:
        """``GET /metrics``: this server's metrics in the Prometheus text format."""
        return self.metrics.render()

    def stop(self) -> None:
        """Lifespan shutdown: stop the worker and the encoders, close the job store, and remove the
        private temporary output folder (logged, with what it held)."""
        self.begin_drain()
        if self.scheduler.stop_running(SHUTDOWN):  # not drained (a server stopped without the signal path)
            log.warning("shutdown: stopping the running batch at its next denoising step")
        self.scheduler.stop(timeout=STOP_GRACE_S)
        self.encoder.shutdown(wait=True)
        if self.videos.jobs is not None:
            self.videos.retry_unsaved()
            problem = self.videos.problem()
            if problem is not None:
                log.error("shutdown: %s", problem)
            self.videos.jobs.close()
        if self._own_dir:
            held = []
            for sub in ("videos", "images"):
                try:
                    held += sorted(os.listdir(os.path.join(self.output_dir, sub)))
                except OSError:
                    pass
            log.log(
                logging.WARNING if held else logging.INFO,
                "removing the temporary output folder %s%s (start serve with --output-dir to keep outputs and "
                "video jobs across restarts)",
                self.output_dir,
                f" with {len(held)} file(s): {', '.join(held)}" if held else "",
            )
            shutil.rmtree(self.output_dir, ignore_errors=True)

    # -- health --------------------------------------------------------------------------------------
    def running_age(self) -> Optional[float]:
        """Seconds the running batch has run (None when idle)."""
        _, since = self.scheduler.running_jobs()
        return None if since is None else time.monotonic() - since

    def health(self) -> tuple[dict, int]:
        """``(body, HTTP status)`` of ``/health``: ``ok`` (idle), ``busy`` (a batch runs within its
        time), ``degraded`` (the running batch is past its deadline: stuck in one step, or the job
        store cannot be written: ``job_store_error`` says why), ``draining`` (shutting down); 503
        for the last two."""
        jobs, since = self.scheduler.running_jobs()
        now = time.monotonic()
        body = {
            "model": self.runner.model_id,
            "queue_depth": self.scheduler.queue_depth,
            "running": sum(j.n for j in jobs),
            "attention_backends": self.runner.default_backends(),
        }
        if since is not None:
            body["running_job_age_s"] = round(now - since, 3)
            overdue = [now - j.deadline for j in jobs if j.deadline is not None and now > j.deadline]
            if overdue:
                body["running_job_overdue_s"] = round(max(overdue), 3)
        self.videos.retry_unsaved()
        store_problem = self.videos.problem()
        if store_problem is not None:
            body["job_store_error"] = store_problem
        if self.draining:
            status = "draining"
        elif store_problem is not None:
            status = "degraded"
        elif since is None:
            status = "ok"
        else:
            status = "degraded" if "running_job_overdue_s" in body else "busy"
        body = {"status": status, **body}
        return body, 503 if status in ("degraded", "draining") else 200

    def retry_after(self) -> int:
        """Seconds a refused client should wait, within [1, 600]: the work queued and running
        (:func:`job_work`: samples × pixels × frames × steps) times the measured seconds per unit of work,
        less what the running batch has done; before any batch finished, the queue in batches × the mean
        batch time (1 s when unknown)."""
        if self._seconds_per_work:
            running, since = self.scheduler.running_jobs()
            done = time.monotonic() - since if since is not None else 0.0
            left = sum(job_work(j) for j in running) * self._seconds_per_work - done
            wait = sum(job_work(j) for j in self.scheduler.pending()) * self._seconds_per_work + max(0.0, left)
        else:
            wait = (self.scheduler.queue_depth / max(1, self.config.max_batch_size) + 1) * (self._batch_seconds or 1.0)
        return int(min(600, max(1, round(wait))))

    # -- checks (the request's own: admission.RequestChecks) ------------------------------------
    def check_accepting(self) -> None:
        if self.draining:
            raise RequestError(
                "the server is shutting down and takes no new work; retry on another instance or after the restart",
                status=503,
                type="server_error",
                code="shutting_down",
                headers={"Retry-After": "30"},
            )

    # -- jobs -----------------------------------------------------------------------------------
    def make_job(self, kind: str, params: dict, *, model: str, n: int = 1, **kw) -> GenerationJob:
        """The scheduler job of validated ``params`` (:meth:`request_params`): its attention settings
        prepared (400 with the reason when refused) and its deadline (video jobs: the queue wait
        and the run are each bounded by the request timeout); ``kw``: further job fields (the
        ``image`` of an image-to-video job, callbacks)."""
        rstate = self.attention_state(params["override"], params["skip_softmax"])
        timeout = self.config.request_timeout_s
        p = {
            k: params[k]
            for k in (
                "prompt",
                "width",
                "height",
                "num_frames",
                "num_inference_steps",
                "negative_prompt",
                "guidance_scale",
                "seed",
                "fps",
            )
        }
        p["guidance_scale_2"] = params.get("guidance_scale_2")
        p["lora"] = tuple(tuple(x) for x in params["lora"]) if params.get("lora") else None
        for key in ("scheduler", "flow_shift", "timesteps", "cfg_interval"):  # the request's sampler fields
            value = params.get(key)
            p[key] = tuple(value) if isinstance(value, list) else value
        prepare_cache = getattr(self.runner, "prepare_cache", None)
        if prepare_cache is not None:  # checked at admission; the default when the request leaves it out
            kw.setdefault("cache", prepare_cache(params.get("cache_backend"), params.get("cache_backend_config")))
        return GenerationJob(
            kind=kind,
            model=model,
            n=n,
            **p,
            override=rstate.override.value if rstate.override is not None else None,
            skip_softmax=rstate.skip_softmax,
            state=rstate,
            deadline=time.monotonic() + timeout,
            run_timeout_s=timeout if kind == "video" else None,
            **kw,
        )

    def attention_state(self, override: Optional[str], skip: Optional[dict]):
        try:
            return self.runner.prepare(override, skip)
        except AttentionConfigError as exc:
            msg = str(exc)
            field = "skip_softmax_params" if msg.startswith("skip_softmax") else "attention_backend_override"
            self.metrics.refusals.labels(field=field).inc()
            raise RequestError(msg, param=field, code="attention_refused") from None

    def job_backends(self, job: GenerationJob) -> list:
        """The backends a job will report before it runs (validated state; the run reports again):
        what its prepared request state runs (layers with a required backend keep theirs under an
        override or skip softmax), else the override's name or the defaults."""
        backends_for = getattr(self.runner, "backends_for", None)
        if backends_for is not None and job.state is not None:
            return backends_for(job.state)
        if job.override is not None:
            return [job.override]
        return self.runner.default_backends()

    # -- submission -----------------------------------------------------------------------------
    def submit(self, job: GenerationJob, *, restore: bool = False) -> concurrent.futures.Future:
        """Queue ``job``; a full queue is a 429 (with Retry-After), a draining server a 503."""
        try:
            return self.scheduler.submit(job, restore=restore)
        except QueueFull as exc:
            self.metrics.queue_full.inc()
            wait = self.retry_after()
            log.warning("request refused (429): %s; Retry-After %d s", exc, wait)
            raise RequestError(
                str(exc),
                status=429,
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(wait)},
                logged=True,
            ) from None
        except SchedulerStopped:
            self.check_accepting()
            raise

    async def wait_result(
        self, request: Request, job: GenerationJob, fut: concurrent.futures.Future
    ) -> GenerationResult:
        """The result of ``job`` for a client waiting on ``request``.  A client that disconnects
        cancels it (removed from the queue, or stopped at its next step: :class:`ClientGone`); past
        the request timeout it is stopped too (504)."""
        waiter = asyncio.wrap_future(fut)
        waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody awaits
        gone = asyncio.ensure_future(_disconnected(request))
        remaining = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
        try:
            done, _ = await asyncio.wait({waiter, gone}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if waiter in done:
            return waiter.result()  # raises the job's error
        if gone in done:
            self.scheduler.cancel(job, DISCONNECTED)
            raise ClientGone(job.id)
        self.scheduler.cancel(job, "timeout")  # logged by _on_cancel
        raise RequestError(
            f"the request did not finish within {self.config.request_timeout_s:g} s (the server's "
            "--request-timeout-s); it was stopped",
            status=504,
            type="timeout_error",
            code="timeout",
            logged=True,
        )

    def hand_over(self, rec, exc: BaseException) -> bool:
        """Whether a video job that failed with ``exc`` is left to another replica instead of failing here
        (a scaled-out replica whose pipeline process died: :class:`~ditattn.server.cluster.ClusterState`)."""
        return False

    def count(self, kind: str, outcome: str, backends: list) -> None:
        self.metrics.generations.labels(kind=kind, outcome=outcome, attention_backend=",".join(backends)).inc()


async def _disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) has disconnected."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def server_state(request: Request) -> ServerState:
    """The app's :class:`ServerState` (a FastAPI dependency).  ``async``: FastAPI runs a plain ``def``
    dependency in its thread pool, a thread hop per request for an attribute read (and on a Ray Serve
    replica a new thread per request)."""
    return request.app.state.server


def failure(exc: BaseException, reference: Optional[str] = None) -> RequestError:
    """The HTTP error of a job that ended with ``exc``: a fixed message for unexpected errors (the
    details are in the server log under ``reference``, logged once by the scheduler)."""
    if isinstance(exc, JobTimeout):
        return RequestError(str(exc), status=504, type="timeout_error", code="timeout", logged=True)
    if isinstance(exc, SchedulerStopped):
        return RequestError(
            "the server is shutting down; retry after the restart",
            status=503,
            type="server_error",
            code="shutting_down",
            headers={"Retry-After": "30"},
            logged=True,
        )
    if isinstance(exc, JobCancelled):
        return RequestError(str(exc), status=409, code="cancelled", logged=True)
    if isinstance(exc, AttentionConfigError):
        return RequestError(str(exc), status=400, code="attention_refused", logged=True)
    return RequestError(
        internal_message(reference), status=500, type="server_error", code="generation_failed", logged=True
    )


def internal_message(reference: Optional[str]) -> str:
    """The fixed text of an internal error (no exception text, no paths)."""
    return "internal server error" + (
        f" (reference {reference}; the server log has the details)"
        if reference
        else "; the server log has the details"
    )


def skip_params(job: GenerationJob) -> Optional[dict]:
    """The job's skip-softmax parameters as reported in responses (None when off)."""
    if job.skip_softmax is None:
        return None
    return {
        "threshold_scale_factor": job.skip_softmax.threshold_scale_factor,
        "start_step": job.skip_softmax.start_step,
    }


def skip_report(job: GenerationJob, result: GenerationResult) -> Optional[dict]:
    """:func:`skip_params` plus the run's statistics (tiles skipped)."""
    params = skip_params(job)
    if params is None:
        return None
    if result.stats:
        params["stats"] = result.stats
    return params
