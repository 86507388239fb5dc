"""The native Wan 2.1 / 2.2 pipeline: text-to-video, image-to-video (Wan 2.1 I2V, Wan 2.2 I2V-A14B)
and text-image-to-video (Wan 2.2 TI2V-5B).

:class:`WanPipelineNative` loads a diffusers-format Wan folder (or a built-in ``ditattn:`` model,
:mod:`ditattn.models.builtin`), constructs every component inside its attention scope so that the run's
:class:`~ditattn.attention.context.AttentionSettings` (global backend, component / role overrides,
backend config) resolve each attention layer once, and checks the overrides afterwards (unknown
component, fixed-attention component, unused override → :class:`AttentionConfigError`).

Components: ``text_encoder`` (native UMT5, selectable, bias-needing), ``transformer`` and the
optional ``transformer_2`` (native Wan DiT, selectable; the Wan 2.2 low-noise expert runs below
``boundary_ratio * num_train_timesteps``), ``vae`` (diffusers ``AutoencoderKLWan``: fixed
attention, not selectable), ``scheduler`` (the diffusers class named in the checkpoint),
``tokenizer``; image-to-video checkpoints with CLIP conditioning add ``image_encoder`` (native CLIP
vision tower, selectable) and ``image_processor``.  How an image conditions each layout:
:mod:`ditattn.pipelines.conditioning`; a call's inputs, scope and result:
:mod:`ditattn.pipelines.generation`; the denoise loop: :mod:`ditattn.pipelines.denoise`; latents
and size rules: :mod:`ditattn.pipelines.latents`.

Python use (one object serves many requests; calls may run concurrently from several threads)::

    from ditattn.pipelines.wan import WanPipelineNative
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", settings=None, device="cpu", dtype=torch.float32)
    frames = pipe(["a cat", "a dog"], seed=[1, 2])        # uint8 [2, F, H, W, 3]
    res = pipe.generate("a cat", override="torch_sdpa")   # GenerationResult (frames, backends, timings)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from ditattn.attention.context import (
    AttentionSettings,
    ComponentScope,
    RequestState,
)
from ditattn.attention.names import ROLES
from ditattn.attention.override import dit_layers, request_backends
from ditattn.attention.sparse import fallback as sparse_run
from ditattn.errors import AttentionConfigError, GenerationCancelled
from ditattn.models.lora import Adapter, resolve_request_lora
from ditattn.pipelines.conditioning import conditioning_mode, image_condition
from ditattn.pipelines.denoise import denoise
from ditattn.pipelines.generation import (
    GenerationResult,
    cache_report,
    cfg_split,
    check_finite,
    generation_run,
    resolve_inputs,
)
from ditattn.pipelines.latents import VideoGeometry, decode_latents, prepare_latents
from ditattn.pipelines.loading import DIT
from ditattn.pipelines.model_index import ModelIndex
from ditattn.pipelines.offload import ComponentPlacement
from ditattn.pipelines.plan import build_plan, dit_backends
from ditattn.pipelines.sampling import build_sampler, cfg_mode, forwards, guided_steps, resolve_cfg_batching
from ditattn.pipelines.text import encode_prompts
from ditattn.platforms import Platform, use_platform
from ditattn.runconfig import SamplingConfig

log = logging.getLogger("ditattn.pipeline")

# Sampling defaults: each built-in model has its own (ditattn.models.builtin); real checkpoints default
# to the Wan 2.1 reference settings (diffusers' defaults).
CHECKPOINT_DEFAULTS = dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0)
MAX_SEQUENCE_LENGTH = 512  # text tokens the DiT cross-attends to (Wan's context length)

SELECTABLE = ("text_encoder", "image_encoder", "transformer", "transformer_2")
FIXED = ("vae",)


class WanPipelineNative:
    """Native Wan text-to-video pipeline; build it with :meth:`from_pretrained`.

    Attributes: ``model_index`` (:class:`ModelIndex`), ``components`` (name -> module/object),
    ``scopes`` (component -> :class:`ComponentScope` with the attention decisions), ``settings``,
    ``platform``, ``device``, ``dtype``, ``defaults`` (sampling defaults of this model), ``adapters``
    (the loaded LoRAs), ``placement`` (where components live between uses: offload).
    """

    def __init__(
        self,
        model_index: ModelIndex,
        components: dict[str, Any],
        scopes: dict[str, ComponentScope],
        settings: AttentionSettings,
        platform: Platform,
        device: torch.device,
        dtype: torch.dtype,
        load_weights: bool,
        *,
        placement: Optional[ComponentPlacement] = None,
        adapters: Sequence[Adapter] = (),
    ):
        self.model_index = model_index
        self.components = components
        self.scopes = scopes
        self.settings = settings
        self.platform = platform
        self.device = device
        self.dtype = dtype
        self.loaded = load_weights
        self.placement = placement or ComponentPlacement(components, device)
        self.adapters = list(adapters)
        #: the default step cache of every call (a :class:`~ditattn.cache.runtime.CacheSetting`) or None
        self.cache_setting = None
        self._offload_lock = threading.Lock()  # offloaded components move: one generation at a time
        # diffusers' AutoencoderKLWan keeps its causal-conv feature cache on the module: one encode or decode
        # at a time, or concurrent calls (threads of a server or a user) corrupt each other's frames
        self._vae_lock = threading.Lock()
        self.vae_parallel = False  # decode's tiles spread over the ranks (from_pretrained(vae_parallel=True))
        self.defaults = dict(model_index.builtin_defaults or CHECKPOINT_DEFAULTS)
        self.boundary_ratio = model_index.config.get("boundary_ratio")
        self.expand_timesteps = bool(model_index.config.get("expand_timesteps") or False)
        vae_cfg = {}
        if os.path.isfile(os.path.join(model_index.folder("vae"), "config.json")):
            from ditattn.models.weights import read_json

            vae_cfg = read_json(os.path.join(model_index.folder("vae"), "config.json"))
        ref = components.get("transformer") or components.get("transformer_2")
        #: VAE compression, latent channels and the DiT's patch: the size rules (latents.py)
        self.geometry = VideoGeometry.from_configs(vae_cfg, dataclasses.asdict(ref.config), self.expand_timesteps)
        g = self.geometry
        self.vae_scale_temporal, self.vae_scale_spatial, self.z_dim = g.temporal, g.spatial, g.z_dim
        #: ``t2v``, ``i2v`` (an image is required) or ``ti2v`` (an image is optional); see conditioning.py
        self.mode = conditioning_mode(g.in_channels, g.z_dim, self.expand_timesteps, g.temporal)
        self.image_embeds = ref.config.has_image_input  # Wan 2.1 I2V: CLIP image tokens
        if self.image_embeds and not {"image_encoder", "image_processor"} <= set(model_index.components):
            raise AttentionConfigError(
                f"{model_index.path}: the transformer takes CLIP image tokens (image_dim) but "
                "model_index.json lacks image_encoder / image_processor"
            )

    # ------------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_pretrained(
        cls,
        path: Optional[str] = None,
        settings: Optional[AttentionSettings] = None,
        device: "str | torch.device | None" = None,
        dtype: "str | torch.dtype | None" = None,
        *,
        variant: Optional[str] = None,
        load_weights: bool = True,
        revision: Optional[str] = None,
        local_files_only: bool = False,
        cache_dir: Optional[str] = None,
        offload: str = "none",
        offload_group_blocks: int = 1,
        vae_tiling: bool = False,
        vae_slicing: bool = False,
        lora: Sequence = (),
        lora_fuse: bool = False,
        dit_quantization: str = "none",
        dit_weights: "str | dict | None" = None,
        vae_parallel: bool = False,
        cache_backend: Optional[str] = None,
        cache_backend_config: "str | dict | None" = None,
    ) -> "WanPipelineNative":
        """Load the pipeline at ``path`` (a local diffusers-format Wan folder, a Hugging Face repo id
        ``org/name`` at ``revision`` — see :func:`~ditattn.pipelines.model_index.resolve_model_path`
        for ``local_files_only`` and ``cache_dir`` — or a built-in ``ditattn:`` model;
        None = the default built-in model) on ``device`` in compute ``dtype``
        (None = float32 on CPU, bfloat16 on accelerators; the VAE always decodes in float32).

        Every component is constructed inside its attention scope under ``settings`` (None = all
        automatic).  ``load_weights=False`` only resolves the attention plan (models on the meta
        device, no VAE): enough for :meth:`plan`.

        Memory: ``offload`` (``none``, ``text_encoder``, ``model``, ``group``: see
        :mod:`ditattn.pipelines.offload`; ``offload_group_blocks`` DiT blocks per streamed group),
        ``vae_tiling`` / ``vae_slicing`` (diffusers' tiled / per-sample VAE encode and decode).
        LoRA: ``lora`` is a list of ``[COMPONENT=]PATH[:SCALE]`` specs (or :class:`~ditattn.models.lora.
        LoRASpec`) loaded into the DiT, fused into the weights with ``lora_fuse`` or kept apart (then a
        request's ``lora=`` scales can change them).  Raises :class:`AttentionConfigError` for a bad
        path, an unsupported checkpoint, a refused backend or override, unused config keys, a bad
        LoRA or offload setting.

        dit_quantization: ``none`` (default), ``fp8`` or ``int8`` — the DiT's linears quantized by
        torchao once at load time (:mod:`ditattn.models.quantization`; refused with the reason
        when the platform, dtype or torchao cannot run it).  dit_weights: a ``.safetensors`` file
        holding the DiT's weights instead of the folder's (diffusers or original Wan key names,
        bf16/fp16/fp32 or FP8/INT8 with scales: :mod:`ditattn.models.wan.checkpoint`), or
        ``{component: file}`` for a model with two DiTs.

        vae_parallel: decode in the VAE's tiles spread over the ranks of the ``torch.distributed``
        job this process is one rank of (every rank gets the frames one device gets with
        ``vae_tiling``); refused outside such a job.
        cache_backend / cache_backend_config: the step cache every call uses unless it asks for
        another (``none``, ``teacache``, ``magcache``, ``first_block_cache`` and their keys:
        :mod:`ditattn.cache`; refused with the reason when this model cannot take it).
        """
        from ditattn.pipelines.construction import load_components

        c = load_components(
            path,
            settings or AttentionSettings(),
            device,
            dtype,
            variant=variant,
            load_weights=load_weights,
            revision=revision,
            local_files_only=local_files_only,
            cache_dir=cache_dir,
            offload=offload,
            offload_group_blocks=offload_group_blocks,
            vae_tiling=vae_tiling,
            vae_slicing=vae_slicing,
            lora=lora,
            lora_fuse=lora_fuse,
            dit_quantization=dit_quantization,
            dit_weights=dit_weights,
            vae_parallel=vae_parallel,
        )
        pipe = cls(
            c.model_index,
            c.components,
            c.scopes,
            c.settings,
            c.platform,
            c.device,
            c.dtype,
            load_weights,
            placement=c.placement,
            adapters=c.adapters,
        )
        pipe.vae_parallel = bool(vae_parallel)
        pipe.cache_setting = pipe.prepare_cache(cache_backend, cache_backend_config)
        return pipe

    @classmethod
    def from_config(
        cls, config, *, load_weights: bool = True, cache_dir: Optional[str] = None, lora_fuse: Optional[bool] = None
    ) -> "WanPipelineNative":
        """The pipeline of a :class:`~ditattn.runconfig.RunConfig` (the object ``ditattn generate``
        builds from its flags and ``--config``): its model section (path, device, dtype, variant,
        revision, compile, offload, VAE tiling / slicing and LoRA settings) and its attention settings
        (``cache_dir``: a Hugging Face cache instead of ``HF_HOME``'s; ``lora_fuse``: the command's
        default when the config leaves it unset).  Sample with ``generate(**config.generate_kwargs())``."""
        from ditattn.pipelines.construction import pretrained_kwargs

        return cls.from_pretrained(
            **pretrained_kwargs(config, load_weights=load_weights, cache_dir=cache_dir, lora_fuse=lora_fuse)
        )

    # ------------------------------------------------------------------------------------------
    # plan

    def plan(self) -> dict:
        """The attention plan: ``{"platform": {...}, "components": [{"name",
        "selectable", "layers": [{"prefix", "role", "backend", "source", "fallback_reason"}]}], "cache"}``;
        after a run, sparse layers also carry ``"sparse_run"`` (calls, mean kept fraction, dense fallbacks,
        heads run dense by the error budget) and the plan the run's totals and ``"dense_notes"``."""
        plan = sparse_run.annotate_plan(
            build_plan(self.platform, self.scopes, self.linear_quantization()), getattr(self, "_sparse_run", {})
        )
        plan["cache"] = self.cache_setting.to_dict() if self.cache_setting is not None else None
        return plan

    def linear_quantization(self) -> dict:
        """``{DiT component: QuantizationPlan}``: which linears ``--dit-quantization`` quantized (or,
        built without weights, would quantize) and why the others stay."""
        return {
            c: self.components[c].linear_quantization
            for c in DIT
            if getattr(self.components.get(c), "linear_quantization", None) is not None
        }

    def quantization_summary(self) -> Optional[str]:
        """``"fp8 (240 of 306 linears)"`` (Wan2.1-1.3B) for a quantized DiT (several DiTs: summed), else None."""
        from ditattn.models.quantization import summary

        return summary(self.linear_quantization().values())

    @property
    def dit_modules(self) -> list[torch.nn.Module]:
        return [self.components[c] for c in DIT if self.components.get(c) is not None]

    def dit_backends(self) -> list[str]:
        """The backends the DiT layers were built with (self-attention first; a per-call fallback
        once a call has used it), without duplicates."""
        return dit_backends(self.scopes)

    # ------------------------------------------------------------------------------------------
    # generation

    def prepare_request(self, override=None, skip_softmax=None) -> Optional[RequestState]:
        """Validate a request's ``attention_backend_override`` / ``skip_softmax`` against the DiT
        and return the prepared state (None when neither is given). Raises
        :class:`AttentionConfigError` with the reason; nothing changes on refusal."""
        if override in (None, "") and skip_softmax is None:
            return None
        from ditattn.attention.override import prepare_request_override

        with use_platform(self.platform):
            return prepare_request_override(
                self.dit_modules, override, self.settings, skip_softmax=skip_softmax, dtype=self.dtype
            )

    def prepare_cache(self, cache_backend=None, cache_backend_config=None):
        """The :class:`~ditattn.cache.runtime.CacheSetting` of a call's ``cache_backend`` /
        ``cache_backend_config`` (both None: the pipeline's default; ``"none"``: no cache), checked against
        this model; raises :class:`AttentionConfigError` with the reason."""
        from ditattn.cache.config import call_cache

        ref = self.components.get("transformer") or self.components.get("transformer_2")
        return call_cache(
            self.cache_setting,
            cache_backend,
            cache_backend_config,
            model=self.model_index.name,
            num_blocks=len(ref.blocks),
        )

    def check_size(self, height: int, width: int, num_frames: int) -> None:
        """Raise :class:`AttentionConfigError` unless the size is one this model can generate."""
        self.geometry.check_size(height, width, num_frames)

    def size_multiple(self) -> int:
        """Heights and widths must be multiples of this (VAE stride x patch size)."""
        return self.geometry.size_multiple

    def __call__(self, prompt, negative_prompt=None, **kw):
        """Same arguments as :meth:`generate`; returns only the frames (uint8 ``[N, F, H, W, 3]``)."""
        return self.generate(prompt, negative_prompt, **kw).frames

    @torch.inference_mode()
    def generate(
        self,
        prompt: Union[str, Sequence[str]],
        negative_prompt: Union[str, Sequence[str], None] = None,
        *,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_frames: Optional[int] = None,
        num_inference_steps: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        guidance_scale_2: Optional[float] = None,
        seed: Union[int, Sequence[int], None] = 0,
        scheduler: Optional[str] = None,
        flow_shift: Optional[float] = None,
        timesteps: Optional[Sequence[float]] = None,
        cfg_interval=None,
        cfg_batching: Optional[str] = None,
        image=None,
        lora: Optional[dict] = None,
        override: Optional[str] = None,
        skip_softmax=None,
        request_state: Optional[RequestState] = None,
        cache_backend: Optional[str] = None,
        cache_backend_config=None,
        cache_setting=None,
        max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        latents: Optional[torch.Tensor] = None,
        output_type: str = "uint8",
        progress: bool = True,
        on_step=None,
        should_stop=None,
    ) -> GenerationResult:
        """Generate one clip per prompt.

        prompt: a string or a list of N strings (one batch); negative_prompt: None, a string for
        all, or N strings. height/width: pixels (multiples of 16), num_frames: 1 + 4k (1 = image);
        None takes :attr:`defaults` (with an image and neither given: the default area at the
        image's aspect ratio). guidance_scale > 1 enables classifier-free guidance
        (guidance_scale_2: the low-noise expert's scale of a two-expert checkpoint, default
        guidance_scale). seed: an int (prompt i uses seed + i) or N ints; each clip's initial noise
        comes from its own CPU generator, so a clip does not depend on what it is batched with (except under a
        step cache, whose compute-or-reuse decision covers the whole batch: one call per prompt keeps them apart).
        scheduler (``flow_euler``, ``unipc``, ``dpmpp``, ``lcm``; None: the checkpoint's), flow_shift,
        timesteps (explicit descending list; overrides num_inference_steps), cfg_interval (``(START, END)``
        or ``"START:END"``), cfg_batching (``auto``, ``batched``, ``sequential``): the sampler and the
        guidance, checked as the CLI's flags (:mod:`ditattn.pipelines.sampling`).
        image: the first frame of image-to-video / TI2V checkpoints (required by ``i2v`` ones,
        refused by text-to-video ones): a path, encoded bytes, a PIL image or a uint8 array ``[H, W,
        3]``, or a list of N of those (one per prompt); height / width None: sized from the (first) image, its
        aspect ratio clamped to 4:1 at the default area, or from the one side given. lora: the scales of the
        loaded unfused LoRA adapters for this call (name -> scale, adapters not named are off; None: their load-time
        scales). override: a per-request
        dense drop-in backend for the DiT; skip_softmax: ``{threshold_scale_factor,
        start_step}``; request_state: an already prepared state (:meth:`prepare_request`)
        instead of those two. cache_backend / cache_backend_config: this call's step cache (None: the
        pipeline's default, ``"none"``: off; :meth:`prepare_cache`), or cache_setting: an already prepared
        one; the result's ``cache`` reports the forwards computed and reused. latents: optional initial
        noise ``[N, C, T, H/8, W/8]`` float32.
        output_type: ``uint8`` (default), ``float`` ([0, 1] float32) or ``latent``.
        on_step: optional callable ``(steps_done, total_steps)`` called after each denoising step.
        should_stop: optional callable ``() -> reason or None`` asked before the text encoder, before
        each denoising step, before decoding and between the latent frames the VAE decodes; a truthy reason stops the
        run there with
        :class:`~ditattn.errors.GenerationCancelled` (a server cancelling a request or enforcing its
        timeout; the pipeline knows nothing of servers).
        """
        if not self.loaded:
            raise AttentionConfigError(
                "this pipeline was built with load_weights=False (plan only); it cannot generate"
            )
        t_start = time.perf_counter()
        inp = resolve_inputs(
            prompt,
            negative_prompt,
            seed=seed,
            image=image,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2,
            output_type=output_type,
            defaults=self.defaults,
            geometry=self.geometry,
            mode=self.mode,
            two_experts=self.boundary_ratio is not None,
        )
        height, width, num_frames, steps = inp.height, inp.width, inp.num_frames, inp.steps
        sampling = SamplingConfig(
            scheduler=scheduler,
            flow_shift=flow_shift,
            timesteps=timesteps,
            cfg_interval=cfg_interval,
            cfg_batching=cfg_batching or "auto",
        )
        state = request_state if request_state is not None else self.prepare_request(override, skip_softmax)
        cache_setting = cache_setting or self.prepare_cache(cache_backend, cache_backend_config)
        if cache_setting is not None:  # refused before any work; a calibration of other settings: a warning
            cache_setting.check_steps(
                len(sampling.timesteps) if sampling.timesteps else steps, guidance_scale=inp.guidance
            )
        cache = cache_setting.new_run() if cache_setting is not None else None

        def check_stop() -> None:
            reason = should_stop() if should_stop is not None else None
            if reason:
                raise GenerationCancelled(reason)

        check_stop()
        dev, dt = self.device, self.dtype
        do_cfg = inp.guidance > 1.0  # as diffusers: the first scale decides whether negatives are encoded
        split = cfg_split(do_cfg, sampling.cfg_batching)  # CFG parallelism: each guidance half on its own ranks
        timings: dict[str, float] = {}

        scales = resolve_request_lora(lora, self.adapters)
        with generation_run(self.placement, dev, scales, self._offload_lock) as run:
            # 1. text
            t0 = time.perf_counter()
            with self.placement.use("text_encoder"):
                context = encode_prompts(
                    self.components["tokenizer"],
                    self.components["text_encoder"],
                    inp.prompts + inp.negatives if do_cfg else inp.prompts,
                    max_sequence_length,
                    dev,
                )
            dits = {c: self.components.get(c) for c in DIT}
            context = context.to(dt)
            timings["text"] = time.perf_counter() - t0

            # 2. noise (and the image's conditioning)
            latents = prepare_latents(self.geometry.latent_shape(num_frames, height, width), inp.seeds, dev, latents)
            condition = None
            if inp.images is not None:
                t0 = time.perf_counter()
                with self._vae_lock:
                    condition = image_condition(
                        inp.images,
                        mode=self.mode,
                        components=self.components,
                        placement=self.placement,
                        height=height,
                        width=width,
                        num_frames=num_frames,
                        temporal=self.vae_scale_temporal,
                        spatial=self.vae_scale_spatial,
                        device=dev,
                        dtype=dt,
                        clip=self.image_embeds,
                    )
                timings["image"] = time.perf_counter() - t0

            # 3. denoise
            sparse_run.begin_run()  # the sparse backends' per-layer kept fractions and dense fallbacks
            t0 = time.perf_counter()
            sampler = build_sampler(
                self.components["scheduler"],
                name=sampling.scheduler,
                shift=sampling.flow_shift,
                steps=steps,
                timesteps=sampling.timesteps,
                device=dev,
                seeds=inp.seeds,
            )
            steps = sampler.num_steps
            if cache_setting is not None:  # the scheduler is known now (the checkpoint's when none was asked for)
                cache_setting.check_steps(steps, scheduler=sampler.name)
            guided = guided_steps(steps, sampling.cfg_interval, do_cfg)
            batching = resolve_cfg_batching(sampling.cfg_batching, device=dev, tokens=self.tokens(latents))
            latents, used_models = denoise(
                latents,
                sampler.scheduler,
                dits,
                context=context,
                condition=condition,
                guidance=inp.guidance,
                guidance_2=inp.guidance_2,
                boundary_ratio=self.boundary_ratio,
                expand_timesteps=self.expand_timesteps,
                placement=self.placement,
                dtype=dt,
                state=state,
                cache=cache,
                progress=progress,
                on_step=on_step,
                check_stop=check_stop,
                guided=guided,
                sequential_cfg=batching == "sequential",
                step_kwargs=sampler.step_kwargs,
            )
            timings["denoise"] = time.perf_counter() - t0
            if condition is not None:
                latents = condition.finalize(latents)  # TI2V: the first latent frame is the image's
            check_finite(latents)  # a black or garbage clip is not a result

            # 4. decode
            check_stop()
            t0 = time.perf_counter()
            if output_type == "latent":
                frames = latents
            else:
                frames = self.decode(
                    latents, progress=progress, check_stop=check_stop if should_stop is not None else None
                )
                if output_type == "uint8":
                    frames = (frames * 255.0).round().clip(0, 255).astype(np.uint8)
            timings["decode"] = time.perf_counter() - t0
            timings["total"] = time.perf_counter() - t_start

            layers = dit_layers(dits[c] for c in DIT if c in used_models)
            backends = request_backends([l for r in ROLES for l in layers if l.role == r], state)
            stats = dict(state.stats) if state is not None else {}
            self._sparse_run = sparse_run.finish_run(stats)  # per sparse layer; also in plan()
            info = dict(
                scheduler=sampler.name,
                flow_shift=sampler.shift,
                timesteps=sampler.timesteps,
                forwards=forwards(guided),
                cfg=cfg_mode(guided, "parallel" if split is not None else batching),
            )
            peak, report = run.peak_memory(), cache_report(cache, split, guided)
            return GenerationResult(
                frames,
                backends,
                timings,
                stats,
                latents,
                inp.seeds,
                height,
                width,
                num_frames,
                steps,
                peak,
                info,
                report,
            )

    def tokens(self, latents: torch.Tensor) -> int:
        """Latent tokens per clip after patching (the DiT's sequence length) for ``latents [N, C, T, h, w]``."""
        ref = self.components.get("transformer") or self.components.get("transformer_2")
        t, h, w = ref.latent_grid(*latents.shape[2:])
        return t * h * w

    def decode(self, latents: torch.Tensor, progress: bool = False, check_stop=None) -> np.ndarray:
        """Latents ``[N, C, T, h, w]`` -> float32 frames in [0, 1], ``np.ndarray [N, F, H, W, 3]``
        (``progress``: a bar on stderr when it is a terminal; ``check_stop`` (optional) is asked between
        latent frames and may raise to stop the decode; not under ``--vae-parallel``, where every rank
        must reach the collective decode)."""
        with self._vae_lock, self.placement.use("vae"):
            return decode_latents(
                self.components["vae"],
                latents,
                self.device,
                parallel=self.vae_parallel,
                progress=progress,
                check_stop=check_stop,
            )
