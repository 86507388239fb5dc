"""``ditattn calibrate-cache``: uncached generations of the calibration prompts, their per-step signals
recorded (:class:`~ditattn.cache.calibration.Recorder`) and fitted into a calibration JSON."""

from __future__ import annotations

import itertools
import os
import sys

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import RunConfig


def run(cfg: RunConfig) -> int:
    """``ditattn calibrate-cache``; user errors raise :class:`AttentionConfigError`."""
    from ditattn.cache.calibration import Recorder, fit, write_calibration
    from ditattn.cache.runtime import CacheSetting
    from ditattn.pipelines.wan import WanPipelineNative

    c = cfg.calibrate
    if not c.calibrate_prompts:
        raise AttentionConfigError("calibrate-cache needs at least one --prompt")
    if not c.calibrate_output or not c.calibrate_output.lower().endswith(".json"):
        raise AttentionConfigError(f"calibrate-cache needs --output FILE.json, got {c.calibrate_output!r}")
    if cfg.sampling.prompt is not None:
        raise AttentionConfigError("calibrate-cache takes its prompts with --prompt (repeatable), not 'prompt'")
    if any(not p.strip() for p in c.calibrate_prompts):
        raise AttentionConfigError("calibrate-cache: a --prompt is empty; accepted: prompts with text")
    steps = len(cfg.sampling.timesteps) if cfg.sampling.timesteps else cfg.sampling.num_inference_steps
    if steps is not None and steps < 2:
        raise AttentionConfigError(
            f"calibrate-cache needs at least 2 denoising steps (a calibration relates each step to the one before), "
            f"got {steps}"
        )
    if cfg.model.backend != "native":
        raise AttentionConfigError(
            f"calibrate-cache records the step cache's signals in ditattn's native Wan transformer, not with "
            f"--backend {cfg.model.backend}; accepted: --backend native"
        )
    from ditattn.pipelines.output import check_output_target

    check_output_target(c.calibrate_output, flag="--output", writer=False)  # before any work
    replaced = os.path.exists(c.calibrate_output)
    pipe = WanPipelineNative.from_config(cfg)
    kw = cfg.generate_kwargs()
    for key in ("prompt", "seed", "override", "skip_softmax"):
        kw.pop(key)
    _check_calibratable(pipe, cfg)  # before the runs, not after all of them
    runs = []
    res = None
    pairs = list(itertools.product(c.calibrate_prompts, c.calibrate_seeds))
    for i, (prompt, seed) in enumerate(pairs):
        rec = Recorder()
        setting = CacheSetting(rec, {"start_step": 0, "end_step": -1, "taylorseer": False, "taylorseer_order": 1})
        res = pipe.generate(prompt, seed=seed, cache_setting=setting, output_type="latent", progress=False, **kw)
        runs.append(rec)
        sys.stderr.write(f"calibrated {i + 1}/{len(pairs)}: {prompt!r} seed {seed}\n")
    guidance = kw["guidance_scale"] if kw["guidance_scale"] is not None else pipe.defaults["guidance_scale"]
    data = fit(
        runs,
        model=pipe.model_index.name,
        num_steps=res.num_inference_steps,
        guidance_scale=guidance,
        size=(res.height, res.width, res.num_frames),
        prompts=c.calibrate_prompts,
        scheduler=res.sampling.get("scheduler"),
    )
    write_calibration(data, c.calibrate_output)
    mag = data["magcache"]["mag_ratios"]
    print(
        f"wrote {c.calibrate_output}{' (replacing the file that was there)' if replaced else ''}: "
        f"{pipe.model_index.name}, {res.num_inference_steps} steps, {len(pairs)} runs; "
        f"teacache polynomial {[round(v, 4) for v in data['teacache']['coefficients']]}; magcache ratios "
        f"{min(mag[1:]):.3f}-{max(mag[1:]):.3f}"
    )
    return 0


def _check_calibratable(pipe, cfg: RunConfig) -> None:
    """Refuse (one line) a run whose cache state would not run through every step as one forward: a calibration
    relates each step's signal to the previous step's, in one state (two experts, guidance on part of the steps
    or in sequence start states mid-run or split them)."""
    from ditattn.pipelines.sampling import config_sampling_plan, guided_steps

    if pipe.boundary_ratio is not None:
        raise AttentionConfigError(
            f"calibrate-cache cannot calibrate {pipe.model_index.name}: a two-expert model (the cache restarts at "
            "the expert switch, so no signal runs through every step); accepted: a model with one expert"
        )
    s = cfg.sampling
    info = config_sampling_plan(pipe, cfg)
    guidance = s.guidance_scale if s.guidance_scale is not None else pipe.defaults["guidance_scale"]
    guided = sum(guided_steps(info["steps"], s.cfg_interval, guidance > 1.0))
    if 0 < guided < info["steps"]:
        raise AttentionConfigError(
            f"calibrate-cache cannot calibrate with guidance on {guided} of {info['steps']} steps (--cfg-interval): "
            "the unguided steps' forward starts a cache state mid-run; accepted: no --cfg-interval (guidance on "
            "every step), or --guidance-scale 1 (none)"
        )
    if guided and info["cfg_batching"] != "batched":
        why = "" if s.cfg_batching == "sequential" else f" (--cfg-batching auto at {info['tokens']} tokens here)"
        raise AttentionConfigError(
            f"calibrate-cache cannot calibrate with the guidance halves in sequence{why}: each half is its own "
            "forward, and a calibration is one forward per step; accepted: --cfg-batching batched"
        )
