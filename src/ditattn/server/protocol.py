"""Request and response bodies of the OpenAI-compatible server.

The field names and shapes follow OpenAI's images and videos APIs as the official ``openai``
Python client sends and parses them (``client.images.generate``, ``client.videos.create /
retrieve / list / download_content``), plus ditattn's extra body fields
(``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``seed``,
``attention_backend_override``, ``skip_softmax_params``, the sampler fields ``scheduler``, ``flow_shift``,
``timesteps``, ``cfg_interval``; videos also ``num_frames`` and ``fps``).

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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ditattn.errors import short_repr

# ------------------------------------------------------------------------------------------------
# errors


#: longest error message a response (and the log line) carries
MAX_MESSAGE = 1000


class RequestError(Exception):
    """A request the server cannot serve as asked; rendered as an OpenAI-style error body.

    status: HTTP status; message: what was wrong and what is accepted; type: OpenAI error type
    (``invalid_request_error``, ``authentication_error``, ``rate_limit_error``, ``not_found_error``,
    ``timeout_error``, ``server_error``); param: the offending request field or None; code: a short
    machine-readable code or None; headers: extra response headers (``Retry-After``); logged: the
    reason was already logged where it was found (the handler does not log it again).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
        logged: bool = False,
    ):
        if len(message) > MAX_MESSAGE:  # messages quote the request: a huge key or id must not come back whole
            message = f"{message[: MAX_MESSAGE - 40]}... (message cut: {len(message)} characters)"
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers, self.logged = dict(headers or {}), logged

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: Optional[str] = None, code: Optional[str] = None
) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error_to_request_error(exc: ValidationError, model: type) -> RequestError:
    """Turn a pydantic ValidationError into one readable 400 naming the first bad field."""
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": str(exc), "type": ""}
    loc = field_path(first.get("loc", ()))
    param = ".".join(loc)[:100] if loc else None
    if first.get("type") == "extra_forbidden":
        accepted = ", ".join(sorted(model.accepted_fields())) if hasattr(model, "accepted_fields") else ""
        msg = f"unknown field '{param}'" + (f"; accepted fields: {accepted}" if accepted else "")
        return RequestError(msg, param=param, code="unknown_parameter")
    if first.get("type") == "missing":
        return RequestError(f"missing required field '{param}'", param=param, code="missing_required_parameter")
    value = first.get("input")
    shown = short_repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    # a field of several accepted types fails once per type: name them all, not the first alone
    same = [e for e in errs if field_path(e.get("loc", ())) == loc and e.get("input") is value]
    reasons = list(dict.fromkeys(_reason(e) for e in same)) or [_reason(first)]
    why = reasons[0] if len(reasons) == 1 else "expected " + " or ".join(r.removeprefix("expected ") for r in reasons)
    msg = f"invalid value for '{param}': {why} (got {shown})"
    return RequestError(msg, param=param, code="invalid_value")


#: pydantic's tags of a union member or validator in an error location (``seconds.str``,
#: ``timesteps.list[float].0``): not field names, left out of the names a client sees
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|tuple\[.*\]|[a-z_-]+\[.*\])$")


def field_path(loc) -> list[str]:
    """The request field names of a pydantic error location, union and validator tags left out."""
    return [str(p) for p in loc if not (isinstance(p, str) and _TYPE_TAG.match(p))]


_EXPECTED = {
    "string_type": "expected a string",
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "list_type": "expected a list",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
}


def _reason(err: dict) -> str:
    """One pydantic error as a short reason (``expected a number``, ``Input should be ...``)."""
    return _EXPECTED.get(err.get("type", ""), str(err.get("msg", "invalid")).removeprefix("Value error, "))


# ------------------------------------------------------------------------------------------------
# multipart forms as sent by the openai client


_FORM_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[[A-Za-z0-9_]*\])*)$")


def unflatten_form(items: list[tuple[str, str]], max_depth: int = 32) -> dict:
    """``[("a", "1"), ("p[x]", "2"), ("l[]", "3"), ("l[]", "4")]`` → ``{"a": "1", "p": {"x": "2"},
    "l": ["3", "4"]}`` (the openai client's ``brackets`` encoding of nested objects and arrays).

    Raises RequestError for a malformed key, a key given twice or nested deeper than ``max_depth``.
    """
    out: dict = {}
    for key, value in items:
        m = _FORM_KEY.match(key) if len(key) <= 512 else None
        if not m:
            raise RequestError(f"malformed form field name {short_repr(key)}", param=key[:100])
        parts = [m.group(1)] + re.findall(r"\[([A-Za-z0-9_]*)\]", m.group(2))
        if len(parts) > max_depth:
            raise RequestError(f"form field {short_repr(key)} nests deeper than {max_depth} levels", param=key[:100])
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
        raise RequestError(
            f"invalid size {value!r}: expected 'WIDTHxHEIGHT' in pixels, e.g. '832x480', or 'auto'",
            param=param,
            code="invalid_size",
        )
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0:
        raise RequestError(
            f"invalid size {value!r}: width and height must be positive", param=param, code="invalid_size"
        )
    return w, h


