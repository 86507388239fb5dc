"""Video jobs: ``POST /v1/videos``, ``GET /v1/videos``, ``GET /v1/videos/{id}``,
``GET /v1/videos/{id}/content`` (MP4) and ``DELETE /v1/videos/{id}``.

A job is validated, queued and answered at once (``status: queued``); the scheduler runs it, the
encoder pool writes its MP4 (:func:`_finish`), and the client polls the job.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import time
import uuid
from typing import Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse

from ditattn.errors import AttentionConfigError
from ditattn.server.bodies import read_body, validate
from ditattn.server.media import write_mp4
from ditattn.server.protocol import RequestError, VideoCreateRequest, VideoList
from ditattn.server.scheduler import GenerationResult, JobTimeout
from ditattn.server.state import BACKEND_HEADER, ServerState, server_state, skip_params, skip_report
from ditattn.server.store import VideoRecord, unlink

router = APIRouter()
log = logging.getLogger("ditattn.server")
_VIDEO_ID = re.compile(r"^video_[0-9a-f]{32}$")


def _frames(state: ServerState, req: VideoCreateRequest, fps: int) -> int:
    """The frame count of a request: ``num_frames``, else ``seconds × fps`` rounded to the model's
    frame step, else the default; 400 unless ``1 + k × frame_step`` within the limit."""
    d, limit = state.runner.defaults, state.config.max_frames
    seconds = req.seconds_value()
    if req.num_frames is not None:
        frames = req.num_frames
    elif seconds is not None:
        frames = 1 + d.frame_step * max(0, round(seconds * fps / d.frame_step))
    else:
        frames = d.num_frames
    if not 1 <= frames <= limit or (frames - 1) % d.frame_step:
        lo = 1 + d.frame_step * max(0, (frames - 1) // d.frame_step)
        raise RequestError(
            f"invalid frame count {frames}: this model needs 1 + {d.frame_step}*k frames, between 1 and "
            f"{limit} (e.g. {min(lo, limit)} or {min(lo + d.frame_step, limit)})",
            param="num_frames" if req.num_frames else "seconds")
    return frames


@router.post("/v1/videos")
async def create_video(request: Request, state: ServerState = Depends(server_state)):
    config = state.config
    # for a model that takes a first frame, the body may carry it (base64 grows it by a third)
    limit = config.max_body_bytes
    if getattr(state.runner.defaults, "image_input", "none") != "none":
        limit += (config.max_image_bytes * 4) // 3 + 4096
    req = validate(VideoCreateRequest, await read_body(request, limit))
    req.check_numbers()
    model = state.check_model(req.model)
    image = state.check_image(req.input_reference)
    width, height = state.check_size(req.size, image)
    fps = state.runner.defaults.fps if req.fps is None else req.fps
    if not 1 <= fps <= config.max_fps:
        raise RequestError(f"fps must be between 1 and {config.max_fps}, got {fps}", param="fps")
    frames = _frames(state, req, fps)
    steps = state.check_steps(req.num_inference_steps)
    vid = "video_" + uuid.uuid4().hex
    job = state.job(req, kind="video", width=width, height=height, num_frames=frames, steps=steps, n=1, fps=fps,
                    model=model, id=vid, image=image, on_start=lambda j: state.videos.update(j.id, status="in_progress"),
                    on_progress=lambda j, frac: state.videos.update(j.id, progress=max(0, min(99, int(frac * 100)))))
    rec = VideoRecord(
        id=vid, model=model, prompt=req.prompt, size=f"{width}x{height}", seconds=f"{frames / fps:g}",
        num_frames=frames, fps=fps, num_inference_steps=steps, override=job.override, skip_softmax=skip_params(job),
        attention_backends=state.job_backends(job), created_at=int(time.time()), job=job,
    )
    state.videos.add(rec)
    try:
        fut = state.submit(job)
    except RequestError:
        state.videos.pop(vid)
        raise
    fut.add_done_callback(lambda f: _finish(state, rec, f))
    return JSONResponse(rec.to_object().model_dump(), headers={BACKEND_HEADER: ",".join(rec.attention_backends)})


def _record(state: ServerState, video_id: str) -> VideoRecord:
    rec = state.videos.get(video_id) if _VIDEO_ID.match(video_id) else None
    if rec is None:
        raise RequestError(f"no video with id '{video_id}'", status=404, type="not_found_error",
                           param="video_id", code="video_not_found")
    return rec


@router.get("/v1/videos")
async def list_videos(after: Optional[str] = None, limit: int = 20, order: str = "desc",
                      state: ServerState = Depends(server_state)):
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


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, state: ServerState = Depends(server_state)):
    rec = _record(state, video_id)
    return JSONResponse(rec.to_object().model_dump(), headers={BACKEND_HEADER: ",".join(rec.attention_backends)})


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, state: ServerState = Depends(server_state)):
    rec = _record(state, video_id)
    if rec.status in ("queued",) and rec.job is not None:
        state.scheduler.cancel(rec.job)
    elif rec.status == "in_progress":
        raise RequestError(f"video '{video_id}' is being generated; delete it after it finishes", status=409,
                           code="video_in_progress")
    state.videos.pop(video_id)
    unlink(rec.path)
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, variant: str = "video", state: ServerState = Depends(server_state)):
    rec = _record(state, video_id)
    if variant != "video":
        raise RequestError(f"variant {variant!r} is not available; accepted: video", param="variant")
    if rec.status != "completed" or not rec.path or not os.path.exists(rec.path):
        why = rec.error["message"] if rec.status == "failed" and rec.error else f"its status is {rec.status}"
        raise RequestError(f"video '{video_id}' has no content: {why}", status=409, code="video_not_ready")
    return FileResponse(rec.path, media_type="video/mp4", filename=f"{video_id}.mp4",
                        headers={BACKEND_HEADER: ",".join(rec.attention_backends)})


def _finish(state: ServerState, rec: VideoRecord, fut: concurrent.futures.Future) -> None:
    """Scheduler done-callback: encode the MP4 on the encoder pool, then mark the job."""
    label = list(rec.attention_backends)
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
        state.count("video", "error", label)
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
            state.count("video", "error", label)
            return
        backends = list(result.attention_backends)
        skip = skip_report(rec.job, result) if rec.job is not None else rec.skip_softmax
        if state.videos.get(rec.id) is None:  # deleted meanwhile
            unlink(path)
            return
        state.videos.update(rec.id, status="completed", progress=100, completed_at=int(time.time()), path=path,
                            attention_backends=backends, skip_softmax=skip, job=None)
        state.count("video", "ok", backends)
        state.metrics.videos.inc()

    try:
        state.encoder.submit(encode)
    except RuntimeError:  # executor shut down
        state.videos.update(rec.id, status="failed", completed_at=int(time.time()), job=None,
                            error={"code": "shutting_down", "message": "the server is shutting down"})
