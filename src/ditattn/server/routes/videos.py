"""Video jobs: ``POST /v1/videos``, ``GET /v1/videos``, ``GET /v1/videos/{id}``,
``GET /v1/videos/{id}/content`` (MP4) and ``DELETE /v1/videos/{id}``.

A job is validated, queued and answered at once (``status: queued``); the scheduler runs it, the
encoder pool writes its MP4 (:func:`_finish`), and the client polls the job.  ``DELETE`` cancels a
queued job (it never runs) or a running one (stopped at its next denoising step) and removes its
output.  With an ``--output-dir`` every job is in the job store: :func:`restore_jobs` re-queues the
unfinished ones and serves the finished ones after a restart; a job stopped by a shutdown goes back
to ``queued``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import time
import uuid
from typing import Optional

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse

from ditattn.errors import AttentionConfigError, short_repr
from ditattn.files import atomic_write
from ditattn.server.bodies import read_body, validate
from ditattn.server.jobs import GenerationJob, GenerationResult, JobCancelled, JobTimeout, SchedulerStopped
from ditattn.server.media import WriteStopped, encode_png, failure_reason, write_mp4
from ditattn.server.protocol import RequestError, VideoCreateRequest, VideoList
from ditattn.server.state import BACKEND_HEADER, ServerState, internal_message, server_state, skip_params, skip_report
from ditattn.server.store import VideoRecord, remove_file

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
        if seconds * fps > limit:
            raise RequestError(
                f"seconds={seconds:g} at {fps} fps is more than {limit} frames (the server's --max-frames)",
                param="seconds",
                code="limit_exceeded",
            )
        frames = 1 + d.frame_step * max(0, round(seconds * fps / d.frame_step))
    else:
        frames = d.num_frames
    if not 1 <= frames <= limit or (frames - 1) % d.frame_step:
        step = d.frame_step
        hi = 1 + step * ((limit - 1) // step)  # the most frames allowed
        lo = 1 + step * max(0, (frames - 1) // step)
        near = [hi] if frames > limit else sorted({min(lo, hi), min(lo + step, hi)})
        raise RequestError(
            f"invalid frame count {short_repr(frames)}: this model needs 1 + {step}*k frames, between 1 and {limit} "
            f"(the server's --max-frames) (e.g. {' or '.join(map(str, near))})",
            param="num_frames" if req.num_frames is not None else "seconds",
            code="invalid_frames",
        )
    return frames


@router.post("/v1/videos")
async def create_video(request: Request, state: ServerState = Depends(server_state)):
    config = state.config
    state.check_accepting()
    # for a model that takes a first frame, the body may carry it (base64 grows it by a third)
    limit = config.max_body_bytes
    if getattr(state.runner.defaults, "image_input", "none") != "none":
        limit += (config.max_image_bytes * 4) // 3 + 4096
    req = validate(VideoCreateRequest, await read_body(request, limit, config.max_json_depth))
    req.check_numbers()
    model = state.check_model(req.model)
    image = state.check_image(req.input_reference)
    width, height = state.check_size(req.size, image)
    fps = state.runner.defaults.fps if req.fps is None else req.fps
    if not 1 <= fps <= config.max_fps:
        raise RequestError(
            f"fps must be between 1 and {config.max_fps} (the server's --max-fps), got {fps}",
            param="fps",
            code="limit_exceeded",
        )
    frames = _frames(state, req, fps)
    steps = state.check_steps(req.num_inference_steps)
    state.check_output_size(width, height, frames, 1)
    params = state.request_params(
        req, kind="video", width=width, height=height, num_frames=frames, steps=steps, fps=fps
    )
    vid = "video_" + uuid.uuid4().hex
    if image is not None and state.videos.jobs is not None:  # kept for a restart, with the job
        params["input_reference_file"] = _save_reference(state, vid, image)
    job = _video_job(state, vid, params, model, image)
    rec = VideoRecord(
        id=vid,
        model=model,
        prompt=req.prompt,
        size=f"{width}x{height}",
        seconds=f"{frames / fps:g}",
        num_frames=frames,
        fps=fps,
        num_inference_steps=steps,
        override=job.override,
        skip_softmax=skip_params(job),
        attention_backends=state.job_backends(job),
        created_at=int(time.time()),
        request=params,
        job=job,
    )
    state.videos.add(rec)
    try:
        fut = state.submit(job)
    except BaseException:
        state.videos.pop(vid)
        raise
    fut.add_done_callback(lambda f: _finish(state, rec, f))
    return JSONResponse(rec.to_object().model_dump(), headers={BACKEND_HEADER: ",".join(rec.attention_backends)})


def _video_job(state: ServerState, vid: str, params: dict, model: str, image=None) -> GenerationJob:
    return state.make_job(
        "video",
        params,
        model=model,
        id=vid,
        image=image,
        on_start=lambda j: state.videos.update(j.id, status="in_progress"),
        on_progress=lambda j, frac: state.videos.update(j.id, progress=max(0, min(99, int(frac * 100)))),
    )


def _reference_path(state: ServerState, name: str) -> str:
    return os.path.join(state.output_dir, name)


def _save_reference(state: ServerState, vid: str, image) -> str:
    """Write the first frame of image-to-video job ``vid`` next to the job store (PNG, lossless), so
    that a restart can run the job again; returns its path relative to the output folder."""
    name = os.path.join("inputs", vid + ".png")
    path = _reference_path(state, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write(path, encode_png(np.asarray(image)))
    return name


def _load_reference(state: ServerState, params: dict):
    """The stored first frame of a restored job (None for a text-to-video job); RequestError when it is gone."""
    name = params.get("input_reference_file")
    if not name:
        return None
    from PIL import Image

    path = _reference_path(state, name)
    if not os.path.isfile(path):
        raise RequestError(f"its stored first frame {name} is gone", param="input_reference")
    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # truncated, not an image
        raise RequestError(
            f"its stored first frame {name} is damaged ({type(exc).__name__}: {str(exc)[:120]})",
            param="input_reference",
        ) from None


def _drop_reference(state: ServerState, rec: VideoRecord) -> None:
    """Remove the stored first frame of a finished or deleted job (if it has one)."""
    name = rec.request.get("input_reference_file") if rec.request else None
    if name:
        remove_file(_reference_path(state, name), f"video {rec.id} finished: its stored first frame is not needed")


def restore_jobs(state: ServerState) -> None:
    """Load the job store of the output folder (at start): finished jobs are served again (a
    completed job whose file is gone becomes failed, logged), unfinished ones are queued again in
    their original order (one whose request this server cannot serve any more fails with the
    reason, logged).  A record that is malformed or whose stored first frame is damaged fails alone,
    with the reason; the others are restored.  Files of a previous run that no job refers to are left
    alone."""
    store = state.videos.jobs
    if store is None:
        return
    state.images.clear_folder()
    _remove_partial_encodes(os.path.join(state.output_dir, "videos"))
    counts = {"completed": 0, "failed": 0, "queued": 0}
    for data in store.load():
        try:
            rec = VideoRecord.from_json(data, state.output_dir)
            _check_record(rec)
        except Exception as exc:  # noqa: BLE001 - one malformed record fails alone
            why = f"its stored record is malformed ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
            log.error("job store: video %s cannot be restored: %s; marked failed", data.get("id"), why)
            _fail_unreadable(state, data, why)
            counts["failed"] += 1
            continue
        if rec.status == "completed" and not (rec.path and os.path.exists(rec.path)):
            log.warning("job store: video %s was completed but its file %s is gone; marked failed", rec.id, rec.path)
            rec.status, rec.error = "failed", {"code": "file_missing", "message": "the output file is gone"}
        state.videos.add(rec)
        if rec.status in ("queued", "in_progress"):
            try:
                _requeue(state, rec)
            except Exception as exc:  # noqa: BLE001 - whatever one job meets, the others are restored
                why = f"it could not be queued again ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
                log.error("job store: video %s %s; marked failed", rec.id, why, exc_info=exc)
                state.videos.update(
                    rec.id,
                    status="failed",
                    completed_at=int(time.time()),
                    job=None,
                    error={"code": "not_restorable", "message": why},
                )
        status = state.videos.get(rec.id).status if state.videos.get(rec.id) is not None else rec.status
        counts["queued" if status in ("queued", "in_progress") else status] += 1
    for vid in store.bad_rows:
        log.error("job store: video %s cannot be restored: its stored record is not valid JSON; marked failed", vid)
        _fail_unreadable(state, {"id": vid}, "its stored record is not valid JSON")
        counts["failed"] += 1
    log.warning(
        "job store %s: %d completed, %d failed, %d re-queued video job(s)",
        store.path,
        counts["completed"],
        counts["failed"],
        counts["queued"],
    )


def _check_record(rec: VideoRecord) -> None:
    """Raise ValueError / TypeError when a restored record's fields have the wrong types."""
    if not isinstance(rec.id, str) or not _VIDEO_ID.match(rec.id):
        raise ValueError(f"bad id {short_repr(rec.id)}")
    if rec.status not in ("queued", "in_progress", "completed", "failed"):
        raise ValueError(f"unknown status {short_repr(rec.status)}")
    if not isinstance(rec.request, dict) or not isinstance(rec.attention_backends, list):
        raise TypeError("request / attention_backends of the wrong type")
    if rec.error is not None and not isinstance(rec.error, dict):
        raise TypeError("error of the wrong type")
    rec.to_object()  # every field the API reports must validate


