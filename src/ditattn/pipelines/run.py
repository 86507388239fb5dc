"""``ditattn generate`` and ``ditattn plan``.

``generate_main(args)`` builds the pipeline (native by default, ``--backend diffusers`` for the
stock diffusers one), generates one clip, writes it into ``--output-path`` (MP4 for clips, PNG for
one frame) and prints the file path and, as the last line, a one-line timing summary.
``plan_main(args)`` builds the native pipeline without weights or denoising and prints the attention
plan (``--json``: the DESIGN 1.5 object).

Default generate settings with the built-in ``ditattn:tiny-wan``: 128x128, 9 frames, 8 steps,
guidance 5.0, seed 0, float32 on CPU (about 2 s of compute on 2 idle cores; most of a cold run
is importing torch and diffusers, ~12 s end to end).  Real checkpoints default to 832x480, 81
frames, 50 steps.  On a CPU run the number of torch threads follows the idle cores (see
:func:`_tune_cpu_threads`).
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from typing import Optional

from ditattn.attention.config import parse_attention_backend_config, parse_component_overrides
from ditattn.attention.context import AttentionSettings
from ditattn.attention.names import AttentionBackendEnum
from ditattn.errors import AttentionConfigError


def parallel_degrees(args) -> tuple[int, int]:
    """``(ulysses, ring)`` for ``--num-gpus N --ulysses-degree U --ring-degree R``: U x R must equal N
    (a missing degree is derived: U = N / R, R = N / U; neither given: U = N, R = 1)."""
    n = getattr(args, "num_gpus", 1) or 1
    u = getattr(args, "ulysses_degree", None)
    r = getattr(args, "ring_degree", None)
    if u is None and r is None:
        u, r = n, 1
    elif u is None:
        if n % r:
            raise AttentionConfigError(f"--ring-degree {r} does not divide --num-gpus {n}")
        u = n // r
    elif r is None:
        if n % u:
            raise AttentionConfigError(f"--ulysses-degree {u} does not divide --num-gpus {n}")
        r = n // u
    if u * r != n:
        raise AttentionConfigError(
            f"--ulysses-degree {u} x --ring-degree {r} = {u * r} must equal --num-gpus {n}"
        )
    return u, r


def settings_from_args(args) -> AttentionSettings:
    """The run's attention settings from the attention flags (raises AttentionConfigError on bad input)."""
    backend = AttentionBackendEnum.from_name(args.attention_backend) if getattr(args, "attention_backend", None) else None
    u, r = parallel_degrees(args)
    return AttentionSettings(
        backend=backend,
        component_overrides=parse_component_overrides(getattr(args, "component_attention_backends", None)),
        config=parse_attention_backend_config(getattr(args, "attention_backend_config", None)),
        autotune=bool(getattr(args, "enable_attention_backend_autotune", False)),
        ring_degree=r,
        ulysses_degree=u,
        compiled=bool(getattr(args, "enable_torch_compile", False) or getattr(args, "enable_cuda_graph", False)),
        cuda_graphs=bool(getattr(args, "enable_cuda_graph", False)),
    )


def skip_softmax_from_args(args) -> Optional[dict]:
    tsf = getattr(args, "skip_softmax_threshold_scale_factor", None)
    start = getattr(args, "skip_softmax_start_step", None)
    if tsf is None:
        if start is not None:
            raise AttentionConfigError(
                "--skip-softmax-start-step needs --skip-softmax-threshold-scale-factor (no default threshold: "
                "calibrate it per model)"
            )
        return None
    return {"threshold_scale_factor": tsf, "start_step": 0 if start is None else start}


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
    explicit = os.environ.get("DITATTN_NUM_THREADS")
    if explicit:
        try:
            torch.set_num_threads(max(1, int(explicit)))
        except ValueError:
            raise AttentionConfigError(f"DITATTN_NUM_THREADS must be a positive integer, got {explicit!r}") from None
        return
    if os.environ.get("OMP_NUM_THREADS") or not hasattr(os, "getloadavg"):
        return
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0]
    want = max(1, min(torch.get_num_threads(), int(cores - busy + 0.5)))
    if want < torch.get_num_threads():
        logging.getLogger("ditattn.pipeline").info(
            "load average %.1f on %d cores: using %d CPU thread(s)", busy, cores, want)
        torch.set_num_threads(want)


def _seed(args) -> int:
    return int(getattr(args, "seed", 0) or 0)


# ------------------------------------------------------------------------------------------------


