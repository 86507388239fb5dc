"""Sequence-parallel runs of a command (``--num-gpus N``): refuse what can be refused before any
rank starts, then run the command's rank function on every rank through
:func:`ditattn.distributed.launch.launch`."""

from __future__ import annotations

from typing import Callable, Optional

from ditattn import settings
from ditattn.distributed.launch import RankInfo, check_devices, in_worker, launch, own_result, under_torchrun
from ditattn.errors import AttentionConfigError
from ditattn.runconfig import RunConfig


def needs_ranks(cfg: RunConfig) -> bool:
    """More than one rank asked for, and this process is not already one of them."""
    return cfg.parallel.num_gpus > 1 and not in_worker()


def preflight(cfg: RunConfig) -> None:
    """What can be refused before any rank starts (a refused run should not load a large model N
    times): the native pipeline is built as for ``ditattn plan`` — on the meta device, no weights —
    under the run's attention settings and degrees, so heads that do not divide by the Ulysses
    degree, ring with a backend without LSE (sparse included), bad overrides and a refused
    ``--attention-backend-override`` raise :class:`AttentionConfigError` here, and so does
    ``--cfg-parallel`` without guidance (:func:`check_cfg_guidance`).  Skipped for
    ``--backend diffusers``."""
    if cfg.model.backend != "native":
        return
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_config(cfg, load_weights=False)
    pipe.prepare_request(cfg.attention.attention_backend_override, cfg.attention.skip_softmax())
    if cfg.parallel.cfg_parallel:
        check_cfg_guidance(cfg, pipe.defaults["guidance_scale"], pipe.defaults["num_inference_steps"])


def check_cfg_guidance(cfg: RunConfig, default: Optional[float] = None, default_steps: Optional[int] = None) -> None:
    """Refuse ``--cfg-parallel`` when the run has no unconditional pass to put on the second half of
    the ranks: a guidance scale <= 1 (``--guidance-scale``, else ``default``, the model's), or a
    ``--cfg-interval`` that guides none of the steps (``--num-inference-steps`` / ``--timesteps``, else
    ``default_steps``); and with a ``--cfg-batching`` other than ``auto``, which the halves on their own
    ranks cannot follow."""
    if not cfg.parallel.cfg_parallel:
        return
    s = cfg.sampling
    g = s.guidance_scale if s.guidance_scale is not None else default
    if g is not None and g <= 1.0:
        where = "--guidance-scale" if s.guidance_scale is not None else "this model's default guidance scale"
        raise AttentionConfigError(
            f"--cfg-parallel runs the unconditional pass on half of the ranks, but {where} is {g:g} (<= 1: no "
            f"unconditional pass); use --guidance-scale above 1, or drop --cfg-parallel"
        )
    if s.cfg_batching != "auto":
        raise AttentionConfigError(
            f"--cfg-batching {s.cfg_batching}: with --cfg-parallel each guidance half runs on its own ranks, neither "
            "batched nor in sequence; accepted: --cfg-batching auto, or no --cfg-parallel"
        )
    steps = len(s.timesteps) if s.timesteps else (s.num_inference_steps or default_steps)
    if s.cfg_interval is not None and steps:
        from ditattn.pipelines.sampling import guided_steps

        if not any(guided_steps(steps, s.cfg_interval)):
            start, end = s.cfg_interval
            raise AttentionConfigError(
                f"--cfg-interval {start:g}:{end:g} guides none of the {steps} steps (step i is guided when START <= "
                "i / steps < END), so --cfg-parallel has no unconditional pass for half of the ranks; widen the "
                "interval or drop --cfg-parallel"
            )


def run_on_ranks(rank_fn: Callable[[RankInfo, RunConfig], int], cfg: RunConfig) -> int:
    """Run ``rank_fn(rank, cfg)`` on ``cfg.parallel.num_gpus`` ranks (spawned, or this process's
    rank under ``torchrun``) after the device check and the :func:`preflight`; return this
    process's exit status (rank 0's after a spawn).  ``rank_fn`` must be a module-level function;
    ranks other than 0 print nothing to stdout."""
    import torch

    n = cfg.parallel.num_gpus
    u, r = cfg.parallel.degrees()
    device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not under_torchrun():
        check_devices(device, n)
    preflight(cfg)
    results = launch(
        rank_fn,
        n,
        args=(cfg,),
        device=device,
        ulysses_degree=u,
        ring_degree=r,
        timeout_s=settings.dist_timeout_s(),
        quiet_followers=True,
        cfg_degree=cfg.parallel.cfg_degree(),
    )
    return int(own_result(results) or 0)
