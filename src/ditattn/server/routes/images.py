"""``POST /v1/images/generations`` and ``GET /v1/images/{id}/content`` (PNG, for ``response_format="url"``).

An image request waits for its result: a client that disconnects meanwhile cancels it (removed from
the queue, or stopped at its next denoising step) and is answered 499 (counted, never sent).
Image URLs are ``--public-url`` + ``/v1/images/{id}/content``, or that path alone (relative) when no
public URL is configured; the request's ``Host`` header is never used.

A generation's answer carries a ``Server-Timing`` header (ms): ``queue`` (from submission to the result,
less the pipeline's own time: the wait in the queue and the batch around it), ``generate`` (the pipeline's
run, decode included), ``encode`` (PNG and base64), ``gc`` (the process's time in Python's garbage
collector meanwhile, any thread's) and ``total`` (the route, from reading the body to the answer; the
HTTP parsing and middleware around it are not counted): a client's latency less ``total`` is
what lies outside the route (the network, the HTTP layer, a proxy such as Ray Serve's).
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from ditattn.server import gcpause
from ditattn.server.bodies import read_body, validate
from ditattn.server.media import encode_png, failure_reason
from ditattn.server.protocol import ImageData, ImageGenerationRequest, ImagesResponse, RequestError
from ditattn.server.state import BACKEND_HEADER, ClientGone, ServerState, failure, server_state, skip_report

router = APIRouter()
_IMAGE_ID = re.compile(r"^img_[0-9a-f]{32}$")
CLIENT_CLOSED = 499  # nginx's "client closed request": counted in /metrics, never reaches the client


@router.post("/v1/images/generations")
async def images_generations(request: Request, state: ServerState = Depends(server_state)):
    t_in, gc_in = time.perf_counter(), gcpause.seconds()
    config = state.config
    state.check_accepting()
    req = validate(ImageGenerationRequest, await read_body(request, config.max_body_bytes, config.max_json_depth))
    req.check_unsupported()
    n = 1 if req.n is None else req.n
    if not 1 <= n <= config.max_n:
        raise RequestError(
            f"n must be between 1 and {config.max_n} (the server's --max-n), got {n}", param="n", code="limit_exceeded"
        )
    req.check_numbers(n)
    model = state.check_model(req.model)
    width, height = state.check_size(req.size)
    steps = state.check_steps(req.num_inference_steps)
    state.check_output_size(width, height, 1, n)
    params = state.request_params(
        req, kind="image", width=width, height=height, num_frames=1, steps=steps, fps=state.runner.defaults.fps
    )
    job = state.make_job("image", params, model=model, n=n)
    fut = state.submit(job)
    t_sub = time.perf_counter()
    try:
        result = await state.wait_result(request, job, fut)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except RequestError:
        state.count("image", "error", state.job_backends(job))
        raise
    except BaseException as exc:  # noqa: BLE001 - the job's own error, logged by the scheduler
        state.count("image", "error", state.job_backends(job))
        raise failure(exc, job.id[:12]) from None
    backends = list(result.attention_backends)
    frames = result.frames
    t_res = time.perf_counter()
    pngs = await asyncio.get_running_loop().run_in_executor(
        state.encoder, lambda: [encode_png(frames[i, 0]) for i in range(frames.shape[0])]
    )
    items = []
    for png in pngs:
        if (req.response_format or "b64_json") == "b64_json":
            items.append(ImageData(b64_json=base64.b64encode(png).decode("ascii")))
        else:
            try:
                iid = state.images.add(png, backends)
            except OSError as exc:  # a full disk: the request fails with the reason, the server serves on
                state.count("image", "error", backends)
                raise RequestError(
                    f"{failure_reason(exc)}; retry later or use response_format 'b64_json'",
                    status=507,
                    type="server_error",
                    code="output_failed",
                ) from None
            items.append(ImageData(url=f"{config.public_url or ''}/v1/images/{iid}/content"))
    state.count("image", "ok", backends)
    state.metrics.images.inc(len(items))
    body = ImagesResponse(
        created=int(time.time()),
        data=items,
        size=f"{width}x{height}",
        attention_backends=backends,
        attention_backend_override=job.override,
        skip_softmax=skip_report(job, result),
        cache=getattr(result, "cache", None),
    )
    content = body.model_dump()
    t_out = time.perf_counter()
    generate = max(0.0, result.seconds)
    timing = server_timing(
        queue=max(0.0, t_res - t_sub - generate),
        generate=generate,
        encode=t_out - t_res,
        gc=gcpause.seconds() - gc_in,
        total=t_out - t_in,
    )
    return JSONResponse(content, headers={BACKEND_HEADER: ",".join(backends), "Server-Timing": timing})


def server_timing(**seconds: float) -> str:
    """A ``Server-Timing`` header value of ``name=seconds`` pairs, in ms (``queue;dur=1.2, total;dur=3.4``)."""
    return ", ".join(f"{name};dur={1e3 * s:.1f}" for name, s in seconds.items())


@router.get("/v1/images/{image_id}/content")
async def image_content(image_id: str, state: ServerState = Depends(server_state)):
    entry = state.images.get(image_id) if _IMAGE_ID.match(image_id) else None
    if entry is None or not os.path.exists(entry[0]):
        raise RequestError(f"no image with id '{image_id[:80]}'", status=404, type="not_found_error", param="image_id")
    return FileResponse(entry[0], media_type="image/png", headers={BACKEND_HEADER: ",".join(entry[1])})
