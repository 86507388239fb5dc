"""ditattn.evaluation: clip metrics against known cases, variant parsing, attention capture, and
``ditattn compare`` end to end on the embedded tiny model (CPU)."""

import json
import math
import time

import numpy as np
import pytest
import torch

from ditattn.cli import main
from ditattn.errors import AttentionConfigError
from ditattn.evaluation.capture import ActivationFileError, capture_qkv, load_qkv, resolve_steps, sample_rows
from ditattn.evaluation.compare import CompareConfig, Variant, json_ready, parse_variant
from ditattn.evaluation.metrics import clip_metrics, ms_ssim, ms_ssim_scales, psnr, ssim, tensor_errors


def _clip(seed=0, frames=3, h=64, w=80, hi=250):
    g = np.random.default_rng(seed)
    return g.integers(0, hi + 1, size=(frames, h, w, 3), dtype=np.uint8)


# ------------------------------------------------------------------------------------------------ metrics


def test_identical_clips_give_infinite_psnr_and_unit_ssim():
    a = _clip()
    m = clip_metrics(a, a.copy())
    assert math.isinf(m["psnr"]) and m["psnr"] > 0
    assert m["ssim"] == 1.0 and m["ms_ssim"] == 1.0  # exactly (float32 rounding alone gives 1 - 1e-6)
    b = a.copy()
    b[1, 32, 40, 1] ^= 16  # one pixel (inside the SSIM window's valid region) off by 16 levels
    assert ssim(b, a) < 1.0 and ms_ssim(b, a)[0] < 1.0 and not math.isinf(psnr(b, a))


