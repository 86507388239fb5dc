"""The denoising loop of the Wan pipelines (:class:`~ditattn.pipelines.wan.WanPipelineNative`).

Each step picks the expert — ``transformer`` while the timestep is at or above the boundary
(``boundary_ratio * num_train_timesteps``, two-expert Wan 2.2 checkpoints), ``transformer_2`` below
it — runs it on the latents (with the image condition of image-to-video checkpoints, and the
conditional and unconditional halves in one batch under classifier-free guidance, or as two
forwards, on the steps of the guidance interval), combines the halves with that expert's guidance
scale and lets the scheduler step.  The text side of each expert
(projected text and cross-attention K/V, :meth:`~ditattn.models.wan.transformer.WanTransformer.encode_text`)
is computed once per loop.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Mapping, Optional, Sequence

import torch

from ditattn.attention.context import RequestState, forward_context, request_scope
from ditattn.cache.runtime import cache_scope
from ditattn.distributed.cfg import get_cfg_parallel
from ditattn.pipelines.conditioning import ImageCondition


def denoise(
    latents: torch.Tensor,
    scheduler,
    dits: Mapping[str, Optional[torch.nn.Module]],
    *,
    context: torch.Tensor,
    condition: Optional[ImageCondition],
    guidance: float,
    guidance_2: float,
    boundary_ratio: Optional[float],
    expand_timesteps: bool,
    placement,
    dtype: torch.dtype,
    state: Optional[RequestState] = None,
    cache=None,
    progress: bool = True,
    on_step: Optional[Callable[[int, int], None]] = None,
    check_stop: Optional[Callable[[], None]] = None,
    guided: Optional[Sequence[bool]] = None,
    sequential_cfg: bool = False,
    step_kwargs: Optional[dict] = None,
) -> tuple[torch.Tensor, set[str]]:
    """Run ``scheduler`` (its timesteps set) over ``latents [N, z, T, h, w]`` (float32, on the
    DiTs' device) and return the final latents (float32) and the names of the experts that ran.

    dits: ``{"transformer": model or None, "transformer_2": model or None}``; context: text
    features ``[N, L, text_dim]``, or ``[2N, ...]`` (conditional, then unconditional) when
    ``guidance > 1`` enables classifier-free guidance (the first scale decides, as in diffusers);
    condition: the batch's image condition or None; guidance_2: the low-noise expert's scale;
    placement: the :class:`~ditattn.pipelines.offload.ComponentPlacement` that brings each expert
    onto the device; dtype: the DiTs' compute dtype.  ``state``: the request's attention state, in
    effect for the whole loop; ``cache``: the request's step cache (a
    :class:`~ditattn.cache.runtime.CacheRun`, in effect for the whole loop; None: every forward computed;
    it keeps one state per ``branch`` of the forward context, so batched CFG decides for both halves
    at once and sequential or CFG-parallel halves decide each for itself);
    ``check_stop()`` runs before each step (it raises to stop);
    ``on_step(done, total)`` after each; ``progress``: a tqdm bar on stderr.  ``guided``: per step,
    whether it runs guidance (None: every step when ``guidance > 1``; an unguided step of a guided run
    computes the conditional half only); ``sequential_cfg``: a guided step runs its halves as two
    forwards of N (``branch`` ``"cond"`` then ``"uncond"`` in the forward context) instead of one of
    2N; ``step_kwargs``: extra arguments of ``scheduler.step`` (:class:`~ditattn.pipelines.sampling.Sampler`).
    Under CFG parallelism (:mod:`ditattn.distributed.cfg`) this rank runs only its guidance half of
    each guided forward and the halves are all-gathered before they are combined (same result on
    every rank); unguided steps compute the conditional half on every rank.
    """
    from tqdm.auto import tqdm

    do_cfg = guidance > 1.0
    split = get_cfg_parallel() if do_cfg else None  # CFG parallelism: this rank's half of guided forwards
    timesteps = scheduler.timesteps
    guided = [do_cfg] * len(timesteps) if guided is None else [bool(g) and do_cfg for g in guided]
    n = latents.shape[0]
    images = condition.image_embeds if condition is not None else None
    ref_dit = dits["transformer"] if dits["transformer"] is not None else dits["transformer_2"]
    grid = ref_dit.latent_grid(*latents.shape[2:])
    boundary = None
    if boundary_ratio is not None and dits["transformer_2"] is not None:
        boundary = float(boundary_ratio) * scheduler.config.num_train_timesteps
    used_models = set()
    text_caches: dict = {}  # per expert and part: projected text + cross-attention K/V, computed once

    def text_cache(name: str, model, part: str):
        """part: "all" (the context as given: 2N rows under CFG), "cond" or "uncond" (N rows)."""
        if (name, part) not in text_caches:  # block-streamed DiTs project the K/V in each block
            ctx = context if part == "all" else context[:n] if part == "cond" else context[n:]
            img = None
            if images is not None and model.config.has_image_input:
                img = torch.cat([images] * 2) if part == "all" and do_cfg else images
            text_caches[(name, part)] = model.encode_text(ctx, img, per_block=name not in placement.streamers)
        return text_caches[(name, part)]

    def forward(step: tuple, xb: torch.Tensor, part: str, branch: Optional[str]) -> torch.Tensor:
        """One DiT forward of step ``(expert name, model, t, i)`` on ``xb`` with the text ``part``."""
        name, model, t, i = step
        if condition is not None and condition.mode == "ti2v":
            ts = condition.timesteps(t, xb.shape[0], model.config.patch_size)
        elif expand_timesteps:
            ts = t.expand(xb.shape[0], grid[0] * grid[1] * grid[2])
        else:
            ts = t.expand(xb.shape[0])
        with forward_context(step=i, num_steps=len(timesteps), video_shape=grid, text_len=0, branch=branch):
            return model(xb, ts, text_cache=text_cache(name, model, part)).float()

    bar = tqdm(
        total=len(timesteps),
        desc="denoising",
        unit="step",
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        leave=True,
    )
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
                step = (name, model, t, i)
                if guided[i] and split is not None:
                    cond, uncond = split.gather(forward(step, x, split.branch, split.branch))
                elif guided[i] and sequential_cfg:
                    cond, uncond = forward(step, x, "cond", "cond"), forward(step, x, "uncond", "uncond")
                elif guided[i]:
                    cond, uncond = forward(step, torch.cat([x, x]), "all", None).chunk(2)
                if guided[i]:
                    pred = uncond + scale * (cond - uncond)
                else:  # no guidance, or a step outside the guidance interval: the conditional half only
                    pred = forward(step, x, "cond", "cond") if do_cfg else forward(step, x, "all", None)
                latents = scheduler.step(pred, t, latents, return_dict=False, **(step_kwargs or {}))[0]
                bar.update(1)
                if on_step is not None:
                    on_step(i + 1, len(timesteps))
    finally:
        bar.close()
    return latents, used_models
