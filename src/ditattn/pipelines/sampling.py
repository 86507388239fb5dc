"""The sampler of the denoising loop: which diffusers scheduler steps the latents, on which
timesteps, and which steps run classifier-free guidance, in which form.

Schedulers (``--scheduler``), all diffusers' own classes in their flow-matching forms:

* ``flow_euler`` — ``FlowMatchEulerDiscreteScheduler(shift=X)``;
* ``unipc`` — ``UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
  flow_shift=X)`` (what Wan checkpoints ship; from a UniPC checkpoint its config is kept, only the
  shift changes);
* ``dpmpp`` — ``DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", prediction_type=
  "flow_prediction", use_flow_sigmas=True, flow_shift=X)``;
* ``lcm`` — ``FlowMatchLCMScheduler(shift=X)``: each step predicts the clean latents
  ``x0 = x - sigma * v`` and re-noises them to the next sigma with fresh Gaussian noise
  (``(1 - sigma_next) x0 + sigma_next * noise``), the sampler of step-distilled checkpoints.  The
  noise of clip ``i`` comes from its own CPU generator seeded from its seed
  (:func:`renoise_seed`), so a clip does not depend on what it is batched with.

None keeps the checkpoint's scheduler with its config (only ``flow_shift`` / ``shift`` replaced when
``--flow-shift`` is given).  The other classes take ``num_train_timesteps`` and the shift from the
checkpoint's config and diffusers' defaults for the rest.

Explicit timesteps (``--timesteps 1000,750,500,250``): each ``T`` is a position on the unshifted
training grid; the step runs at ``sigma = shift * s / (1 + (shift - 1) * s)`` with
``s = T / num_train_timesteps`` and the DiT is given ``sigma * num_train_timesteps`` — the convention
of the distilled Wan checkpoints (their lists are meant for shift 5: sigmas 1, 0.9375, 0.833, 0.625).
It is diffusers' ``set_timesteps(sigmas=[T / num_train_timesteps, ...])``, which applies the shift
itself; ``dpmpp`` has no such entry in diffusers in its flow form and refuses explicit timesteps.

CFG: :func:`guided_steps` (the ``--cfg-interval``) and :func:`resolve_cfg_batching` (``--cfg-batching``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ditattn.errors import AttentionConfigError

#: diffusers class -> ``--scheduler`` name
CLASS_NAMES = {
    "FlowMatchEulerDiscreteScheduler": "flow_euler",
    "UniPCMultistepScheduler": "unipc",
    "DPMSolverMultistepScheduler": "dpmpp",
    "FlowMatchLCMScheduler": "lcm",
}
NAME_CLASSES = {v: k for k, v in CLASS_NAMES.items()}
#: the config key that holds the flow shift, per class
SHIFT_KEY = {"flow_euler": "shift", "lcm": "shift", "unipc": "flow_shift", "dpmpp": "flow_shift"}
#: the settings that make each multistep class a flow-matching solver (always applied)
FLOW_FORM = {
    "unipc": dict(prediction_type="flow_prediction", use_flow_sigmas=True),
    "dpmpp": dict(prediction_type="flow_prediction", use_flow_sigmas=True, algorithm_type="dpmsolver++"),
}
#: ``--cfg-batching auto``: sequential halves from this many latent tokens per clip on an accelerator
#: (one forward already fills the device; batching then only doubles activation memory); below it,
#: and on the CPU, the halves run as one batched forward.  Measured on an H200 (Wan2.1-1.3B, bf16,
#: one guided step, bench/cfg_batching.py): 32 760 tokens (480x832x81) batched 914 ms / sequential
#: 906 ms; 1 950 tokens (240x416x17) batched 43 ms / sequential 91 ms.
AUTO_SEQUENTIAL_MIN_TOKENS = 32760  # 832x480, 81 frames: 21 x 30 x 52 tokens
RENOISE_SEED_XOR = 0x5DEECE66D  # clip seed -> seed of its re-noising generator (lcm)


@dataclasses.dataclass
class Sampler:
    """A fresh scheduler with its timesteps set, and how the loop steps it.

    scheduler: the diffusers scheduler (``timesteps`` / ``sigmas`` set); name: its ``--scheduler`` name;
    shift: the flow shift in effect; timesteps: the explicit list given, or None;
    step_kwargs: extra keyword arguments of ``scheduler.step`` (``lcm``: its per-clip generators)."""

    scheduler: Any
    name: str
    shift: float
    timesteps: Optional[tuple]
    step_kwargs: dict

    @property
    def num_steps(self) -> int:
        return len(self.scheduler.timesteps)


def checkpoint_scheduler(factory: Callable[[], Any]) -> tuple[Optional[str], float, int]:
    """``(name or None, shift, num_train_timesteps)`` of the checkpoint's scheduler factory
    (:func:`ditattn.pipelines.loading._scheduler_factory`): None for a class outside
    :data:`CLASS_NAMES`; the shift 1.0 when its config has none."""
    cfg = dict(factory.config)
    name = CLASS_NAMES.get(factory.cls.__name__)
    shift = cfg.get(SHIFT_KEY[name]) if name else cfg.get("flow_shift", cfg.get("shift"))
    return name, float(shift if shift is not None else 1.0), int(cfg.get("num_train_timesteps", 1000))


def make_scheduler(factory: Callable[[], Any], name: Optional[str], shift: Optional[float]):
    """A fresh diffusers scheduler: ``name`` (None: the checkpoint's class) at ``shift`` (None: the
    checkpoint's), built as the module docstring says.  Returns ``(scheduler, name, shift)``."""
    import diffusers

    own, own_shift, train_steps = checkpoint_scheduler(factory)
    shift = own_shift if shift is None else float(shift)
    if name is None or name == own:
        if own is None:
            if name is None and shift == own_shift:
                return factory(), factory.cls.__name__, shift
            raise AttentionConfigError(
                f"flow_shift: this checkpoint's scheduler {factory.cls.__name__} takes no "
                f"shift; choose a scheduler: {', '.join(NAME_CLASSES)}"
            )
        # None: the checkpoint's scheduler as it is (only a new shift); named: in its flow form
        overrides = dict(FLOW_FORM.get(own, {})) if name is not None else {}
        if name is not None or shift != own_shift:
            overrides[SHIFT_KEY[own]] = shift
        return (factory.cls.from_config(factory.config, **overrides) if overrides else factory()), own, shift
    cls = getattr(diffusers, NAME_CLASSES[name])
    sched = cls(num_train_timesteps=train_steps, **{SHIFT_KEY[name]: shift}, **FLOW_FORM.get(name, {}))
    return sched, name, shift


def check_timesteps(timesteps: Sequence[float], num_train_timesteps: int, max_steps: Optional[int] = None) -> None:
    """Refuse an explicit list outside ``(0, num_train_timesteps]`` or longer than ``max_steps``
    (one-line :class:`AttentionConfigError`; descending order and no duplicates: the config check)."""
    if timesteps[0] > num_train_timesteps:
        n = num_train_timesteps
        raise AttentionConfigError(
            f"timesteps: {timesteps[0]:g} is above this checkpoint's num_train_timesteps "
            f"({n}); accepted: descending values in (0, {n}]"
        )
    if max_steps is not None and len(timesteps) > max_steps:
        raise AttentionConfigError(f"timesteps: {len(timesteps)} steps, at most {max_steps} accepted")


def renoise_seed(seed: int) -> int:
    """The seed of clip ``seed``'s re-noising generator (``lcm``): not its initial noise's seed, nor
    a neighbour clip's (``seed + 1``)."""
    return (int(seed) ^ RENOISE_SEED_XOR) % (2**63)


def build_sampler(
    factory: Callable[[], Any],
    *,
    name: Optional[str] = None,
    shift: Optional[float] = None,
    steps: int,
    timesteps: Optional[Sequence[float]] = None,
    device=None,
    seeds: Sequence[int] = (0,),
) -> Sampler:
    """The :class:`Sampler` of one generation: :func:`make_scheduler`, then its timesteps — ``steps``
    evenly spaced by the class's own rule, or the explicit ``timesteps`` (module docstring; they
    override ``steps``) — on ``device``, stepped from index 0; ``seeds``: the clips' seeds (``lcm``'s
    re-noising generators).  Raises :class:`AttentionConfigError` for a bad combination."""
    sched, resolved, shift = make_scheduler(factory, name, shift)
    train_steps = int(sched.config.num_train_timesteps)
    if timesteps is not None:
        timesteps = tuple(float(t) for t in timesteps)
        check_timesteps(timesteps, train_steps)
        if resolved not in ("flow_euler", "unipc", "lcm"):
            raise AttentionConfigError(
                f"timesteps: an explicit list works with scheduler flow_euler, unipc or lcm "
                f"(diffusers' {type(sched).__name__} takes no explicit flow sigmas)"
            )
        sched.set_timesteps(sigmas=np.array(timesteps, dtype=np.float64) / train_steps, device=device)
    else:
        sched.set_timesteps(steps, device=device)
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(0)
    kwargs = {}
    if resolved == "lcm":
        kwargs["generator"] = [torch.Generator("cpu").manual_seed(renoise_seed(s)) for s in seeds]
    return Sampler(sched, resolved, shift, timesteps, kwargs)


def guided_steps(num_steps: int, interval: Optional[Sequence[float]], enabled: bool = True) -> list[bool]:
    """Which of ``num_steps`` steps run classifier-free guidance: step ``i`` (0-based) is guided when
    ``START <= i / num_steps < END`` for ``interval = (START, END)`` (None: every step); none when
    guidance is off (``enabled`` False: scale <= 1).  E.g. 50 steps with ``0:0.4``: steps 0-19."""
    if not enabled:
        return [False] * num_steps
    if interval is None:
        return [True] * num_steps
    start, end = interval
    return [start <= i / num_steps < end for i in range(num_steps)]


def resolve_cfg_batching(mode: Optional[str], *, device: torch.device, tokens: int) -> str:
    """``batched`` or ``sequential`` for ``--cfg-batching mode`` (``auto`` / None: sequential when
    ``device`` is an accelerator and a clip has at least :data:`AUTO_SEQUENTIAL_MIN_TOKENS` latent
    tokens after patching, else batched)."""
    if mode in ("batched", "sequential"):
        return mode
    if mode not in (None, "auto"):
        raise AttentionConfigError(f"cfg_batching: expected auto, batched or sequential, got {mode!r}")
    if torch.device(device).type != "cpu" and tokens >= AUTO_SEQUENTIAL_MIN_TOKENS:
        return "sequential"
    return "batched"


def cfg_mode(guided: Sequence[bool], batching: str) -> str:
    """The CFG mode as the run summary states it: ``off``, ``batched``/``sequential`` and, when an
    interval leaves some steps unguided, ``on G of N steps``."""
    g = sum(guided)
    if g == 0:
        return "off"
    return batching if g == len(guided) else f"{batching}, on {g} of {len(guided)} steps"


def forwards(guided: Sequence[bool]) -> int:
    """DiT passes per clip: 2 for each guided step (conditional + unconditional), 1 for the others."""
    return sum(2 if g else 1 for g in guided)


def sampling_plan(
    pipe,
    sampling,
    *,
    steps: Optional[int] = None,
    guidance: Optional[float] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    num_frames: Optional[int] = None,
    cfg_parallel: bool = False,
) -> dict:
    """What a generation of ``pipe`` (a :class:`~ditattn.pipelines.wan.WanPipelineNative`, weights
    loaded or not) would sample with the :class:`~ditattn.runconfig.SamplingConfig` ``sampling`` and
    the size / steps / guidance given (None: the model's defaults) and ``cfg_parallel`` (each guidance half
    on its own ranks: the mode is ``parallel``; any other requested batching is refused), for ``ditattn plan``:
    ``{"scheduler", "flow_shift", "steps", "timesteps" (what the DiT is given), "cfg" (the mode),
    "cfg_batching" (resolved), "cfg_batching_requested", "forwards" (DiT passes per clip)}``."""
    from ditattn.pipelines.loading import _scheduler_factory

    d = pipe.defaults
    factory = pipe.components.get("scheduler")
    if factory is None:  # built without weights: the checkpoint's scheduler config is still on disk
        factory = _scheduler_factory(pipe.model_index.folder("scheduler"), pipe.model_index.components["scheduler"][1])
    sampler = build_sampler(
        factory,
        name=sampling.scheduler,
        shift=sampling.flow_shift,
        steps=steps or d["num_inference_steps"],
        timesteps=sampling.timesteps,
    )
    guidance = d["guidance_scale"] if guidance is None else guidance
    guided = guided_steps(sampler.num_steps, sampling.cfg_interval, guidance > 1.0)
    shape = pipe.geometry.latent_shape(num_frames or d["num_frames"], height or d["height"], width or d["width"])
    ref = pipe.components.get("transformer") or pipe.components.get("transformer_2")
    t, h, w = ref.latent_grid(*shape[1:])
    batching = resolve_cfg_batching(sampling.cfg_batching, device=pipe.device, tokens=t * h * w)
    if cfg_parallel and guidance > 1.0:
        if sampling.cfg_batching != "auto":
            raise AttentionConfigError(
                f"--cfg-batching {sampling.cfg_batching}: with --cfg-parallel each guidance half runs on its own "
                "ranks, neither batched nor in sequence; accepted: --cfg-batching auto, or no --cfg-parallel"
            )
        batching = "parallel"
    return {
        "scheduler": sampler.name,
        "flow_shift": sampler.shift,
        "steps": sampler.num_steps,
        "timesteps": [round(float(x), 3) for x in sampler.scheduler.timesteps],
        "cfg": cfg_mode(guided, batching),
        "cfg_batching": batching,
        "cfg_batching_requested": sampling.cfg_batching,
        "tokens": t * h * w,
        "forwards": forwards(guided),
    }


def config_sampling_plan(pipe, cfg) -> dict:
    """:func:`sampling_plan` of a :class:`~ditattn.runconfig.RunConfig`'s sampling section (size, steps,
    guidance; None: the model's) and its ``cfg_parallel``."""
    s = cfg.sampling
    return sampling_plan(
        pipe,
        s,
        steps=s.num_inference_steps,
        guidance=s.guidance_scale,
        height=s.height,
        width=s.width,
        num_frames=s.num_frames,
        cfg_parallel=cfg.parallel.cfg_parallel,
    )


def format_sampling(info: dict) -> str:
    """One line of ``ditattn plan``'s text output for :func:`sampling_plan`'s dict."""
    ts = info["timesteps"]
    shown = ", ".join(f"{x:g}" for x in ts) if len(ts) <= 8 else f"{ts[0]:g} ... {ts[-1]:g}"
    auto = f" (auto at {info['tokens']} tokens per clip)" if info["cfg_batching_requested"] == "auto" else ""
    return (
        f"sampling: {info['scheduler']} shift {info['flow_shift']:g}, {info['steps']} steps (DiT timesteps "
        f"{shown}), CFG {info['cfg']}{auto}, {info['forwards']} DiT forwards per clip"
    )


def check_sampling_settings(config) -> None:
    """Refuse the sampler settings of a :class:`~ditattn.runconfig.RunConfig` that do not build on its
    checkpoint's scheduler (a timestep above ``num_train_timesteps``, explicit timesteps with
    ``dpmpp``), reading only the checkpoint's scheduler config: before any model loads."""
    s, m = config.sampling, config.model
    if s.scheduler is None and s.flow_shift is None and s.timesteps is None:
        return
    from ditattn.pipelines.loading import _scheduler_factory
    from ditattn.pipelines.model_index import read_model_index, resolve_model_path

    folder, name = resolve_model_path(
        m.model_path, revision=m.revision, local_files_only=m.local_files_only, variant=m.model_variant
    )
    mi = read_model_index(folder, name)
    factory = _scheduler_factory(mi.folder("scheduler"), mi.components["scheduler"][1])
    build_sampler(factory, name=s.scheduler, shift=s.flow_shift, steps=1, timesteps=s.timesteps)