def test_known_perturbation_psnr_by_hand():
    a = _clip(hi=250)
    b = a + np.uint8(3)  # every pixel off by 3 of 255 levels, no clipping
    assert psnr(b, a) == pytest.approx(20 * math.log10(255 / 3), abs=1e-3)  # 38.59 dB
    # half the pixels off by 10: MSE = (10/255)^2 / 2
    c = a.copy()
    c[:, :, : a.shape[2] // 2] += np.uint8(5)
    assert psnr(c, a) == pytest.approx(10 * math.log10(1 / ((5 / 255) ** 2 / 2)), abs=1e-3)
    assert 0 < ssim(b, a) < 1.0 + 1e-6


def test_ssim_orders_perturbations_and_checks_shapes():
    a = _clip()
    rng = np.random.default_rng(1)
    small = np.clip(a.astype(int) + rng.integers(-4, 5, a.shape), 0, 255).astype(np.uint8)
    large = np.clip(a.astype(int) + rng.integers(-60, 61, a.shape), 0, 255).astype(np.uint8)
    assert ssim(small, a) > ssim(large, a)
    with pytest.raises(ValueError, match="differ in shape"):
        psnr(a[:, :32], a)
    with pytest.raises(ValueError, match="frames, height, width, 3"):
        psnr(a[..., :2], a[..., :2])


def test_ms_ssim_uses_the_scales_that_fit():
    assert ms_ssim_scales(480, 832) == 5
    assert ms_ssim_scales(176, 176) == 5
    assert ms_ssim_scales(128, 128) == 4
    assert ms_ssim_scales(32, 48) == 2
    assert ms_ssim_scales(8, 8) == 0
    val, n = ms_ssim(_clip(h=8, w=8), _clip(h=8, w=8))
    assert n == 0 and math.isnan(val)


def test_tensor_errors_known_cases():
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    assert tensor_errors(x, x) == (0.0, pytest.approx(1.0))
    rel, cos = tensor_errors(x * 1.1, x)
    assert rel == pytest.approx(0.1, rel=1e-9) and cos == pytest.approx(1.0)
    rel, cos = tensor_errors(-x, x)
    assert rel == pytest.approx(2.0) and cos == pytest.approx(-1.0)
    z = torch.zeros(3)
    assert tensor_errors(z, z) == (0.0, 1.0)
    assert math.isinf(tensor_errors(torch.ones(3), z)[0])


def test_json_ready_writes_strict_json():
    out = json_ready({"psnr": math.inf, "x": [float("nan"), -math.inf, 1.5]})
    assert out == {"psnr": "inf", "x": ["nan", "-inf", 1.5]}
    json.loads(json.dumps(out, allow_nan=False))


# ------------------------------------------------------------------------------------------------ variants


def test_parse_variant_short_and_json_forms():
    v = parse_variant("vsa=video_sparse_attn:sparsity=0.9")
    assert v == Variant("vsa", "video_sparse_attn", {"sparsity": 0.9}, {})
    v = parse_variant("d=FA3")
    assert v.backend == "fa" and v.config == {}
    v = parse_variant("m=vmoba_attn:first_full_step=0;moba_threshold=0.5@text_encoder=torch_sdpa")
    assert v.config == {"first_full_step": 0, "moba_threshold": 0.5}
    assert v.components == {"text_encoder": "torch_sdpa"}
    v = parse_variant(
        's={"backend": "sol_attn", "config": {"tau": 2}, "components": {"transformer.cross": "torch_sdpa"}}'
    )
    assert v.backend == "sol_attn" and v.config == {"tau": 2.0} and v.components == {"transformer.cross": "torch_sdpa"}
    assert parse_variant("a=auto").backend is None
    assert parse_variant("vsa=video_sparse_attn:sparsity=0.9").label() == "video_sparse_attn:sparsity=0.9"


@pytest.mark.parametrize(
    "text, match",
    [
        ("novalue", "expected NAME="),
        ("bad name=fa", "letters, digits"),
        ("x=not_a_backend", "not_a_backend"),
        ("x=video_sparse_attn:sparsity=2", "sparsity"),
        ("x=video_sparse_attn:bogus=1", "bogus"),
        ("x=auto:sparsity=0.5", "needs a backend"),
        ("x={bad json", "not valid JSON"),
        ('x={"backend": "fa", "extra": 1}', "unknown key"),
        ("x=fa@vae.middle=fa", "role suffix"),
    ],
)
def test_parse_variant_errors(text, match):
    with pytest.raises(AttentionConfigError, match=match):
        parse_variant(text)


def test_compare_config_validation():
    d = Variant("d", "torch_sdpa")
    with pytest.raises(AttentionConfigError, match="at least two"):
        CompareConfig(variants=[d], prompts=["a"]).validate()
    with pytest.raises(AttentionConfigError, match="unique"):
        CompareConfig(variants=[d, d], prompts=["a"]).validate()
    with pytest.raises(AttentionConfigError, match="prompt"):
        CompareConfig(variants=[d, Variant("e")], prompts=[" "]).validate()
    with pytest.raises(AttentionConfigError, match="warmup"):
        CompareConfig(variants=[d, Variant("e")], prompts=["a"], warmup=-1).validate()


def test_resolve_steps_and_rows():
    assert resolve_steps([0, -1], 8) == {0, 7}
    with pytest.raises(AttentionConfigError, match="outside"):
        resolve_steps([8], 8)
    assert sample_rows(100, 0) is None and sample_rows(100, 200) is None
    r = sample_rows(1000, 64)
    assert r.shape == (64,) and torch.equal(r, sample_rows(1000, 64)) and bool((r[1:] > r[:-1]).all())


# ------------------------------------------------------------------------------------------------ end to end

# latent video grid 3x4x8 tokens: two 4x4x4 VSA tiles (48 tokens each, not packed into one block)
SMALL = ["--num-inference-steps", "2", "--num-frames", "9", "--height", "64", "--width", "128"]


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    t0 = time.perf_counter()
    rc = main(
        [
            "compare",
            "--prompt",
            "a red circle moving right",
            "--prompt",
            "a blue square",
            *SMALL,
            "--variant",
            "dense=torch_sdpa",
            "--variant",
            "vsa=video_sparse_attn:sparsity=0.5",
            "--output-path",
            str(out),
            "--no-video",
        ]
    )
    secs = time.perf_counter() - t0
    assert rc == 0
    return out, json.loads((out / "compare.json").read_text()), secs


def test_compare_two_variants_two_prompts_on_cpu(compare_run):
    out, rep, secs = compare_run
    print(f"compare 2 variants x 2 prompts: {secs:.1f} s")
    assert rep["reference"] == "dense" and rep["meta"]["model"] == "ditattn:shapes"  # the default, trained model
    assert [v["name"] for v in rep["variants"]] == ["dense", "vsa"]
    dense, vsa = rep["variants"]
    assert len(vsa["runs"]) == 2 and {r["prompt_index"] for r in vsa["runs"]} == {0, 1}
    for run in vsa["runs"]:
        assert run["dit_s"] > 0 and run["total_s"] >= run["dit_s"]
        assert 0 < run["psnr"] < 200 and 0 < run["ssim"] <= 1 and 0 < run["ms_ssim"] <= 1
        assert run["kept_fraction"] == pytest.approx(0.5)  # 2 tiles, the top 1 kept per query tile
        assert run["attention_backends"][0] == "video_sparse_attn"
        layers = run["layers"]
        assert {(x["layer"], x["step"]) for x in layers} == {
            (f"transformer.blocks.{i}.attn1", s) for i in range(6) for s in (0, 1)
        }  # ditattn:shapes: 6 blocks
        for x in layers:
            assert x["rel_err"] > 0 and x["cosine"] < 1 and x["in_context_rel_err"] > 0
        # step 0, block 0 sees identical inputs in both runs: drift-free, so both errors agree
        first = next(x for x in layers if x["step"] == 0 and x["layer"].endswith("blocks.0.attn1"))
        assert first["rel_err"] == pytest.approx(first["in_context_rel_err"], rel=1e-6)
    s = vsa["summary"]
    for key in (
        "dit_s",
        "total_s",
        "speedup_dit",
        "speedup_total",
        "psnr_mean",
        "ssim_mean",
        "ms_ssim_mean",
        "attn_rel_err_mean",
        "in_context_rel_err_mean",
        "kept_fraction",
    ):
        assert s[key] is not None, key
    assert dense["summary"]["kept_fraction"] is None  # dense: no sparse-engine calls
    assert (out / "compare.png").stat().st_size > 1000 and (out / "contact_sheet.png").stat().st_size > 1000


def test_compare_identical_variants_are_exact(tmp_path, capsys):
    rc = main(
        [
            "compare",
            "--prompt",
            "a cat",
            *[x if x != "2" or i != 1 else "1" for i, x in enumerate(SMALL)],  # SMALL at 1 step
            "--variant",
            "a=torch_sdpa",
            "--variant",
            "b=torch_sdpa",
            "--output-path",
            str(tmp_path),
            "--no-video",
            "--seed",
            "3",
            "4",
            "--warmup",
            "0",
            "--save-clips",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "inf" in text.splitlines()[-1]
    rep = json.loads((tmp_path / "compare.json").read_text())
    # --save-clips: every clip, lossless, under <variant>_p<prompt>_s<seed>
    assert rep["files"]["clips"] == str(tmp_path / "clips.npz")
    with np.load(tmp_path / "clips.npz") as clips:
        assert sorted(clips.files) == ["a_p0_s3", "a_p0_s4", "b_p0_s3", "b_p0_s4"]
        a3 = clips["a_p0_s3"]
        assert a3.dtype == np.uint8 and a3.shape == (9, 64, 128, 3)
        assert np.array_equal(a3, clips["b_p0_s3"]) and not np.array_equal(a3, clips["a_p0_s4"])
    runs = rep["variants"][1]["runs"]
    assert [r["seed"] for r in runs] == [3, 4]
    for r in runs:
        assert r["psnr"] == "inf" and r["ssim"] == pytest.approx(1.0) and r["ms_ssim"] == pytest.approx(1.0)
        assert all(x["rel_err"] == 0 and x["in_context_rel_err"] == 0 for x in r["layers"])
    assert rep["variants"][1]["summary"]["psnr_mean"] == "inf"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--variant", "a=torch_sdpa"], "at least two"),
        (["--variant", "a=torch_sdpa", "--variant", "b=nope"], "nope"),
        (["--variant", "a=torch_sdpa", "--variant", "b=fa", "--attention-backend", "fa"], "per variant"),
        (["--variant", "a=torch_sdpa", "--variant", "b=fa", "--capture-steps", "x"], "capture-steps"),
        (["--variant", "a=torch_sdpa", "--variant", "b=fa", "--capture-steps", "9"], "outside"),
    ],
)
def test_compare_cli_errors(argv, match, capsys, tmp_path):
    rc = main(
        [
            "compare",
            "--prompt",
            "p",
            "--num-inference-steps",
            "2",
            "--height",
            "32",
            "--width",
            "32",
            "--num-frames",
            "1",
            "--output-path",
            str(tmp_path),
            *argv,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and match in err and "Traceback" not in err


def test_capture_qkv_roundtrip(tmp_path):
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained(None, device="cpu")
    path = str(tmp_path / "qkv.safetensors")
    entries = capture_qkv(
        pipe, "a dog", path, steps=(-1,), layers=[1], num_inference_steps=2, height=64, width=64, num_frames=5
    )
    assert [e["name"] for e in entries] == ["transformer.blocks.1.attn1@step1"]
    ((e, q, k, v),) = load_qkv(path)
    T, H, W = e["video_shape"]
    assert q.shape == (1, T * H * W, 2, 128) and k.shape == q.shape and v.shape == q.shape  # ditattn:shapes
    assert e["step"] == 1 and e["layer_idx"] == 1 and e["model"] == "ditattn:shapes"
    # a block index the model does not have (ditattn:shapes: 6 blocks) is refused before the generation
    with pytest.raises(AttentionConfigError, match=r"^layers -1, 10: .* accepted: block indices 0 to 5 \(6 blocks\)$"):
        capture_qkv(pipe, "a dog", str(tmp_path / "none.safetensors"), layers=[0, 5, 10, -1], num_inference_steps=2)
    assert not (tmp_path / "none.safetensors").exists()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ActivationFileError, match="cannot read"):
        load_qkv(str(bad))


# ------------------------------------------------------------------------------------------------ structured inputs


def test_structured_inputs_decay_with_distance_and_differ_by_head_type():
    from ditattn.evaluation.structured import StructuredSpec, attention_profile, structured_qkv

    grid = (6, 12, 16)
    spec = StructuredSpec(video_shape=grid, heads=5, sinks=0)
    q, k, v, info = structured_qkv(spec, dtype=torch.float32)
    assert q.shape == (1, 6 * 12 * 16, 5, 128) and info["head_types"][:3] == ["spatial", "temporal", "spatial"]
    assert all(10 <= n <= 16 for n in info["content_norms"])
    q2, k2, _, _ = structured_qkv(spec, dtype=torch.float32)
    assert torch.equal(q, q2) and torch.equal(k, k2)  # deterministic
    prof = attention_profile(q, k, grid)
    S, T = q.shape[1], grid[0]
    for h, kind in enumerate(info["head_types"]):
        if kind != "global":  # local heads put far more mass on the 27 nearest tokens than uniform attention
            assert prof["near"][h] > 5 * 27 / S, (h, kind, prof["near"][h])
    # spatial heads stay in their frame, temporal heads stay at their place across frames
    assert prof["same_frame"][0] > 1.5 / T and prof["same_frame"][0] > prof["same_frame"][1]
    assert prof["same_place"][1] > prof["same_place"][0] and prof["same_place"][1] > 10 * T / S
    # the global head is the broadest
    assert prof["top1_percent"][4] < min(prof["top1_percent"][:4])


def test_structured_sinks_draw_attention():
    from ditattn.evaluation.structured import StructuredSpec, sink_positions, structured_qkv

    assert sink_positions(100, 4) == [0, 25, 50, 75] and sink_positions(100, 0) == []
    grid = (4, 8, 8)
    with_s = structured_qkv(StructuredSpec(video_shape=grid, heads=2, sinks=4), dtype=torch.float32)
    without = structured_qkv(StructuredSpec(video_shape=grid, heads=2, sinks=0), dtype=torch.float32)

    def sink_mass(q, k, sinks):
        p = torch.softmax(q[0, :, 0] @ k[0, :, 0].T * 128**-0.5, dim=-1)
        return float(p[:, sinks].sum(-1).mean())

    sinks = with_s[3]["sinks"]
    assert sink_mass(with_s[0], with_s[1], sinks) > 3 * sink_mass(without[0], without[1], sinks)


def test_compare_without_eval_extra_is_one_line_before_any_generation(monkeypatch, capsys, tmp_path):
    from ditattn import extras
    from ditattn.pipelines import wan

    real = extras._installed
    monkeypatch.setattr(extras, "_installed", lambda m: m not in ("torchmetrics", "matplotlib") and real(m))
    assert extras.missing("eval") == ["torchmetrics", "matplotlib"]

    def no_generation(*a, **k):
        raise AssertionError("compare loaded a pipeline before checking the eval extra")

    monkeypatch.setattr(wan.WanPipelineNative, "from_pretrained", no_generation)
    argv = ["compare", "--prompt", "p", "--variant", "a=torch_sdpa", "--variant", "b=torch_sdpa"]
    assert main([*argv, "--output-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            "error: ditattn compare needs torchmetrics, matplotlib, which are not installed; install ditattn[eval]"
        )
        and err.count("\n") == 1
    )