def plan_main(args) -> int:
    """``ditattn plan``: resolve every attention layer of the native pipeline and print the plan
    (on the platform in force: the machine here, or the one ``--platform`` simulates, which the CLI
    installs with :func:`ditattn.platforms.use_platform` before calling this)."""
    if getattr(args, "backend", "native") == "diffusers":
        raise AttentionConfigError(
            "plan describes the native pipeline's attention layers; --backend diffusers has no ditattn plan "
            "(drop --backend diffusers)"
        )
    from ditattn.pipelines.plan import format_plan
    from ditattn.pipelines.wan import WanPipelineNative

    settings = settings_from_args(args)
    pipe = WanPipelineNative.from_pretrained(
        args.model_path, settings, device=args.device, dtype=args.dtype, variant=args.model_variant,
        load_weights=False,
    )
    override = getattr(args, "attention_backend_override", None)
    ss = skip_softmax_from_args(args)
    state = pipe.prepare_request(override, ss)
    size = [getattr(args, k, None) for k in ("height", "width", "num_frames")]
    if any(v is not None for v in size):  # a size the model cannot generate is an error here too
        d = pipe.defaults
        pipe.check_size(size[0] or d["height"], size[1] or d["width"], size[2] or d["num_frames"])
    unused = [flag for attr, flag in (("negative_prompt", "--negative-prompt"),
                                      ("num_inference_steps", "--num-inference-steps"),
                                      ("guidance_scale", "--guidance-scale"), ("seed", "--seed"))
              if getattr(args, attr, None) not in (None, 0)]
    if unused:  # accepted for symmetry with generate; say so rather than ignore them silently
        sys.stderr.write(f"note: {', '.join(unused)} do not change the attention plan (sampling only)\n")
    plan = pipe.plan()
    if args.json:
        if state is not None and state.override is not None:
            plan["request_override"] = state.override.value
        print(json.dumps(plan, indent=2))
    else:
        dtype = str(pipe.dtype).replace("torch.", "")
        print(format_plan(plan, model=pipe.model_index.name, dtype=dtype,
                          override=state.override.value if state is not None and state.override else None))
    return 0


def generate_main(args) -> int:
    """``ditattn generate``: run the pipeline, write the output, print its path and a timing line."""
    t_start = time.perf_counter()
    if not args.prompt or not args.prompt.strip():
        raise AttentionConfigError("--prompt must not be empty")
    if args.num_frames == 1 and getattr(args, "fps", None) is not None:
        raise AttentionConfigError("--fps applies to videos only; --num-frames 1 writes a single frame (PNG)")
    if args.backend == "diffusers":
        from ditattn.pipelines.diffusers_backend import reject_native_only_flags

        reject_native_only_flags(args)  # before any launch: sequence parallelism is native-only
    parallel_degrees(args)  # U x R must equal --num-gpus
    if (args.num_gpus or 1) > 1:
        if importlib.util.find_spec("ditattn.distributed.launch") is None:
            raise AttentionConfigError(
                f"--num-gpus {args.num_gpus}: sequence parallelism is not available in this build; "
                "run with --num-gpus 1"
            )
        from ditattn.distributed.launch import launch, needs_launch

        if needs_launch(args):  # spawn (or join) the ranks; each launched rank re-enters here and runs below
            return launch(args)
    import torch

    threads = torch.get_num_threads()
    try:
        if args.backend == "diffusers":
            return _generate_diffusers(args, t_start)
        return _generate_native(args, t_start)
    finally:
        torch.set_num_threads(threads)  # _tune_cpu_threads may have lowered it for this run


def _write(args, frames, prompt: str, seed: int, num_frames: int) -> Optional[str]:
    from ditattn.pipelines.output import output_file_path, save_frames

    if not args.save_output:
        return None
    path = output_file_path(args.output_path, args.output_file, prompt, seed, num_frames)
    try:
        return save_frames(frames, path, fps=getattr(args, "fps", 16) or 16)
    except OSError as exc:
        raise AttentionConfigError(f"cannot write {path}: {exc.strerror or exc}; choose another --output-path") from None


def _summary(*, total, load, steps, size, frames, parts: dict, backends: str, path: Optional[str]) -> str:
    w, h = size
    detail = ", ".join(f"{k} {v:.1f}s" for k, v in parts.items())
    if "denoise" in parts:
        detail += f"; {parts['denoise'] / max(steps, 1):.2f}s/step"
    where = "" if path else " (not saved)"
    return (f"done in {total:.1f}s{where}: {w}x{h}, {frames} frame{'s' if frames != 1 else ''}, {steps} steps "
            f"(load {load:.1f}s, {detail}); DiT attention: {backends}")


