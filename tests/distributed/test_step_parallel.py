"""CFG parallelism and parallel VAE decode on gloo ranks against the one-process run.

* ``ditattn generate --cfg-parallel`` through the CLI on 2 ranks, and ``--cfg-parallel --ulysses-degree 2
  --vae-parallel`` on 4 (spawned ranks, rank 0 writes);
* in the same spawns, the pipeline under CFG × Ulysses × ring layouts with the VAE's tiles spread over
  the ranks (small tiles, so a 48×64 clip decodes in 6 tiles), on ``ditattn:tiny-wan``, the
  two-expert ``ditattn:tiny-wan2.2`` and the image-to-video ``ditattn:tiny-wan-i2v``: the frames equal
  the one-process frames with tiling (≤ 1e-5) and are identical on every rank;
* the parallel tiled decode of the Wan 2.2 VAE layout (patchified, clamped) against diffusers' own;
* bad combinations refused with one ``error:`` line before any rank starts;
* on a machine with 4 CUDA GPUs, CFG 2 × Ulysses 2 with the parallel decode on NCCL against one GPU.
"""

import os
import sys

import numpy as np
import pytest
import torch

from ditattn import AttentionConfigError
from ditattn.attention.context import AttentionSettings, current_forward
from ditattn.distributed.cfg import destroy_cfg_parallel, get_cfg_parallel, init_cfg_parallel, resolve_parallel
from ditattn.distributed.groups import destroy_sequence_parallel, init_sequence_parallel

# 9 frames at 48x64: latents 3x6x8 (36 DiT tokens); 32-pixel tiles every 24 pixels: 2 x 3 = 6 tiles
GEN = dict(height=48, width=64, num_frames=9, num_inference_steps=2, seed=3)
TILES = dict(
    tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24, tile_sample_stride_width=24
)


def _pipe(model, settings, device="cpu", **kw):
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained(model, settings, device=device, dtype="float32", **kw)
    pipe.components["vae"].enable_tiling(**TILES)
    return pipe


def _generate(pipe, model):
    kw = {"guidance_scale_2": 3.0} if model.endswith("2.2") else {}
    if model.endswith("i2v"):  # the first frame: latents concatenated to the input, CLIP tokens split by half
        kw["image"] = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    return pipe.generate(
        "a red fox", negative_prompt="blurry", output_type="float", progress=False, **GEN, **kw
    ).frames


def _worker(configs):
    """Each config ``(model, cfg, ulysses, ring, vae_parallel)``: fresh groups, the pipeline, its frames
    and the guidance branches its DiT forwards ran under."""
    out = {}
    for model, c, u, r, vae in configs:
        destroy_cfg_parallel()
        destroy_sequence_parallel()
        init_sequence_parallel(u, r, cfg_degree=c)
        init_cfg_parallel(c)
        pipe = _pipe(model, AttentionSettings(ulysses_degree=u, ring_degree=r), vae_parallel=vae)
        branches = set()
        for dit in pipe.dit_modules:
            dit.register_forward_pre_hook(lambda m, a: branches.add(current_forward().branch))
        out[(model, c, u, r, vae)] = (_generate(pipe, model), branches)
    # the Wan 2.2 VAE layout (patch size 2, values clamped at +-1): parallel vs one-device tiled decode
    from ditattn.distributed.vae import parallel_tiled_decode

    out["vae22"] = parallel_tiled_decode(_vae22(), _vae22_latents())
    return out


def _vae22():
    from diffusers import AutoencoderKLWan

    from ditattn.models.tiny_i2v import VAE22

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**VAE22).eval()
    vae.enable_tiling(
        tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48, tile_sample_stride_width=48
    )
    return vae


def _vae22_latents():
    return 3 * torch.randn(1, 48, 2, 7, 5, generator=torch.Generator().manual_seed(1))


def _rank_target(rank, cfg):
    """What each launched rank runs: the real ``ditattn generate`` rank, then the layouts above."""
    from ditattn.entrypoints.generate import run_rank

    rc = run_rank(rank, cfg)
    cli_branch = get_cfg_parallel().branch
    with torch.inference_mode():
        res = _worker(CONFIGS[rank.world_size])
    res["rc"], res["cli_branch"] = rc, cli_branch
    torch.save(res, os.path.join(os.environ["DITATTN_TEST_RESULTS"], f"rank{rank.rank}.pt"))
    return rc


