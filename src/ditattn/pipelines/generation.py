"""One call of a Wan pipeline's ``generate``: its inputs checked and completed with the model's
defaults (:func:`resolve_inputs`), the scope it runs in (:func:`generation_run`: LoRA scales,
offload, peak memory) and what it returns (:class:`GenerationResult`).  The pipeline itself:
:class:`ditattn.pipelines.wan.WanPipelineNative`."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from ditattn.errors import AttentionConfigError
from ditattn.models.lora import lora_scales
from ditattn.pipelines.conditioning import batch_images, output_size_for_image
from ditattn.pipelines.latents import VideoGeometry
from ditattn.runconfig.checks import float_between, int_between
from ditattn.runconfig.fields import MAX_GUIDANCE, MAX_SEED

SEED, GUIDANCE = int_between(0, MAX_SEED), float_between(0.0, MAX_GUIDANCE)  # the flags' checks


def _checked(name: str, check, value):
    """``check(value)``, its ValueError as an :class:`AttentionConfigError` naming ``name``."""
    try:
        return check(value)
    except ValueError as exc:
        raise AttentionConfigError(f"{name}: {exc}") from None


OUTPUT_TYPES = ("uint8", "float", "latent")


@dataclasses.dataclass
class GenerationInputs:
    """A generate call's batch of N clips: ``prompts`` / ``negatives`` / ``seeds`` (N each),
    ``images`` (N RGB PIL images, or None without image conditioning), the size, the steps and the
    guidance scales (``guidance_2``: the low-noise expert's)."""

    prompts: list[str]
    negatives: list[str]
    seeds: list[int]
    images: Optional[list]
    height: int
    width: int
    num_frames: int
    steps: int
    guidance: float
    guidance_2: float


def resolve_inputs(
    prompt: Union[str, Sequence[str]],
    negative_prompt: Union[str, Sequence[str], None] = None,
    *,
    seed: Union[int, Sequence[int], None],
    image,
    height: Optional[int],
    width: Optional[int],
    num_frames: Optional[int],
    num_inference_steps: Optional[int],
    guidance_scale: Optional[float],
    guidance_scale_2: Optional[float],
    output_type: str,
    defaults: dict,
    geometry: VideoGeometry,
    mode: str,
    two_experts: bool,
) -> GenerationInputs:
    """The arguments of :meth:`~ditattn.pipelines.wan.WanPipelineNative.generate` (same meanings),
    checked, with None filled from ``defaults`` (with an image and neither height nor width: the
    default area at the image's aspect ratio, clamped to 4:1; only one of them: the other from that
    aspect ratio).  ``geometry`` / ``mode`` / ``two_experts``: the
    model's size rules, image conditioning (:func:`~ditattn.pipelines.conditioning.batch_images`)
    and whether it has a low-noise expert.  Raises :class:`AttentionConfigError` naming the argument."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise AttentionConfigError("prompt must be a string or a non-empty list of strings")
    n = len(prompts)
    if negative_prompt is None or isinstance(negative_prompt, str):
        negatives = [negative_prompt or ""] * n
    else:
        negatives = list(negative_prompt)
        if len(negatives) != n:
            raise AttentionConfigError(f"negative_prompt has {len(negatives)} entries for {n} prompts")
    if seed is None:
        seed = 0
    seeds = [int(seed) + i for i in range(n)] if isinstance(seed, (int, np.integer)) else [int(s) for s in seed]
    if len(seeds) != n:
        raise AttentionConfigError(f"seed has {len(seeds)} entries for {n} prompts")
    for s in seeds:  # the CLI's and RunConfig's own check (seed + i for prompt i)
        _checked("seed", SEED, s)
    images = batch_images(image, n, mode)
    d = defaults
    if images is not None:
        height, width = output_size_for_image(
            images[0].width, images[0].height, height, width, d["height"] * d["width"], geometry.size_multiple
        )
    height = d["height"] if height is None else height
    width = d["width"] if width is None else width
    num_frames = d["num_frames"] if num_frames is None else num_frames
    steps = d["num_inference_steps"] if num_inference_steps is None else num_inference_steps
    guidance = d["guidance_scale"] if guidance_scale is None else float(guidance_scale)
    for name, g in (("guidance_scale", guidance), ("guidance_scale_2", guidance_scale_2)):
        if g is not None:
            _checked(name, GUIDANCE, g)
    if guidance_scale_2 is not None and not two_experts:
        raise AttentionConfigError(
            "guidance_scale_2 applies to two-expert checkpoints (Wan 2.2 A14B, with "
            "boundary_ratio); this one has a single transformer"
        )
    guidance_2 = guidance if guidance_scale_2 is None else float(guidance_scale_2)
    if guidance_scale_2 is not None and guidance <= 1.0 < guidance_2:
        raise AttentionConfigError(
            f"guidance_scale_2 {guidance_2:g} would have no effect: classifier-free guidance is on only when "
            f"guidance_scale (the high-noise expert's, {guidance:g}) is above 1, which decides whether the negative "
            "prompt is encoded at all; accepted: guidance_scale above 1 with it, or leave guidance_scale_2 out"
        )
    geometry.check_size(height, width, num_frames)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise AttentionConfigError(f"num_inference_steps must be a positive integer, got {steps!r}")
    if output_type not in OUTPUT_TYPES:
        raise AttentionConfigError(f"output_type must be uint8, float or latent, got {output_type!r}")
    return GenerationInputs(prompts, negatives, seeds, images, height, width, num_frames, steps, guidance, guidance_2)


@dataclasses.dataclass
class GenerationResult:
    """What one pipeline call produced.

    frames: ``np.uint8 [N, F, H, W, 3]`` (or float32 in [0, 1] with ``output_type="float"``, or the
    final latents ``[N, C, T, H/8, W/8]`` tensor with ``output_type="latent"``); attention_backends:
    the backends the DiT's attention ran in this call (the request override when one was given);
    timings: seconds per stage (``text``, ``image``, ``denoise``, ``decode``, ``total``); stats: request
    statistics reported by backends (e.g. skip-softmax tile fractions); peak_memory: the most bytes
    allocated on the CUDA device during the call (None elsewhere); cache: the step cache's report
    (:meth:`~ditattn.cache.runtime.CacheRun.stats`: forwards computed and reused, with the setting) or None.
    """

    frames: Any
    attention_backends: list[str]
    timings: dict[str, float]
    stats: dict
    latents: torch.Tensor  # the final latents [N, C, T, H/8, W/8] (float32) that were decoded
    seeds: list[int]
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    peak_memory: Optional[int] = None
    #: the sampler and guidance that ran: scheduler, flow_shift, timesteps (explicit list or None),
    #: forwards (DiT passes per clip: 2 per guided step, 1 otherwise), cfg (off / batched / sequential ...)
    sampling: dict = dataclasses.field(default_factory=dict)
    cache: Optional[dict] = None


@dataclasses.dataclass
class GenerationRun:
    device: Optional[torch.device]  # CUDA device whose peak memory is measured, else None

    def peak_memory(self) -> Optional[int]:
        return None if self.device is None else int(torch.cuda.max_memory_allocated(self.device))


@contextlib.contextmanager
def generation_run(placement, device: torch.device, scales: Optional[dict], lock) -> Iterator[GenerationRun]:
    """One generation: the LoRA ``scales`` in effect (:func:`~ditattn.models.lora.lora_scales`), one
    call at a time under ``lock`` when components move (``placement``:
    :class:`~ditattn.pipelines.offload.ComponentPlacement` with offload), every offloaded component
    back on the CPU afterwards, CUDA peak memory measured on ``device``."""
    lock = lock if placement.offloaded else contextlib.nullcontext()
    cuda = device.type == "cuda"
    with lock, lora_scales(scales):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        run = GenerationRun(device if cuda else None)
        try:
            yield run
        finally:
            placement.release()


def cfg_split(do_cfg: bool, cfg_batching: str):
    """This rank's CFG-parallel state when the run is guided (:func:`~ditattn.distributed.cfg.get_cfg_parallel`),
    else None; a ``cfg_batching`` other than ``auto`` under CFG parallelism is refused (the halves run on
    their own ranks, neither batched nor in sequence)."""
    from ditattn.distributed.cfg import get_cfg_parallel

    split = get_cfg_parallel() if do_cfg else None
    if split is not None and cfg_batching != "auto":
        raise AttentionConfigError(
            f"cfg_batching {cfg_batching}: with CFG parallelism (--cfg-parallel) each guidance half runs on its "
            "own ranks, neither batched nor in sequence; accepted: cfg_batching auto, or no --cfg-parallel"
        )
    return split


#: why a run's numbers go non-finite, and what to try: said by both backends' refusals
NON_FINITE_CAUSES = (
    "causes: non-finite weights, e.g. a broken LoRA or checkpoint, or an overflow in float16; try --dtype "
    "bfloat16 or float32"
)


def check_finite(latents: torch.Tensor) -> None:
    """Refuse denoised ``latents`` holding NaN or inf (one device sync): decoded, they would be a black or
    garbage clip reported as a result."""
    if not bool(torch.isfinite(latents).all()):
        raise AttentionConfigError(
            f"the denoised latents hold NaN or inf values, so no frames are decoded or saved ({NON_FINITE_CAUSES})"
        )


def cache_report(cache, split, guided) -> Optional[dict]:
    """The step cache's report of a run (None without a cache); under CFG parallelism both halves' forwards
    (each rank saw its own half only), gathered over the CFG group (collective: every rank calls it)."""
    if cache is None:
        return None
    stats = cache.stats()
    if split is None:
        return stats
    import torch.distributed as dist

    from ditattn.cache.runtime import merge_cfg_halves

    halves = [None] * split.degree
    dist.all_gather_object(halves, (stats, cache.forward_blocks_run), group=split.group)
    return merge_cfg_halves(halves, guided)