def _generate_native(args, t_start: float) -> int:
    from ditattn.distributed.groups import sequence_parallel_rank
    from ditattn.pipelines.output import output_file_path
    from ditattn.pipelines.wan import WanPipelineNative

    settings = settings_from_args(args)
    ss = skip_softmax_from_args(args)
    _tune_cpu_threads(args.device)
    if args.save_output and args.output_file:  # fail before the work on a bad name
        output_file_path(args.output_path, args.output_file, args.prompt, _seed(args), args.num_frames or 2)
    t0 = time.perf_counter()
    pipe = WanPipelineNative.from_pretrained(
        args.model_path, settings, device=args.device, dtype=args.dtype, variant=args.model_variant,
    )
    state = pipe.prepare_request(args.attention_backend_override, ss)
    load = time.perf_counter() - t0 + (t0 - t_start)
    res = pipe.generate(
        args.prompt, args.negative_prompt, height=args.height, width=args.width, num_frames=args.num_frames,
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale, seed=_seed(args),
        request_state=state, progress=sequence_parallel_rank() == 0,  # one progress bar: rank 0's
    )
    t0 = time.perf_counter()
    path = _write(args, res.frames[0], args.prompt, _seed(args), res.num_frames)
    save = time.perf_counter() - t0
    if path:
        print(f"saved: {path}")
    if res.stats:
        print(f"attention stats: {json.dumps(res.stats, default=str)}")
    parts = {"text": res.timings["text"], "denoise": res.timings["denoise"], "decode": res.timings["decode"],
             "save": save}
    print(_summary(total=time.perf_counter() - t_start, load=load, steps=res.num_inference_steps,
                   size=(res.width, res.height), frames=res.num_frames, parts=parts,
                   backends=",".join(res.attention_backends), path=path))
    sys.stdout.flush()
    return 0


def _generate_diffusers(args, t_start: float) -> int:
    import torch

    from ditattn.pipelines.diffusers_backend import load_diffusers_pipeline, reject_native_only_flags, run_diffusers
    from ditattn.pipelines.model_index import read_model_index, resolve_model_path
    from ditattn.pipelines.output import output_file_path
    from ditattn.pipelines.wan import CHECKPOINT_DEFAULTS, TINY_DEFAULTS, parse_device, parse_dtype
    from ditattn.platforms import platform_for_device

    reject_native_only_flags(args)
    folder, name = resolve_model_path(args.model_path)
    mi = read_model_index(folder, name)
    dev = parse_device(args.device)
    dt = parse_dtype(args.dtype, platform_for_device(dev))
    _tune_cpu_threads(dev)
    d = TINY_DEFAULTS if mi.is_builtin else CHECKPOINT_DEFAULTS
    height = args.height or d["height"]
    width = args.width or d["width"]
    num_frames = args.num_frames or d["num_frames"]
    steps = args.num_inference_steps or d["num_inference_steps"]
    guidance = d["guidance_scale"] if args.guidance_scale is None else args.guidance_scale
    _check_size_static(mi, height, width, num_frames)
    if args.save_output and args.output_file:
        output_file_path(args.output_path, args.output_file, args.prompt, _seed(args), num_frames)
    t0 = time.perf_counter()
    pipe = load_diffusers_pipeline(folder, device=dev, dtype=dt, variant=args.model_variant,
                                   attention_backend=args.attention_backend)
    load = time.perf_counter() - t0 + (t0 - t_start)
    with torch.inference_mode():
        frames, secs = run_diffusers(
            pipe, prompt=args.prompt, negative_prompt=args.negative_prompt, height=height, width=width,
            num_frames=num_frames, num_inference_steps=steps, guidance_scale=guidance, seed=_seed(args),
        )
    t0 = time.perf_counter()
    path = _write(args, frames[0], args.prompt, _seed(args), num_frames)
    save = time.perf_counter() - t0
    if path:
        print(f"saved: {path}")
    backend = f"diffusers:{args.attention_backend or 'default'}"
    print(_summary(total=time.perf_counter() - t_start, load=load, steps=steps, size=(width, height),
                   frames=num_frames, parts={"generate": secs, "save": save}, backends=backend, path=path))
    return 0


def _check_size_static(mi, height: int, width: int, num_frames: int) -> None:
    """The size rules of :meth:`WanPipelineNative.check_size` from the checkpoint's configs alone."""
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
