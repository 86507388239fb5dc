"""The built-in trained model ``ditattn:shapes``: package format, registry, golden clip, prompt following.

The golden test regenerates ``tests/data/shapes_golden.npz`` (written by ``python -m
ditattn.train.reference``) on the CPU in float32 from the shipped weights; the semantic test
generates one prompt per motion and judges the clip (dominant colour, centroid travel / growth).
"""

import json
import os
import sys

import numpy as np
import pytest
import torch

import serving
from ditattn.errors import AttentionConfigError
from ditattn.models import shapes
from ditattn.models.builtin import BUILTIN_MODELS, DEFAULT_MODEL, builtin_model_path
from ditattn.pipelines.model_index import read_model_index, resolve_model_path

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "shapes_golden.npz")
# one prompt per motion, colours and shapes rotating (fixed before looking at any output)
SEMANTIC = [
    ("red", "circle", "moving right"),
    ("blue", "square", "moving up"),
    ("yellow", "triangle", "growing"),
    ("green", "circle", "moving down"),
    ("white", "square", "moving left"),
    ("red", "triangle", "shrinking"),
]


def _tiny_package(folder):
    """A package written from the untrained ``tiny`` recipe (format round trip, no training)."""
    from ditattn.train.dit_stage import build_text_encoder, build_transformer
    from ditattn.train.recipe import recipe
    from ditattn.train.shapes import export
    from ditattn.train.vae_stage import build_vae

    r = recipe("tiny")
    vae = build_vae(r, 0)
    vae.register_to_config(latents_mean=[0.0] * 16, latents_std=[1.0] * 16)
    export(str(folder), r, vae, build_text_encoder(r, 0), build_transformer(r, 0), {"note": "test"})
    return r


def test_package_round_trip_through_a_diffusers_folder(tmp_path):
    r = _tiny_package(tmp_path / "pkg")
    meta = shapes.read_meta(str(tmp_path / "pkg"))
    assert meta["training"] == {"note": "test"} and meta["sampling_defaults"] == r.sampling_defaults
    assert shapes.sampling_defaults(str(tmp_path / "pkg")) == r.sampling_defaults
    folder = shapes.shapes_model_path(root=str(tmp_path / "cache"), package=str(tmp_path / "pkg"))
    assert os.path.basename(folder) == f"shapes-{shapes.package_digest(str(tmp_path / 'pkg'))}"
    assert shapes.shapes_model_path(root=str(tmp_path / "cache"), package=str(tmp_path / "pkg")) == folder  # cached
    mi = read_model_index(folder)
    assert set(mi.components) == {"text_encoder", "tokenizer", "transformer", "vae", "scheduler"}

    from diffusers import WanPipeline

    ref = WanPipeline.from_pretrained(folder)  # diffusers loads the same folder (the --backend diffusers path)
    from safetensors.torch import load_file

    packed = load_file(str(tmp_path / "pkg" / "shapes.safetensors"))
    for comp in ("transformer", "vae", "text_encoder"):
        state = getattr(ref, comp).state_dict()
        for k, v in packed.items():
            if k.startswith(comp + "."):
                torch.testing.assert_close(state[k[len(comp) + 1 :]], v.float(), rtol=0, atol=0)


def test_package_errors_are_clear(tmp_path):
    with pytest.raises(AttentionConfigError, match="missing from this install"):
        shapes.read_meta(str(tmp_path))
    _tiny_package(tmp_path)
    meta = json.loads((tmp_path / "shapes.json").read_text())
    (tmp_path / "shapes.json").write_text(json.dumps(dict(meta, format=99)))
    with pytest.raises(AttentionConfigError, match="format 99 is not supported"):
        shapes.read_meta(str(tmp_path))
    del meta["sampling_defaults"]["num_frames"]
    (tmp_path / "shapes.json").write_text(json.dumps(meta))
    with pytest.raises(AttentionConfigError, match="lacks num_frames"):
        shapes.read_meta(str(tmp_path))


def test_builtin_registry():
    assert list(BUILTIN_MODELS) == [
        "ditattn:shapes",
        "ditattn:tiny-wan",
        "ditattn:tiny-wan2.2",
        "ditattn:tiny-wan-i2v",
        "ditattn:tiny-wan2.2-ti2v",
        "ditattn:tiny-wan2.2-i2v",
    ]
    assert DEFAULT_MODEL in BUILTIN_MODELS
    with pytest.raises(AttentionConfigError, match="unknown built-in model 'ditattn:nope'.*ditattn:shapes"):
        resolve_model_path("ditattn:nope")
    for m in BUILTIN_MODELS.values():
        d = m.defaults()
        assert set(d) == {"height", "width", "num_frames", "num_inference_steps", "guidance_scale"}


