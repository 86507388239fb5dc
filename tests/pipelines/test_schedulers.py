"""Samplers of the denoising loop: ditattn builds each scheduler from its flags (``--scheduler``,
``--flow-shift``, ``--timesteps``) on top of the checkpoint's scheduler config and runs its own loop
(:func:`ditattn.pipelines.denoise.denoise`); the reference is a diffusers scheduler configured
independently (as diffusers' Wan docs do, or from the distilled checkpoints' sigma formula) and stepped
by hand on the same model outputs.  Every step's latents must agree to 1e-5 (relative)."""

import types

import numpy as np
import pytest
import torch

from ditattn.errors import AttentionConfigError
from ditattn.pipelines.denoise import denoise
from ditattn.pipelines.sampling import build_sampler, checkpoint_scheduler, renoise_seed
from ditattn.runconfig import SamplingConfig

SHAPE = (2, 4, 3, 6, 10)  # [N, C, T, h, w]: odd sizes, two clips
SEEDS = [7, 8]


@pytest.fixture(scope="module")
def factory():
    """The scheduler factory of the built-in ditattn:tiny-wan checkpoint (UniPC, flow shift 3), as the
    pipeline loads it."""
    from ditattn.pipelines.loading import _scheduler_factory
    from ditattn.pipelines.model_index import read_model_index, resolve_model_path

    folder, name = resolve_model_path("ditattn:tiny-wan")
    mi = read_model_index(folder, name)
    return _scheduler_factory(mi.folder("scheduler"), mi.components["scheduler"][1])


def velocity(x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for the DiT: smooth in x and t, shifted by the text (so the two CFG
    halves differ)."""
    bias = context.float().mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)
    return torch.sin(1.3 * x + t.float().view(-1, 1, 1, 1, 1) / 1000.0) * 0.7 + 0.1 * x + bias


class FakeDiT(torch.nn.Module):
    """The interface :func:`denoise` uses; records every forward's latents, timesteps and CFG branch."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(has_image_input=False, patch_size=(1, 2, 2))
        self.calls = []

    def latent_grid(self, t, h, w):
        return (t, h // 2, w // 2)

    def encode_text(self, context, image=None, per_block=True):
        return context

    def forward(self, x, ts, text_cache):
        from ditattn.attention.context import current_forward

        self.calls.append((x.clone(), ts.clone(), current_forward().branch))
        return velocity(x, ts, text_cache)


PLACEMENT = types.SimpleNamespace(onload=lambda name: None, streamers=())


def contexts(n: int):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 5, 8, generator=g), torch.randn(n, 5, 8, generator=g) * 0.5


def run_ditattn(factory, guidance=1.0, **flags):
    """ditattn's loop: the sampler from the flags, the fake DiT; returns the latents entering each
    step and the final latents."""
    x0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
    cond, uncond = contexts(SHAPE[0])
    ctx = torch.cat([cond, uncond]) if guidance > 1 else cond
    steps = flags.pop("steps", 6)
    cfg = SamplingConfig(**flags)  # the flags' own checks and types ("1000,750" -> floats)
    sampler = build_sampler(
        factory, name=cfg.scheduler, shift=cfg.flow_shift, timesteps=cfg.timesteps, steps=steps, seeds=SEEDS
    )
    dit = FakeDiT()
    out, used = denoise(
        x0,
        sampler.scheduler,
        {"transformer": dit, "transformer_2": None},
        context=ctx,
        condition=None,
        guidance=guidance,
        guidance_2=guidance,
        boundary_ratio=None,
        expand_timesteps=False,
        placement=PLACEMENT,
        dtype=torch.float32,
        progress=False,
        step_kwargs=sampler.step_kwargs,
    )
    seen = [c[0][: SHAPE[0]] for c in dit.calls if c[2] != "uncond"]
    return seen + [out], sampler


def run_reference(sched, guidance=1.0, step=None):
    """The reference loop: a diffusers scheduler (timesteps set) stepped by hand."""
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
    cond, uncond = contexts(SHAPE[0])
    seen = []
    for t in sched.timesteps:
        seen.append(x.clone())
        ts = t.expand(SHAPE[0])
        v = velocity(x, ts, cond)
        if guidance > 1:
            u = velocity(x, ts, uncond)
            v = u + guidance * (v - u)
        x = step(v, t, x) if step is not None else sched.step(v, t, x, return_dict=False)[0]
    return seen + [x]


def assert_steps_match(ours, ref):
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        err = (torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())).item()
        assert err <= 1e-5, f"step {i}: relative error {err:.2e}"


