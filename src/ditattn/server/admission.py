"""Admission control: the checks a generation request passes before it becomes a job.

:class:`RequestChecks` checks a request against the served model (the runner's ``defaults``,
``aliases`` and ``check_lora``) and the server's limits (:class:`~ditattn.runconfig.ServerConfig`):
model name, size, steps, output pixels, skip-softmax start step, the first frame of an
image-to-video request and LoRA scales; :meth:`RequestChecks.request_params` turns a checked request
into the JSON-safe fields its job is built from.  Every refusal is a
:class:`~ditattn.server.protocol.RequestError` (400 naming the field, 404 for an unknown model).
"""

from __future__ import annotations

import secrets
from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import ServerConfig
from ditattn.server.protocol import RequestError, parse_size

DEFAULT_OUTPUT_CAP = 1280 * 720 * 81  # the largest output of a Wan 2.x checkpoint (720p, 81 frames)


def inline_cache_config(value) -> Optional[dict]:
    """A request's ``cache_backend_config`` (``k=v`` text or an object) as a dict; None when absent.  Inline
    only: no file is read on a request's word (text naming one, and a non-empty ``calibration``, are 400s).
    String values of an object are read as ``k=v`` values are (``"0.1"`` -> 0.1, ``"true"`` -> True), so a
    form's nested fields and a JSON object mean the same."""
    from ditattn.attention.config import parse_scalar
    from ditattn.cache.config import parse_cache_backend_config

    if value is None:
        return None
    param = "cache_backend_config"
    if isinstance(value, dict):
        raw = {k: parse_scalar(v) if isinstance(v, str) else v for k, v in value.items()}
    else:
        try:
            raw = parse_cache_backend_config(value, files=False)
        except AttentionConfigError as exc:
            raise RequestError(f"{param}: {exc}", param=param, code="invalid_cache") from None
    if raw.get("calibration"):
        raise RequestError(
            f"{param}: calibration files are not read from requests (got calibration={raw['calibration']!r:.80}); "
            "a request uses the calibration the server was started with (ditattn serve --cache-backend-config "
            "calibration=FILE) or the one shipped with the model; accepted: leave calibration out",
            param=param,
            code="invalid_cache",
        )
    return raw