def test_shapes_ships_with_the_package():
    """The packaged weights are float16 safetensors of a few MB and the model resolves by name."""
    meta_path, weights_path = shapes.package_files()
    assert os.path.getsize(weights_path) < 16 * 2**20
    from safetensors import safe_open

    with safe_open(weights_path, "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}
    folder, name = resolve_model_path("ditattn:shapes")
    assert name == "ditattn:shapes" and folder == builtin_model_path("ditattn:shapes")
    mi = read_model_index(folder, name)
    assert mi.is_builtin and mi.builtin_defaults == shapes.sampling_defaults()


# the clips are generated by a subprocess of their own, in the background while the suite runs (tests/background.py):
# the packaged model on the CPU in float32, as WanPipelineNative.from_pretrained loads it; the frames go to a file
_GENERATE = r"""
import json, sys
import numpy as np, torch
from ditattn.pipelines.wan import WanPipelineNative
out, prompt, kw = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
pipe = WanPipelineNative.from_pretrained("ditattn:shapes", device="cpu", dtype=torch.float32)
np.save(out, np.asarray(pipe.generate(prompt, progress=False, **kw).frames))
"""


def _generate_run(folder, prompt, **kw):
    args = [sys.executable, "-c", _GENERATE, os.path.join(folder, "frames.npy"), json.dumps(prompt), json.dumps(kw)]
    return dict(args=args, env=serving.subprocess_env(), timeout=900)


def _frames(background_run) -> np.ndarray:
    proc, folder = background_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(folder / "frames.npy")


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _golden_run(folder):
    ref = np.load(GOLDEN)
    return _generate_run(
        folder,
        str(ref["prompt"]),
        seed=int(ref["seed"]),
        height=int(ref["height"]),
        width=int(ref["width"]),
        num_frames=int(ref["num_frames"]),
        num_inference_steps=int(ref["num_inference_steps"]),
        guidance_scale=float(ref["guidance_scale"]),
    )


@pytest.mark.background.with_args(_golden_run)
def test_golden_clip_is_reproduced(background_run):
    """Fixed prompt and seed, CPU float32: the clip matches the committed reference (PSNR >= 40 dB)."""
    ref = np.load(GOLDEN)
    digest = shapes.package_digest()
    if str(ref["digest"]) != digest:
        pytest.fail(
            f"{GOLDEN} was made from weights {ref['digest']}, the package holds {digest}: regenerate it "
            "with python -m ditattn.train.reference"
        )
    frames = _frames(background_run)[0]
    assert frames.shape == ref["frames"].shape
    assert _psnr(frames, ref["frames"]) >= 40.0


def _training_preset():
    return shapes.read_meta().get("training", {}).get("preset")


@pytest.fixture(scope="module")
def trained_weights():
    preset = _training_preset()
    if preset != "full":
        pytest.skip(
            f"the packaged ditattn:shapes weights are a placeholder (training preset {preset!r}, not 'full'); "
            "prompt following is tested on the GPU-trained weights (docs/shapes.md)"
        )


def _semantic_run(folder):
    """All semantic prompts in one batch at the default size (prompt i gets seed 1 + i); nothing to generate
    for placeholder weights (the tests skip)."""
    if _training_preset() != "full":
        return dict(args=[sys.executable, "-c", "pass"])
    return _generate_run(folder, [f"a {c} {s} {m}" for c, s, m in SEMANTIC], seed=1)


@pytest.mark.background.with_args(_semantic_run)  # one run for the six cases
@pytest.mark.parametrize("i", range(len(SEMANTIC)), ids=[" ".join(p) for p in SEMANTIC])
def test_prompted_colour_and_motion_are_visible(trained_weights, background_run, i):
    from ditattn.train.judge import judge

    color, shape, motion = SEMANTIC[i]
    prompt = f"a {color} {shape} {motion}"
    v = judge(_frames(background_run)[i], color, motion)
    assert v.color_ok, f"{prompt}: dominant colour {v.dominant}"
    assert v.motion_ok, f"{prompt}: centroid moved dx={v.dx:.2f} dy={v.dy:.2f}, area x{v.growth:.2f}"
