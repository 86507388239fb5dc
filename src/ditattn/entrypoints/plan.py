"""``ditattn plan``: resolve every attention layer of the native pipeline without weights or
denoising and print the plan (``--json``: the plan as a JSON object), on the machine here or on the
platform ``--platform`` simulates (``cfg.simulation``)."""

from __future__ import annotations

import json
import sys

from ditattn.runconfig import RunConfig, flag_name


def run(cfg: RunConfig) -> int:
    """``ditattn plan``; user errors raise :class:`AttentionConfigError`."""
    with cfg.simulation.scope():
        return _plan(cfg)


def _plan(cfg: RunConfig) -> int:
    if cfg.model.backend == "diffusers":
        return _plan_diffusers(cfg)
    from ditattn.pipelines.plan import format_plan
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_config(cfg, load_weights=False)
    state = pipe.prepare_request(cfg.attention.attention_backend_override, cfg.attention.skip_softmax())
    from ditattn.entrypoints.ranks import check_cfg_guidance

    # --cfg-parallel without an unconditional pass is refused as generate's preflight refuses it
    check_cfg_guidance(cfg, pipe.defaults["guidance_scale"], pipe.defaults["num_inference_steps"])
    s = cfg.sampling
    if any(v is not None for v in (s.height, s.width, s.num_frames)):  # a size the model cannot generate is an error
        d = pipe.defaults
        pipe.check_size(s.height or d["height"], s.width or d["width"], s.num_frames or d["num_frames"])
    from ditattn.pipelines.sampling import config_sampling_plan, format_sampling

    sampling = config_sampling_plan(pipe, cfg)
    if pipe.cache_setting is not None:  # as generate refuses them: a start / end step this run cannot take
        guidance = s.guidance_scale if s.guidance_scale is not None else pipe.defaults["guidance_scale"]
        pipe.cache_setting.check_steps(sampling["steps"], guidance_scale=guidance, scheduler=sampling["scheduler"])
    unused = [
        f"--{flag_name(k)}"
        for k in ("prompt", "negative_prompt", "guidance_scale_2", "image", "seed")
        if getattr(s, k) not in (None, 0)
    ]
    m = cfg.model
    unused += [
        f"--{flag_name(k)}"
        for k in ("lora_path", "lora_fuse", "vae_tiling", "vae_slicing")
        if getattr(m, k) not in (None, False, ())
    ]
    unused += ["--offload"] if m.offload != "none" else []
    if unused:  # accepted for symmetry with generate; say so rather than ignore them silently
        sys.stderr.write(
            f"note: {', '.join(unused)} do not change the attention plan (sampling, weights and memory only)\n"
        )
    plan = pipe.plan()
    override = state.override.value if state is not None and state.override is not None else None
    if cfg.json:
        if override is not None:
            plan["request_override"] = override
        plan["sampling"] = sampling
        print(json.dumps(plan, indent=2))
    else:
        dtype = str(pipe.dtype).replace("torch.", "")
        print(format_plan(plan, model=pipe.model_index.name, dtype=dtype, override=override))
        print(format_sampling(sampling))
        cache = pipe.cache_setting
        print(
            f"step cache: {cache.describe() if cache is not None else 'none'}"
            + (f" [reuses {cache.method.facts.reuses}; decided by {cache.method.facts.signal}]" if cache else "")
        )
    return 0


def _plan_diffusers(cfg: RunConfig) -> int:
    """``plan --backend diffusers``: the diffusers pipeline's transformer layers as ditattn routes them."""
    from ditattn.pipelines.diffusers_backend import plan_diffusers, reject_native_only_options
    from ditattn.pipelines.plan import format_plan

    reject_native_only_options(cfg)
    from ditattn.cache.config import resolve_cache

    resolve_cache(cfg.cache.cache_backend, cfg.cache.cache_backend_config, native=False)  # refused: native only
    routing, name, dtype = plan_diffusers(cfg)
    plan = routing.plan()
    override = None
    if cfg.attention.attention_backend_override or cfg.attention.skip_softmax():
        from ditattn.integrations.diffusers import prepare_request

        state = prepare_request(routing, cfg.attention.attention_backend_override, cfg.attention.skip_softmax())
        override = state.override.value if state.override is not None else None
    if cfg.json:
        plan["pipeline"] = "diffusers"
        if override is not None:
            plan["request_override"] = override
        print(json.dumps(plan, indent=2))
    else:
        print(
            format_plan(
                plan,
                model=f"{name} (diffusers pipeline, ditattn attention)",
                dtype=str(dtype).replace("torch.", ""),
                override=override,
            )
        )
    return 0