def distilled_sigmas(timesteps, shift, train=1000):
    """The distilled checkpoints' rule, written out: the shifted sigma grid of ``train`` points from 1,
    indexed at ``train - T``."""
    grid = np.linspace(1.0, 0.0, train + 1)[:-1]
    grid = shift * grid / (1 + (shift - 1) * grid)
    return [float(grid[train - int(t)]) for t in timesteps]


def test_checkpoint_scheduler_is_unipc_flow(factory):
    assert checkpoint_scheduler(factory) == ("unipc", 3.0, 1000)


@pytest.mark.parametrize("shift", [None, 5.0])
def test_unipc_matches_diffusers(factory, shift):
    from diffusers import UniPCMultistepScheduler

    ours, sampler = run_ditattn(factory, guidance=4.0, scheduler="unipc", flow_shift=shift)
    ref = UniPCMultistepScheduler.from_config(factory.config, flow_shift=shift or 3.0)  # as diffusers' Wan docs
    ref.set_timesteps(6)
    assert sampler.name == "unipc" and sampler.shift == (shift or 3.0)
    assert_steps_match(ours, run_reference(ref, guidance=4.0))


def test_default_is_the_checkpoint_scheduler(factory):
    from diffusers import UniPCMultistepScheduler

    ours, sampler = run_ditattn(factory, steps=5)  # no flags: the checkpoint's own class and config
    ref = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    ref.set_timesteps(5)
    assert sampler.name == "unipc"
    assert_steps_match(ours, run_reference(ref))


@pytest.mark.parametrize("shift", [3.0, 7.5])
def test_flow_euler_matches_diffusers(factory, shift):
    from diffusers import FlowMatchEulerDiscreteScheduler

    ours, _ = run_ditattn(factory, guidance=3.0, scheduler="flow_euler", flow_shift=shift, steps=7)
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(7)
    assert_steps_match(ours, run_reference(ref, guidance=3.0))


@pytest.mark.parametrize("shift", [3.0, 1.5])
def test_dpmpp_matches_diffusers(factory, shift):
    from diffusers import DPMSolverMultistepScheduler

    ours, _ = run_ditattn(factory, guidance=2.5, scheduler="dpmpp", flow_shift=shift, steps=6)
    ref = DPMSolverMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=shift,
        algorithm_type="dpmsolver++",
        solver_order=2,
    )
    ref.set_timesteps(6)
    assert_steps_match(ours, run_reference(ref, guidance=2.5))