CONFIGS = {
    2: [
        ("ditattn:tiny-wan", 2, 1, 1, True),
        ("ditattn:tiny-wan", 1, 2, 1, True),
        ("ditattn:tiny-wan-i2v", 2, 1, 1, False),
    ],
    4: [
        ("ditattn:tiny-wan2.2", 2, 2, 1, True),
        ("ditattn:tiny-wan", 1, 2, 2, True),
        ("ditattn:tiny-wan", 2, 1, 2, False),
    ],
}
CLI = {2: ["--cfg-parallel"], 4: ["--cfg-parallel", "--ulysses-degree", "2", "--vae-parallel"]}


@pytest.mark.parametrize("world", [2, 4])
def test_cfg_and_vae_parallel_match_one_process(world, tmp_path, capfd, monkeypatch):
    import imageio.v3 as iio

    import ditattn.entrypoints.generate as generate_mod
    from ditattn.cli import main

    out_dir, res_dir = tmp_path / "out", tmp_path / "res"
    res_dir.mkdir()
    common = [
        "generate",
        "--model-path",
        "ditattn:tiny-wan",
        "--prompt",
        "a red fox",
        "--num-frames",
        "1",
        "--height",
        "48",
        "--width",
        "64",
        "--num-inference-steps",
        "2",
        "--output-path",
        str(out_dir),
    ]
    assert main(common + ["--output-file", "single.png"]) == 0
    with torch.inference_mode():
        single = {
            m: _generate(_pipe(m, AttentionSettings(), vae_tiling=True), m) for m in {c[0] for c in CONFIGS[world]}
        }
        vae22 = _vae22()
        ref22 = vae22.decode(_vae22_latents()).sample

    monkeypatch.setenv("DITATTN_TEST_RESULTS", str(res_dir))
    monkeypatch.setattr(generate_mod, "run_rank", _rank_target)  # what `generate --num-gpus N` runs per rank
    assert main(common + ["--output-file", "par.png", "--num-gpus", str(world)] + CLI[world]) == 0

    # the CLI run: rank 0 alone printed and wrote, and the image equals the one-process one
    printed = capfd.readouterr().out
    assert printed.count("saved:") == 2
    assert printed.count("CFG parallel") == 1 and printed.count("CFG batched") == 1  # the summary says what ran
    a, b = (iio.imread(out_dir / f).astype(int) for f in ("single.png", "par.png"))
    assert a.shape == b.shape == (48, 64, 3) and a.std() > 1
    assert np.abs(a - b).max() <= 1

    res = [torch.load(res_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert [r["rc"] for r in res] == [0] * world
    half = world // 2
    assert [r["cli_branch"] for r in res] == ["cond"] * half + ["uncond"] * half
    assert ref22.abs().max() == 1.0  # the clamp is exercised
    for rank, rank_res in enumerate(res):
        assert (rank_res["vae22"] - ref22).abs().max() <= 1e-6
        for key in CONFIGS[world]:
            model, c, u, r, vae = key
            frames, branches = rank_res[key]
            ref = single[model]
            assert frames.shape == ref.shape and ref.std() > 0.01
            assert np.abs(frames - ref).max() <= 1e-5, (key, np.abs(frames - ref).max())
            assert np.array_equal(frames, res[0][key][0]), key  # every rank stepped identically
            want = {None} if c == 1 else {"cond" if rank // (world // c) == 0 else "uncond"}
            assert branches == want, (key, rank, branches)


def test_parallel_flags_in_config_and_rank_arithmetic(tmp_path):
    from ditattn.runconfig import ParallelConfig, RunConfig

    assert resolve_parallel(4, 2, cfg_parallel=True) == (2, 2, 1)
    assert resolve_parallel(8, None, 2, cfg_parallel=True) == (2, 2, 2)
    assert resolve_parallel(2, cfg_parallel=True, vae_parallel=True) == (2, 1, 1)
    assert resolve_parallel(4, vae_parallel=True) == (1, 4, 1)
    path = tmp_path / "run.yaml"
    path.write_text("num-gpus: 4\ncfg-parallel: true\nvae_parallel: true\nring-degree: 2\n")
    p = RunConfig.from_file(str(path)).parallel
    assert (p.cfg_parallel, p.vae_parallel, p.cfg_degree(), p.degrees()) == (True, True, 2, (1, 2))
    assert ParallelConfig(num_gpus=6, cfg_parallel=True).degrees() == (3, 1)
    with pytest.raises(AttentionConfigError, match="does not equal --num-gpus 8 / 2"):
        ParallelConfig(num_gpus=8, cfg_parallel=True, ulysses_degree=2, ring_degree=4).degrees()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cfg-parallel", "--num-gpus", "3"], "--cfg-parallel needs an even --num-gpus"),
        (["--cfg-parallel"], "--cfg-parallel needs an even --num-gpus"),
        (
            ["--cfg-parallel", "--num-gpus", "4", "--ulysses-degree", "4"],
            "--ulysses-degree 4 does not divide --num-gpus 4 / 2 (--cfg-parallel)",
        ),
        (
            ["--cfg-parallel", "--num-gpus", "4", "--ulysses-degree", "2", "--ring-degree", "2"],
            "--ulysses-degree 2 × --ring-degree 2 = 4 does not equal --num-gpus 4 / 2 (--cfg-parallel)",
        ),
        (
            ["--cfg-parallel", "--num-gpus", "2", "--guidance-scale", "1"],
            "--guidance-scale is 1 (<= 1: no unconditional",
        ),
        (
            ["--cfg-parallel", "--num-gpus", "2", "--cfg-batching", "sequential"],
            "--cfg-batching sequential: with --cfg-parallel each guidance half runs on its own ranks",
        ),
        (
            ["--cfg-parallel", "--num-gpus", "2", "--cfg-interval", "0.1:0.2", "--num-inference-steps", "4"],
            "--cfg-interval 0.1:0.2 guides none of the 4 steps",
        ),
        (["--vae-parallel"], "--vae-parallel splits the VAE decode over the ranks and needs --num-gpus 2"),
        (["--cfg-parallel", "--num-gpus", "2", "--backend", "diffusers"], "runs the native pipeline only"),
    ],
)
def test_bad_combinations_are_one_error_line(flags, message, capsys):
    from ditattn.cli import main

    assert main(["generate", "--prompt", "x", "--model-path", "ditattn:tiny-wan"] + flags) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--cfg-interval", "0.5:0.6", "--num-inference-steps", "3"],
            "--cfg-interval 0.5:0.6 guides none of the 3 steps",
        ),
        (["--cfg-interval", "0.9:0.95"], "guides none of the 8 steps"),  # the model's default step count
        (["--guidance-scale", "1"], "--guidance-scale is 1 (<= 1: no unconditional"),
        (["--cfg-batching", "sequential"], "--cfg-batching sequential: with --cfg-parallel"),
    ],
)
def test_plan_refuses_cfg_parallel_without_guidance_as_generate_does(flags, message, capsys):
    """``plan`` runs generate's --cfg-parallel check (with the model's default guidance and steps): one
    error line and exit 2, not a plan that says "CFG off"."""
    from ditattn.cli import main

    argv = ["plan", "--model-path", "ditattn:tiny-wan", "--device", "cpu", "--num-gpus", "2", "--cfg-parallel"]
    assert main(argv + flags) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert captured.out == ""