def _fail_unreadable(state: ServerState, data: dict, why: str) -> None:
    """Replace a record that cannot be restored by a failed job saying ``why`` (so that its client
    learns it), when its id is a video id; otherwise the row stays in the job store, logged."""
    vid = data.get("id")
    if not isinstance(vid, str) or not _VIDEO_ID.match(vid):
        return
    now = int(time.time())
    created = data.get("created_at")
    rec = VideoRecord(
        id=vid,
        model=state.runner.model_id,
        prompt="",
        size="",
        seconds="",
        num_frames=0,
        fps=0,
        num_inference_steps=0,
        override=None,
        skip_softmax=None,
        attention_backends=[],
        created_at=created if isinstance(created, int) and not isinstance(created, bool) else now,
        status="failed",
        completed_at=now,
        error={"code": "not_restorable", "message": why},
    )
    state.videos.add(rec)


def _requeue(state: ServerState, rec: VideoRecord) -> None:
    try:
        model = state.check_model(rec.model)
        if rec.request.get("lora"):
            state.check_lora({name: scale for name, scale in rec.request["lora"]})
        job = _video_job(state, rec.id, rec.request, model, _load_reference(state, rec.request))
        fut = state.submit(job, restore=True)
    except (RequestError, KeyError, TypeError, AttentionConfigError) as exc:
        why = exc.message if isinstance(exc, RequestError) else f"its stored request is incomplete ({exc})"
        log.warning("job store: video %s cannot run on this server: %s; marked failed", rec.id, why)
        state.videos.update(
            rec.id, status="failed", completed_at=int(time.time()), error={"code": "not_restorable", "message": why}
        )
        return
    state.videos.update(rec.id, status="queued", progress=0, job=job)
    fut.add_done_callback(lambda f: _finish(state, rec, f))


