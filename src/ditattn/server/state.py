"""What the request handlers share (:class:`ServerState`, at ``app.state.server``): the runner, the
scheduler, the metrics, the video and image stores, the encoder pool and the output directory, with
the checks and the job submission every generating endpoint uses."""
from __future__ import annotations

import concurrent.futures
import os
import secrets
import shutil
import tempfile
import time
from typing import Optional

from fastapi import Request

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import ServerConfig
from ditattn.server.metrics import Metrics
from ditattn.server.protocol import RequestError, parse_size
from ditattn.server.scheduler import (GenerationJob, GenerationResult, JobTimeout, QueueFull, Scheduler,
                                      SchedulerStopped)
from ditattn.server.store import ImageStore, VideoStore

BACKEND_HEADER = "x-ditattn-attention-backend"


class ServerState:
    """Everything the handlers share; built by :func:`ditattn.server.app.create_app`."""

    def __init__(self, runner, config: ServerConfig):
        self.runner = runner
        self.config = config
        self.metrics = Metrics(queue_depth=lambda: self.scheduler.queue_depth, running=lambda: self.scheduler.running)
        self.scheduler = Scheduler(runner, max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                   batch_window_s=config.batch_window_s, on_batch=self._on_batch)
        self._own_dir = config.output_dir is None
        self.output_dir = config.output_dir or tempfile.mkdtemp(prefix="ditattn-serve-")
        for sub in ("videos", "images"):
            os.makedirs(os.path.join(self.output_dir, sub), exist_ok=True)
        self.videos = VideoStore(config.max_videos_kept)
        self.images = ImageStore(os.path.join(self.output_dir, "images"), config.max_videos_kept * 4)
        self.encoder = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ditattn-encode")
        self.started = time.time()

    def _on_batch(self, jobs, seconds, error) -> None:
        m = self.metrics
        m.batches.labels(outcome="ok" if error is None else "error").inc()
        m.batch_size.observe(len(jobs))
        m.generation_seconds.observe(seconds)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.encoder.shutdown(wait=True)
        if self._own_dir:
            shutil.rmtree(self.output_dir, ignore_errors=True)

    # -- checks shared by images and videos -----------------------------------------------------
    def check_model(self, model: Optional[str]) -> str:
        """The served model's id for a request's ``model`` (None / '' = the served one); 404 otherwise."""
        if model is None or model == "":
            return self.runner.model_id
        if model not in self.runner.aliases:
            raise RequestError(f"The model '{model}' does not exist on this server; available: {self.runner.model_id}",
                               status=404, param="model", code="model_not_found")
        return self.runner.model_id

    def check_size(self, size: Optional[str], image=None) -> tuple[int, int]:
        """``(width, height)`` of a request's ``size`` within the limits; None / auto = the default
        (with a first frame ``image``: the default area at the image's aspect ratio)."""
        d, c = self.runner.defaults, self.config
        wh = parse_size(size)
        if wh is None and image is not None:
            from ditattn.pipelines.conditioning import size_for_image

            h, w = size_for_image(image.width, image.height, d.width * d.height, d.size_multiple)
            wh = (w, h)
        if wh is None:
            return d.width, d.height
        w, h = wh
        m = d.size_multiple
        if w % m or h % m:
            raise RequestError(f"invalid size '{w}x{h}': width and height must be multiples of {m} for this model",
                               param="size", code="invalid_size")
        if w > c.max_side or h > c.max_side or w * h > c.max_pixels:
            raise RequestError(f"invalid size '{w}x{h}': at most {c.max_side} pixels per side and {c.max_pixels} "
                               f"pixels in total", param="size", code="invalid_size")
        return w, h

    def check_steps(self, steps: Optional[int]) -> int:
        if steps is None:
            return self.runner.defaults.num_inference_steps
        if not 1 <= steps <= self.config.max_steps:
            raise RequestError(f"num_inference_steps must be between 1 and {self.config.max_steps}, got {steps}",
                               param="num_inference_steps")
        return steps

    def check_image(self, input_reference) -> Optional[object]:
        """The first frame of a request (a PIL image) or None; 400 when the model takes no image, needs
        one that is missing, or the image is unusable."""
        mode = getattr(self.runner.defaults, "image_input", "none")
        if input_reference is None:
            if mode == "required":
                raise RequestError("this model is image-to-video: input_reference (the first frame) is required; "
                                   "send it with POST /v1/videos", param="input_reference",
                                   code="missing_input_reference")
            return None
        if mode == "none":
            raise RequestError("input_reference (image-to-video) is not supported: this server runs a text-to-video "
                               "model", param="input_reference")
        from ditattn.server.references import reference_image

        return reference_image(input_reference, max_bytes=self.config.max_image_bytes,
                               max_pixels=self.config.max_image_pixels)

    def check_lora(self, lora) -> Optional[tuple]:
        """A request's ``lora`` scales as the job's sorted tuple (None: the server's defaults); 400 with
        the reason when an adapter is unknown, fused or the scale is not finite."""
        check = getattr(self.runner, "check_lora", None)
        if lora is None:
            return None
        if check is None:
            raise RequestError("lora is not supported by this server", param="lora")
        try:
            return check(lora)
        except AttentionConfigError as exc:
            raise RequestError(str(exc), param="lora", code="invalid_lora") from None

    def job(self, req, *, kind: str, width: int, height: int, num_frames: int, steps: int, **kw) -> GenerationJob:
        """The scheduler job of a validated image / video request: its attention settings prepared
        (400 with the reason when refused), its LoRA scales and second guidance scale checked, the
        server's defaults for the fields it leaves out, a random seed when it has none, and the
        request deadline."""
        d = self.runner.defaults
        if kind == "image" and getattr(d, "image_input", "none") == "required":
            raise RequestError("this model is image-to-video: images need a first frame; use POST /v1/videos with "
                               "input_reference", param="model")
        if req.guidance_scale_2 is not None and not getattr(d, "two_experts", False):
            raise RequestError("guidance_scale_2 applies to two-expert models (Wan 2.2 A14B); this model has one "
                               "transformer", param="guidance_scale_2")
        kw.setdefault("lora", self.check_lora(req.lora))
        skip = req.skip_softmax_params.as_dict() if req.skip_softmax_params is not None else None
        rstate = self.attention_state(req.attention_backend_override, skip)
        return GenerationJob(
            kind=kind, prompt=req.prompt, width=width, height=height, num_frames=num_frames, num_inference_steps=steps,
            negative_prompt=req.negative_prompt if req.negative_prompt is not None else
            getattr(self.runner, "default_negative_prompt", None),
            guidance_scale=d.guidance_scale if req.guidance_scale is None else req.guidance_scale,
            guidance_scale_2=req.guidance_scale_2,
            seed=secrets.randbelow(2 ** 31) if req.seed is None else req.seed,
            override=rstate.override.value if rstate.override is not None else None,
            skip_softmax=rstate.skip_softmax, state=rstate, deadline=time.monotonic() + self.config.request_timeout_s,
            **kw)

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
    def submit(self, job: GenerationJob) -> concurrent.futures.Future:
        """Queue ``job``; a full queue is a 429, a stopping scheduler a 503."""
        import logging

        try:
            return self.scheduler.submit(job)
        except QueueFull as exc:
            self.metrics.queue_full.inc()
            logging.getLogger("ditattn.server").warning("request refused (429): %s", exc)
            raise RequestError(str(exc), status=429, type="rate_limit_error", code="queue_full") from None
        except SchedulerStopped as exc:
            raise RequestError(str(exc), status=503, type="server_error", code="shutting_down") from None

    def count(self, kind: str, outcome: str, backends: list) -> None:
        self.metrics.generations.labels(kind=kind, outcome=outcome, attention_backend=",".join(backends)).inc()


