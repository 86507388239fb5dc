"""The OpenAI-compatible HTTP server (DESIGN 1.6, 2.7, 2.8): FastAPI app factory and ``ditattn serve``.

Endpoints: ``POST /v1/images/generations``, ``POST /v1/videos``, ``GET /v1/videos``,
``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content`` (MP4), ``DELETE /v1/videos/{id}``,
``GET /v1/images/{id}/content`` (PNG, for ``response_format="url"``), ``GET /v1/models``,
``GET /health``, ``GET /metrics``.

Every request is validated before it is queued: body fields, size / steps / frames / n limits, the
model name, and the attention settings (``attention_backend_override`` and ``skip_softmax_params``
through the runner's ``prepare``, which applies DESIGN 2.7 / 2.8 and logs each refusal). Refusals
are 400s with an OpenAI error body. Valid requests go to the :class:`Scheduler` (429 when its queue
is full). Outputs are written atomically under a server-owned directory with server-generated ids;
no request field names a path.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import hmac
import io
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ditattn.errors import AttentionConfigError
from ditattn.server import metrics as _metrics
from ditattn.server.protocol import (
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    RequestError,
    VideoCreateRequest,
    VideoError,
    VideoList,
    VideoObject,
    error_body,
    parse_size,
    unflatten_form,
    validation_error_to_request_error,
)
from ditattn.server.scheduler import GenerationJob, GenerationResult, JobTimeout, QueueFull, Scheduler, SchedulerStopped

log = logging.getLogger("ditattn.server")

BACKEND_HEADER = "x-ditattn-attention-backend"
_VIDEO_ID = re.compile(r"^video_[0-9a-f]{32}$")
_IMAGE_ID = re.compile(r"^img_[0-9a-f]{32}$")


@dataclasses.dataclass
class ServerConfig:
    """Server limits and behaviour.

    api_key: required bearer token (None = open); max_batch_size / max_queue: scheduler bounds;
    request_timeout_s: an image request waits at most this long (504 after), a video job fails if
    it cannot start within it; output_dir: where MP4/PNG outputs go (None = a private temporary
    directory removed at shutdown); max_*: request limits (400 beyond them); max_videos_kept: the
    oldest finished video jobs (and files) are forgotten beyond this count.
    """

    api_key: Optional[str] = None
    max_batch_size: int = 4
    max_queue: int = 64
    request_timeout_s: float = 600.0
    output_dir: Optional[str] = None
    max_side: int = 2048
    max_pixels: int = 1920 * 1088
    max_frames: int = 257
    max_steps: int = 200
    max_n: int = 10
    max_fps: int = 120
    max_body_bytes: int = 1 << 20
    max_videos_kept: int = 1000
    batch_window_s: float = 0.01


# ------------------------------------------------------------------------------------------------
# outputs


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def encode_png(frame: np.ndarray) -> bytes:
    """uint8 ``[H, W, 3]`` → PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame)).save(buf, format="PNG")
    return buf.getvalue()


def write_mp4(path: str, frames: np.ndarray, fps: int) -> None:
    """Encode uint8 ``[F, H, W, 3]`` frames as H.264 MP4 at ``fps``, written atomically to ``path``."""
    import imageio.v2 as imageio

    tmp = os.path.join(os.path.dirname(path), f".{uuid.uuid4().hex}.tmp.mp4")
    try:
        with imageio.get_writer(tmp, format="FFMPEG", fps=fps, codec="libx264", pixelformat="yuv420p",
                                macro_block_size=1, ffmpeg_log_level="error") as w:
            for fr in frames:
                w.append_data(np.ascontiguousarray(fr))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclasses.dataclass
