"""The run configuration's sections for how the denoising loop runs: :class:`SamplingConfig`
(prompt, size, steps, guidance, sampler, timesteps, CFG interval and batching) and
:class:`CacheOptions` (the step cache).  Re-exported by :mod:`ditattn.runconfig`."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from ditattn.runconfig.checks import (
    float_between,
    fraction_interval,
    int_between,
    one_of,
    optional,
    text,
    text_or_mapping,
    timestep_list,
)
from ditattn.runconfig.fields import MAX_FRAMES, MAX_GUIDANCE, MAX_SEED, MAX_SIDE, MAX_STEPS
from ditattn.runconfig.fields import Section as _Section
from ditattn.runconfig.fields import setting as _field

#: samplers of the denoising loop (ditattn.pipelines.sampling); None: the checkpoint's own scheduler
SCHEDULERS = ("flow_euler", "unipc", "dpmpp", "lcm")
#: how the two halves of classifier-free guidance run (ditattn.pipelines.sampling.resolve_cfg_batching)
CFG_BATCHING = ("auto", "batched", "sequential")


@dataclasses.dataclass(frozen=True)
class SamplingConfig(_Section):
    """Prompt and sampling; None takes the model's default (``serve``: the default of requests)."""

    prompt: Optional[str] = _field(
        None, optional(text), "text prompt (required for generate; here or in --config)", metavar="PROMPT"
    )
    negative_prompt: Optional[str] = _field(
        None, optional(text), "negative prompt for classifier-free guidance", metavar="TEXT"
    )
    num_inference_steps: Optional[int] = _field(
        None, optional(int_between(1, MAX_STEPS)), "denoising steps (default: the model's)", metavar="N"
    )
    guidance_scale: Optional[float] = _field(
        None,
        optional(float_between(0.0, MAX_GUIDANCE)),
        "classifier-free guidance scale, > 1 enables guidance (default: the model's)",
        metavar="G",
    )
    guidance_scale_2: Optional[float] = _field(
        None,
        optional(float_between(0.0, MAX_GUIDANCE)),
        "guidance scale of the low-noise expert of two-expert Wan 2.2 "
        "checkpoints (default: --guidance-scale); the switch point is the "
        "checkpoint's boundary_ratio",
        metavar="G",
    )
    image: Optional[str] = _field(
        None,
        optional(text),
        "first frame for image-to-video checkpoints (Wan 2.1 I2V, Wan 2.2 I2V-A14B: "
        "required; TI2V-5B: optional): a local PNG, JPEG, WebP or BMP file. Without "
        "--height/--width the output takes the model's default area at the image's aspect "
        "ratio (clamped to 4:1); with only one of them the other follows that ratio",
        metavar="PATH",
    )
    height: Optional[int] = _field(
        None, optional(int_between(1, MAX_SIDE)), "output height in pixels (default: the model's)", metavar="H"
    )
    width: Optional[int] = _field(
        None, optional(int_between(1, MAX_SIDE)), "output width in pixels (default: the model's)", metavar="W"
    )
    num_frames: Optional[int] = _field(
        None, optional(int_between(1, MAX_FRAMES)), "frames, 1 = image (default: the model's)", metavar="F"
    )
    seed: Optional[int] = _field(
        None,
        optional(int_between(0, MAX_SEED)),
        "random seed, an integer >= 0 (default 0; serve refuses it: requests carry their own)",
        metavar="S",
    )
    scheduler: Optional[str] = _field(
        None,
        optional(one_of(*SCHEDULERS)),
        "sampler: flow_euler, unipc, dpmpp "
        "(flow-prediction DPM-Solver++), lcm (predict x0, re-noise; for step-distilled "
        "checkpoints) (default: the checkpoint's own, unipc for Wan)",
        metavar="NAME",
    )
    flow_shift: Optional[float] = _field(
        None,
        optional(float_between(0.0, 100.0, lo_open=True)),
        "flow-matching timestep shift (default: the checkpoint's, e.g. 3.0 for Wan 2.1 480p)",
        metavar="X",
    )
    timesteps: Optional[tuple] = _field(
        None,
        optional(timestep_list),
        "explicit descending timesteps, e.g. "
        "1000,750,500,250 as distilled checkpoints ship; each T runs at sigma = "
        "shift(T / num_train_timesteps); overrides num-inference-steps",
        metavar="T1,T2,...",
    )
    cfg_interval: Optional[tuple] = _field(
        None,
        optional(fraction_interval),
        "guide only steps i of n with START "
        "<= i/n < END (fractions of the schedule); other steps run the "
        "conditional pass only (default 0:1, every step)",
        metavar="START:END",
    )
    cfg_batching: str = _field(
        "auto",
        one_of(*CFG_BATCHING),
        "classifier-free guidance halves as one batch-2 "
        "forward (batched), two batch-1 forwards (sequential), or auto (the rule in "
        "docs/steps.md)",
        metavar="auto|batched|sequential",
    )


def _cache_name(value: Any) -> str:
    from ditattn.cache.registry import CACHE_BACKENDS

    return one_of(*CACHE_BACKENDS)(value.strip().lower() if isinstance(value, str) else value)


@dataclasses.dataclass(frozen=True)
class CacheOptions(_Section):
    """The step cache: which method skips the DiT work that does not change between steps, and its keys
    (:mod:`ditattn.cache`; ``docs/caching.md``)."""

    cache_backend: Optional[str] = _field(
        None,
        optional(_cache_name),
        "step cache: none, teacache, magcache or first_block_cache (docs/caching.md)",
        metavar="NAME",
    )
    cache_backend_config: Union[str, dict, None] = _field(
        None,
        optional(text_or_mapping),
        "step-cache keys: a "
        ".json/.yaml file, a JSON object or k=v pairs, e.g. "
        "threshold=0.1,start_step=2 or taylorseer=true",
        metavar="CFG",
    )

    def __post_init__(self):
        super().__post_init__()
        from ditattn.cache.config import validate_cache

        validate_cache(self.cache_backend, self.cache_backend_config)  # names, keys, types, ranges