# Bounds of the numeric request fields that no server setting bounds: far beyond any real request,
# tight enough that no value reaches code that would overflow on it.
MAX_SEED = 2**63 - 1
MAX_GUIDANCE = 100.0
MAX_SECONDS = 3600.0


#: limits of a request's ``cache_backend_config``: text length, object keys
MAX_CONFIG_TEXT = 2000
MAX_CONFIG_KEYS = 64


def _finite(**kw):
    return Field(default=None, allow_inf_nan=False, **kw)


class SkipSoftmaxBody(BaseModel):
    """``skip_softmax_params`` of a request. Semantic checks (required, > 0) are the runtime's;
    here only that the numbers are finite and bounded."""

    model_config = ConfigDict(extra="forbid")
    threshold_scale_factor: Optional[float] = _finite(le=1e6)
    start_step: Optional[int] = Field(default=None, ge=0, le=100000)

    @field_validator("threshold_scale_factor", "start_step", mode="before")
    @classmethod
    def _numbers_are_not_bools(cls, value):
        return _not_bool(value)

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


def _not_bool(value: Any) -> Any:
    """JSON ``true`` / ``false`` is no number (pydantic's lax mode would read ``"n": true`` as 1)."""
    if isinstance(value, bool):
        raise ValueError("expected a number, got a boolean")
    return value


