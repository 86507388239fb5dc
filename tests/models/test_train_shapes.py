"""Training code of ``ditattn:shapes``: procedural scenes, the judge, flow-matching pieces, and a
smoke run of both stages on toy sizes (CPU, a few seconds)."""

import json
import os
import types

import numpy as np
import pytest
import torch

from ditattn.train.judge import judge
from ditattn.train.scenes import COLORS, MOTIONS, SHAPES, caption, parse_caption, render, sample_scenes, scene_batch


def _uint8(clips):
    return ((clips + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 4, 1).numpy()


def test_scenes_are_deterministic_and_in_range():
    a, caps_a, _ = scene_batch(8, 5, 32, 48, torch.Generator().manual_seed(3))
    b, caps_b, _ = scene_batch(8, 5, 32, 48, torch.Generator().manual_seed(3))
    c, caps_c, _ = scene_batch(8, 5, 32, 48, torch.Generator().manual_seed(4))
    assert a.shape == (8, 3, 5, 32, 48) and a.dtype == torch.float32
    assert torch.equal(a, b) and caps_a == caps_b
    assert not torch.equal(a, c)
    assert a.min() >= -1 and a.max() <= 1


def test_captions_follow_the_grammar():
    scenes = sample_scenes(200, 64, 64, torch.Generator().manual_seed(0))
    caps = scenes.captions()
    two = [c for c in caps if " and " in c]
    assert 0 < len(two) < len(caps)  # both one- and two-shape scenes
    for cap, present in zip(caps, scenes.present.tolist()):
        parsed = parse_caption(cap)
        assert parsed is not None and len(parsed) == sum(present)
        for color, shape, motion in parsed:
            assert color in COLORS and shape in SHAPES and motion in MOTIONS
    assert parse_caption("a purple circle moving right") is None
    assert parse_caption("a red fox") is None
    assert caption("red", "circle", "moving right") == "a red circle moving right"
    with pytest.raises(ValueError, match="accepted"):
        caption("red", "hexagon", "moving right")


@pytest.mark.parametrize("size", [(64, 64), (32, 96), (96, 32)])
def test_shapes_stay_inside_the_frame(size):
    h, w = size
    scenes = sample_scenes(64, h, w, torch.Generator().manual_seed(1))
    clips = render(scenes, 9, h, w)
    border = torch.cat([clips[..., 0, :], clips[..., -1, :], clips[..., :, 0], clips[..., :, -1]], dim=-1)
    bg = torch.tensor([0.12 * 2 - 1] * 3).view(1, 3, 1, 1)
    assert (border - bg).abs().max() < 0.05


def test_judge_accepts_the_truth_and_rejects_wrong_prompts():
    g = torch.Generator().manual_seed(5)
    clips, caps, scenes = scene_batch(60, 9, 64, 64, g, p_two=0.0)
    frames = _uint8(clips)
    opposite = {
        "moving left": "moving right",
        "moving right": "moving left",
        "moving up": "moving down",
        "moving down": "moving up",
        "growing": "shrinking",
        "shrinking": "growing",
    }
    colors = list(COLORS)
    for fr, cap in zip(frames, caps):
        ((color, _, motion),) = parse_caption(cap)
        assert judge(fr, color, motion).ok, cap
        assert not judge(fr, color, opposite[motion]).motion_ok, cap
        other = colors[(colors.index(color) + 1) % len(colors)]
        assert not judge(fr, other, motion).color_ok, cap
    blank = np.full((9, 64, 64, 3), 31, np.uint8)
    v = judge(blank, "red", "moving right")
    assert not v.ok and v.dominant is None


def _flood_labels(mask):
    """Reference 8-connected pieces by breadth-first search: a list of sets of (y, x)."""
    H, W = mask.shape
    seen, out = np.zeros_like(mask), []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        piece, todo = set(), [(y0, x0)]
        seen[y0, x0] = True
        while todo:
            y, x = todo.pop()
            piece.add((y, x))
            for yy in range(max(0, y - 1), min(H, y + 2)):
                for xx in range(max(0, x - 1), min(W, x + 2)):
                    if mask[yy, xx] and not seen[yy, xx]:
                        seen[yy, xx] = True
                        todo.append((yy, xx))
        out.append(piece)
    return out


def test_pieces_match_a_flood_fill_on_random_masks():
    from ditattn.train.judge import pieces

    rng = np.random.default_rng(11)
    masks = rng.random((3, 23, 37)) < np.array([0.2, 0.4, 0.55])[:, None, None]
    labels = pieces(masks)
    for mask, lab in zip(masks, labels):
        assert ((lab > 0) == mask).all()
        ref = _flood_labels(mask)
        got = {}
        for y, x in zip(*np.nonzero(mask)):
            got.setdefault(int(lab[y, x]), set()).add((y, x))
        assert sorted(map(sorted, got.values())) == sorted(map(sorted, ref))


def test_rect_fill_of_ideal_shapes_at_any_rotation():
    from ditattn.train.judge import classify_fill, rect_fill

    yy, xx = np.mgrid[0:151, 0:163] + 0.5
    cx, cy = 81.3, 74.9
    disk = (xx - cx) ** 2 + (yy - cy) ** 2 < 50**2
    assert abs(rect_fill(disk) - np.pi / 4) < 0.02 and classify_fill(rect_fill(disk)) == "circle"
    for angle in (0.0, 20.0, 45.0):
        a = np.deg2rad(angle)
        u, v = (xx - cx) * np.cos(a) + (yy - cy) * np.sin(a), -(xx - cx) * np.sin(a) + (yy - cy) * np.cos(a)
        square = (np.abs(u) < 40) & (np.abs(v) < 40)
        triangle = (v < 35) & (v > np.sqrt(3) * np.abs(u) - 70)  # equilateral, rotated
        assert rect_fill(square) > 0.95 and classify_fill(rect_fill(square)) == "square", angle
        assert abs(rect_fill(triangle) - 0.5) < 0.05 and classify_fill(rect_fill(triangle)) == "triangle", angle
    assert np.isnan(rect_fill(np.zeros((5, 5), bool))) and classify_fill(float("nan")) is None


@pytest.mark.parametrize("size", [(64, 64, 9), (96, 128, 17)])
def test_judge_tells_the_rendered_shape(size):
    """On clips rendered from the training grammar (every colour, motion and shape, sizes from the
    smallest shrinking shape up), the judge reads the drawn shape and rejects the two others."""
    h, w, f = size
    clips, caps, _ = scene_batch(45 if h == 64 else 15, f, h, w, torch.Generator().manual_seed(h + f), p_two=0.0)
    right = 0
    for fr, cap in zip(_uint8(clips), caps):
        ((color, shape, motion),) = parse_caption(cap)
        v = judge(fr, color, motion, shape)
        right += bool(v.shape_ok) and v.shape == shape and v.main_share == 1.0
        for other in SHAPES:
            if other != shape:
                assert judge(fr, color, motion, other).shape_ok is False, cap
    assert right >= 0.98 * len(caps), f"{right} / {len(caps)}"


def test_judge_refuses_a_shape_in_two_pieces():
    """Two squares of the prompted colour (a shape drawn twice) are not a square; an unknown shape is an error."""
    from ditattn.train.scenes import Scenes

    two = lambda v0, v1: torch.tensor([[v0, v1]])  # noqa: E731
    red, square = list(COLORS).index("red"), SHAPES.index("square")
    scenes = Scenes(
        kind=two(square, square),
        color=two(red, red),
        motion=two(4, 4),
        present=two(True, True),
        x0=two(0.3, 0.7),
        y0=two(0.5, 0.5),
        dx=two(0.0, 0.0),
        dy=two(0.0, 0.0),
        radius=two(0.12, 0.12),
        scale0=two(0.6, 0.6),
        scale1=two(1.4, 1.4),
    )
    frames = _uint8(render(scenes, 9, 64, 96))[0]
    v = judge(frames, "red", "growing", "square")
    assert v.color_ok and v.motion_ok and v.shape == "square" and v.shape_ok is False
    assert abs(v.main_share - 0.5) < 0.05
    assert judge(frames[:, :, :48], "red", "growing", "square").shape_ok  # one of them alone
    with pytest.raises(ValueError, match="accepted"):
        judge(frames, "red", "growing", "hexagon")


def test_loss_weight_maps_follow_the_shapes():
    """The DiT's shape weights sit on the latent cells (first frame alone, then groups of 4) that a
    shape touches; the VAE's outline weights on the pixels next to an edge only."""
    from ditattn.train.dit_stage import latent_foreground
    from ditattn.train.vae_stage import outline

    bg = 0.12 * 2 - 1
    clips = torch.full((2, 3, 13, 48, 40), bg)
    clips[0, 0, 6, 17:20, 26:31] = 0.8  # frame 6 -> latent frame 2 (frames 5-8); rows 2, columns 3
    clips[1, :, 0, :, :] = 0.9  # everything in frame 0 only
    fg = latent_foreground(clips)
    assert fg.shape == (2, 1, 4, 6, 5)
    assert fg[0].nonzero().tolist() == [[0, 2, 2, 3]]
    assert fg[1, 0, 0].all() and not fg[1, 0, 1:].any()
    edge = outline(clips[:1])
    assert edge.shape == (1, 1, 13, 48, 40)
    ys, xs = edge[0, 0, 6].nonzero().T.tolist()
    assert (min(ys), max(ys), min(xs), max(xs)) == (16, 20, 25, 31)
    assert not edge[0, 0, 6, 18, 28] and edge[0, 0, 6, 17, 28] and edge[0, 0, 6, 16, 28]  # inside / border / outside
    assert int(edge.sum()) == (5 * 7 - 1 * 3) and not edge[0, 0, :6].any()


def test_short_text_context_equals_the_pipelines_512_token_padding():
    """The training shortcut (few zero rows + log-count bias) is the same function as the zero padding
    to 512 tokens that ditattn's and diffusers' pipelines feed the DiT."""
    from diffusers import WanTransformer3DModel

    from ditattn.train.flow import install_text_bias, text_context

    torch.manual_seed(0)
    m = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    ).eval()
    x, t = torch.randn(2, 16, 2, 4, 4), torch.tensor([300.0, 700.0])
    hidden = torch.randn(2, 7, 32)
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4])
    padded = torch.zeros(2, 512, 32)
    padded[0, :7], padded[1, :3] = hidden[0], hidden[1, :3]
    with torch.no_grad():
        ref = m(x, t, padded).sample
        context, bias = text_context(hidden, mask)
        proc = install_text_bias(m)
        proc.bias = bias
        out = m(x, t, context).sample
    assert context.shape == (2, 8, 32) and bias.shape == (2, 1, 1, 8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_shifted_sigmas_match_the_scheduler_shift():
    from diffusers import UniPCMultistepScheduler

    from ditattn.train.flow import flow_pair, shift_sigmas
    from ditattn.train.recipe import SCHEDULER

    sched = UniPCMultistepScheduler(**SCHEDULER)
    sched.set_timesteps(10)
    u = torch.linspace(1, 0, 11)[:-1]  # the sampler's unshifted sigmas
    torch.testing.assert_close(
        shift_sigmas(u, SCHEDULER["flow_shift"]) * 1000, sched.timesteps.float(), rtol=0, atol=1.0
    )
    x0, noise = torch.randn(3, 4), torch.randn(3, 4)
    xt, v = flow_pair(x0, noise, torch.tensor([0.0, 0.5, 1.0]))
    torch.testing.assert_close(xt[0], x0[0])
    torch.testing.assert_close(xt[2], noise[2])
    torch.testing.assert_close(v, noise - x0)


def _train(out, *extra):
    from ditattn.train.shapes import main

    return main(
        ["--preset", "tiny", "--out", str(out), "--device", "cpu", "--threads", "1", "--eval-prompts", "0", *extra]
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A package trained by the ``tiny`` preset, 3 VAE + 3 DiT steps (shared by the tests below)."""
    out = tmp_path_factory.mktemp("tiny_run")
    assert _train(out, "--stage", "all", "--vae-steps", "3", "--dit-steps", "3") == 0
    return out


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "shapes.safetensors"))


def test_training_smoke_run_writes_a_loadable_model(tiny_run, tmp_path):
    """3 VAE steps + 3 DiT steps on toy sizes: loss log, curve, samples and package files that the
    native pipeline loads and runs."""
    names = set(os.listdir(tiny_run))
    assert {
        "shapes.json",
        "shapes.safetensors",
        "loss.json",
        "loss.png",
        "vae_recon.png",
        "samples.png",
        "train.log",
    } <= names
    log = json.loads((tiny_run / "loss.json").read_text())
    assert [len(log["stages"][s]) for s in ("vae", "dit")] == [3, 3]
    assert all(np.isfinite(r[2]) for s in ("vae", "dit") for r in log["stages"][s])
    meta = json.loads((tiny_run / "shapes.json").read_text())
    assert meta["training"]["stages"]["dit"]["steps"] == 3 and meta["training"]["seed"] == 0
    assert len(meta["components"]["vae"]["latents_mean"]) == 16

    tensors = _tensors(tiny_run)
    assert {t.dtype for t in tensors.values()} == {torch.float16}

    from ditattn.models.shapes import shapes_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    folder = shapes_model_path(root=str(tmp_path / "cache"), package=str(tiny_run))
    pipe = WanPipelineNative.from_pretrained(folder, device="cpu")
    res = pipe.generate(
        "a red circle moving right", height=32, width=32, num_frames=5, num_inference_steps=2, progress=False
    )
    assert res.frames.shape == (1, 5, 32, 32, 3)

    # stage dit alone takes the VAE from the previous run's package, bit for bit
    out2 = tmp_path / "again"
    assert _train(out2, "--stage", "dit", "--dit-steps", "2", "--init", str(tiny_run)) == 0
    tensors2 = _tensors(out2)
    vae_keys = [k for k in tensors if k.startswith("vae.")]
    assert vae_keys and all(torch.equal(tensors[k], tensors2[k]) for k in vae_keys)


def test_dit_stage_resumes_from_a_package(tiny_run, tmp_path):
    """--resume starts the text encoder + DiT from the package (0 steps give it back bit for bit; a
    few steps stay closer to it than fresh weights do) and takes its VAE; the history is kept."""
    ref = _tensors(tiny_run)
    assert _train(tmp_path / "zero", "--stage", "dit", "--dit-steps", "0", "--resume", str(tiny_run)) == 0
    zero = _tensors(tmp_path / "zero")
    assert ref.keys() == zero.keys() and all(torch.equal(ref[k], zero[k]) for k in ref)

    # another seed than the package's: a fresh start is then far from it, a resumed one near
    assert (
        _train(tmp_path / "two", "--stage", "dit", "--dit-steps", "2", "--seed", "5", "--resume", str(tiny_run)) == 0
    )
    assert (
        _train(tmp_path / "fresh", "--stage", "dit", "--dit-steps", "2", "--seed", "5", "--init", str(tiny_run)) == 0
    )
    two, fresh = _tensors(tmp_path / "two"), _tensors(tmp_path / "fresh")
    keys = [k for k in ref if k.startswith(("transformer.", "text_encoder."))]

    def dist(t):
        return sum(float((t[k].float() - ref[k].float()).pow(2).sum()) for k in keys)

    assert 0 < dist(two) < dist(fresh)
    meta = json.loads((tmp_path / "two" / "shapes.json").read_text())["training"]
    assert meta["resumed_from"]["folder"] == str(tiny_run)
    assert meta["history"][-1]["stages"]["dit"]["steps"] == 3  # what the resumed package had been through
    assert meta["stages"]["dit"]["resumed"] is True and meta["stages"]["dit"]["steps"] == 2


def test_decoder_only_vae_stage_keeps_the_latents_and_the_dit(tiny_run, tmp_path):
    """--vae-train decoder --resume: the encoder, the latent statistics, the text encoder and the DiT
    come out bit for bit; the decoder trained; the package is judged (it holds a trained DiT)."""
    ref = _tensors(tiny_run)
    out = tmp_path / "dec"
    assert _train(out, "--stage", "vae", "--vae-steps", "2", "--resume", str(tiny_run), "--vae-train", "decoder") == 0
    new = _tensors(out)
    frozen = [k for k in ref if k.startswith(("vae.encoder.", "vae.quant_conv.", "transformer.", "text_encoder."))]
    decoder = [k for k in ref if k.startswith("vae.decoder.")]
    assert frozen and all(torch.equal(ref[k], new[k]) for k in frozen)
    assert any(not torch.equal(ref[k], new[k]) for k in decoder)
    old_meta, meta = (json.loads((f / "shapes.json").read_text()) for f in (tiny_run, out))
    for key in ("latents_mean", "latents_std"):
        assert meta["components"]["vae"][key] == old_meta["components"]["vae"][key]
    vae_info = meta["training"]["stages"]["vae"]
    assert vae_info["train_encoder"] is False and vae_info["resumed"] is True and vae_info["steps"] == 2
    assert "samples" in meta["training"]["stages"]["dit"] and (out / "samples.png").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--stage", "vae", "--vae-steps", "1", "--vae-train", "decoder"],
            "--vae-train decoder continues a trained VAE",
        ),
        (["--stage", "dit", "--dit-steps", "1", "--resume", "/nonexistent"], "--resume /nonexistent: no shapes.json"),
        (["--stage", "dit", "--dit-steps", "1", "--tune-guidance", "1,5"], "every scale must be above 1"),
        (["--stage", "dit", "--dit-steps", "1", "--tune-guidance", "five"], "expected auto, off or scales"),
        (["--stage", "dit", "--dit-steps", "1", "--dit-fg-weight", "-1"], "--dit-fg-weight must be >= 0"),
        (["--stage", "vae", "--vae-steps", "1", "--vae-edge-weight", "-0.5"], "--vae-edge-weight must be >= 0"),
        (["--stage", "dit", "--dit-steps", "1", "--eval-sizes", "64x64x8"], "frames 1 + 4k"),
        (["--stage", "dit", "--dit-steps", "1", "--eval-prompts", "61"], "--eval-prompts must be in 0..60"),
        (["--stage", "dit", "--dit-steps", "1", "--dit-sigma-shift", "0"], "--dit-sigma-shift must be > 0"),
        (["--stage", "dit", "--dit-steps", "1", "--dit-two-shapes", "1.5"], "--dit-two-shapes must be in 0..1"),
        (["--stage", "dit", "--dit-steps", "1", "--dit-shape-weights", "hexagon=2"], "SHAPE one of circle, square"),
        (["--stage", "dit", "--dit-steps", "1", "--dit-shape-weights", "square=-1"], "W >= 0, e.g. square=2"),
        (
            ["--stage", "dit", "--dit-steps", "1", "--dit-shape-weights", "circle=0,square=0,triangle=0"],
            "at least one shape needs a weight above 0",
        ),
    ],
)
def test_resume_and_tuning_flags_are_checked(argv, message, tmp_path, capsys):
    from ditattn.train.shapes import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_shape_weighted_losses_train(tiny_run, tmp_path):
    """--vae-edge-weight (decoder only) and --dit-fg-weight runs train, log their weights, and the
    weighted DiT loss differs from the plain one on the same seed."""
    assert (
        _train(
            tmp_path / "vae",
            "--stage",
            "vae",
            "--vae-train",
            "decoder",
            "--resume",
            str(tiny_run),
            "--vae-steps",
            "2",
            "--vae-edge-weight",
            "3",
        )
        == 0
    )
    log = json.loads((tmp_path / "vae" / "loss.json").read_text())
    assert log["info"]["vae"]["edge_weight"] == 3.0 and all(np.isfinite(r[2]) for r in log["stages"]["vae"])
    losses = {}
    for w in ("0", "2"):
        out = tmp_path / f"dit{w}"
        assert _train(out, "--stage", "dit", "--init", str(tiny_run), "--dit-steps", "2", "--dit-fg-weight", w) == 0
        log = json.loads((out / "loss.json").read_text())
        assert log["info"]["dit"]["fg_weight"] == float(w)
        losses[w] = [r[2] for r in log["stages"]["dit"]]
    assert all(np.isfinite(losses["2"])) and losses["0"][0] != losses["2"][0]
    # noise levels and shape odds of the DiT's clips: logged, and they change what is trained on
    out = tmp_path / "squares"
    argv = ["--dit-sigma-shift", "1", "--dit-shape-weights", "circle=0,triangle=0", "--dit-two-shapes", "0"]
    assert _train(out, "--stage", "dit", "--init", str(tiny_run), "--dit-steps", "2", *argv) == 0
    log = json.loads((out / "loss.json").read_text())
    plain = json.loads((tmp_path / "dit0" / "loss.json").read_text())["info"]["dit"]  # the run without these flags
    assert log["info"]["dit"]["sigma_shift"] == 1.0 and log["info"]["dit"]["shape_weights"] == [0.0, 1.0, 0.0]
    assert log["info"]["dit"]["p_two"] == 0.0 and plain["p_two"] == pytest.approx(0.35)
    assert log["info"]["dit"]["sigma_shift"] != plain["sigma_shift"]
    assert all(np.isfinite(r[2]) for r in log["stages"]["dit"]) and log["stages"]["dit"][0][2] != losses["0"][0]


def test_shape_odds_of_the_scenes():
    from ditattn.train.recipe import parse_shape_weights

    assert parse_shape_weights("square=2, triangle=1.5") == (1.0, 2.0, 1.5)
    g = torch.Generator().manual_seed(0)
    only = sample_scenes(64, 64, 64, g, shape_weights=(0.0, 1.0, 0.0))
    assert set(only.kind.flatten().tolist()) == {SHAPES.index("square")}
    many = sample_scenes(3000, 64, 64, torch.Generator().manual_seed(1), shape_weights=(1.0, 2.0, 0.0))
    share = many.kind.flatten().bincount(minlength=3).double() / many.kind.numel()
    assert share[2] == 0 and abs(float(share[1]) - 2 / 3) < 0.03
    equal = sample_scenes(3000, 64, 64, torch.Generator().manual_seed(1))
    assert (equal.kind.flatten().bincount(minlength=3).double() / equal.kind.numel() - 1 / 3).abs().max() < 0.03
    with pytest.raises(ValueError, match="shape_weights"):
        sample_scenes(2, 64, 64, g, shape_weights=(1.0, 1.0))


def test_resuming_under_another_preset_is_refused(tiny_run, tmp_path, capsys):
    from ditattn.train.shapes import main

    rc = main(
        [
            "--preset",
            "cpu",
            "--stage",
            "dit",
            "--dit-steps",
            "1",
            "--resume",
            str(tiny_run),
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "is not preset 'cpu'" in err and "resume with the preset it was trained with" in err


def test_learning_rate_schedule():
    from ditattn.train.recipe import DitStage

    cfg = DitStage(buckets=(), batch_tokens=1, warmup=10, resume_warmup=2, decay_frac=0.2, final_lr_frac=0.1)
    assert cfg.lr_factor(0, 0.0) == pytest.approx(0.1) and cfg.lr_factor(9, 0.01) == 1.0
    assert cfg.lr_factor(0, 0.0, resumed=True) == pytest.approx(0.5)
    assert cfg.lr_factor(100, 0.8) == 1.0  # stable until the last 20 %
    assert cfg.lr_factor(100, 0.9) == pytest.approx(0.55) and cfg.lr_factor(100, 1.0) == pytest.approx(0.1)
    assert DitStage(buckets=(), batch_tokens=1, warmup=1).lr_factor(5, 1.0) == 1.0  # no decay by default


def test_tuning_prompts_leave_the_semantic_test_out():
    from test_shapes_model import SEMANTIC

    from ditattn.train.evaluation import HELD_OUT, tuning_prompts

    assert set(HELD_OUT) == set(SEMANTIC)
    items = tuning_prompts(90)
    assert len(set(items)) == 84 and not set(items) & set(HELD_OUT)  # 5 colours x 6 motions x 3 shapes - 6
    assert {c for c, _, _ in items[:24]} == set(COLORS) and {m for _, _, m in items[:24]} == set(MOTIONS)


def test_held_out_prompts_are_neither_tuned_nor_tested_on():
    from ditattn.train.evaluation import HELD_OUT, TUNING_N, held_out_prompts, tuning_prompts

    items = held_out_prompts(60)
    assert len(set(items)) == 60 and not set(items) & (set(HELD_OUT) | set(tuning_prompts(TUNING_N)))
    assert held_out_prompts(30) == items[:30] and held_out_prompts(30, seed=7) != items[:30]
    assert sorted(s for _, s, _ in items[:30]) == sorted(SHAPES * 10)  # shapes in turn
    with pytest.raises(ValueError, match="0..60"):
        held_out_prompts(61)


def test_evaluation_cli_reports_shape_colour_and_motion(tiny_run, tmp_path, capsys):
    from ditattn.train.evaluation import main

    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "--package",
                str(tiny_run),
                "--sizes",
                "32x32x5,32x48x5",
                "--prompts",
                "2",
                "--steps",
                "1",
                "--device",
                "cpu",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("held-out prompts (2 at 32x48x5, 1 steps, guidance 3): shape ")
    evals = json.loads(out.read_text())["evaluations"]
    assert [e["size"] for e in evals] == [[32, 32, 5], [32, 48, 5]]
    for e in evals:
        assert len(e["results"]) == 2 and 0 <= e["shape_accuracy"] <= 1
        assert e["shape_accuracy"] == sum(r["shape_ok"] for r in e["results"]) / 2
    assert main(["--package", str(tiny_run), "--sizes", "30x32x5"]) == 2
    assert "multiples of 16" in capsys.readouterr().err
    assert main(["--package", str(tmp_path), "--sizes", "32x32x5"]) == 2  # no package there


def test_evaluation_passes_the_flow_shift_to_the_sampler(tiny_run, capsys):
    from ditattn.train import evaluation

    seen = []

    class Spy:
        def generate(self, prompts, **kw):
            seen.append(kw["flow_shift"])
            f = kw["num_frames"]
            return types.SimpleNamespace(frames=np.zeros((len(prompts), f, kw["height"], kw["width"], 3), np.uint8))

    ev = evaluation.evaluate_held_out(Spy(), [(32, 32, 5)], n=3, steps=1, flow_shift=1.5)[0]
    assert seen == [1.5] and ev["flow_shift"] == 1.5 and "flow shift 1.5)" in evaluation.format_held_out(ev)
    assert evaluation.main(["--package", str(tiny_run), "--flow-shift", "0", "--device", "cpu"]) == 2
    assert "--flow-shift must be > 0" in capsys.readouterr().err
    argv = ["--package", str(tiny_run), "--sizes", "32x32x5", "--prompts", "1", "--steps", "1", "--device", "cpu"]
    assert evaluation.main([*argv, "--flow-shift", "5"]) == 0
    assert ", flow shift 5): shape" in capsys.readouterr().out


def test_evaluation_from_a_later_prompt_keeps_each_prompt_s_seed(tiny_run, capsys):
    from ditattn.train import evaluation

    seen = []

    class Spy:
        def generate(self, prompts, **kw):
            seen.append((list(prompts), list(kw["seed"])))
            f = kw["num_frames"]
            return types.SimpleNamespace(frames=np.zeros((len(prompts), f, kw["height"], kw["width"], 3), np.uint8))

    everything = evaluation.held_out_prompts(60)
    ev = evaluation.evaluate_held_out(Spy(), [(32, 32, 5)], n=3, steps=1, first=30)[0]
    assert seen == [([f"a {c} {s} {m}" for c, s, m in everything[30:33]], [1030, 1031, 1032])]
    assert ev["first"] == 30 and [r["prompt"] for r in ev["results"]] == seen[0][0]
    assert "held-out prompts (30-32 at 32x32x5" in evaluation.format_held_out(ev)
    seen.clear()
    evaluation.evaluate_held_out(Spy(), [(32, 32, 5)], n=2, steps=1)
    assert seen == [([f"a {c} {s} {m}" for c, s, m in everything[:2]], [1000, 1001])]
    assert evaluation.main(["--package", str(tiny_run), "--prompts", "30", "--first-prompt", "31"]) == 2
    assert "--first-prompt must be in 0..30 with --prompts 30" in capsys.readouterr().err
    argv = ["--package", str(tiny_run), "--sizes", "32x32x5", "--prompts", "1", "--steps", "1", "--device", "cpu"]
    assert evaluation.main([*argv, "--first-prompt", "59"]) == 0
    assert "held-out prompts (59-59 at 32x32x5" in capsys.readouterr().out


def test_evaluation_passes_sampler_options_and_another_noise_seed(tiny_run, capsys):
    from ditattn.train import evaluation

    seen = []

    class Spy:
        def generate(self, prompts, **kw):
            seen.append({k: kw.get(k) for k in ("seed", "scheduler", "cfg_interval")})
            f = kw["num_frames"]
            return types.SimpleNamespace(frames=np.zeros((len(prompts), f, kw["height"], kw["width"], 3), np.uint8))

    sampler = {"scheduler": "flow_euler", "cfg_interval": (0.1, 1.0)}
    ev = evaluation.evaluate_held_out(Spy(), [(32, 32, 5)], n=2, steps=1, seed=5000, first=3, sampler=sampler)[0]
    assert seen == [{"seed": [5003, 5004], **sampler}] and ev["seed"] == 5000 and ev["sampler"] == sampler
    line = evaluation.format_held_out(ev)
    assert "(3-4, seeds from 5000 at 32x32x5" in line and "scheduler flow_euler, cfg interval (0.1, 1.0)" in line
    argv = ["--package", str(tiny_run), "--sizes", "32x32x5", "--prompts", "1", "--steps", "1", "--device", "cpu"]
    assert evaluation.main([*argv, "--cfg-interval", "0.5:0.2"]) == 2
    assert "START must be below END" in capsys.readouterr().err
    assert evaluation.main([*argv, "--cfg-interval", "0:0.5", "--scheduler", "flow_euler", "--seed", "7"]) == 0
    assert "seeds from 7 at 32x32x5, 1 steps, guidance" in capsys.readouterr().out


def test_guidance_tuning_picks_a_scale_of_the_grid(tiny_run):
    from ditattn.train.evaluation import tune_guidance
    from ditattn.train.recipe import recipe

    tuned = tune_guidance(str(tiny_run), recipe("tiny"), torch.device("cpu"), (2.0, 4.0), n=3)
    assert tuned["best"] in (2.0, 4.0) and [r["guidance"] for r in tuned["rows"]] == [2.0, 4.0]
    assert all(0 <= r["both"] <= r["color"] <= 3 for r in tuned["rows"]) and tuned["size"] == [32, 32, 5]
    assert all(0 <= r["shape"] <= 3 for r in tuned["rows"])


def test_a_tuned_scale_at_the_edge_of_the_grid_is_flagged_with_the_scales_beyond_it():
    from ditattn.train.evaluation import grid_edge_note

    low = grid_edge_note(3.0, (3.0, 5.0, 7.0, 9.0, 11.0))
    assert "smallest" in low and "--tune-guidance 2,2.5,3,5,7,9,11" in low
    high = grid_edge_note(11.0, (11.0, 3.0, 7.0))
    assert "largest" in high and "--tune-guidance 3,7,11,13,15" in high
    assert grid_edge_note(5.0, (3.0, 5.0, 7.0)) is None  # inside the grid
    assert grid_edge_note(3.0, (3.0,)) is None  # one scale: no direction to look in
    assert grid_edge_note(1.5, (1.5, 2.0)) is None  # nothing above 1 is left below it
    assert "--tune-guidance 1.5,2,3" in grid_edge_note(2.0, (2.0, 3.0))


def test_training_is_deterministic_from_the_seed(tmp_path):
    for name in ("a", "b"):
        assert _train(tmp_path / name, "--stage", "vae", "--vae-steps", "2") == 0
    la, lb = (json.loads((tmp_path / n / "loss.json").read_text())["stages"]["vae"] for n in ("a", "b"))
    assert [r[2] for r in la] == [r[2] for r in lb]
    from safetensors.torch import load_file

    ta, tb = (load_file(str(tmp_path / n / "shapes.safetensors")) for n in ("a", "b"))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def test_training_cli_needs_a_budget(capsys):
    from ditattn.train.shapes import main

    with pytest.raises(SystemExit) as exc:
        main(["--stage", "vae", "--out", "/tmp/x-never-written"])
    assert exc.value.code == 2
    assert "give --budget-s, --vae-budget-s or --vae-steps" in capsys.readouterr().err


def test_unclamped_decode_is_diffusers_decode_before_its_clamp():
    from ditattn.train.recipe import recipe
    from ditattn.train.vae_stage import build_vae, decode_unclamped

    vae = build_vae(recipe("tiny"), 0).eval()
    z = torch.randn(2, 16, 3, 4, 4)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(10)  # outputs well outside [-1, 1]: the clamp must matter
        ref = vae.decode(z).sample
        out = decode_unclamped(vae, z)
    assert out.shape == ref.shape == (2, 3, 9, 32, 32)
    torch.testing.assert_close(out.clamp(-1, 1), ref)
    assert out.abs().max() > 2


def test_bucket_flag_parsing():
    from ditattn.train.recipe import Bucket, parse_buckets

    assert parse_buckets("64x64x9:2, 128x256x17") == (Bucket(64, 64, 9, 2.0), Bucket(128, 256, 17, 1.0))
    assert Bucket(256, 256, 33).tokens() == 2304
    for bad in ("64x64", "60x64x9", "64x64x8", "64x64x9:0", "axbxc"):
        with pytest.raises(ValueError, match="--buckets"):
            parse_buckets(bad)


def test_training_cli_rejects_an_unusable_device(tmp_path, capsys):
    from ditattn.train.shapes import main

    assert main(["--stage", "vae", "--vae-steps", "1", "--out", str(tmp_path), "--device", "nonsense"]) == 2
    assert "unknown device 'nonsense'" in capsys.readouterr().err
