"""Classifier-free guidance control: the guidance interval (``--cfg-interval``), batched vs sequential
halves (``--cfg-batching``), its ``auto`` rule, and what the run summary reports."""

import pytest
import torch
from test_schedulers import PLACEMENT, SHAPE, FakeDiT, assert_steps_match, contexts, factory, velocity  # noqa: F401

import serving
from ditattn.cli import main
from ditattn.errors import AttentionConfigError
from ditattn.pipelines.denoise import denoise
from ditattn.pipelines.sampling import (
    AUTO_SEQUENTIAL_MIN_TOKENS,
    build_sampler,
    cfg_mode,
    forwards,
    guided_steps,
    resolve_cfg_batching,
)
from ditattn.runconfig import SamplingConfig


@pytest.mark.parametrize(
    "n, interval, expected",
    [
        (4, None, [True] * 4),
        (4, (0.0, 0.5), [True, True, False, False]),  # i/n = 0, .25 guided; .5 is END: not guided
        (4, (0.25, 1.0), [False, True, True, True]),  # START is inclusive
        (5, (0.2, 0.6), [False, True, True, False, False]),
        (3, (0.5, 0.6), [False, False, False]),  # no i/3 in [0.5, 0.6)
        (50, (0.0, 0.4), [True] * 20 + [False] * 30),
    ],
)
def test_guided_steps_definition(n, interval, expected):
    assert guided_steps(n, interval) == expected
    assert guided_steps(n, interval, enabled=False) == [False] * n


def test_interval_is_validated():
    assert SamplingConfig(cfg_interval="0:0.5").cfg_interval == (0.0, 0.5)
    assert SamplingConfig(cfg_interval=[0.2, 1]).cfg_interval == (0.2, 1.0)
    for bad in ("0.5", "0.6:0.4", "0:1.5", "-0.1:0.5", "a:b", "0:0.5:1", [0.5]):
        with pytest.raises(AttentionConfigError, match=r"^cfg_interval: expected START:END with 0 <= START < END"):
            SamplingConfig(cfg_interval=bad)
    with pytest.raises(AttentionConfigError, match=r"^cfg_batching: expected one of auto, batched, sequential"):
        SamplingConfig(cfg_batching="parallel")


def run_loop(factory, *, guidance, interval=None, sequential=False, steps=5):  # noqa: F811
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
    cond, uncond = contexts(SHAPE[0])
    sampler = build_sampler(factory, name="flow_euler", shift=3.0, steps=steps, seeds=[1, 2])
    guided = guided_steps(steps, interval, guidance > 1)
    dit = FakeDiT()
    out, _ = denoise(
        x,
        sampler.scheduler,
        {"transformer": dit, "transformer_2": None},
        context=torch.cat([cond, uncond]) if guidance > 1 else cond,
        condition=None,
        guidance=guidance,
        guidance_2=guidance,
        boundary_ratio=None,
        expand_timesteps=False,
        placement=PLACEMENT,
        dtype=torch.float32,
        progress=False,
        guided=guided,
        sequential_cfg=sequential,
    )
    return out, dit.calls, guided