class RequestChecks:
    """The request checks of :class:`~ditattn.server.state.ServerState`, which provides ``runner``
    (the served model) and ``config`` (the server's limits)."""

    runner: object  # ditattn.server.runner.PipelineRunner or any object with its attributes
    config: ServerConfig

    def check_model(self, model: Optional[str]) -> str:
        """The served model's id for a request's ``model`` (None / '' = the served one); 404 otherwise."""
        if model is None or model == "":
            return self.runner.model_id
        if model not in self.runner.aliases:
            raise RequestError(
                f"The model '{model[:200]}' does not exist on this server; available: {self.runner.model_id}",
                status=404,
                param="model",
                code="model_not_found",
            )
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
        if w > c.max_side or h > c.max_side or w * h > c.max_pixels:
            raise RequestError(
                f"invalid size '{w}x{h}': at most {c.max_side} pixels per side (the server's "
                f"--max-side) and {c.max_pixels} pixels in total (--max-pixels)",
                param="size",
                code="limit_exceeded",
            )
        m = d.size_multiple
        if w % m or h % m:
            raise RequestError(
                f"invalid size '{w}x{h}': width and height must be multiples of {m} for this model",
                param="size",
                code="invalid_size",
            )
        return w, h

    def check_steps(self, steps: Optional[int]) -> int:
        if steps is None:
            steps = self.runner.defaults.num_inference_steps
        if not 1 <= steps <= self.config.max_steps:
            raise RequestError(
                f"num_inference_steps must be between 1 and {self.config.max_steps} (the server's "
                f"--max-steps), got {steps}",
                param="num_inference_steps",
                code="limit_exceeded",
            )
        return steps

    @property
    def max_output_pixels(self) -> int:
        """``--max-output-pixels``, or 16 × the model's default output (width × height × frames), at
        most a 720p 81-frame clip (1280 × 720 × 81)."""
        if self.config.max_output_pixels is not None:
            return self.config.max_output_pixels
        d = self.runner.defaults
        return min(DEFAULT_OUTPUT_CAP, 16 * d.width * d.height * d.num_frames)

    def check_output_size(self, width: int, height: int, frames: int, n: int) -> None:
        """width × height × frames × n within ``--max-output-pixels`` (400 naming it)."""
        total, limit = width * height * frames * n, self.max_output_pixels
        if total > limit:
            raise RequestError(
                f"this request asks for {width}x{height} x {frames} frame(s) x n={n} = {total} output "
                f"pixels; the server's limit (--max-output-pixels) is {limit}",
                param="size",
                code="limit_exceeded",
            )

    def check_skip_softmax(self, skip: Optional[dict]) -> None:
        if skip and skip.get("start_step") is not None and skip["start_step"] > self.config.max_steps:
            raise RequestError(
                f"skip_softmax_params.start_step must be at most {self.config.max_steps} (the "
                f"server's --max-steps), got {skip['start_step']}",
                param="skip_softmax_params",
            )

    def check_image(self, input_reference) -> Optional[object]:
        """The first frame of a request (a PIL image) or None; 400 when the model takes no image, needs
        one that is missing, or the image is unusable."""
        mode = getattr(self.runner.defaults, "image_input", "none")
        if input_reference is None:
            if mode == "required":
                raise RequestError(
                    "this model is image-to-video: input_reference (the first frame) is required; "
                    "send it with POST /v1/videos",
                    param="input_reference",
                    code="missing_input_reference",
                )
            return None
        if mode == "none":
            raise RequestError(
                "input_reference (image-to-video) is not supported: this server runs a text-to-video model",
                param="input_reference",
            )
        from ditattn.server.references import reference_image

        return reference_image(
            input_reference, max_bytes=self.config.max_image_bytes, max_pixels=self.config.max_image_pixels
        )

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

    def check_cache(self, req, steps: Optional[int] = None) -> dict:
        """A request's ``cache_backend`` / ``cache_backend_config`` checked against the model (400 naming the
        field with the reason), as the JSON-safe params that build its job (absent: the server's default)."""
        backend, config = req.cache_backend, inline_cache_config(req.cache_backend_config)
        prepare = getattr(self.runner, "prepare_cache", None)
        if backend is None and config is None:
            default = prepare(None, None) if prepare is not None else None
            if default is not None and steps is not None:  # the server's cache may not fit this request's steps
                try:
                    default.check_steps(steps)
                except AttentionConfigError as exc:
                    raise RequestError(
                        f"{steps} steps do not fit the server's step cache (serve --cache-backend "
                        f"{default.describe()}): {exc}; send more steps, or cache_backend none",
                        param="num_inference_steps",
                        code="invalid_cache",
                    ) from None
            return {}
        if prepare is None:
            raise RequestError("cache_backend is not supported by this server", param="cache_backend")
        try:
            setting = prepare(backend, config)
            if setting is not None and steps is not None:
                setting.check_steps(steps)
        except AttentionConfigError as exc:
            raise RequestError(str(exc), param=getattr(exc, "field", "cache_backend"), code="invalid_cache") from None
        return {"cache_backend": backend, "cache_backend_config": config}

    def request_params(
        self, req, *, kind: str, width: int, height: int, num_frames: int, steps: int, fps: int
    ) -> dict:
        """The validated request as the JSON-safe fields that build its job (the server's defaults
        for those it leaves out, a random seed when it has none); 400 when an image request reaches
        an image-to-video model, ``guidance_scale_2`` a one-expert model, or ``lora`` an unknown or
        fused adapter.  The first frame of an image-to-video job is not among them (see
        :meth:`~ditattn.server.state.ServerState.make_job`)."""
        d = self.runner.defaults
        if kind == "image" and getattr(d, "image_input", "none") == "required":
            raise RequestError(
                "this model is image-to-video: images need a first frame; use POST /v1/videos with input_reference",
                param="model",
            )
        if req.guidance_scale_2 is not None and not getattr(d, "two_experts", False):
            raise RequestError(
                "guidance_scale_2 applies to two-expert models (Wan 2.2 A14B); this model has one transformer",
                param="guidance_scale_2",
            )
        g1 = d.guidance_scale if req.guidance_scale is None else req.guidance_scale
        if req.guidance_scale_2 is not None and g1 <= 1.0 < req.guidance_scale_2:
            raise RequestError(
                f"guidance_scale_2 {req.guidance_scale_2:g} would have no effect: classifier-free guidance is on only "
                f"when guidance_scale (here {g1:g}) is above 1; send guidance_scale above 1 with it",
                param="guidance_scale_2",
            )
        lora = self.check_lora(req.lora)
        sampling = self.check_sampling(req.sampling())
        skip = req.skip_softmax_params.as_dict() if req.skip_softmax_params is not None else None
        self.check_skip_softmax(skip)
        return dict(
            prompt=req.prompt,
            width=width,
            height=height,
            num_frames=num_frames,
            num_inference_steps=steps,
            fps=fps,
            negative_prompt=req.negative_prompt
            if req.negative_prompt is not None
            else getattr(self.runner, "default_negative_prompt", None),
            guidance_scale=d.guidance_scale if req.guidance_scale is None else req.guidance_scale,
            guidance_scale_2=req.guidance_scale_2,
            lora=None if lora is None else [list(x) for x in lora],
            seed=secrets.randbelow(2**31) if req.seed is None else req.seed,
            override=req.attention_backend_override,
            skip_softmax=skip,
            **sampling,
            **self.check_cache(req, len(sampling["timesteps"]) if sampling.get("timesteps") else steps),
        )

    def check_sampling(self, sampling: dict) -> dict:
        """A request's checked sampler fields (:meth:`~ditattn.server.protocol._Extras.sampling`) against
        the server's --max-steps and the model's scheduler (400 naming the field)."""
        ts = sampling.get("timesteps")
        if ts is not None and len(ts) > self.config.max_steps:
            raise RequestError(
                f"timesteps has {len(ts)} entries; at most {self.config.max_steps} (the server's --max-steps)",
                param="timesteps",
                code="limit_exceeded",
            )
        check = getattr(self.runner, "check_sampling", None)
        if sampling and check is not None:
            try:
                check(sampling)
            except AttentionConfigError as exc:
                msg = str(exc)
                field = next((f for f in ("timesteps", "flow-shift", "flow_shift") if f in msg), "scheduler")
                raise RequestError(msg, param=field.replace("-", "_")) from None
        return sampling
