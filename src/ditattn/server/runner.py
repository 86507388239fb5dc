"""Runners: what the server calls to validate attention settings and generate a batch.

:class:`BaseRunner` holds everything that does not depend on the pipeline: the model's defaults and
limits, the per-request attention validation (``prepare_request_override`` over the DiT modules)
and the report of which backend each DiT layer runs under the active request scope.
:class:`PipelineRunner` drives the native Wan pipeline (``ditattn.pipelines.wan``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Iterable, Optional, Sequence

import numpy as np
from torch import nn

from ditattn.attention.context import AttentionSettings, RequestState, current_request
from ditattn.attention.override import dit_layers, prepare_request_override, request_backends
from ditattn.errors import AttentionConfigError
from ditattn.platforms import use_platform

log = logging.getLogger("ditattn.server")


@dataclasses.dataclass
class ModelDefaults:
    """Defaults for fields a request leaves out, and the model's shape rules.

    size_multiple: width and height must be multiples of it (VAE stride × patch size);
    frame_step: frame counts must be ``1 + k * frame_step`` (VAE temporal stride); image_input:
    ``none`` (text-to-video), ``optional`` (TI2V) or ``required`` (image-to-video); two_experts: the
    checkpoint has a low-noise expert (``guidance_scale_2`` applies).
    """

    width: int = 832
    height: int = 480
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    fps: int = 16
    size_multiple: int = 16
    frame_step: int = 4
    image_input: str = "none"
    two_experts: bool = False


class BaseRunner:
    """Attention validation and reporting over ``dit_modules``; subclasses implement ``run_batch``.

    model_id: the id ``GET /v1/models`` lists; aliases: other accepted values of a request's
    ``model``; settings: the server's AttentionSettings (compile / CUDA graphs / ring degree feed the
    override rules); dtype: the DiT's compute dtype; platform: the platform the DiT runs on (None =
    the current one); default_override / default_skip_softmax: what a request that leaves those
    fields out gets (``ditattn serve --attention-backend-override`` / ``--skip-softmax-*``).
    """

    def __init__(
        self,
        model_id: str,
        dit_modules: Sequence[nn.Module],
        *,
        defaults: Optional[ModelDefaults] = None,
        settings: Optional[AttentionSettings] = None,
        dtype=None,
        aliases: Iterable[str] = (),
        platform=None,
        default_override: Optional[str] = None,
        default_skip_softmax: Optional[dict] = None,
    ):
        self.model_id = model_id
        self.aliases = {model_id, *aliases}
        self.dit_modules = list(dit_modules)
        self.defaults = defaults or ModelDefaults()
        self.settings = settings or AttentionSettings()
        self.dtype = dtype
        self.platform = platform
        self.default_override = default_override or None
        self.default_skip_softmax = default_skip_softmax
        self.default_negative_prompt: Optional[str] = None
        self._layers = dit_layers(self.dit_modules)

    def prepare(self, override: Optional[str], skip_softmax: Optional[dict]) -> RequestState:
        """Validate ``attention_backend_override`` / ``skip_softmax_params`` against every DiT layer,
        all or nothing; return the RequestState to run under (``override`` None when the server
        default runs). Fields left out (None) take the server's defaults. Raises
        AttentionConfigError with the reason (logged) on any refusal, including a backend this build
        has no implementation of."""
        if override is None or override == "":
            override = self.default_override
        if skip_softmax is None:
            skip_softmax = self.default_skip_softmax
        plat = use_platform(self.platform) if self.platform is not None else contextlib.nullcontext()
        try:
            with plat:
                return prepare_request_override(
                    self.dit_modules, override, self.settings, skip_softmax, self.dtype, layers=self._layers
                )
        except LookupError as exc:  # get_impl: backend known but not built
            msg = f"attention_backend_override '{override}' is refused: {exc}"
            log.warning("request refused: %s", msg)
            raise AttentionConfigError(msg) from None

    def default_backends(self) -> list[str]:
        """The DiT backend value(s) of the server default (no request override)."""
        return sorted({l.backend.value for l in self._layers})

    def active_backends(self) -> list[str]:
        """The DiT backend value(s) the layers run under the current request scope (what
        ``LocalAttention.forward`` will pick: the request table entry, else the layer's backend)."""
        return self.backends_for(current_request())

    def backends_for(self, state: Optional[RequestState]) -> list[str]:
        """The DiT backend value(s) a request prepared as ``state`` runs (layers with a required
        backend keep theirs under an override or skip softmax)."""
        return sorted(request_backends(self._layers, state))

    def request_stats(self) -> dict:
        """JSON-safe copy of the active request's statistics (e.g. skip-softmax tile counts)."""
        req = current_request()
        if req is None or not req.stats:
            return {}
        return _json_safe(req.stats)

    def run_batch(self, jobs) -> list:  # pragma: no cover - interface
        raise NotImplementedError


def _json_safe(x, depth: int = 0):
    if depth > 6:
        return str(x)
    if isinstance(x, dict):
        return {str(k): _json_safe(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v, depth + 1) for v in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, float):
        return x if np.isfinite(x) else str(x)
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return _json_safe(x.detach().cpu().tolist(), depth + 1)
    except Exception:  # pragma: no cover
        pass
    if isinstance(x, np.generic):
        return _json_safe(x.item(), depth + 1)
    return str(x)


class PipelineRunner(BaseRunner):
    """Runs batches on a :class:`ditattn.pipelines.wan.WanPipelineNative`.

    A batch's jobs share one signature (size, frames, steps, guidance, attention settings); their
    prompts, negative prompts and seeds (job seed + i for its i-th sample) are stacked into one
    pipeline call whose frames are split back per job. Each sample's noise comes from its own seed,
    so a sample does not depend on what it was batched with.
    """

    def __init__(
        self, pipe, model_id: str, *, aliases: Iterable[str] = (), default_override=None, default_skip_softmax=None
    ):
        d = pipe.defaults
        defaults = ModelDefaults(
            width=d["width"],
            height=d["height"],
            num_frames=d["num_frames"],
            num_inference_steps=d["num_inference_steps"],
            guidance_scale=d["guidance_scale"],
            size_multiple=pipe.size_multiple(),
            frame_step=pipe.vae_scale_temporal,
            image_input={"t2v": "none", "ti2v": "optional", "i2v": "required"}[pipe.mode],
            two_experts=pipe.boundary_ratio is not None,
        )
        super().__init__(
            model_id,
            pipe.dit_modules,
            defaults=defaults,
            settings=pipe.settings,
            dtype=pipe.dtype,
            aliases=aliases,
            platform=pipe.platform,
            default_override=default_override,
            default_skip_softmax=default_skip_softmax,
        )
        self.pipe = pipe
        params = inspect.signature(pipe.generate).parameters
        self._on_step, self._should_stop = "on_step" in params, "should_stop" in params
        self._cache = "cache_setting" in params

    def prepare_cache(self, backend, config):
        """A request's step cache (:class:`~ditattn.cache.CacheSetting` or None), checked against the model;
        both None: the server's default (``serve --cache-backend``)."""
        return self.pipe.prepare_cache(backend, config)

    def default_backends(self) -> list[str]:
        return list(self.pipe.dit_backends())

    def check_lora(self, lora: Optional[dict]) -> Optional[tuple]:
        """A request's ``lora`` (adapter name -> scale) as the job's sorted ``((name, scale), ...)``, or
        None for the defaults; raises :class:`~ditattn.models.lora.LoRAError` naming what is wrong."""
        from ditattn.models.lora import resolve_request_lora

        scales = resolve_request_lora(lora, self.pipe.adapters)
        return None if scales is None else tuple(sorted(scales.items()))

    #: the server's sampler settings (serve --scheduler ...), the defaults of requests that leave them out
    default_sampling: dict = {}

    def sampling_for(self, job) -> dict:
        """The sampler keyword arguments of ``job``'s pipeline call: its fields over the server's defaults."""
        out = dict(self.default_sampling)
        out.update(
            {
                k: getattr(job, k)
                for k in ("scheduler", "flow_shift", "timesteps", "cfg_interval")
                if getattr(job, k, None) is not None
            }
        )
        return out

    def check_sampling(self, sampling: dict) -> None:
        """Raise :class:`AttentionConfigError` unless the sampler settings (over the server's defaults)
        build on this model's scheduler (explicit timesteps within its training range, a scheduler
        that takes them)."""
        from ditattn.pipelines.sampling import build_sampler

        s = {**self.default_sampling, **sampling}
        build_sampler(
            self.pipe.components["scheduler"],
            name=s.get("scheduler"),
            shift=s.get("flow_shift"),
            steps=1,
            timesteps=s.get("timesteps"),
        )

    def adapters(self) -> list[dict]:
        """The loaded LoRA adapters (name, component, default scale, fused)."""
        return [
            {"name": a.name, "component": a.component, "scale": a.scale, "fused": a.fused} for a in self.pipe.adapters
        ]

    def run_batch(self, jobs) -> list:
        """One pipeline call for ``jobs``; it stops at the next denoising step, or between the frames
        the VAE decodes, once every job must (cancelled, timed out, shutdown:
        :func:`~ditattn.server.jobs.batch_stop_reason`); a shutdown that comes once every denoising
        step ran lets the decode finish, so that the finished clip is kept."""
        from ditattn.server.jobs import SHUTDOWN, GenerationResult, batch_stop_reason

        head = jobs[0]
        prompts, negatives, seeds = [], [], []
        for j in jobs:
            for i in range(j.n):
                prompts.append(j.prompt)
                negatives.append(j.negative_prompt or "")
                seeds.append(j.seed + i)
        kw = {}
        if self._on_step:  # once every step ran, a shutdown lets the decode finish (the frames are kept)

            def on_step(done: int, total: int) -> None:
                for j in jobs:
                    j.denoised = done >= total
                for j in jobs:
                    if j.on_progress is not None:
                        j.on_progress(j, done / max(total, 1))

            kw["on_step"] = on_step
        if self._should_stop:

            def should_stop():
                reason = batch_stop_reason(jobs)
                return None if reason == SHUTDOWN and all(j.denoised for j in jobs) else reason

            kw["should_stop"] = should_stop
        if head.image is not None:  # one first frame per sample
            kw["image"] = [j.image for j in jobs for _ in range(j.n)]
        if head.lora is not None:
            kw["lora"] = dict(head.lora)
        kw.update(self.sampling_for(head))
        if self._cache:  # the job's own step cache (request-scoped state inside the call)
            kw.update(cache_setting=head.cache) if head.cache is not None else kw.update(cache_backend="none")
        res = self.pipe.generate(
            prompts,
            negatives,
            height=head.height,
            width=head.width,
            num_frames=head.num_frames,
            num_inference_steps=head.num_inference_steps,
            guidance_scale=head.guidance_scale,
            guidance_scale_2=head.guidance_scale_2,
            seed=seeds,
            request_state=current_request() or head.state,
            progress=False,
            **kw,
        )
        frames = np.asarray(res.frames)
        stats = _json_safe(res.stats) if res.stats else {}
        out, k = [], 0
        for j in jobs:
            out.append(
                GenerationResult(
                    frames=frames[k : k + j.n],
                    attention_backends=list(res.attention_backends),
                    stats=stats,
                    seconds=float(res.timings.get("total", 0.0)),
                    cache=getattr(res, "cache", None),
                )
            )
            k += j.n
        return out


def build_runner(config) -> PipelineRunner:
    """Load the pipeline of ``config`` (a :class:`~ditattn.runconfig.RunConfig`: model, attention
    and parallel sections) and validate the server-wide request defaults (its sampling section and
    attention override / skip softmax); raises AttentionConfigError on bad input."""
    import os

    from ditattn.distributed.launch import in_worker
    from ditattn.pipelines.wan import WanPipelineNative

    if config.model.backend != "native":
        raise AttentionConfigError(
            "ditattn serve runs the native pipeline only (per-request attention overrides "
            "need ditattn's attention layers); drop --backend diffusers"
        )
    config.parallel.degrees()
    n = config.parallel.num_gpus
    if n > 1 and not in_worker():  # ranks started by ditattn.distributed.launch relay rank 0's calls
        raise AttentionConfigError(
            f"sequence parallelism (--num-gpus {n}) needs one process per rank: start "
            f"it with ditattn serve (ditattn.distributed.launch), or use --num-gpus 1"
        )
    pipe = WanPipelineNative.from_config(config, lora_fuse=False)  # unfused: requests may set the scales
    name = pipe.model_index.name
    aliases = {name, config.model.model_path or name}
    if not name.startswith("ditattn:"):
        aliases.add(os.path.basename(os.path.normpath(name)))
    runner = PipelineRunner(
        pipe,
        name,
        aliases=aliases,
        default_override=config.attention.attention_backend_override,
        default_skip_softmax=config.attention.skip_softmax(),
    )
    # sampling settings given to `serve` become the defaults of requests that leave those fields out
    d, s = runner.defaults, config.sampling
    for field in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale"):
        if getattr(s, field) is not None:
            setattr(d, field, getattr(s, field))
    pipe.check_size(d.height, d.width, d.num_frames)
    runner.default_negative_prompt = s.negative_prompt
    runner.default_sampling = {
        k: getattr(s, k)
        for k in ("scheduler", "flow_shift", "timesteps", "cfg_interval", "cfg_batching")
        if getattr(s, k) is not None
    }
    runner.check_sampling({})  # the server-wide sampler settings must themselves be valid
    runner.prepare(None, None)  # the server-wide attention defaults must themselves be valid
    return runner


def _follow(rank, cfg) -> int:
    """Ranks 1..N-1 of a replica's sequence-parallel group: the same pipeline, replaying rank 0's
    calls until the replica stops (as ``ditattn serve --num-gpus N`` does on one host)."""
    from ditattn.distributed.relay import PipelineRelay
    from ditattn.pipelines.wan import WanPipelineNative

    relay = PipelineRelay()  # collective: created in the same order as on rank 0
    relay.follow(WanPipelineNative.from_config(cfg.for_rank(rank.rank, rank.device)))
    return 0


def open_runner(cfg, stack: contextlib.ExitStack):
    """The runner of one replica.  With ``--num-gpus N`` > 1 this process becomes rank 0 of the
    replica's own sequence-parallel group: ranks 1..N-1 are spawned on the replica's other GPUs (gloo
    processes on the CPU), every pipeline call is relayed to them, and ``stack`` (closed when the
    replica stops) stops them.  Under Ray the replica's GPUs are the ones it was given
    (``CUDA_VISIBLE_DEVICES``)."""
    n = cfg.parallel.num_gpus
    if n <= 1:
        return build_runner(cfg)
    import torch

    from ditattn import settings
    from ditattn.distributed.launch import lead_ranks
    from ditattn.distributed.relay import PipelineRelay
    from ditattn.pipelines.wan import WanPipelineNative

    u, r = cfg.parallel.degrees()
    device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank = stack.enter_context(
        lead_ranks(
            _follow,
            n,
            args=(cfg,),
            device=device,
            ulysses_degree=u,
            ring_degree=r,
            cfg_degree=cfg.parallel.cfg_degree(),
            timeout_s=settings.dist_timeout_s(),
        )
    )
    relay = PipelineRelay()
    stack.enter_context(relay.leading(WanPipelineNative))
    return build_runner(cfg.for_rank(0, rank.device))