class VideoRecord:
    id: str
    model: str
    prompt: str
    size: str
    seconds: str
    num_frames: int
    fps: int
    num_inference_steps: int
    override: Optional[str]
    skip_softmax: Optional[dict]
    attention_backends: list
    created_at: int
    status: str = "queued"
    progress: int = 0
    completed_at: Optional[int] = None
    error: Optional[dict] = None
    path: Optional[str] = None
    job: Any = None

    def to_object(self) -> VideoObject:
        return VideoObject(
            id=self.id, created_at=self.created_at, completed_at=self.completed_at, model=self.model,
            progress=self.progress, prompt=self.prompt, seconds=self.seconds, size=self.size, status=self.status,
            error=VideoError(**self.error) if self.error else None, attention_backends=list(self.attention_backends),
            attention_backend_override=self.override, skip_softmax=self.skip_softmax, num_frames=self.num_frames,
            fps=self.fps, num_inference_steps=self.num_inference_steps,
        )


class VideoStore:
    """Video job records by id (insertion order), bounded: the oldest finished ones are forgotten."""

    def __init__(self, max_kept: int):
        self.max_kept = max_kept
        self._records: "OrderedDict[str, VideoRecord]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, rec: VideoRecord) -> None:
        drop = []
        with self._lock:
            self._records[rec.id] = rec
            if len(self._records) > self.max_kept:
                for vid, r in list(self._records.items()):
                    if len(self._records) <= self.max_kept:
                        break
                    if r.status in ("completed", "failed"):
                        drop.append(self._records.pop(vid))
        for r in drop:
            _unlink(r.path)

    def get(self, vid: str) -> Optional[VideoRecord]:
        with self._lock:
            return self._records.get(vid)

    def pop(self, vid: str) -> Optional[VideoRecord]:
        with self._lock:
            return self._records.pop(vid, None)

    def list(self) -> list:
        with self._lock:
            return list(self._records.values())

    def update(self, vid: str, **kw) -> None:
        with self._lock:
            r = self._records.get(vid)
            if r is not None:
                for k, v in kw.items():
                    setattr(r, k, v)


def _unlink(path: Optional[str]) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


# ------------------------------------------------------------------------------------------------
# request body parsing