class _Extras(BaseModel):
    """The ditattn extra body fields shared by images and videos."""

    model_config = ConfigDict(extra="forbid")

    @field_validator(
        "num_inference_steps",
        "guidance_scale",
        "guidance_scale_2",
        "flow_shift",
        "seed",
        "n",
        "num_frames",
        "fps",
        "seconds",
        "output_compression",
        "partial_images",
        "frame_count",
        "frame_duration_ms",
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _numbers_are_not_bools(cls, value):
        return _not_bool(value)

    negative_prompt: Optional[str] = Field(default=None, max_length=20000)
    num_inference_steps: Optional[int] = None  # the limit: the server's --max-steps
    guidance_scale: Optional[float] = _finite()
    guidance_scale_2: Optional[float] = _finite()
    lora: Optional[dict[str, float]] = Field(default=None, max_length=16)
    seed: Optional[int] = None  # the range: check_numbers
    attention_backend_override: Optional[str] = Field(default=None, max_length=64)
    skip_softmax_params: Optional[SkipSoftmaxBody] = None
    scheduler: Optional[str] = Field(default=None, max_length=32)
    flow_shift: Optional[float] = _finite()
    timesteps: Union[list[float], str, None] = None  # a list or "1000,750,500,250" (forms send text)
    cfg_interval: Union[list[float], str, None] = None  # [START, END] or "START:END"
    #: the request's step cache (none, teacache, magcache, first_block_cache) and its keys (k=v text or an object)
    cache_backend: Optional[str] = Field(default=None, max_length=64)
    cache_backend_config: Union[str, dict[str, Union[str, int, float, bool, None]], None] = None

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_scales_are_numbers(cls, value, info):
        """A JSON ``lora`` maps names to numbers: ``true`` or ``"0.5"`` is refused, not read as 1 / 0.5
        (pydantic's lax mode); a form body (context ``form``) carries every value as text."""
        if isinstance(value, dict) and not (info.context or {}).get("form"):
            for name, scale in value.items():
                if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                    raise ValueError(
                        f"the scale of {short_repr(name)} must be a number (adapter name -> scale, e.g. "
                        f'{{"style": 0.8}}), got {short_repr(scale)}'
                    )
        return value

    @field_validator("cache_backend_config", mode="after")
    @classmethod
    def _config_size(cls, value):
        """Text of at most :data:`MAX_CONFIG_TEXT` characters, or an object of at most
        :data:`MAX_CONFIG_KEYS` keys of at most 64 characters each."""
        if isinstance(value, str) and len(value) > MAX_CONFIG_TEXT:
            raise ValueError(f"at most {MAX_CONFIG_TEXT} characters of key=value text, got {len(value)}")
        if isinstance(value, dict):
            if len(value) > MAX_CONFIG_KEYS:
                raise ValueError(f"at most {MAX_CONFIG_KEYS} keys, got {len(value)}")
            long = next((k for k in value if len(k) > 64), None)
            if long is not None:
                raise ValueError(f"key {short_repr(long)} is longer than 64 characters")
        return value

    @classmethod
    def accepted_fields(cls) -> list[str]:
        return list(cls.model_fields)

    def sampling(self) -> dict:
        """The sampler fields the request gives (``scheduler``, ``flow_shift``, ``timesteps`` as a list,
        ``cfg_interval`` as ``[START, END]``), checked as the CLI's flags (400 naming the field)."""
        from ditattn.errors import AttentionConfigError
        from ditattn.runconfig import SamplingConfig

        out = {}
        for name in ("scheduler", "flow_shift", "timesteps", "cfg_interval"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                checked = getattr(SamplingConfig(**{name: value}), name)
            except AttentionConfigError as exc:
                raise RequestError(str(exc), param=name) from None
            out[name] = list(checked) if isinstance(checked, tuple) else checked
        return out

    def check_numbers(self, n: int = 1) -> None:
        """Range checks no server setting decides: guidance scales in [0, 100]; seed in [0, 2^63 - 1]
        with room for the ``n`` consecutive seeds of an image request."""
        for name in ("guidance_scale", "guidance_scale_2"):
            g = getattr(self, name)
            if g is not None and not (math.isfinite(g) and 0.0 <= g <= MAX_GUIDANCE):
                raise RequestError(
                    f"{name} must be a number from 0 to {MAX_GUIDANCE:g}, got {g!r} (above 1 "
                    f"enables classifier-free guidance; typical values are 3-8)",
                    param=name,
                )
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED - (n - 1):
            raise RequestError(
                f"seed must be an integer from 0 to {MAX_SEED - (n - 1)}"
                + (f" (image i of n={n} uses seed + i)" if n > 1 else "")
                + f", got {self.seed}",
                param="seed",
            )


# ------------------------------------------------------------------------------------------------
# images


class ImageGenerationRequest(_Extras):
    """``POST /v1/images/generations`` body (OpenAI images API + ditattn's extra fields).

    OpenAI fields that change nothing for a diffusion model (quality, style, user, …) are accepted
    and ignored; ones whose requested behaviour the server cannot give (streaming, partial images,
    non-PNG output, transparent background, SVG) are refused with a 400.
    """

    prompt: str = Field(min_length=1, max_length=20000)
    model: Optional[str] = Field(default=None, max_length=512)
    n: Optional[int] = None  # the limit: the server's --max-n
    size: Optional[str] = Field(default=None, max_length=64)
    response_format: Optional[Literal["b64_json", "url"]] = None
    # accepted and ignored
    quality: Optional[str] = Field(default=None, max_length=64)
    style: Optional[str] = Field(default=None, max_length=64)
    user: Optional[str] = Field(default=None, max_length=256)
    safety_identifier: Optional[str] = Field(default=None, max_length=256)
    moderation: Optional[str] = Field(default=None, max_length=64)
    output_compression: Optional[int] = Field(default=None, ge=0, le=100)
    complexity: Optional[str] = Field(default=None, max_length=64)
    # accepted only with the value the server can honour
    background: Optional[str] = Field(default=None, max_length=64)
    output_format: Optional[str] = Field(default=None, max_length=64)
    stream: Optional[bool] = None
    partial_images: Optional[int] = Field(default=None, ge=0, le=3)
    svg: Optional[Any] = None
    frame_count: Optional[int] = Field(default=None, ge=0, le=100000)
    frame_duration_ms: Optional[int] = Field(default=None, ge=0, le=10**7)

    def check_unsupported(self) -> None:
        if self.stream:
            raise RequestError("stream=true is not supported by this server; omit it", param="stream")
        if self.partial_images:
            raise RequestError("partial_images is not supported by this server (no streaming)", param="partial_images")
        if self.output_format not in (None, "png"):
            raise RequestError(
                f"output_format {self.output_format!r} is not supported; accepted: png", param="output_format"
            )
        if self.background not in (None, "auto", "opaque"):
            raise RequestError(
                f"background {self.background!r} is not supported; accepted: auto, opaque", param="background"
            )
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
    cache: Optional[dict] = None  # the step cache's report: backend, forwards computed / reused, trace


# ------------------------------------------------------------------------------------------------
# videos


class VideoCreateRequest(_Extras):
    """``POST /v1/videos`` body (OpenAI videos API + ditattn's extra fields + ``num_frames``, ``fps``).

    ``seconds`` is the OpenAI clip duration (a string in the client; any positive number here);
    ``num_frames`` wins over it. ``input_reference`` is the first frame of an image-to-video job
    (:mod:`ditattn.server.references`: a file upload, ``{"image_url": data URL}`` or base64).
    """

    prompt: str = Field(min_length=1, max_length=20000)
    model: Optional[str] = Field(default=None, max_length=512)
    seconds: Optional[Union[str, float]] = None
    size: Optional[str] = Field(default=None, max_length=64)
    num_frames: Optional[int] = None  # the limit: the server's --max-frames
    fps: Optional[int] = None  # the limit: the server's --max-fps
    input_reference: Optional[Any] = None
    user: Optional[str] = Field(default=None, max_length=256)

    def seconds_value(self) -> Optional[float]:
        """``seconds`` as a number (None when left out); 400 unless a finite number in (0, 3600]."""
        if self.seconds is None or (isinstance(self.seconds, str) and self.seconds.strip() == ""):
            return None
        shown = short_repr(self.seconds, 40)
        try:
            s = float(self.seconds)
        except (TypeError, ValueError, OverflowError):
            raise RequestError(
                f"invalid seconds {shown}: expected a positive number such as '4'", param="seconds"
            ) from None
        if not (math.isfinite(s) and 0 < s <= MAX_SECONDS):
            raise RequestError(
                f"invalid seconds {shown}: expected a number above 0 and at most {MAX_SECONDS:g}", param="seconds"
            )
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
    cache: Optional[dict] = None  # the step cache's report (completed jobs that ran one)


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
