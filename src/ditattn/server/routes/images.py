"""``POST /v1/images/generations`` and ``GET /v1/images/{id}/content`` (PNG, for ``response_format="url"``)."""
from __future__ import annotations

import asyncio
import base64
import re
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, JSONResponse

from ditattn.server.bodies import read_body, validate
from ditattn.server.media import encode_png
from ditattn.server.protocol import ImageData, ImageGenerationRequest, ImagesResponse, RequestError
from ditattn.server.scheduler import GenerationResult
from ditattn.server.state import BACKEND_HEADER, ServerState, failure, server_state, skip_report

router = APIRouter()
_IMAGE_ID = re.compile(r"^img_[0-9a-f]{32}$")


@router.post("/v1/images/generations")
async def images_generations(request: Request, state: ServerState = Depends(server_state)):
    config = state.config
    req = validate(ImageGenerationRequest, await read_body(request, config.max_body_bytes))
    req.check_unsupported()
    req.check_numbers()
    model = state.check_model(req.model)
    width, height = state.check_size(req.size)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= config.max_n:
        raise RequestError(f"n must be between 1 and {config.max_n}, got {n}", param="n")
    steps = state.check_steps(req.num_inference_steps)
    job = state.job(req, kind="image", width=width, height=height, num_frames=1, steps=steps, n=n, model=model)
    fut = state.submit(job)
    try:
        result: GenerationResult = await asyncio.wait_for(asyncio.wrap_future(fut), config.request_timeout_s)
    except asyncio.TimeoutError:
        state.scheduler.cancel(job)
        state.count("image", "error", state.job_backends(job))
        raise RequestError(f"the request did not finish within {config.request_timeout_s:g} s", status=504,
                           type="timeout_error", code="timeout") from None
    except asyncio.CancelledError:
        state.scheduler.cancel(job)
        raise
    except BaseException as exc:  # noqa: BLE001
        state.count("image", "error", state.job_backends(job))
        raise failure(exc) from None
    backends = list(result.attention_backends)
    frames = result.frames
    pngs = await asyncio.get_running_loop().run_in_executor(
        state.encoder, lambda: [encode_png(frames[i, 0]) for i in range(frames.shape[0])])
    items = []
    for png in pngs:
        if (req.response_format or "b64_json") == "b64_json":
            items.append(ImageData(b64_json=base64.b64encode(png).decode("ascii")))
        else:
            iid = state.images.add(png, backends)
            items.append(ImageData(url=str(request.base_url).rstrip("/") + f"/v1/images/{iid}/content"))
    state.count("image", "ok", backends)
    state.metrics.images.inc(len(items))
    body = ImagesResponse(
        created=int(time.time()), data=items, size=f"{width}x{height}", attention_backends=backends,
        attention_backend_override=job.override, skip_softmax=skip_report(job, result),
    )
    return JSONResponse(body.model_dump(), headers={BACKEND_HEADER: ",".join(backends)})


@router.get("/v1/images/{image_id}/content")
async def image_content(image_id: str, state: ServerState = Depends(server_state)):
    import os

    entry = state.images.get(image_id) if _IMAGE_ID.match(image_id) else None
    if entry is None or not os.path.exists(entry[0]):
        raise RequestError(f"no image with id '{image_id}'", status=404, type="not_found_error", param="image_id")
    return FileResponse(entry[0], media_type="image/png", headers={BACKEND_HEADER: ",".join(entry[1])})