def test_cfg_parallel_without_guidance_refused_from_model_default():
    from ditattn.entrypoints.ranks import check_cfg_guidance
    from ditattn.runconfig import ParallelConfig, RunConfig

    cfg = RunConfig(parallel=ParallelConfig(num_gpus=2, cfg_parallel=True))
    check_cfg_guidance(cfg, 5.0)
    with pytest.raises(AttentionConfigError, match="default guidance scale is 1"):
        check_cfg_guidance(cfg, 1.0)


def _odd_ranks_run(folder):
    env = dict(os.environ, DITATTN_CACHE=os.path.join(folder, "cache"), PYTHONPATH=os.pathsep.join(sys.path))
    return dict(
        args=[
            sys.executable,
            "-m",
            "ditattn",
            "generate",
            "--prompt",
            "x",
            "--model-path",
            "ditattn:tiny-wan",
            "--cfg-parallel",
            "--num-gpus",
            "3",
        ],
        env=env,
        timeout=120,
    )


@pytest.mark.background.with_args(_odd_ranks_run)
def test_cli_module_refuses_odd_ranks_before_loading(background_run):
    """``python -m ditattn generate --cfg-parallel --num-gpus 3``: exit 2, one ``error:`` line, no
    model built in the (empty) model cache."""
    proc, tmp_path = background_run
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --cfg-parallel needs an even --num-gpus (the conditional and unconditional passes each run on half "
        "of the ranks), got --num-gpus 3; use --num-gpus 4 or 2"
    ]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))