def _remove_partial_encodes(folder: str) -> None:
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".tmp.mp4")]
    except OSError:
        return
    for name in names:
        remove_file(os.path.join(folder, name), "a partial MP4 of an interrupted encode")


def _record(state: ServerState, video_id: str) -> VideoRecord:
    rec = state.videos.get(video_id) if _VIDEO_ID.match(video_id) else None
    if rec is None:
        raise RequestError(
            f"no video with id '{video_id[:80]}'",
            status=404,
            type="not_found_error",
            param="video_id",
            code="video_not_found",
        )
    return rec


@router.get("/v1/videos")
async def list_videos(
    after: Optional[str] = None, limit: int = 20, order: str = "desc", state: ServerState = Depends(server_state)
):
    if not 1 <= limit <= 100:
        raise RequestError(f"limit must be between 1 and 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise RequestError(f"order must be 'asc' or 'desc', got {order[:40]!r}", param="order")
    recs = state.videos.list()
    if order == "desc":
        recs = recs[::-1]
    if after:
        ids = [r.id for r in recs]
        if after not in ids:
            raise RequestError(
                f"no video with id '{after[:80]}' (the 'after' cursor)",
                status=404,
                param="after",
                type="not_found_error",
            )
        recs = recs[ids.index(after) + 1 :]
    page = recs[:limit]
    body = VideoList(
        data=[r.to_object() for r in page],
        has_more=len(recs) > limit,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
    )
    return JSONResponse(body.model_dump())


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, state: ServerState = Depends(server_state)):
    rec = _record(state, video_id)
    return JSONResponse(rec.to_object().model_dump(), headers={BACKEND_HEADER: ",".join(rec.attention_backends)})


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, state: ServerState = Depends(server_state)):
    """Delete a video job: a queued one never runs, a running one stops at its next denoising step,
    a finished one's MP4 is removed (logged)."""
    rec = _record(state, video_id)
    stage = state.scheduler.cancel(rec.job, "deleted") if rec.job is not None else None
    state.videos.pop(video_id)
    _drop_reference(state, rec)
    log.info(
        "video %s deleted by request (it was %s%s)",
        video_id,
        rec.status,
        "; stopping it at its next denoising step" if stage == "running" else "",
    )
    remove_file(rec.path, f"video {video_id} deleted by request")
    return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, variant: str = "video", state: ServerState = Depends(server_state)):
    rec = _record(state, video_id)
    if variant != "video":
        raise RequestError(f"variant {variant[:40]!r} is not available; accepted: video", param="variant")
    if rec.status != "completed" or not rec.path or not os.path.exists(rec.path):
        why = rec.error["message"] if rec.status == "failed" and rec.error else f"its status is {rec.status}"
        raise RequestError(f"video '{video_id}' has no content: {why}", status=409, code="video_not_ready")
    return FileResponse(
        rec.path,
        media_type="video/mp4",
        filename=f"{video_id}.mp4",
        headers={BACKEND_HEADER: ",".join(rec.attention_backends)},
    )