def server_state(request: Request) -> ServerState:
    """The app's :class:`ServerState` (a FastAPI dependency)."""
    return request.app.state.server


def failure(exc: BaseException) -> RequestError:
    """The HTTP error of a job that failed with ``exc``."""
    if isinstance(exc, JobTimeout):
        return RequestError(str(exc), status=504, type="timeout_error", code="timeout")
    if isinstance(exc, SchedulerStopped):
        return RequestError(str(exc), status=503, type="server_error", code="shutting_down")
    if isinstance(exc, AttentionConfigError):
        return RequestError(str(exc), status=400, code="attention_refused")
    return RequestError(f"generation failed: {type(exc).__name__}: {exc}", status=500, type="server_error",
                        code="generation_failed")


def skip_params(job: GenerationJob) -> Optional[dict]:
    """The job's skip-softmax parameters as reported in responses (None when off)."""
    if job.skip_softmax is None:
        return None
    return {"threshold_scale_factor": job.skip_softmax.threshold_scale_factor,
            "start_step": job.skip_softmax.start_step}


def skip_report(job: GenerationJob, result: GenerationResult) -> Optional[dict]:
    """:func:`skip_params` plus the run's statistics (tiles skipped)."""
    params = skip_params(job)
    if params is None:
        return None
    if result.stats:
        params["stats"] = result.stats
    return params