async def _read_body(request: Request, max_bytes: int) -> dict:
    """The request body as a dict: JSON, multipart/form-data (as the openai client sends videos) or
    url-encoded form. Uploaded files become the marker ``{"filename": ...}`` (never stored)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestError(f"request body too large ({declared} bytes; limit {max_bytes})", status=413)
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestError(f"request body too large (limit {max_bytes} bytes)", status=413)
    ctype = request.headers.get("content-type", "")
    low = ctype.lower()
    if low.startswith("multipart/form-data"):
        return unflatten_form(_parse_multipart(ctype, body))
    if low.startswith("application/x-www-form-urlencoded"):
        from urllib.parse import parse_qsl

        try:
            items = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
        except UnicodeDecodeError:
            raise RequestError("form body is not valid UTF-8") from None
        return unflatten_form(items)
    if not body.strip():
        raise RequestError("empty request body; send a JSON object")
    import json

    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    return data


def _parse_multipart(content_type: str, body: bytes) -> list:
    from email import policy
    from email.parser import BytesParser

    if "boundary=" not in content_type:
        raise RequestError("multipart/form-data body without a boundary")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1", "replace")
    msg = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        raise RequestError("malformed multipart/form-data body")
    items = []
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not name:
            raise RequestError("multipart part without a field name")
        filename = part.get_filename()
        payload = part.get_payload(decode=True) or b""
        if filename is not None:
            items.append((name, {"filename": filename}))
            continue
        try:
            items.append((name, payload.decode(part.get_content_charset() or "utf-8")))
        except (UnicodeDecodeError, LookupError):
            raise RequestError(f"form field {name!r} is not valid UTF-8", param=name) from None
    return items


def _validate(model_cls, data: dict):
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error_to_request_error(exc, model_cls) from None


# ------------------------------------------------------------------------------------------------
# the app


class ServerState:
    """Everything the handlers share: runner, scheduler, metrics, video store, output directory."""

    def __init__(self, runner, config: ServerConfig):
        self.runner = runner
        self.config = config
        self.metrics = _metrics.Metrics(queue_depth=lambda: self.scheduler.queue_depth,
                                        running=lambda: self.scheduler.running)
        self.scheduler = Scheduler(runner, max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                   batch_window_s=config.batch_window_s, on_batch=self._on_batch)
        self.videos = VideoStore(config.max_videos_kept)
        self._own_dir = config.output_dir is None
        self.output_dir = config.output_dir or tempfile.mkdtemp(prefix="ditattn-serve-")
        for sub in ("videos", "images"):
            os.makedirs(os.path.join(self.output_dir, sub), exist_ok=True)
        self.encoder = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ditattn-encode")
        self.images: "OrderedDict[str, tuple[str, list]]" = OrderedDict()  # id -> (path, backends)
        self._images_lock = threading.Lock()
        self.started = time.time()

    def _on_batch(self, jobs, seconds, error) -> None:
        m = self.metrics
        m.batches.inc(outcome="ok" if error is None else "error")
        m.batch_size.observe(len(jobs))
        m.generation_seconds.observe(seconds)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.encoder.shutdown(wait=True)
        if self._own_dir:
            shutil.rmtree(self.output_dir, ignore_errors=True)

    # -- validation shared by images and videos ----------------------------------------------
    def check_model(self, model: Optional[str]) -> str:
        if model is None or model == "":
            return self.runner.model_id
        if model not in self.runner.aliases:
            raise RequestError(f"The model '{model}' does not exist on this server; available: {self.runner.model_id}",
                               status=404, param="model", code="model_not_found")
        return self.runner.model_id

    def check_size(self, size: Optional[str]) -> tuple[int, int]:
        d, c = self.runner.defaults, self.config
        wh = parse_size(size)
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

    def negative_prompt(self, value: Optional[str]) -> Optional[str]:
        return value if value is not None else getattr(self.runner, "default_negative_prompt", None)

    def attention_state(self, override: Optional[str], skip: Optional[dict]):
        try:
            return self.runner.prepare(override, skip)
        except AttentionConfigError as exc:
            msg = str(exc)
            field = "skip_softmax_params" if msg.startswith("skip_softmax") else "attention_backend_override"
            self.metrics.refusals.inc(field=field)
            raise RequestError(msg, param=field, code="attention_refused") from None

    def job_backends(self, job: GenerationJob) -> list:
        """The backends a job will report before it runs (validated state; the run reports again)."""
        backends_for = getattr(self.runner, "backends_for", None)
        if backends_for is not None and job.state is not None:
            return backends_for(job.state)
        if job.override is not None:
            return [job.override]
        return self.runner.default_backends()

    # -- image outputs ------------------------------------------------------------------------
    def store_image(self, png: bytes, backends: list) -> str:
        iid = "img_" + uuid.uuid4().hex
        path = os.path.join(self.output_dir, "images", iid + ".png")
        _atomic_write(path, png)
        drop = []
        with self._images_lock:
            self.images[iid] = (path, backends)
            while len(self.images) > self.config.max_videos_kept * 4:
                drop.append(self.images.popitem(last=False)[1][0])
        for p in drop:
            _unlink(p)
        return iid


def _error_response(exc: RequestError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _endpoint_label(app: FastAPI, request: Request) -> str:
    """The matched route's path template (bounded label values), also for requests refused before
    routing (401); ``other`` for paths no route serves."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return path
    from starlette.routing import Match

    for r in app.router.routes:
        try:
            if r.matches(request.scope)[0] == Match.FULL:
                return getattr(r, "path", "other")
        except Exception:  # pragma: no cover - defensive
            continue
    return "other"