def _nccl_rank(rank):
    g = rank.groups
    pipe = _pipe(
        "ditattn:tiny-wan",
        AttentionSettings(ulysses_degree=g.ulysses_degree, ring_degree=g.ring_degree),
        vae_parallel=True,
        device=rank.device,
    )
    return _generate(pipe, "ditattn:tiny-wan")


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs (NCCL)")
def test_nccl_cfg_ulysses_and_vae_parallel_match_one_gpu():
    """The same on NCCL: CFG 2 × Ulysses 2 with the decode over 4 GPUs against one GPU (float32)."""
    from ditattn.distributed.launch import launch

    with torch.inference_mode():
        ref = _generate(
            _pipe("ditattn:tiny-wan", AttentionSettings(), vae_tiling=True, device="cuda"), "ditattn:tiny-wan"
        )
    out = launch(_nccl_rank, 4, cfg_degree=2, ulysses_degree=2, device="cuda", timeout_s=300)
    for frames in out:
        assert np.abs(frames - ref).max() <= 1e-4
        assert np.array_equal(frames, out[0])


def test_cfg_parallel_reports_both_halves_step_cache(capfd):
    """Under --cfg-parallel each rank ran (and reported) only its guidance half's forwards ('4 of 6 DiT
    calls' for a 12-call run); the report gathers both halves and equals the sequential run's, where each
    branch also decides on its own signal."""
    import re

    from ditattn.cli import main

    common = ["generate", "--model-path", "ditattn:tiny-wan", "--prompt", "a red fox", "--num-frames", "1"]
    common += ["--height", "48", "--width", "64", "--num-inference-steps", "6", "--guidance-scale", "3"]
    common += ["--cache-backend", "teacache", "--cache-backend-config", "threshold=1e6,max_consecutive_skips=1"]
    common += ["--no-save-output"]
    assert main(common + ["--cfg-batching", "sequential"]) == 0
    assert main(common + ["--num-gpus", "2", "--cfg-parallel"]) == 0
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("done in")]
    reports = [re.search(r"step cache teacache: (\d+) of (\d+) DiT calls computed, (\d+) reused", x) for x in lines]
    assert len(reports) == 2 and all(reports), lines
    assert reports[0].groups() == reports[1].groups() and reports[0].group(2) == "12", lines
    assert "CFG sequential" in lines[0] and "CFG parallel" in lines[1]


def test_merging_the_cfg_halves_counts_an_unguided_step_once():
    from ditattn.cache.runtime import merge_cfg_halves

    cond = ({"backend": "teacache", "trace": "CRCC", "forwards": 4}, [(6, 6), (0, 6), (6, 6), (6, 6)])
    uncond = ({"backend": "teacache", "trace": "CCRC", "forwards": 4}, [(6, 6), (6, 6), (0, 6), (6, 6)])
    merged = merge_cfg_halves([cond, uncond], [True, True, False, False])  # steps 2 and 3 unguided: one forward
    assert merged["trace"] == "CCRCCC" and merged["forwards"] == 6
    assert (merged["computed"], merged["reused"], merged["blocks_computed"], merged["blocks_total"]) == (5, 1, 30, 36)
    assert merge_cfg_halves([cond, uncond], [True] * 5) is cond[0]  # counts that do not fit: one half's report