@pytest.mark.parametrize("name", ["flow_euler", "unipc"])
def test_explicit_timesteps_follow_the_distilled_rule(factory, name):
    """--timesteps 1000,750,500,250 at shift 5: sigmas 1, 0.9375, 0.833, 0.625 and the DiT sees
    sigma * 1000; the reference gets those sigmas from the formula (unshifted scheduler)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    ts = (1000, 750, 500, 250)
    ours, sampler = run_ditattn(factory, scheduler=name, flow_shift=5.0, timesteps="1000,750,500,250")
    sig = distilled_sigmas(ts, 5.0)
    np.testing.assert_allclose(sig, [1.0, 0.9375, 5 / 6, 0.625], rtol=1e-6)
    if name == "flow_euler":
        ref = FlowMatchEulerDiscreteScheduler(shift=1.0)
        np.testing.assert_allclose(sampler.scheduler.timesteps.numpy(), np.array(sig) * 1000, rtol=1e-6)
    else:
        ref = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=1.0)
    ref.set_timesteps(sigmas=np.array(sig))
    assert sampler.num_steps == 4 and sampler.timesteps == tuple(float(t) for t in ts)
    assert_steps_match(ours, run_reference(ref))


def test_lcm_predicts_x0_and_renoises(factory):
    """lcm with an explicit list: each step x0 = x - sigma v, then (1 - sigma') x0 + sigma' noise, the
    noise of clip i from its own generator (reference written out, not diffusers)."""
    ts = (1000, 750, 500, 250)
    ours, sampler = run_ditattn(factory, scheduler="lcm", flow_shift=5.0, timesteps=ts)
    sig = distilled_sigmas(ts, 5.0) + [0.0]
    gens = [torch.Generator().manual_seed(renoise_seed(s)) for s in SEEDS]
    cond, _ = contexts(SHAPE[0])
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
    ref = []
    for i, s in enumerate(sig[:-1]):
        ref.append(x.clone())
        x0 = x - s * velocity(x, torch.full((SHAPE[0],), s * 1000), cond)
        noise = torch.cat([torch.randn((1, *SHAPE[1:]), generator=g) for g in gens])
        x = (1 - sig[i + 1]) * x0 + sig[i + 1] * noise
    assert sampler.name == "lcm"
    assert_steps_match(ours, ref + [x])


def test_lcm_default_steps_match_diffusers(factory):
    from diffusers import FlowMatchLCMScheduler

    ours, _ = run_ditattn(factory, scheduler="lcm", flow_shift=2.0, steps=5)
    ref = FlowMatchLCMScheduler(shift=2.0)
    ref.set_timesteps(5)
    gens = [torch.Generator().manual_seed(renoise_seed(s)) for s in SEEDS]
    assert_steps_match(
        ours, run_reference(ref, step=lambda v, t, x: ref.step(v, t, x, generator=gens, return_dict=False)[0])
    )


def test_lcm_clip_independent_of_batch(factory):
    """A clip's re-noising depends on its own seed only."""
    full, _ = run_ditattn(factory, scheduler="lcm", timesteps=(1000, 500))
    sampler = build_sampler(factory, name="lcm", steps=2, timesteps=(1000, 500), seeds=[8])
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))[1:]
    cond, _ = contexts(SHAPE[0])
    dit = FakeDiT()
    out, _ = denoise(
        x,
        sampler.scheduler,
        {"transformer": dit, "transformer_2": None},
        context=cond[1:],
        condition=None,
        guidance=1.0,
        guidance_2=1.0,
        boundary_ratio=None,
        expand_timesteps=False,
        placement=PLACEMENT,
        dtype=torch.float32,
        progress=False,
        step_kwargs=sampler.step_kwargs,
    )
    assert torch.allclose(out, full[-1][1:], rtol=1e-6, atol=1e-6)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, words",
    [
        ("1000,750,750", "a duplicate"),
        ("250,500", "not descending"),
        ("1000,0", "timesteps above 0"),
        ("1000,abc", "timesteps above 0"),
        ("", "timesteps above 0"),
        ([], "descending timesteps"),
        (",".join(str(1000 - i * 0.5) for i in range(1001)), "1 to 1000"),
    ],
)
def test_bad_timesteps_are_one_line_errors(value, words):
    with pytest.raises(AttentionConfigError) as err:
        SamplingConfig(timesteps=value)
    msg = str(err.value)
    assert msg.startswith("timesteps: ") and words in msg and "\n" not in msg


def test_timesteps_above_training_range_or_with_dpmpp(factory):
    with pytest.raises(AttentionConfigError, match=r"above this checkpoint's num_train_timesteps \(1000\)"):
        build_sampler(factory, steps=4, timesteps=(1200.0, 500.0))
    with pytest.raises(
        AttentionConfigError, match="timesteps: an explicit list works with scheduler flow_euler, unipc or lcm"
    ):
        build_sampler(factory, name="dpmpp", steps=4, timesteps=(1000.0, 500.0))


@pytest.mark.parametrize(
    "key, value", [("scheduler", "euler"), ("flow_shift", 0), ("flow_shift", "nan"), ("flow_shift", 1000.0)]
)
def test_bad_scheduler_or_shift(key, value):
    with pytest.raises(AttentionConfigError, match=rf"^{key}: expected"):
        SamplingConfig(**{key: value})


def test_cli_flags_and_config_file(tmp_path):
    """The flags and the --config keys are the same RunConfig fields."""
    from ditattn.entrypoints.cli import COMMANDS, build_config, build_parser
    from ditattn.runconfig import RunConfig

    f = tmp_path / "c.yaml"
    f.write_text("scheduler: lcm\nflow-shift: 5\ntimesteps: [1000, 750, 500, 250]\ncfg-interval: '0:0.5'\n")
    cfg = RunConfig.from_file(str(f))
    assert (cfg.sampling.scheduler, cfg.sampling.flow_shift, cfg.sampling.timesteps, cfg.sampling.cfg_interval) == (
        "lcm",
        5.0,
        (1000.0, 750.0, 500.0, 250.0),
        (0.0, 0.5),
    )
    args = build_parser().parse_args(
        [
            "generate",
            "--prompt",
            "x",
            "--scheduler",
            "unipc",
            "--flow-shift",
            "2",
            "--timesteps",
            "999,500",
            "--cfg-interval",
            "0.1:0.9",
            "--cfg-batching",
            "sequential",
        ]
    )
    given = dict(vars(args))
    command = next(c for c in COMMANDS if c.name == given.pop("command"))
    s = build_config(command, given).sampling
    assert (s.scheduler, s.flow_shift, s.timesteps, s.cfg_interval, s.cfg_batching) == (
        "unipc",
        2.0,
        (999.0, 500.0),
        (0.1, 0.9),
        "sequential",
    )