def create_app(runner, config: Optional[ServerConfig] = None) -> FastAPI:
    """Build the FastAPI app serving ``runner`` (see :class:`ditattn.server.runner.BaseRunner`).

    The scheduler thread starts with the app's lifespan (uvicorn runs it) and stops at shutdown.
    ``app.state.server`` is the :class:`ServerState`.
    """
    config = config or ServerConfig()
    state = ServerState(runner, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="ditattn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    m = state.metrics

    # -- middleware: auth + request metrics ---------------------------------------------------
    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        response = None
        if config.api_key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
                msg = ("missing API key: send 'Authorization: Bearer <key>'" if not auth
                       else "invalid API key in the Authorization header")
                response = JSONResponse(error_body(msg, type="authentication_error", code="invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if response is None:
            response = await call_next(request)
        m.requests.inc(endpoint=_endpoint_label(app, request), status=str(response.status_code))
        return response

    # -- errors --------------------------------------------------------------------------------
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        if exc.status >= 500:
            log.error("request failed: %s", exc.message)
        elif exc.status not in (401, 404) and exc.code != "attention_refused":  # those are logged where raised
            log.warning("request refused (%d): %s", exc.status, exc.message)
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(msg, type=kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"invalid value for '{loc}': {first.get('msg', 'invalid')}", param=loc),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}: {exc}", type="server_error"),
                            status_code=500)

    # -- submit + wait helpers -----------------------------------------------------------------
    def submit(job: GenerationJob):
        try:
            return state.scheduler.submit(job)
        except QueueFull as exc:
            m.queue_full.inc()
            log.warning("request refused (429): %s", exc)
            raise RequestError(str(exc), status=429, type="rate_limit_error", code="queue_full") from None
        except SchedulerStopped as exc:
            raise RequestError(str(exc), status=503, type="server_error", code="shutting_down") from None

    def failure(exc: BaseException) -> RequestError:
        if isinstance(exc, JobTimeout):
            return RequestError(str(exc), status=504, type="timeout_error", code="timeout")
        if isinstance(exc, SchedulerStopped):
            return RequestError(str(exc), status=503, type="server_error", code="shutting_down")
        if isinstance(exc, AttentionConfigError):
            return RequestError(str(exc), status=400, code="attention_refused")
        return RequestError(f"generation failed: {type(exc).__name__}: {exc}", status=500, type="server_error",
                            code="generation_failed")

    # -- images --------------------------------------------------------------------------------
    @app.post("/v1/images/generations")
    async def images_generations(request: Request):
        data = await _read_body(request, config.max_body_bytes)
        req = _validate(ImageGenerationRequest, data)
        req.check_unsupported()
        req.check_numbers()
        model = state.check_model(req.model)
        width, height = state.check_size(req.size)
        n = 1 if req.n is None else req.n
        if not 1 <= n <= config.max_n:
            raise RequestError(f"n must be between 1 and {config.max_n}, got {n}", param="n")
        steps = state.check_steps(req.num_inference_steps)
        skip = req.skip_softmax_params.as_dict() if req.skip_softmax_params is not None else None
        rstate = state.attention_state(req.attention_backend_override, skip)
        job = GenerationJob(
            kind="image", prompt=req.prompt, negative_prompt=state.negative_prompt(req.negative_prompt), width=width, height=height,
            num_frames=1, num_inference_steps=steps,
            guidance_scale=runner.defaults.guidance_scale if req.guidance_scale is None else req.guidance_scale,
            seed=secrets.randbelow(2 ** 31) if req.seed is None else req.seed, n=n, model=model,
            override=rstate.override.value if rstate.override is not None else None,
            skip_softmax=rstate.skip_softmax, state=rstate,
            deadline=time.monotonic() + config.request_timeout_s,
        )
        fut = submit(job)
        try:
            result: GenerationResult = await asyncio.wait_for(asyncio.wrap_future(fut), config.request_timeout_s)
        except asyncio.TimeoutError:
            state.scheduler.cancel(job)
            m.generations.inc(kind="image", outcome="error", attention_backend=",".join(state.job_backends(job)))
            raise RequestError(f"the request did not finish within {config.request_timeout_s:g} s", status=504,
                               type="timeout_error", code="timeout") from None
        except asyncio.CancelledError:
            state.scheduler.cancel(job)
            raise
        except BaseException as exc:  # noqa: BLE001
            m.generations.inc(kind="image", outcome="error", attention_backend=",".join(state.job_backends(job)))
            raise failure(exc) from None
        backends = list(result.attention_backends)
        label = ",".join(backends)
        frames = result.frames
        pngs = await asyncio.get_running_loop().run_in_executor(
            state.encoder, lambda: [encode_png(frames[i, 0]) for i in range(frames.shape[0])])
        fmt = req.response_format or "b64_json"
        items = []
        for png in pngs:
            if fmt == "b64_json":
                items.append(ImageData(b64_json=base64.b64encode(png).decode("ascii")))
            else:
                iid = state.store_image(png, backends)
                items.append(ImageData(url=str(request.base_url).rstrip("/") + f"/v1/images/{iid}/content"))
        m.generations.inc(kind="image", outcome="ok", attention_backend=label)
        m.images.inc(len(items))
        body = ImagesResponse(
            created=int(time.time()), data=items, size=f"{width}x{height}", attention_backends=backends,
            attention_backend_override=job.override, skip_softmax=_skip_report(job, result),
        )
        return JSONResponse(body.model_dump(), headers={BACKEND_HEADER: label})

    @app.get("/v1/images/{image_id}/content")
    async def image_content(image_id: str):
        if not _IMAGE_ID.match(image_id):
            raise RequestError(f"no image with id '{image_id}'", status=404, type="not_found_error", param="image_id")
        with state._images_lock:
            entry = state.images.get(image_id)
        if entry is None or not os.path.exists(entry[0]):
            raise RequestError(f"no image with id '{image_id}'", status=404, type="not_found_error", param="image_id")
        return FileResponse(entry[0], media_type="image/png", headers={BACKEND_HEADER: ",".join(entry[1])})

    # -- videos --------------------------------------------------------------------------------
    @app.post("/v1/videos")
    async def create_video(request: Request):
        data = await _read_body(request, config.max_body_bytes)
        req = _validate(VideoCreateRequest, data)
        req.check_numbers()
        if req.input_reference is not None:
            raise RequestError("input_reference (image-to-video) is not supported: this server runs text-to-video "
                               "models", param="input_reference")
        model = state.check_model(req.model)
        width, height = state.check_size(req.size)
        d = runner.defaults
        fps = d.fps if req.fps is None else req.fps
        if not 1 <= fps <= config.max_fps:
            raise RequestError(f"fps must be between 1 and {config.max_fps}, got {fps}", param="fps")
        seconds = req.seconds_value()
        if req.num_frames is not None:
            frames = req.num_frames
        elif seconds is not None:
            frames = 1 + d.frame_step * max(0, round(seconds * fps / d.frame_step))
        else:
            frames = d.num_frames
        if not 1 <= frames <= config.max_frames or (frames - 1) % d.frame_step:
            lo = 1 + d.frame_step * max(0, (frames - 1) // d.frame_step)
            raise RequestError(
                f"invalid frame count {frames}: this model needs 1 + {d.frame_step}*k frames, between 1 and "
                f"{config.max_frames} (e.g. {min(lo, config.max_frames)} or "
                f"{min(lo + d.frame_step, config.max_frames)})", param="num_frames" if req.num_frames else "seconds")
        steps = state.check_steps(req.num_inference_steps)
        skip = req.skip_softmax_params.as_dict() if req.skip_softmax_params is not None else None
        rstate = state.attention_state(req.attention_backend_override, skip)
        vid = "video_" + uuid.uuid4().hex
        job = GenerationJob(
            kind="video", prompt=req.prompt, negative_prompt=state.negative_prompt(req.negative_prompt), width=width, height=height,
            num_frames=frames, num_inference_steps=steps,
            guidance_scale=d.guidance_scale if req.guidance_scale is None else req.guidance_scale,
            seed=secrets.randbelow(2 ** 31) if req.seed is None else req.seed, n=1, fps=fps, model=model,
            override=rstate.override.value if rstate.override is not None else None,
            skip_softmax=rstate.skip_softmax, state=rstate, id=vid,
            deadline=time.monotonic() + config.request_timeout_s,
            on_start=lambda j: state.videos.update(j.id, status="in_progress"),
            on_progress=lambda j, frac: state.videos.update(j.id, progress=max(0, min(99, int(frac * 100)))),
        )
        rec = VideoRecord(
            id=vid, model=model, prompt=req.prompt, size=f"{width}x{height}", seconds=f"{frames / fps:g}",
            num_frames=frames, fps=fps, num_inference_steps=steps, override=job.override,
            skip_softmax=_skip_params(job), attention_backends=state.job_backends(job), created_at=int(time.time()),
            job=job,
        )
        state.videos.add(rec)
        try:
            fut = submit(job)
        except RequestError:
            state.videos.pop(vid)
            raise
        fut.add_done_callback(lambda f: _finish_video(state, rec, f))
        return JSONResponse(rec.to_object().model_dump(), headers={BACKEND_HEADER: ",".join(rec.attention_backends)})

    def _get_video(video_id: str) -> VideoRecord:
        rec = state.videos.get(video_id) if _VIDEO_ID.match(video_id) else None
        if rec is None:
            raise RequestError(f"no video with id '{video_id}'", status=404, type="not_found_error",
                               param="video_id", code="video_not_found")
        return rec

    @app.get("/v1/videos")
    async def list_videos(after: Optional[str] = None, limit: int = 20, order: str = "desc"):
        if not 1 <= limit <= 100:
            raise RequestError(f"limit must be between 1 and 100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise RequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        recs = state.videos.list()
        if order == "desc":
            recs = recs[::-1]
        if after:
            ids = [r.id for r in recs]
            if after not in ids:
                raise RequestError(f"no video with id '{after}' (the 'after' cursor)", status=404, param="after",
                                   type="not_found_error")
            recs = recs[ids.index(after) + 1:]
        page = recs[:limit]
        body = VideoList(data=[r.to_object() for r in page], has_more=len(recs) > limit,
                         first_id=page[0].id if page else None, last_id=page[-1].id if page else None)
        return JSONResponse(body.model_dump())

    @app.get("/v1/videos/{video_id}")
    async def retrieve_video(video_id: str):
        rec = _get_video(video_id)
        return JSONResponse(rec.to_object().model_dump(), headers={BACKEND_HEADER: ",".join(rec.attention_backends)})

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        rec = _get_video(video_id)
        if rec.status in ("queued",) and rec.job is not None:
            state.scheduler.cancel(rec.job)
        elif rec.status == "in_progress":
            raise RequestError(f"video '{video_id}' is being generated; delete it after it finishes", status=409,
                               code="video_in_progress")
        state.videos.pop(video_id)
        _unlink(rec.path)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video"):
        rec = _get_video(video_id)
        if variant != "video":
            raise RequestError(f"variant {variant!r} is not available; accepted: video", param="variant")
        if rec.status != "completed" or not rec.path or not os.path.exists(rec.path):
            why = rec.error["message"] if rec.status == "failed" and rec.error else f"its status is {rec.status}"
            raise RequestError(f"video '{video_id}' has no content: {why}", status=409, code="video_not_ready")
        return FileResponse(rec.path, media_type="video/mp4", filename=f"{video_id}.mp4",
                            headers={BACKEND_HEADER: ",".join(rec.attention_backends)})

    # -- models, health, metrics ---------------------------------------------------------------
    @app.get("/v1/models")
    async def list_models():
        card = ModelCard(id=runner.model_id, created=int(state.started))
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id not in runner.aliases:
            raise RequestError(f"The model '{model_id}' does not exist on this server", status=404,
                               type="not_found_error", code="model_not_found")
        return JSONResponse(ModelCard(id=runner.model_id, created=int(state.started)).model_dump())

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": runner.model_id, "queue_depth": state.scheduler.queue_depth,
                "attention_backends": runner.default_backends()}

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type=_metrics.CONTENT_TYPE)

    return app


def _skip_params(job: GenerationJob) -> Optional[dict]:
    if job.skip_softmax is None:
        return None
    return {"threshold_scale_factor": job.skip_softmax.threshold_scale_factor,
            "start_step": job.skip_softmax.start_step}


def _skip_report(job: GenerationJob, result: GenerationResult) -> Optional[dict]:
    params = _skip_params(job)
    if params is None:
        return None
    if result.stats:
        params["stats"] = result.stats
    return params


def _finish_video(state: ServerState, rec: VideoRecord, fut: concurrent.futures.Future) -> None:
    """Scheduler done-callback: encode the MP4 on the encoder pool, then mark the job."""
    m = state.metrics
    label = ",".join(rec.attention_backends)
    if fut.cancelled():
        state.videos.update(rec.id, status="failed", error={"code": "cancelled", "message": "the job was cancelled"},
                            completed_at=int(time.time()), job=None)
        return
    exc = fut.exception()
    if exc is not None:
        code = "timeout" if isinstance(exc, JobTimeout) else "generation_failed"
        if isinstance(exc, AttentionConfigError):
            code = "attention_refused"
        state.videos.update(rec.id, status="failed", error={"code": code, "message": f"{exc}"},
                            completed_at=int(time.time()), job=None)
        m.generations.inc(kind="video", outcome="error", attention_backend=label)
        return
    result: GenerationResult = fut.result()

    def encode():
        try:
            path = os.path.join(state.output_dir, "videos", rec.id + ".mp4")
            write_mp4(path, result.frames[0], rec.fps)
        except Exception as e:  # noqa: BLE001
            log.exception("encoding video %s failed", rec.id)
            state.videos.update(rec.id, status="failed", completed_at=int(time.time()), job=None,
                                error={"code": "encoding_failed", "message": f"MP4 encoding failed: {e}"})
            m.generations.inc(kind="video", outcome="error", attention_backend=label)
            return
        backends = list(result.attention_backends)
        skip = _skip_report(rec.job, result) if rec.job is not None else rec.skip_softmax
        if state.videos.get(rec.id) is None:  # deleted meanwhile
            _unlink(path)
            return
        state.videos.update(rec.id, status="completed", progress=100, completed_at=int(time.time()), path=path,
                            attention_backends=backends, skip_softmax=skip, job=None)
        m.generations.inc(kind="video", outcome="ok", attention_backend=",".join(backends))
        m.videos.inc()

    try:
        state.encoder.submit(encode)
    except RuntimeError:  # executor shut down
        state.videos.update(rec.id, status="failed", completed_at=int(time.time()), job=None,
                            error={"code": "shutting_down", "message": "the server is shutting down"})


# ------------------------------------------------------------------------------------------------
# ditattn serve


def serve_main(args) -> int:
    """``ditattn serve``: load the model named by ``args`` (``--model-path`` etc.), then run the
    server on ``--host``/``--port`` until interrupted. User-input errors raise AttentionConfigError."""
    import uvicorn

    from ditattn.distributed.launch import launch, needs_launch
    from ditattn.server.runner import build_runner

    if needs_launch(args):  # --num-gpus > 1: one process per rank; rank 0 serves, the others follow
        return launch(args)
    runner = build_runner(args)
    config = ServerConfig(api_key=args.api_key, max_batch_size=args.max_batch_size, max_queue=args.max_queue)
    app = create_app(runner, config)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this address can use the server",
                    args.host)
    print(f"ditattn serve: model {runner.model_id} on http://{args.host}:{args.port} "
          f"(DiT attention: {', '.join(runner.default_backends())})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if getattr(args, "verbose", False) else "warning")
    return 0
