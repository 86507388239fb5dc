"""The denoising loop of the Wan pipelines (:class:`~ditattn.pipelines.wan.WanPipelineNative`).

Each step picks the expert — ``transformer`` while the timestep is at or above the boundary
(``boundary_ratio * num_train_timesteps``, two-expert Wan 2.2 checkpoints), ``transformer_2`` below
it — runs it on the latents (with the image condition of image-to-video checkpoints, and the
conditional and unconditional halves in one batch under classifier-free guidance), combines the
halves with that expert's guidance scale and lets the scheduler step.  The text side of each expert
(projected text and cross-attention K/V, :meth:`~ditattn.models.wan.transformer.WanTransformer.encode_text`)
is computed once per loop.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Mapping, Optional

import torch

from ditattn.attention.context import RequestState, forward_context, request_scope
from ditattn.cache.runtime import cache_scope
from ditattn.pipelines.conditioning import ImageCondition


def denoise(latents: torch.Tensor, scheduler, dits: Mapping[str, Optional[torch.nn.Module]], *,
            context: torch.Tensor, condition: Optional[ImageCondition], guidance: float, guidance_2: float,
            boundary_ratio: Optional[float], expand_timesteps: bool, placement, dtype: torch.dtype,
            state: Optional[RequestState] = None, cache=None, progress: bool = True,
            on_step: Optional[Callable[[int, int], None]] = None,
            check_stop: Optional[Callable[[], None]] = None) -> tuple[torch.Tensor, set[str]]:
    """Run ``scheduler`` (its timesteps set) over ``latents [N, z, T, h, w]`` (float32, on the
    DiTs' device) and return the final latents (float32) and the names of the experts that ran.

    dits: ``{"transformer": model or None, "transformer_2": model or None}``; context: text
    features ``[N, L, text_dim]``, or ``[2N, ...]`` (conditional, then unconditional) when
    ``guidance > 1`` enables classifier-free guidance (the first scale decides, as in diffusers);
    condition: the batch's image condition or None; guidance_2: the low-noise expert's scale;
    placement: the :class:`~ditattn.pipelines.offload.ComponentPlacement` that brings each expert
    onto the device; dtype: the DiTs' compute dtype.  ``state``: the request's attention state, in
    effect for the whole loop; ``cache``: the request's step cache (a
    :class:`~ditattn.cache.runtime.CacheRun`, in effect for the whole loop; None: every forward computed);
    ``check_stop()`` runs before each step (it raises to stop);
    ``on_step(done, total)`` after each; ``progress``: a tqdm bar on stderr.
    """
    from tqdm.auto import tqdm

    do_cfg = guidance > 1.0
    image_embeds = None
    if condition is not None and condition.image_embeds is not None:
        image_embeds = torch.cat([condition.image_embeds] * 2) if do_cfg else condition.image_embeds
    ref_dit = dits["transformer"] if dits["transformer"] is not None else dits["transformer_2"]
    grid = ref_dit.latent_grid(*latents.shape[2:])
    timesteps = scheduler.timesteps
    boundary = None
    if boundary_ratio is not None and dits["transformer_2"] is not None:
        boundary = float(boundary_ratio) * scheduler.config.num_train_timesteps
    used_models = set()
    text_caches: dict = {}  # per expert: projected text + cross-attention K/V, computed once
    bar = tqdm(total=len(timesteps), desc="denoising", unit="step", file=sys.stderr, disable=not progress,
               dynamic_ncols=True, leave=True)
    try:
        with request_scope(state) if state is not None else contextlib.nullcontext(), cache_scope(cache):
            for i, t in enumerate(timesteps):
                if check_stop is not None:
                    check_stop()
                if dits["transformer"] is not None and (boundary is None or float(t) >= boundary):
                    name, scale = "transformer", guidance
                else:
                    name, scale = "transformer_2", guidance_2
                model = dits[name]
                used_models.add(name)
                placement.onload(name)  # stays on the device until another component needs it
                x = (latents if condition is None else condition.model_input(latents)).to(dtype)
                if do_cfg:
                    x = torch.cat([x, x])
                if name not in text_caches:  # block-streamed DiTs project the K/V in each block
                    text_caches[name] = model.encode_text(
                        context, image_embeds if model.config.has_image_input else None,
                        per_block=name not in placement.streamers)
                if condition is not None and condition.mode == "ti2v":
                    ts = condition.timesteps(t, x.shape[0], model.config.patch_size)
                elif expand_timesteps:
                    ts = t.expand(x.shape[0], grid[0] * grid[1] * grid[2])
                else:
                    ts = t.expand(x.shape[0])
                with forward_context(step=i, num_steps=len(timesteps), video_shape=grid, text_len=0):
                    out = model(x, ts, text_cache=text_caches[name])
                if do_cfg:
                    cond, uncond = out.float().chunk(2)
                    pred = uncond + scale * (cond - uncond)
                else:
                    pred = out.float()
                latents = scheduler.step(pred, t, latents, return_dict=False)[0]
                bar.update(1)
                if on_step is not None:
                    on_step(i + 1, len(timesteps))
    finally:
        bar.close()
    return latents, used_models
