"""``--backend diffusers``: the stock diffusers ``WanPipeline``, for comparison with the native one.

Only ``--attention-backend`` applies, passed unchanged to diffusers' ``set_attention_backend``
(diffusers' own names: ``native``, ``flash``, ``_flash_3_hub``, ``sage``, ``xformers``, …).  The
ditattn attention machinery (component overrides, backend config, request override, skip softmax,
autotune, sequence parallelism) exists only for the native pipeline, so those flags are rejected.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from ditattn.errors import AttentionConfigError

NATIVE_ONLY = ("component_attention_backends", "attention_backend_config", "attention_backend_override",
               "skip_softmax_threshold_scale_factor", "skip_softmax_start_step")


def reject_native_only_options(config) -> None:
    """Raise :class:`AttentionConfigError` naming the first native-only option of ``config`` (a
    :class:`~ditattn.runconfig.RunConfig`) set together with ``--backend diffusers``."""
    a, m, p = config.attention, config.model, config.parallel
    given = [name for name in NATIVE_ONLY if getattr(a, name) not in (None, "", False)]
    given += [name for name in ("enable_torch_compile", "enable_cuda_graph") if getattr(m, name)]
    if given:
        raise AttentionConfigError(
            f"--{given[0].replace('_', '-')} applies to the native pipeline only; --backend diffusers runs the stock "
            "diffusers WanPipeline, whose only attention flag is --attention-backend (passed to set_attention_backend)"
        )
    if a.enable_attention_backend_autotune:
        raise AttentionConfigError(
            "--enable-attention-backend-autotune applies to the native pipeline only; not with --backend diffusers"
        )
    if p.num_gpus > 1 or (p.ulysses_degree or 1) > 1 or (p.ring_degree or 1) > 1:
        raise AttentionConfigError(
            "sequence parallelism (--num-gpus/--ulysses-degree/--ring-degree) runs the native pipeline only; "
            "not with --backend diffusers"
        )


def check_size_static(mi, height: int, width: int, num_frames: int) -> None:
    """The size rules of :meth:`WanPipelineNative.check_size` from the checkpoint's configs alone
    (``mi``: its :class:`~ditattn.pipelines.model_index.ModelIndex`), before diffusers loads it."""
    import os

    from ditattn.models.weights import read_json

    vae = read_json(os.path.join(mi.folder("vae"), "config.json"))
    comp = "transformer" if "transformer" in mi.components else "transformer_2"
    tr = read_json(os.path.join(mi.folder(comp), "config.json"))
    sp = int(vae.get("scale_factor_spatial") or 8)
    st = int(vae.get("scale_factor_temporal") or 4)
    patch = tr.get("patch_size", (1, 2, 2))
    mult = sp * max(int(patch[1]), int(patch[2]))
    for what, v in (("height", height), ("width", width)):
        if v % mult:
            raise AttentionConfigError(f"--{what} {v} is not supported; accepted: positive multiples of {mult}")
    if (num_frames - 1) % st:
        raise AttentionConfigError(
            f"--num-frames {num_frames} is not supported; accepted: 1 + {st}k (1, {1 + st}, {1 + 2 * st}, ...)"
        )


def diffusers_backend_names() -> list[str]:
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName

        return [b.value for b in AttentionBackendName]
    except Exception:  # pragma: no cover - older diffusers
        return []


def load_diffusers_pipeline(folder: str, *, device: torch.device, dtype: torch.dtype,
                            variant: Optional[str] = None, attention_backend: Optional[str] = None):
    """``diffusers.WanPipeline`` from ``folder`` on ``device`` (VAE in float32), with
    ``set_attention_backend(attention_backend)`` applied to its transformer(s) when given."""
    from diffusers import WanPipeline

    kw = {"variant": variant} if variant else {}
    try:
        pipe = WanPipeline.from_pretrained(folder, dtype=dtype, **kw)
    except (OSError, ValueError) as exc:
        raise AttentionConfigError(f"diffusers cannot load {folder}: {exc}") from None
    pipe.to(device)
    pipe.vae.to(torch.float32)
    if attention_backend:
        for name in ("transformer", "transformer_2"):
            model = getattr(pipe, name, None)
            if model is None:
                continue
            try:
                model.set_attention_backend(attention_backend)
            except (ValueError, ImportError, RuntimeError, KeyError) as exc:
                msg = " ".join(str(exc).split())
                if "must be one of" not in msg:
                    msg += f"; diffusers' backend names: {', '.join(diffusers_backend_names())}"
                raise AttentionConfigError(
                    f"--attention-backend '{attention_backend}' (with --backend diffusers) was refused by diffusers' "
                    f"set_attention_backend: {msg}"
                ) from None
    return pipe


def run_diffusers(pipe, *, prompt: str, negative_prompt: Optional[str], height: int, width: int, num_frames: int,
                  num_inference_steps: int, guidance_scale: float, seed: int, max_sequence_length: int = 512,
                  progress: bool = True) -> tuple[np.ndarray, float]:
    """Run the diffusers pipeline; returns (uint8 frames ``[1, F, H, W, 3]``, seconds)."""
    pipe.set_progress_bar_config(disable=not progress)
    t0 = time.perf_counter()
    out = pipe(
        prompt=prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=num_frames,
        num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
        generator=torch.Generator("cpu").manual_seed(seed), output_type="np", max_sequence_length=max_sequence_length,
    ).frames
    frames = np.asarray(out, dtype=np.float32)
    return (frames * 255.0).round().clip(0, 255).astype(np.uint8), time.perf_counter() - t0