def _finish(state: ServerState, rec: VideoRecord, fut: concurrent.futures.Future) -> None:
    """Scheduler done-callback: encode the MP4 on the encoder pool, then mark the job; a job a
    shutdown stopped goes back to ``queued`` (it is in the job store for the next start)."""
    label = list(rec.attention_backends)
    exc = fut.exception()
    if exc is not None:
        if isinstance(exc, SchedulerStopped) and state.videos.jobs is not None:
            if state.videos.update(rec.id, status="queued", progress=0, job=None) is not None:
                log.info("video %s stays queued for the next start (job store %s)", rec.id, state.videos.jobs.path)
            return
        if state.hand_over(rec, exc):  # its stored first frame stays: the replica that takes it over reads it
            return
        _drop_reference(state, rec)
        if isinstance(exc, JobCancelled):  # deleted: the record is already gone
            return
        error = {"code": "generation_failed", "message": internal_message(rec.id[:12])}
        if isinstance(exc, JobTimeout):
            error = {"code": "timeout", "message": str(exc)}
        elif isinstance(exc, SchedulerStopped):
            error = {
                "code": "shutting_down",
                "message": "the server shut down before the job finished (no --output-dir: the job could not be kept)",
            }
        elif isinstance(exc, AttentionConfigError):
            error = {"code": "attention_refused", "message": str(exc)}
        state.videos.update(rec.id, status="failed", error=error, completed_at=int(time.time()), job=None)
        state.count("video", "error", label)
        return
    _drop_reference(state, rec)
    result: GenerationResult = fut.result()
    job = rec.job

    def encode():
        path = os.path.join(state.output_dir, "videos", rec.id + ".mp4")
        try:  # a job deleted meanwhile stops its encode between frames
            write_mp4(path, result.frames[0], rec.fps, should_stop=lambda: state.videos.get(rec.id) is None)
        except WriteStopped:
            log.info("video %s was deleted while it was encoded; encoding stopped", rec.id)
            return
        except Exception as e:  # noqa: BLE001 - a full disk, an encoder error, a truncated file
            reason = failure_reason(e)
            log.error(
                "writing video %s failed (reference %s): %s: %s",
                rec.id,
                rec.id[:12],
                type(e).__name__,
                e,
                exc_info=e if not isinstance(e, OSError) else None,
            )
            state.videos.update(
                rec.id,
                status="failed",
                completed_at=int(time.time()),
                job=None,
                error={"code": "output_failed", "message": f"{reason} (reference {rec.id[:12]})"},
            )
            state.count("video", "error", label)
            return
        backends = list(result.attention_backends)
        skip = skip_report(job, result) if job is not None else rec.skip_softmax
        if (
            state.videos.update(
                rec.id,
                status="completed",
                progress=100,
                completed_at=int(time.time()),
                path=path,
                attention_backends=backends,
                skip_softmax=skip,
                job=None,
                cache=getattr(result, "cache", None),
            )
            is None
        ):
            remove_file(path, f"video {rec.id} was deleted while it was encoded")
            return
        state.count("video", "ok", backends)
        state.metrics.videos.inc()

    try:
        state.encode_later(encode)
    except RuntimeError:  # the encoder pool is shut down: the server is past its drain
        log.error("video %s finished after the encoders stopped; its frames are lost", rec.id)
        state.videos.update(
            rec.id,
            status="failed",
            completed_at=int(time.time()),
            job=None,
            error={"code": "shutting_down", "message": "the server shut down while the job finished"},
        )
