"""Request and response bodies of the OpenAI-compatible server (DESIGN 1.6).

The field names and shapes follow OpenAI's images and videos APIs as the official ``openai``
Python client sends and parses them (``client.images.generate``, ``client.videos.create /
retrieve / list / download_content``), plus the extra body fields of DESIGN 1.6
(``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``seed``,
``attention_backend_override``, ``skip_softmax_params``; videos also ``num_frames`` and ``fps``).

The client posts images as JSON and videos as ``multipart/form-data`` whose values are strings and
whose nested objects are flattened to ``key[sub]`` names; :func:`unflatten_form` turns such a form
back into the JSON-shaped dict these models validate (pydantic's lax mode converts ``"2"`` to 2).
Every user-input error surfaces as :class:`RequestError`, which the app renders as an OpenAI error
body ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import math
import re
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# ------------------------------------------------------------------------------------------------
# errors


class RequestError(Exception):
    """A request the server cannot serve as asked; rendered as an OpenAI-style error body.

    status: HTTP status; message: what was wrong and what is accepted; type: OpenAI error type
    (``invalid_request_error``, ``authentication_error``, ``rate_limit_error``, ``not_found_error``,
    ``timeout_error``, ``server_error``); param: the offending request field or None; code: a short
    machine-readable code or None.
    """

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error_to_request_error(exc: ValidationError, model: type) -> RequestError:
    """Turn a pydantic ValidationError into one readable 400 naming the first bad field."""
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": str(exc), "type": ""}
    loc = [str(p) for p in first.get("loc", ())]
    param = ".".join(loc) if loc else None
    if first.get("type") == "extra_forbidden":
        accepted = ", ".join(sorted(model.accepted_fields())) if hasattr(model, "accepted_fields") else ""
        msg = f"unknown field '{param}'" + (f"; accepted fields: {accepted}" if accepted else "")
        return RequestError(msg, param=param, code="unknown_parameter")
    if first.get("type") == "missing":
        return RequestError(f"missing required field '{param}'", param=param, code="missing_required_parameter")
    value = first.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    msg = f"invalid value for '{param}': {first.get('msg', 'invalid')} (got {shown})"
    return RequestError(msg, param=param, code="invalid_value")


# ------------------------------------------------------------------------------------------------
# multipart forms as sent by the openai client


_FORM_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[[A-Za-z0-9_]*\])*)$")


def unflatten_form(items: list[tuple[str, str]]) -> dict:
    """``[("a", "1"), ("p[x]", "2"), ("l[]", "3"), ("l[]", "4")]`` → ``{"a": "1", "p": {"x": "2"},
    "l": ["3", "4"]}`` (the openai client's ``brackets`` encoding of nested objects and arrays).

    Raises RequestError for a malformed key or a key given twice.
    """
    out: dict = {}
    for key, value in items:
        m = _FORM_KEY.match(key)
        if not m:
            raise RequestError(f"malformed form field name {key!r}", param=key)
        parts = [m.group(1)] + re.findall(r"\[([A-Za-z0-9_]*)\]", m.group(2))
        node = out
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            nxt_is_list = not last and parts[i + 1] == ""
            if part == "":  # list append; only valid as the last part
                if not last:
                    raise RequestError(f"unsupported nested list in form field {key!r}", param=key)
                node.append(value)
                break
            if last:
                if part in node:
                    raise RequestError(f"form field {key!r} given more than once", param=key)
                node[part] = value
                break
            if nxt_is_list:
                child = node.setdefault(part, [])
                if not isinstance(child, list):
                    raise RequestError(f"form field {key!r} conflicts with another field", param=key)
                if i + 1 == len(parts) - 1:
                    child.append(value)
                    break
                raise RequestError(f"unsupported nested list in form field {key!r}", param=key)
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RequestError(f"form field {key!r} conflicts with another field", param=key)
            node = child
    return out


# ------------------------------------------------------------------------------------------------
# shared pieces


_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")


def parse_size(value: Optional[str], *, param: str = "size") -> Optional[tuple[int, int]]:
    """``"WxH"`` → ``(width, height)``; None or ``"auto"`` → None (the model's default).

    Raises RequestError naming the accepted form for anything else (range checks are the
    server's limits, applied later)."""
    if value is None:
        return None
    text = str(value).strip()
    if text == "" or text.lower() == "auto":
        return None
    m = _SIZE.match(text)
    if not m:
        raise RequestError(f"invalid size {value!r}: expected 'WIDTHxHEIGHT' in pixels, e.g. '832x480', or 'auto'",
                           param=param, code="invalid_size")
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0:
        raise RequestError(f"invalid size {value!r}: width and height must be positive", param=param,
                           code="invalid_size")
    return w, h


class SkipSoftmaxBody(BaseModel):
    """``skip_softmax_params`` (DESIGN 2.8). Semantic checks (required, > 0) are the runtime's."""

    model_config = ConfigDict(extra="forbid")
    threshold_scale_factor: Optional[float] = None
    start_step: Optional[int] = None

    def as_dict(self) -> dict:
        d: dict = {}
        if self.threshold_scale_factor is not None:
            d["threshold_scale_factor"] = self.threshold_scale_factor
        if self.start_step is not None:
            d["start_step"] = self.start_step
        return d

    @classmethod
    def accepted_fields(cls) -> list[str]:
        return list(cls.model_fields)


class _Extras(BaseModel):
    """The ditattn extra body fields shared by images and videos."""

    model_config = ConfigDict(extra="forbid")

    negative_prompt: Optional[str] = Field(default=None, max_length=20000)
    num_inference_steps: Optional[int] = None
    guidance_scale: Optional[float] = None
    guidance_scale_2: Optional[float] = None
    lora: Optional[dict[str, float]] = Field(default=None, max_length=16)
    seed: Optional[int] = None
    attention_backend_override: Optional[str] = Field(default=None, max_length=64)
    skip_softmax_params: Optional[SkipSoftmaxBody] = None

    @classmethod
    def accepted_fields(cls) -> list[str]:
        return list(cls.model_fields)

    def check_numbers(self) -> None:
        for name in ("guidance_scale", "guidance_scale_2"):
            if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} must be a finite number", param=name)
        if self.seed is not None and not (-(2 ** 63) <= self.seed < 2 ** 63):
            raise RequestError("seed must fit in a signed 64-bit integer", param="seed")


# ------------------------------------------------------------------------------------------------
# images


class ImageGenerationRequest(_Extras):
    """``POST /v1/images/generations`` body (OpenAI images API + DESIGN 1.6 extras).

    OpenAI fields that change nothing for a diffusion model (quality, style, user, …) are accepted
    and ignored; ones whose requested behaviour the server cannot give (streaming, partial images,
    non-PNG output, transparent background, SVG) are refused with a 400.
    """

    prompt: str = Field(min_length=1, max_length=20000)
    model: Optional[str] = None
    n: Optional[int] = None
    size: Optional[str] = None
    response_format: Optional[Literal["b64_json", "url"]] = None
    # accepted and ignored
    quality: Optional[str] = None
    style: Optional[str] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    moderation: Optional[str] = None
    output_compression: Optional[int] = None
    complexity: Optional[str] = None
    # accepted only with the value the server can honour
    background: Optional[str] = None
    output_format: Optional[str] = None
    stream: Optional[bool] = None
    partial_images: Optional[int] = None
    svg: Optional[Any] = None
    frame_count: Optional[int] = None
    frame_duration_ms: Optional[int] = None

    def check_unsupported(self) -> None:
        if self.stream:
            raise RequestError("stream=true is not supported by this server; omit it", param="stream")
        if self.partial_images:
            raise RequestError("partial_images is not supported by this server (no streaming)", param="partial_images")
        if self.output_format not in (None, "png"):
            raise RequestError(f"output_format {self.output_format!r} is not supported; accepted: png",
                               param="output_format")
        if self.background not in (None, "auto", "opaque"):
            raise RequestError(f"background {self.background!r} is not supported; accepted: auto, opaque",
                               param="background")
        if self.svg is not None:
            raise RequestError("svg output is not supported by this server", param="svg")
        if self.frame_count not in (None, 1) or self.frame_duration_ms is not None:
            raise RequestError("animated images are not supported; use POST /v1/videos", param="frame_count")


class ImageData(BaseModel):
    b64_json: Optional[str] = None
    url: Optional[str] = None
    revised_prompt: Optional[str] = None


class ImagesResponse(BaseModel):
    """OpenAI ``ImagesResponse`` plus ``attention_backends`` (the DiT's backend(s) for this request)."""

    created: int
    data: list[ImageData]
    size: Optional[str] = None
    output_format: Optional[str] = "png"
    attention_backends: list[str]
    attention_backend_override: Optional[str] = None
    skip_softmax: Optional[dict] = None


# ------------------------------------------------------------------------------------------------
# videos


class VideoCreateRequest(_Extras):
    """``POST /v1/videos`` body (OpenAI videos API + DESIGN 1.6 extras + ``num_frames``, ``fps``).

    ``seconds`` is the OpenAI clip duration (a string in the client; any positive number here);
    ``num_frames`` wins over it. ``input_reference`` is the first frame of an image-to-video job
    (:mod:`ditattn.server.references`: a file upload, ``{"image_url": data URL}`` or base64).
    """

    prompt: str = Field(min_length=1, max_length=20000)
    model: Optional[str] = None
    seconds: Optional[Union[str, float]] = None
    size: Optional[str] = None
    num_frames: Optional[int] = None
    fps: Optional[int] = None
    input_reference: Optional[Any] = None
    user: Optional[str] = None

    def seconds_value(self) -> Optional[float]:
        if self.seconds is None or (isinstance(self.seconds, str) and self.seconds.strip() == ""):
            return None
        try:
            s = float(self.seconds)
        except (TypeError, ValueError):
            raise RequestError(f"invalid seconds {self.seconds!r}: expected a positive number such as '4'",
                               param="seconds") from None
        if not (s > 0 and math.isfinite(s)):
            raise RequestError(f"invalid seconds {self.seconds!r}: must be a positive number", param="seconds")
        return s


class VideoError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    """OpenAI ``Video`` (``object: "video"``, status queued / in_progress / completed / failed)
    plus the ditattn fields ``attention_backends``, ``num_frames``, ``fps``,
    ``num_inference_steps``, ``attention_backend_override``."""

    id: str
    object: Literal["video"] = "video"
    created_at: int
    completed_at: Optional[int] = None
    expires_at: Optional[int] = None
    error: Optional[VideoError] = None
    model: str
    progress: int = 0
    prompt: Optional[str] = None
    remixed_from_video_id: Optional[str] = None
    seconds: str
    size: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    attention_backends: list[str]
    attention_backend_override: Optional[str] = None
    skip_softmax: Optional[dict] = None
    num_frames: int
    fps: int
    num_inference_steps: int


class VideoList(BaseModel):
    """OpenAI cursor page: ``{"object": "list", "data": [...], "has_more", "first_id", "last_id"}``."""

    object: Literal["list"] = "list"
    data: list[VideoObject]
    has_more: bool
    first_id: Optional[str] = None
    last_id: Optional[str] = None


# ------------------------------------------------------------------------------------------------
# models


class ModelCard(BaseModel):
    """OpenAI ``Model`` plus ``lora_adapters`` (what a request's ``lora`` may name) and ``image_input``
    (``none``, ``optional`` or ``required``: whether video jobs take / need an ``input_reference``)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ditattn"
    lora_adapters: list[dict] = Field(default_factory=list)
    image_input: str = "none"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
