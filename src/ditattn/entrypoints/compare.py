"""``ditattn compare``: the RunConfig becomes a typed :class:`~ditattn.evaluation.compare.CompareConfig`;
the work is :func:`ditattn.evaluation.compare.run_compare`."""

from __future__ import annotations

import dataclasses
import json

from ditattn.errors import AttentionConfigError
from ditattn.runconfig import RunConfig, flag_name


def compare_config(cfg: RunConfig):
    """The :class:`~ditattn.evaluation.compare.CompareConfig` of this run; user errors raise
    :class:`AttentionConfigError` (attention settings are per variant, so the global attention
    flags other than autotune are refused; the native pipeline on one device)."""
    from ditattn.evaluation.compare import CompareConfig, parse_variant

    refused = [f"--{flag_name(k)}" for k in cfg.attention.given() if k != "enable_attention_backend_autotune"]
    if refused:
        raise AttentionConfigError(
            f"compare takes its attention settings per variant, not {', '.join(refused)}; "
            "accepted: --variant NAME=BACKEND[:k=v;k=v][@component=backend,...]"
        )
    if cfg.model.dit_quantization != "none":
        raise AttentionConfigError(
            "compare takes the DiT quantization per variant, not --dit-quantization; accepted: "
            "--variant NAME=BACKEND+fp8 (or +int8)"
        )
    p = cfg.parallel
    if cfg.model.backend != "native" or p.num_gpus != 1 or p.cfg_parallel or p.vae_parallel:
        raise AttentionConfigError(
            "compare runs the native pipeline on one device; accepted: --backend native, "
            "--num-gpus 1 (no --cfg-parallel / --vae-parallel)"
        )
    s, c, o = cfg.sampling, cfg.compare, cfg.output
    if s.prompt is not None or s.seed is not None:
        raise AttentionConfigError(
            "compare takes 'prompts' and 'seeds' (flags --prompt, --seed, both repeatable), not 'prompt' / 'seed'"
        )
    if not c.variant:
        raise AttentionConfigError("compare needs --variant NAME=SPEC at least twice (the first is the reference)")
    return CompareConfig(
        variants=[parse_variant(v) for v in c.variant],
        prompts=list(c.prompts),
        seeds=list(c.seeds),
        model_path=cfg.model.model_path,
        device=cfg.model.device,
        dtype=cfg.model.dtype,
        negative_prompt=s.negative_prompt,
        num_inference_steps=s.num_inference_steps,
        guidance_scale=s.guidance_scale,
        height=s.height,
        width=s.width,
        num_frames=s.num_frames,
        sampling={
            k: getattr(s, k)
            for k in ("scheduler", "flow_shift", "timesteps", "cfg_interval", "cfg_batching")
            if getattr(s, k) is not None
        },
        capture_steps=c.capture_steps,
        capture_rows=c.capture_rows,
        in_context=c.in_context,
        warmup=c.warmup,
        output_dir=o.output_path,
        write_video=c.write_video,
        save_clips=c.save_clips,
        fps=o.fps or 16,
        base=dataclasses.replace(cfg.attention_settings(), backend=None),
        dit_weights=cfg.model.dit_weights,
    )


def run(cfg: RunConfig) -> int:
    """``ditattn compare``: run, write the files, print their paths and the summary table (or the
    report with ``--json``)."""
    import torch

    from ditattn.entrypoints.generate import _tune_cpu_threads
    from ditattn.evaluation.compare import format_summary, json_ready, run_compare

    ccfg = compare_config(cfg)
    from ditattn.pipelines.output import check_output_folder

    check_output_folder(ccfg.output_dir, flag="--output-path")  # before any run, not after all of them
    threads = torch.get_num_threads()
    _tune_cpu_threads(cfg.model.device)  # on a busy CPU, fewer threads run much faster (see its docstring)
    try:
        report = run_compare(ccfg)
    finally:
        torch.set_num_threads(threads)
    if cfg.json:
        print(json.dumps(json_ready(report), indent=1))
        return 0
    for note in report.get("notes", []):
        print(f"note: {note}")
    for key, val in report["files"].items():
        print(f"{key}: {', '.join(val) if isinstance(val, list) else val}")
    print(format_summary(report))
    return 0
