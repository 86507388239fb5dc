"""``--backend diffusers``: the stock diffusers ``WanPipeline`` (``WanImageToVideoPipeline`` with
``--image``), alone or with ditattn's attention inside it (:mod:`ditattn.integrations.diffusers`).
The memory and LoRA flags map to diffusers' own (``enable_model_cpu_offload``,
``enable_group_offload``, VAE ``enable_tiling`` / ``enable_slicing``, ``load_lora_weights`` +
``set_adapters`` (+ ``fuse_lora``)); ``--offload text_encoder`` has no diffusers counterpart and is
refused.

``--attention-backend NAME``: a ditattn backend name (``fa``, ``torch_sdpa``, ``video_sparse_attn``,
…) routes the pipeline's transformer attention through ditattn (:func:`~ditattn.integrations.diffusers.apply`),
and so do ``--component-attention-backends`` (transformer keys), ``--attention-backend-config``,
``--attention-backend-override``, skip softmax and autotune; a name that only diffusers knows
(``native``, ``flash``, ``_flash_3_hub``, ``sage``, ``xformers``, …) is passed unchanged to
diffusers' ``set_attention_backend``; with none of these flags diffusers runs its own default.  A
name both know (``aiter``) is ditattn's.  Sequence parallelism and torch.compile run the native
pipeline only.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np
import torch

from ditattn.attention.names import DIT_COMPONENTS
from ditattn.errors import AttentionConfigError

DITATTN_ONLY = (
    "component_attention_backends",
    "attention_backend_config",
    "attention_backend_override",
    "skip_softmax_threshold_scale_factor",
    "skip_softmax_start_step",
    "enable_attention_backend_autotune",
)


def reject_native_only_options(config) -> None:
    """Raise :class:`AttentionConfigError` for an option of ``config`` (a
    :class:`~ditattn.runconfig.RunConfig`) that only the native pipeline runs (torch.compile, CUDA
    graphs, sequence parallelism, DiT quantization and weight files) set together with
    ``--backend diffusers``, and for ditattn attention flags next to a diffusers-only
    ``--attention-backend`` name."""
    m, p = config.model, config.parallel
    given = [name for name in ("enable_torch_compile", "enable_cuda_graph", "dit_weights") if getattr(m, name)]
    given += ["dit_quantization"] if m.dit_quantization != "none" else []
    if given:
        raise AttentionConfigError(
            f"--{given[0].replace('_', '-')} applies to the native pipeline only; not with --backend diffusers"
        )
    s = config.sampling
    sampler = [k for k in ("scheduler", "flow_shift", "timesteps", "cfg_interval") if getattr(s, k) is not None]
    if sampler or s.cfg_batching != "auto":
        flag = (sampler or ["cfg_batching"])[0].replace("_", "-")
        raise AttentionConfigError(f"--{flag} applies to the native pipeline only; not with --backend diffusers")
    if m.offload == "text_encoder":
        raise AttentionConfigError(
            "--offload text_encoder applies to the native pipeline only; with --backend "
            "diffusers use --offload model or group"
        )
    if p.num_gpus > 1 or (p.ulysses_degree or 1) > 1 or (p.ring_degree or 1) > 1 or p.cfg_parallel or p.vae_parallel:
        raise AttentionConfigError(
            "sequence parallelism (--num-gpus/--ulysses-degree/--ring-degree, --cfg-parallel, --vae-parallel) "
            "runs the native pipeline only; not with --backend diffusers"
        )
    attention_route(config)


def attention_route(config) -> Optional[str]:
    """How ``--backend diffusers`` runs attention: ``"ditattn"`` (through
    :mod:`ditattn.integrations.diffusers`), ``"diffusers"`` (``--attention-backend`` is a
    diffusers-only name for ``set_attention_backend``) or None (diffusers' default)."""
    from ditattn.attention.names import AttentionBackendEnum

    a = config.attention
    ours = [n for n in DITATTN_ONLY if getattr(a, n) not in (None, "", False)]
    name = a.attention_backend
    if name is None:
        return "ditattn" if ours else None
    try:
        AttentionBackendEnum.from_name(name)
        return "ditattn"
    except AttentionConfigError as exc:
        ditattn_error = str(exc)
    if name not in diffusers_backend_names():
        raise AttentionConfigError(
            f"--attention-backend '{name}' (with --backend diffusers) is neither a ditattn backend nor one of "
            f"diffusers' ({', '.join(diffusers_backend_names())}); {ditattn_error.split('; ', 1)[-1]}"
        )
    if ours:
        raise AttentionConfigError(
            f"--{ours[0].replace('_', '-')} needs a ditattn --attention-backend; '{name}' is diffusers' own backend "
            "name (ditattn's dense ones: fa, torch_sdpa, torch_cudnn_sdpa, sage_attn)"
        )
    return "diffusers"


def conditioning_mode_static(mi) -> str:
    """The checkpoint's image conditioning (``t2v``, ``i2v``, ``ti2v``; see
    :mod:`ditattn.pipelines.conditioning`) from its configs alone."""
    from ditattn.pipelines.conditioning import conditioning_mode
    from ditattn.pipelines.latents import VideoGeometry

    g = VideoGeometry.from_model_index(mi)
    return conditioning_mode(g.in_channels, g.z_dim, g.expand_timesteps, g.temporal)


def check_size_static(mi, height: int, width: int, num_frames: int) -> None:
    """The size rules of :meth:`WanPipelineNative.check_size` from the checkpoint's configs alone
    (``mi``: its :class:`~ditattn.pipelines.model_index.ModelIndex`), before diffusers loads it."""
    from ditattn.pipelines.latents import VideoGeometry

    VideoGeometry.from_model_index(mi).check_size(height, width, num_frames, flags=True)


def diffusers_backend_names() -> list[str]:
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName

        return [b.value for b in AttentionBackendName]
    except Exception:  # pragma: no cover - older diffusers
        return []


def _has_ftfy() -> bool:
    """Whether diffusers found ftfy: its Wan image-to-video pipeline imports ftfy only then, but calls it on
    every prompt either way (a package without its install metadata counts as absent, as diffusers sees it)."""
    from diffusers import utils

    return bool(utils.is_ftfy_available())


def load_diffusers_pipeline(
    folder: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    variant: Optional[str] = None,
    attention_backend: Optional[str] = None,
    image_to_video: bool = False,
    model=None,
):
    """``diffusers.WanPipeline`` (``WanImageToVideoPipeline`` with ``image_to_video``) from ``folder`` on
    ``device`` (VAE in float32), with diffusers' ``set_attention_backend(attention_backend)`` applied to
    its transformer(s) when given, and ``model`` (a :class:`~ditattn.runconfig.ModelConfig`)'s offload,
    VAE tiling / slicing and LoRA settings mapped to diffusers' own."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    if image_to_video and not _has_ftfy():
        raise AttentionConfigError(
            "--backend diffusers: diffusers' WanImageToVideoPipeline cleans every prompt with ftfy, which is not "
            "installed (it would stop at the first prompt with \"NameError: name 'ftfy' is not defined\"); "
            "install it (pip install ftfy), or use the native pipeline (--backend native)"
        )
    kw = {"variant": variant} if variant else {}
    try:
        pipe = (WanImageToVideoPipeline if image_to_video else WanPipeline).from_pretrained(folder, dtype=dtype, **kw)
    except (OSError, ValueError) as exc:
        raise AttentionConfigError(f"diffusers cannot load {folder}: {exc}") from None
    pipe.vae.to(torch.float32)
    if model is not None:
        _apply_model_options(pipe, model, device)
    else:
        pipe.to(device)
    if attention_backend:
        for name in DIT_COMPONENTS:
            dit = getattr(pipe, name, None)
            if dit is None:
                continue
            try:
                dit.set_attention_backend(attention_backend)
            except (ValueError, ImportError, RuntimeError, KeyError) as exc:
                msg = " ".join(str(exc).split())
                if "must be one of" not in msg:
                    msg += f"; diffusers' backend names: {', '.join(diffusers_backend_names())}"
                raise AttentionConfigError(
                    f"--attention-backend '{attention_backend}' (with --backend diffusers) was refused by diffusers' "
                    f"set_attention_backend: {msg}"
                ) from None
    return pipe


def apply_ditattn(pipe, config):
    """:func:`ditattn.integrations.diffusers.apply` with the attention flags of ``config``."""
    from ditattn.integrations.diffusers import apply

    a = config.attention
    return apply(
        pipe,
        attention_backend=a.attention_backend,
        attention_backend_config=a.attention_backend_config,
        component_attention_backends=a.component_attention_backends,
        attention_backend_override=a.attention_backend_override,
        skip_softmax=a.skip_softmax(),
        enable_attention_backend_autotune=a.enable_attention_backend_autotune,
    )


def plan_diffusers(config):
    """The attention plan of the diffusers pipeline ``config`` describes, without weights: its
    transformer(s) built from their configs on the meta device and routed by ditattn (nothing
    installed).  Returns ``(routing, model name, dtype)``."""
    import diffusers

    from ditattn.integrations.diffusers import DIT, route_models
    from ditattn.pipelines.loading import parse_device, parse_dtype
    from ditattn.pipelines.model_index import read_model_index, resolve_model_path
    from ditattn.platforms import platform_for_device

    if attention_route(config) == "diffusers":
        raise AttentionConfigError(
            f"plan explains ditattn's backends; '{config.attention.attention_backend}' is "
            "diffusers' own backend name (ditattn's: see ditattn backends)"
        )
    m = config.model
    folder, name = resolve_model_path(
        m.model_path, revision=m.revision, local_files_only=m.local_files_only, variant=m.model_variant
    )
    mi = read_model_index(folder, name)
    dev = parse_device(m.device)
    platform = platform_for_device(dev)
    dt = parse_dtype(m.dtype, platform)
    dits = {}
    for comp in DIT:
        if comp in mi.components:
            cls = getattr(diffusers, mi.components[comp][1], None)
            if cls is None:
                raise AttentionConfigError(
                    f"{folder}: {comp} class '{mi.components[comp][1]}' is not in diffusers {diffusers.__version__}"
                )
            with torch.device("meta"):
                dits[comp] = cls.from_config(cls.load_config(os.path.join(folder, comp)))
    fixed = tuple(c for c, (lib, klass) in mi.components.items() if c not in dits and _is_model(lib, klass))
    routing = route_models(
        dits, config.attention_settings(), fixed=fixed, known=tuple(mi.components), platform=platform, dtype=dt
    )
    return routing, name, dt


def _is_model(library: str, klass: str) -> bool:
    """Whether ``library.klass`` (a ``model_index.json`` entry) is a torch model (not a tokenizer
    or scheduler)."""
    import importlib

    try:
        cls = getattr(importlib.import_module(library), klass)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, torch.nn.Module)


def _apply_model_options(pipe, model, device: torch.device) -> None:
    """Offload, VAE tiling / slicing and LoRA of a :class:`~ditattn.runconfig.ModelConfig`, diffusers' way.
    Each LoRA file is first read and checked against the transformer as the native pipeline does
    (:func:`~ditattn.models.lora.read_lora`, :func:`~ditattn.models.lora.check_lora`: the same one-line
    refusals, nothing of the file left unmatched), then loaded by diffusers."""
    from ditattn.models.lora import LoRAError, check_lora, parse_lora_spec, read_lora

    names, scales = [], []
    for raw in model.lora_path:
        spec = parse_lora_spec(raw)
        dit = getattr(pipe, spec.component, None)
        if dit is None:
            raise LoRAError(f"--lora-path {spec.path}: this checkpoint has no {spec.component}")
        where = f"--lora-path {spec.path}"
        check_lora(dit, read_lora(spec), where)  # unreadable, kohya, NaN, keys matching no layer of the DiT
        path = os.path.expanduser(spec.path)
        kw = {"weight_name": os.path.basename(path)} if os.path.isfile(path) else {}
        folder = os.path.dirname(path) or "." if os.path.isfile(path) else path
        name = spec.name if spec.name not in names else f"{spec.name}_{len(names) + 1}"
        try:
            pipe.load_lora_weights(
                folder, adapter_name=name, load_into_transformer_2=spec.component == "transformer_2", **kw
            )
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise LoRAError(f"{where}: diffusers cannot load it ({' '.join(str(exc).split())[:300]})") from None
        names.append(name)
        scales.append(spec.scale)
    if names:
        try:
            pipe.set_adapters(names, scales)
            if model.lora_fuse is not False:
                pipe.fuse_lora(adapter_names=names)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise LoRAError(
                f"--lora-path: diffusers cannot apply the adapters {', '.join(names)} "
                f"({' '.join(str(exc).split())[:300]})"
            ) from None
    if model.vae_tiling:
        pipe.vae.enable_tiling()
    if model.vae_slicing:
        pipe.vae.enable_slicing()
    if model.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif model.offload == "group":
        pipe.enable_group_offload(
            onload_device=device,
            offload_type="block_level",
            num_blocks_per_group=model.offload_group_blocks,
            use_stream=device.type == "cuda",
        )
    else:
        pipe.to(device)


def run_diffusers(
    pipe,
    *,
    prompt: str,
    negative_prompt: Optional[str],
    height: int,
    width: int,
    num_frames: int,
    num_inference_steps: int,
    guidance_scale: float,
    seed: int,
    max_sequence_length: int = 512,
    progress: bool = True,
    image=None,
    guidance_scale_2: Optional[float] = None,
) -> tuple[np.ndarray, float]:
    """Run the diffusers pipeline (``image``: the first frame of an image-to-video pipeline); returns
    (uint8 frames ``[1, F, H, W, 3]``, seconds)."""
    pipe.set_progress_bar_config(disable=not progress)
    extra = {} if image is None else {"image": image}
    if guidance_scale_2 is not None:
        extra["guidance_scale_2"] = guidance_scale_2
    t0 = time.perf_counter()
    out = pipe(
        prompt=prompt,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
        max_sequence_length=max_sequence_length,
        **extra,
    ).frames
    frames = np.asarray(out, dtype=np.float32)
    if not np.isfinite(frames).all():  # a black or garbage clip is not a result (as the native pipeline refuses)
        from ditattn.pipelines.generation import NON_FINITE_CAUSES

        raise AttentionConfigError(f"diffusers decoded NaN or inf values, so nothing is saved ({NON_FINITE_CAUSES})")
    return (frames * 255.0).round().clip(0, 255).astype(np.uint8), time.perf_counter() - t0
