"""``ditattn generate``: run the pipeline, write the output, print its path and a timing line.

:func:`run` takes a :class:`~ditattn.runconfig.RunConfig`, generates one clip, writes it (MP4 for
clips, PNG for one frame) and prints the file path and, as the last line, a one-line timing
summary; ``--num-gpus N`` runs it on N ranks (rank 0 prints and writes).

Default settings: each built-in model has its own (:mod:`ditattn.models.builtin`; the default
``ditattn:tiny-wan``: 128x128, 9 frames, 8 steps, guidance 5.0), seed 0, float32 on CPU (about 2 s of compute on 2 idle
cores; most of a cold run is importing torch
and diffusers, ~12 s end to end).  Real checkpoints default to 832x480, 81 frames, 50 steps.  On a
CPU run the number of torch threads follows the idle cores (see :func:`_tune_cpu_threads`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from ditattn import settings
from ditattn.distributed.launch import RankInfo
from ditattn.entrypoints.ranks import check_cfg_guidance, needs_ranks, run_on_ranks
from ditattn.errors import AttentionConfigError
from ditattn.runconfig import RunConfig


def run(cfg: RunConfig) -> int:
    """``ditattn generate``; user errors raise :class:`AttentionConfigError`."""
    t_start = time.perf_counter()
    s = cfg.sampling
    if s.prompt is None:
        raise AttentionConfigError("--prompt is required (on the command line, or as 'prompt' in --config)")
    if not s.prompt.strip():
        raise AttentionConfigError("--prompt must not be empty")
    if s.image is not None:  # a missing or unreadable image fails before any loading
        from ditattn.pipelines.conditioning import load_image

        load_image(s.image, where="--image")
    if s.num_frames == 1 and cfg.output.fps is not None:
        raise AttentionConfigError("--fps applies to videos only; --num-frames 1 writes a single frame (PNG)")
    if cfg.model.backend == "diffusers":
        from ditattn.pipelines.diffusers_backend import reject_native_only_options

        reject_native_only_options(cfg)  # before any launch: sequence parallelism is native-only
    cfg.parallel.degrees()  # (2 with --cfg-parallel) x U x R must equal --num-gpus
    check_cfg_guidance(cfg)  # --cfg-parallel with --guidance-scale <= 1 (the model's default: in the preflight)
    if needs_ranks(cfg):  # each rank runs run_rank below
        return run_on_ranks(run_rank, cfg)
    return generate_here(cfg, t_start)


def run_rank(rank: RankInfo, cfg: RunConfig) -> int:
    """What each rank of ``generate --num-gpus N`` runs: the same generation on its device; only
    rank 0 writes the output."""
    return generate_here(cfg.for_rank(rank.rank, rank.device), time.perf_counter())


def generate_here(cfg: RunConfig, t_start: float) -> int:
    """Generate in this process (one rank, or the whole run)."""
    import torch

    threads = torch.get_num_threads()
    try:
        if cfg.model.backend == "diffusers":
            return _generate_diffusers(cfg, t_start)
        return _generate_native(cfg, t_start)
    finally:
        torch.set_num_threads(threads)  # _tune_cpu_threads may have lowered it for this run


def _tune_cpu_threads(device) -> None:
    """On a CPU run, use only the cores other processes leave idle (1-minute load average).

    PyTorch's OpenMP threads spin-wait at barriers, so when the machine is already busy, running
    as many threads as cores makes them fight the other work: on a loaded 2-core machine the default
    run was 3-4x slower with 2 threads than with 1.  ``OMP_NUM_THREADS`` or ``DITATTN_NUM_THREADS``
    set by the user win; an idle machine keeps torch's default.
    """
    import logging
    import os

    import torch

    if str(device or "cpu").split(":")[0] != "cpu" and torch.cuda.is_available():
        return
    explicit = settings.num_threads()
    if explicit is not None:
        torch.set_num_threads(explicit)
        return
    if os.environ.get("OMP_NUM_THREADS") or not hasattr(os, "getloadavg"):
        return
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0]
    want = max(1, min(torch.get_num_threads(), int(cores - busy + 0.5)))
    if want < torch.get_num_threads():
        logging.getLogger("ditattn.pipeline").info(
            "load average %.1f on %d cores: using %d CPU thread(s)", busy, cores, want
        )
        torch.set_num_threads(want)


def _output_path(cfg: RunConfig, num_frames: Optional[int]) -> Optional[str]:
    """The file this run writes (None with --no-save-output), checked before any work: name and
    extension, a writable folder, the writer installed; an existing file gets a numeric suffix
    unless --overwrite (chosen again when writing, so a file created meanwhile is kept too)."""
    from ditattn.pipelines.output import check_output_target, output_file_path, split_output_target, unused_path

    o, s = cfg.output, cfg.sampling
    if not o.save_output:
        return None
    folder, name = split_output_target(o.output_path, o.output_file)
    flag = "--output-file" if o.output_file else "--output-path"
    path = output_file_path(folder, name, s.prompt, s.seed or 0, num_frames, flag=flag)
    check_output_target(path)
    return unused_path(path, o.overwrite)


def _write(cfg: RunConfig, frames, num_frames: int) -> Optional[str]:
    from ditattn.pipelines.output import save_frames

    path = _output_path(cfg, num_frames)
    if path is None:
        return None
    try:
        return save_frames(frames, path, fps=cfg.output.fps or 16)
    except OSError as exc:
        raise AttentionConfigError(
            f"cannot write {path}: {exc.strerror or exc}; choose another --output-path"
        ) from None


def _report(
    cfg: RunConfig,
    frames,
    *,
    t_start: float,
    load: float,
    steps: int,
    size: tuple,
    num_frames: int,
    parts: dict,
    backends: str,
    stats: Optional[dict] = None,
    peak_memory: Optional[int] = None,
    sampling: Optional[dict] = None,
    cache: Optional[dict] = None,
) -> None:
    """Write the output, print its path, the attention stats and the one-line timing summary (with
    the sampler, the DiT forwards per clip and the CFG mode of ``sampling`` when given, and the peak
    CUDA memory of the generation when it ran on a GPU)."""
    t0 = time.perf_counter()
    path = _write(cfg, frames, num_frames)
    parts = {**parts, "save": time.perf_counter() - t0}
    if path:
        print(f"saved: {path}")
    if stats:
        print(f"attention stats: {json.dumps(stats, default=str)}")
    w, h = size
    detail = ", ".join(f"{k} {v:.1f}s" for k, v in parts.items())
    if "denoise" in parts:
        detail += f"; {parts['denoise'] / max(steps, 1):.2f}s/step"
    where = "" if path else " (not saved)"
    total = time.perf_counter() - t_start
    peak = f"; peak GPU memory {peak_memory / 2**30:.1f} GiB" if peak_memory is not None else ""
    how = ""
    if sampling:  # e.g. ", lcm shift 5, 4 DiT forwards, CFG off"
        how = (
            f", {sampling['scheduler']} shift {sampling['flow_shift']:g}, {sampling['forwards']} DiT forwards, "
            f"CFG {sampling['cfg']}"
        )
    step_cache = ""
    if cache is not None:  # the step cache counts DiT calls (a batched CFG call carries both halves)
        step_cache = (
            f"; step cache {cache['backend']}: {cache['computed']} of {cache['forwards']} DiT calls "
            f"computed, {cache['reused']} reused"
        )
    print(
        f"done in {total:.1f}s{where}: {w}x{h}, {num_frames} frame{'s' if num_frames != 1 else ''}, {steps} steps"
        f"{how} (load {load:.1f}s, {detail}); DiT attention: {backends}{peak}{step_cache}"
    )
    sys.stdout.flush()


def _generate_native(cfg: RunConfig, t_start: float) -> int:
    from ditattn.distributed.groups import sequence_parallel_rank
    from ditattn.pipelines.wan import WanPipelineNative

    cfg.attention_settings()  # refuse bad attention flags before any work
    kw = cfg.generate_kwargs()
    _tune_cpu_threads(cfg.model.device)
    _output_path(cfg, cfg.sampling.num_frames)  # refuse an unwritable output before loading
    from ditattn.pipelines.sampling import check_sampling_settings

    check_sampling_settings(cfg)  # ... and sampler settings the checkpoint's scheduler cannot take
    t0 = time.perf_counter()
    pipe = WanPipelineNative.from_config(cfg, lora_fuse=True)  # one run: LoRAs fused unless --lora-fuse false
    _output_path(cfg, kw["num_frames"] or pipe.defaults["num_frames"])  # ... and with the frame count, before the work
    _warn_if_slow(pipe, kw)
    state = pipe.prepare_request(kw.pop("override"), kw.pop("skip_softmax"))
    load = time.perf_counter() - t0 + (t0 - t_start)
    res = pipe.generate(**kw, request_state=state, progress=sequence_parallel_rank() == 0)  # one bar: rank 0's
    parts = {k: res.timings[k] for k in ("text", "image", "denoise", "decode") if k in res.timings}
    _report(
        cfg,
        res.frames[0],
        t_start=t_start,
        load=load,
        steps=res.num_inference_steps,
        size=(res.width, res.height),
        num_frames=res.num_frames,
        parts=parts,
        backends=",".join(res.attention_backends) + _linears_note(pipe),
        stats=res.stats,
        peak_memory=res.peak_memory,
        sampling=res.sampling,
        cache=res.cache,
    )
    return 0


def _warn_if_slow(pipe, kw: dict) -> None:
    """On the CPU: a warning on stderr, with the estimate, when the request would take minutes
    (:mod:`ditattn.pipelines.estimate`); the run goes on."""
    from ditattn.pipelines.estimate import WARN_SECONDS, estimate, human_seconds

    if pipe.device.type != "cpu":
        return
    dit = "transformer" if "transformer" in pipe.components else "transformer_2"
    d, c = pipe.defaults, pipe.components[dit].config
    h, w = kw["height"] or d["height"], kw["width"] or d["width"]
    frames, steps = kw["num_frames"] or d["num_frames"], kw["num_inference_steps"] or d["num_inference_steps"]
    guidance = (d["guidance_scale"] if kw["guidance_scale"] is None else kw["guidance_scale"]) > 1.0
    est = estimate(
        height=h,
        width=w,
        num_frames=frames,
        steps=steps,
        guidance=guidance,
        layers=c.num_layers,
        heads=c.num_attention_heads,
        head_dim=c.attention_head_dim,
        ffn_dim=c.ffn_dim,
        patch_size=c.patch_size,
        vae_spatial=pipe.vae_scale_spatial,
        vae_temporal=pipe.vae_scale_temporal,
    )
    if est.seconds > WARN_SECONDS:
        sys.stderr.write(
            f"warning: {w}x{h}, {frames} frames, {steps} steps on the CPU: {est.describe()}, roughly "
            f"{human_seconds(est.seconds)} here; a smaller --height/--width/--num-frames or fewer "
            "--num-inference-steps is faster, a GPU much faster\n"
        )
        sys.stderr.flush()


def _diffusers_image(mi, path: Optional[str]):
    """The ``--image`` of a ``--backend diffusers`` run (checked against the checkpoint), or None."""
    from ditattn.pipelines.conditioning import load_image
    from ditattn.pipelines.diffusers_backend import conditioning_mode_static

    mode = conditioning_mode_static(mi)
    if path is None:
        if mode == "i2v":
            raise AttentionConfigError("this checkpoint is image-to-video: give the first frame with --image PATH")
        return None
    if mode == "t2v":
        raise AttentionConfigError(
            "this checkpoint is text-to-video and takes no --image; image conditioning needs "
            "an image-to-video checkpoint (Wan 2.1 I2V, Wan 2.2 I2V-A14B or TI2V-5B)"
        )
    return load_image(path, where="--image")


def _linears_note(pipe) -> str:
    """``"; DiT linears: fp8 (240 of 306 linears)"`` under --dit-quantization, else empty."""
    q = pipe.quantization_summary()
    return f"; DiT linears: {q}" if q else ""


def _generate_diffusers(cfg: RunConfig, t_start: float) -> int:
    from ditattn.cache.config import resolve_cache

    resolve_cache(cfg.cache.cache_backend, cfg.cache.cache_backend_config, native=False)  # refused: native only
    import torch

    from ditattn.models.weights import read_json
    from ditattn.pipelines.diffusers_backend import (
        apply_ditattn,
        attention_route,
        check_size_static,
        load_diffusers_pipeline,
        reject_native_only_options,
        run_diffusers,
    )
    from ditattn.pipelines.loading import parse_device, parse_dtype
    from ditattn.pipelines.model_index import read_model_index, resolve_model_path
    from ditattn.pipelines.wan import CHECKPOINT_DEFAULTS
    from ditattn.platforms import platform_for_device

    reject_native_only_options(cfg)
    route = attention_route(cfg)
    if route == "ditattn":
        cfg.attention_settings()  # refuse bad attention flags before loading
    m, s = cfg.model, cfg.sampling
    folder, name = resolve_model_path(
        m.model_path, revision=m.revision, local_files_only=m.local_files_only, variant=m.model_variant
    )
    mi = read_model_index(folder, name)
    dev = parse_device(m.device)
    dt = parse_dtype(m.dtype, platform_for_device(dev))
    _tune_cpu_threads(dev)
    d = mi.builtin_defaults or CHECKPOINT_DEFAULTS
    image = _diffusers_image(mi, s.image)
    height, width = s.height or d["height"], s.width or d["width"]
    if image is not None and (s.height is None or s.width is None):  # as the native pipeline sizes it
        from ditattn.pipelines.conditioning import output_size_for_image

        patch = read_json(
            os.path.join(
                mi.folder("transformer" if "transformer" in mi.components else "transformer_2"), "config.json"
            )
        ).get("patch_size", (1, 2, 2))
        spatial = int(read_json(os.path.join(mi.folder("vae"), "config.json")).get("scale_factor_spatial") or 8)
        height, width = output_size_for_image(
            image.width, image.height, s.height, s.width, d["height"] * d["width"], spatial * int(patch[1])
        )
    num_frames = s.num_frames or d["num_frames"]
    steps = s.num_inference_steps or d["num_inference_steps"]
    guidance = d["guidance_scale"] if s.guidance_scale is None else s.guidance_scale
    check_size_static(mi, height, width, num_frames)
    _output_path(cfg, num_frames)
    t0 = time.perf_counter()
    pipe = load_diffusers_pipeline(
        folder,
        device=dev,
        dtype=dt,
        variant=m.model_variant,
        attention_backend=cfg.attention.attention_backend if route == "diffusers" else None,
        image_to_video=image is not None,
        model=m,
    )
    routing = apply_ditattn(pipe, cfg) if route == "ditattn" else None
    load = time.perf_counter() - t0 + (t0 - t_start)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        frames, secs = run_diffusers(
            pipe,
            prompt=s.prompt,
            negative_prompt=s.negative_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=steps,
            guidance_scale=guidance,
            seed=s.seed or 0,
            image=image,
            guidance_scale_2=s.guidance_scale_2,
        )
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    backends, stats = f"diffusers:{cfg.attention.attention_backend or 'default'}", {}
    if routing is not None:
        from ditattn.integrations.diffusers import call_backends

        backends = f"{','.join(call_backends(pipe))} (ditattn in diffusers)"
        stats = dict(routing.last_state.stats) if routing.last_state is not None else {}
    _report(
        cfg,
        frames[0],
        t_start=t_start,
        load=load,
        steps=steps,
        size=(width, height),
        num_frames=num_frames,
        parts={"generate": secs},
        backends=backends,
        stats=stats,
        peak_memory=peak,
    )
    return 0
