"""``ditattn.WanPipeline``: the Wan text-to-video and image-to-video pipeline for Python users.

A thin front of :class:`~ditattn.pipelines.wan.WanPipelineNative` that takes the CLI's settings
as keyword arguments — strings, or :class:`~ditattn.AttentionBackendEnum` members, ``torch.dtype``
and ``torch.device`` objects — and checks them exactly as the CLI does (the fields of
:class:`~ditattn.runconfig.RunConfig`), so a bad value raises the same one-line
:class:`~ditattn.errors.AttentionConfigError` (a ``ValueError``)::

    import ditattn
    pipe = ditattn.WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", attention_backend="fa",
                                               component_attention_backends={"text_encoder": "torch_sdpa"},
                                               device="cuda", dtype="bfloat16")
    frames = pipe("a red fox running through fresh snow", num_frames=33, seed=1)   # uint8 [1, 33, H, W, 3]
    ditattn.save_video(frames, "fox.mp4")

An image-to-video checkpoint (Wan 2.1 I2V, Wan 2.2 I2V-A14B, TI2V-5B) takes the first frame:
``pipe("a boat sets sail", image="first.png")``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import AttentionOptions, CacheOptions, ModelConfig, RunConfig, SamplingConfig

Spec = Union[str, Mapping[str, Any], None]


class WanPipeline:
    """Wan 2.1 / 2.2 text-to-video and image-to-video with ditattn's attention backends; build it with
    :meth:`from_pretrained`.  ``pipe(prompt, ...)`` returns the frames; :meth:`generate` also returns
    the attention backends that ran and the timings; :meth:`plan` the attention plan.

    Attributes: ``config`` (the :class:`~ditattn.runconfig.RunConfig` it was built from),
    ``native`` (the :class:`~ditattn.pipelines.wan.WanPipelineNative` that runs it), ``device``,
    ``dtype``, ``defaults`` (the model's sampling defaults).
    """

    def __init__(self, native, config: RunConfig):
        self.native = native
        self.config = config

    @classmethod
    def from_pretrained(
        cls,
        model: Optional[str] = None,
        *,
        attention_backend: Any = None,
        attention_backend_config: Spec = None,
        component_attention_backends: Spec = None,
        device: Any = None,
        dtype: Any = None,
        revision: Optional[str] = None,
        local_files_only: bool = False,
        cache_dir: Optional[str] = None,
        variant: Optional[str] = None,
        enable_attention_backend_autotune: bool = False,
        enable_torch_compile: bool = False,
        dit_quantization: str = "none",
        dit_weights: Spec = None,
        lora_path: Union[str, Sequence[str]] = (),
        lora_fuse: Optional[bool] = None,
        offload: str = "none",
        offload_group_blocks: int = 1,
        vae_tiling: bool = False,
        vae_slicing: bool = False,
        cache_backend: Optional[str] = None,
        cache_backend_config: Spec = None,
    ) -> "WanPipeline":
        """Load ``model`` — a local diffusers-format Wan folder, a Hugging Face repo id ``org/name``
        (the local cache first, ``revision``, ``local_files_only``, ``cache_dir`` instead of
        ``HF_HOME``; the last two do nothing for the built-in models, which are local: ``cache_dir`` logs a
        warning saying so) or a built-in model, ``ditattn:shapes``
        (the trained one), ``ditattn:tiny-wan`` / ``ditattn:tiny-wan2.2`` (random weights; None: ``ditattn:shapes``).

        attention_backend: the global backend (``"fa"``, ``"torch_sdpa"``, ``"video_sparse_attn"``,
        an ``AttentionBackendEnum`` member, …; None: automatic per platform);
        attention_backend_config: backend parameters (a dict, JSON, ``"k=v,k=v"`` or a file path);
        component_attention_backends: per-component / per-role overrides (a dict such as
        ``{"text_encoder": "torch_sdpa", "transformer.cross": "fa"}`` or the CLI's spec string);
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device`` (None: cuda if available);
        dtype: ``"bfloat16"`` / ``"float16"`` / ``"float32"`` or a ``torch.dtype`` (None: float32
        on CPU, bfloat16 on GPUs); dit_quantization: ``"none"``, ``"fp8"`` (NVIDIA GPU with compute
        capability >= 8.9, bfloat16) or ``"int8"`` — the DiT's linears in 8 bits through torchao
        (``ditattn[quant]``); dit_weights: a ``.safetensors`` file of DiT weights instead of the
        checkpoint's (FP8/INT8 with scales too) or ``{"transformer": file, "transformer_2": file}``;
        lora_path: LoRA adapters, ``[COMPONENT=]PATH[:SCALE]`` each (a step-distill LoRA for both experts of
        Wan 2.2: ``["transformer=high.safetensors", "transformer_2=low.safetensors"]``), fused unless
        ``lora_fuse=False`` (then :meth:`generate`'s ``lora=`` picks each call's scales).
        offload: ``"none"``, ``"text_encoder"``, ``"model"`` or ``"group"`` (CPU offload, as ``--offload``;
        offload_group_blocks: DiT blocks per streamed group); vae_tiling / vae_slicing: tiled / per-sample
        VAE encode and decode.
        cache_backend / cache_backend_config: the step cache of every call (``"teacache"``, ``"magcache"``,
        ``"first_block_cache"`` and their keys as a dict, JSON, ``"k=v,k=v"`` or a file; docs/caching.md).
        Raises :class:`AttentionConfigError` for any bad value.
        """
        config = RunConfig(
            model=ModelConfig(
                model_path=model,
                revision=revision,
                local_files_only=local_files_only,
                model_variant=variant,
                device=device,
                dtype=dtype,
                enable_torch_compile=enable_torch_compile,
                dit_quantization=dit_quantization,
                dit_weights=dit_weights,
                lora_path=lora_path,
                lora_fuse=lora_fuse,
                offload=offload,
                offload_group_blocks=offload_group_blocks,
                vae_tiling=vae_tiling,
                vae_slicing=vae_slicing,
            ),
            attention=AttentionOptions(
                attention_backend=attention_backend,
                attention_backend_config=attention_backend_config,
                component_attention_backends=component_attention_backends,
                enable_attention_backend_autotune=enable_attention_backend_autotune,
            ),
            cache=CacheOptions(cache_backend=cache_backend, cache_backend_config=cache_backend_config),
        )
        from ditattn.pipelines.wan import WanPipelineNative

        return cls(WanPipelineNative.from_config(config, cache_dir=cache_dir, lora_fuse=True), config)

    # -- properties of the loaded model ---------------------------------------------------------
    @property
    def device(self):
        return self.native.device

    @property
    def dtype(self):
        return self.native.dtype

    @property
    def defaults(self) -> dict:
        return dict(self.native.defaults)

    def plan(self) -> dict:
        """The attention plan: which backend each attention layer got and why (the object
        ``ditattn plan --json`` prints)."""
        return self.native.plan()

    # -- generation ----------------------------------------------------------------------------
    def __call__(self, prompt: Union[str, Sequence[str]], **kw: Any):
        """Generate; same arguments as :meth:`generate`.  Returns the frames: ``np.uint8
        [N, F, H, W, 3]``, one clip per prompt (``F == 1`` for an image)."""
        return self.generate(prompt, **kw).frames

    def generate(
        self,
        prompt: Union[str, Sequence[str]],
        *,
        negative_prompt: Union[str, Sequence[str], None] = None,
        num_inference_steps: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        guidance_scale_2: Optional[float] = None,
        image: Any = None,
        lora: Optional[Mapping[str, float]] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_frames: Optional[int] = None,
        seed: Union[int, Sequence[int], None] = None,
        scheduler: Optional[str] = None,
        flow_shift: Optional[float] = None,
        timesteps: Union[str, Sequence[float], None] = None,
        cfg_interval: Union[str, Sequence[float], None] = None,
        cfg_batching: str = "auto",
        attention_backend_override: Any = None,
        skip_softmax_threshold_scale_factor: Optional[float] = None,
        skip_softmax_start_step: Optional[int] = None,
        cache_backend: Optional[str] = None,
        cache_backend_config: Spec = None,
        progress: bool = True,
    ):
        """Generate one clip per prompt and return the
        :class:`~ditattn.pipelines.generation.GenerationResult` (``frames``, ``attention_backends``,
        ``timings``, ``stats``).

        prompt: a string or a list of N strings (one batch); negative_prompt: a string or N strings.
        None sampling values take the model's :attr:`defaults`; height / width: multiples of 16;
        num_frames: 1 + 4k (1 = an image); seed: an int (prompt i uses seed + i; None: 0) or N ints.
        guidance_scale_2: the low-noise expert's guidance scale of a two-expert Wan 2.2 checkpoint
        (None: guidance_scale).  image: the first frame of an image-to-video checkpoint (required by Wan
        2.1 I2V / Wan 2.2 I2V-A14B, optional for TI2V-5B, refused by text-to-video ones): a file path, encoded
        bytes, a PIL image or a uint8 array ``[H, W, 3]``, or one per prompt; without height and width
        the output takes the default area at the image's aspect ratio (clamped to 4:1), with one of them
        the other follows that ratio.  lora: this call's scales of the unfused LoRA adapters
        (``from_pretrained(lora_path=..., lora_fuse=False)``): ``{name: scale}``, adapters not named off
        (None: their load-time scales).
        scheduler: ``flow_euler``, ``unipc``, ``dpmpp`` or ``lcm`` (None: the checkpoint's); flow_shift: the
        timestep shift (None: the checkpoint's); timesteps: explicit descending timesteps such as
        ``[1000, 750, 500, 250]`` (override num_inference_steps); cfg_interval: ``"START:END"`` or
        ``(START, END)``, the fractions of the schedule that run guidance; cfg_batching: ``auto``,
        ``batched`` or ``sequential`` (docs/steps.md).
        attention_backend_override: a dense drop-in backend for this call's DiT attention (``fa``,
        ``torch_sdpa``, ``sage_attn``, ``sage_attn_3``); skip_softmax_*: request-scoped skip softmax
        (needs a threshold, calibrated per model); cache_backend / cache_backend_config: this call's step
        cache (None: the pipeline's; ``"none"``: off), reported in the result's ``cache``.  Raises
        :class:`AttentionConfigError` with the
        CLI's message for any bad value.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else None
        if not prompts:
            raise AttentionConfigError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
        negatives = negative_prompt if isinstance(negative_prompt, (list, tuple)) else [negative_prompt]
        seeds = seed if isinstance(seed, (list, tuple)) else [seed]
        for name, given in (("negative_prompt", negatives), ("seed", seeds)):
            if len(given) not in (1, len(prompts)):
                raise AttentionConfigError(f"{name} has {len(given)} entries for {len(prompts)} prompts")
        for i, p in enumerate(prompts):  # each value through the CLI's checks
            sampling = SamplingConfig(
                prompt=p,
                negative_prompt=negatives[min(i, len(negatives) - 1)],
                num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale,
                guidance_scale_2=guidance_scale_2,
                height=height,
                width=width,
                num_frames=num_frames,
                seed=seeds[min(i, len(seeds) - 1)],
                scheduler=scheduler,
                flow_shift=flow_shift,
                timesteps=timesteps,
                cfg_interval=cfg_interval,
                cfg_batching=cfg_batching,
            )
        if not all(p.strip() for p in prompts):
            raise AttentionConfigError("prompt must not be empty")
        attention = AttentionOptions(
            attention_backend_override=attention_backend_override,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            skip_softmax_start_step=skip_softmax_start_step,
        )
        CacheOptions(cache_backend=cache_backend, cache_backend_config=cache_backend_config)  # the CLI's checks
        return self.native.generate(
            prompts if len(prompts) > 1 else prompts[0],
            negative_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2,
            image=image,
            lora=lora,
            seed=0 if seed is None else seed,
            scheduler=sampling.scheduler,
            flow_shift=sampling.flow_shift,
            timesteps=sampling.timesteps,
            cfg_interval=sampling.cfg_interval,
            cfg_batching=sampling.cfg_batching,
            override=attention.attention_backend_override,
            skip_softmax=attention.skip_softmax(),
            cache_backend=cache_backend,
            cache_backend_config=cache_backend_config,
            progress=progress,
        )

    def __repr__(self) -> str:
        dit = ", ".join(self.native.dit_backends())
        q = self.native.quantization_summary()
        return (
            f"WanPipeline(model={self.native.model_index.name!r}, device={self.device}, "
            f"dtype={str(self.dtype).replace('torch.', '')}, DiT attention: {dit}"
            + (f", DiT linears: {q})" if q else ")")
        )


__all__ = ["WanPipeline"]