def reference(factory, *, guidance, guided, steps=5):  # noqa: F811
    """Written out: guided steps combine both halves, the others take the conditional velocity."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(steps)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
    cond, uncond = contexts(SHAPE[0])
    for i, t in enumerate(sched.timesteps):
        ts = t.expand(SHAPE[0])
        v = velocity(x, ts, cond)
        if guided[i]:
            u = velocity(x, ts, uncond)
            v = u + guidance * (v - u)
        x = sched.step(v, t, x, return_dict=False)[0]
    return x


@pytest.mark.parametrize("sequential", [False, True])
def test_interval_runs_conditional_only_outside(factory, sequential):  # noqa: F811
    out, calls, guided = run_loop(factory, guidance=4.0, interval=(0.0, 0.4), sequential=sequential)
    assert guided == [True, True, False, False, False]
    n = SHAPE[0]
    if sequential:  # two batch-N forwards per guided step, named by branch; then one conditional forward
        assert [(c[0].shape[0], c[2]) for c in calls] == [(n, "cond"), (n, "uncond")] * 2 + [(n, "cond")] * 3
    else:  # one batch-2N forward per guided step
        assert [(c[0].shape[0], c[2]) for c in calls] == [(2 * n, None)] * 2 + [(n, "cond")] * 3
    assert_steps_match([out], [reference(factory, guidance=4.0, guided=guided)])


def test_sequential_equals_batched(factory):  # noqa: F811
    a, _, guided = run_loop(factory, guidance=5.0, sequential=False)
    b, _, _ = run_loop(factory, guidance=5.0, sequential=True)
    assert all(guided)
    assert_steps_match([b], [a])
    assert_steps_match([a], [reference(factory, guidance=5.0, guided=guided)])


def test_guidance_one_is_one_forward_per_step(factory):  # noqa: F811
    out, calls, guided = run_loop(factory, guidance=1.0, interval=(0.0, 0.5))
    assert guided == [False] * 5 and [(c[0].shape[0], c[2]) for c in calls] == [(SHAPE[0], None)] * 5
    assert_steps_match([out], [reference(factory, guidance=1.0, guided=guided)])


def test_auto_rule():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    assert resolve_cfg_batching("auto", device=cpu, tokens=10**6) == "batched"
    assert resolve_cfg_batching("auto", device=gpu, tokens=AUTO_SEQUENTIAL_MIN_TOKENS - 1) == "batched"
    assert resolve_cfg_batching(None, device=gpu, tokens=AUTO_SEQUENTIAL_MIN_TOKENS) == "sequential"
    assert resolve_cfg_batching("batched", device=gpu, tokens=10**6) == "batched"
    assert resolve_cfg_batching("sequential", device=cpu, tokens=1) == "sequential"
    assert cfg_mode([True, True], "batched") == "batched"
    assert cfg_mode([True, False, False], "sequential") == "sequential, on 1 of 3 steps"
    assert cfg_mode([False], "batched") == "off"
    assert forwards([True, True, False]) == 5


@pytest.fixture(scope="module")
def tiny():
    from ditattn.pipelines.wan import WanPipelineNative

    return WanPipelineNative.from_pretrained("ditattn:tiny-wan", device="cpu", dtype="float32")


def test_tiny_model_sequential_matches_batched(tiny):
    """The real DiT: sequential halves (separate text caches per half) give the batched result."""
    kw = dict(
        height=32,
        width=48,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=4.0,
        seed=3,
        output_type="latent",
        progress=False,
    )
    a = tiny.generate(["a cat", "a dog"], cfg_batching="batched", **kw)
    b = tiny.generate(["a cat", "a dog"], cfg_batching="sequential", **kw)
    c = tiny.generate(["a cat", "a dog"], cfg_interval="0:0.5", **kw)
    assert a.sampling["cfg"] == "batched" and b.sampling["cfg"] == "sequential" and a.sampling["forwards"] == 6
    assert c.sampling["cfg"] == "batched, on 2 of 3 steps" and c.sampling["forwards"] == 5
    assert_steps_match([b.latents], [a.latents])
    assert (c.latents - a.latents).abs().max() > 1e-3  # the last step ran unguided


def test_summary_line_reports_sampler_and_forwards(capsys, tmp_path):
    capsys.readouterr()
    rc = main(
        [
            "generate",
            "--model-path",
            "ditattn:tiny-wan",
            "--prompt",
            "a cat",
            "--height",
            "32",
            "--width",
            "48",
            "--num-frames",
            "1",
            "--num-inference-steps",
            "4",
            "--guidance-scale",
            "3",
            "--cfg-interval",
            "0:0.5",
            "--cfg-batching",
            "sequential",
            "--scheduler",
            "flow_euler",
            "--flow-shift",
            "5",
            "--output-path",
            str(tmp_path),
        ]
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0
    assert "4 steps, flow_euler shift 5, 6 DiT forwards, CFG sequential, on 2 of 4 steps (load" in last


def test_bench_cfg_batching_cpu_smoke(tmp_path):
    """bench/cfg_batching.py runs (CPU smoke mode) and its two paths compute the same numbers."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "cfg.json"
    env = serving.subprocess_env(BENCH_DEVICE="cpu")
    subprocess.run(
        [
            sys.executable,
            os.path.join(root, "bench", "cfg_batching.py"),
            "--arch",
            "tiny",
            "--sizes",
            "32x48x5",
            "--text-len",
            "16",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 2 * 2 * 3 and row["rel_diff"] < 1e-5 and row["batched_ms"] > 0
