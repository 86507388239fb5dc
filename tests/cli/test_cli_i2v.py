"""The command line of image-to-video, LoRA and memory: ``generate --image`` (native and ``--backend
diffusers``, same frames), ``--lora-path`` / ``--offload`` / ``--vae-tiling`` from flags and YAML, the plan's
image cross-attention role, and each misuse as one ``error:`` line with exit status 2."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from ditattn.cli import main

SMALL = ["--num-inference-steps", "2", "--num-frames", "1", "--height", "32", "--width", "48"]
I2V = ["--model-path", "ditattn:tiny-wan-i2v"]


def run(capsys, *argv):
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "first.png"
    Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8)).save(path)
    return str(path)


def test_generate_image_to_video_native_and_diffusers_agree(capsys, tmp_path, image):
    rc, out, err = run(
        capsys,
        "generate",
        *I2V,
        "--prompt",
        "a fox",
        "--image",
        image,
        *SMALL,
        "--output-path",
        str(tmp_path),
        "--output-file",
        "native.png",
        "--offload",
        "model",
        "--vae-tiling",
    )
    assert rc == 0, err
    summary = out.strip().splitlines()[-1]
    assert "48x32, 1 frame, 2 steps" in summary and "image " in summary and "DiT attention: torch_sdpa" in summary
    assert "peak GPU memory" not in summary  # CPU run
    rc, out, err = run(
        capsys,
        "generate",
        *I2V,
        "--prompt",
        "a fox",
        "--image",
        image,
        *SMALL,
        "--output-path",
        str(tmp_path),
        "--output-file",
        "ref.png",
        "--backend",
        "diffusers",
    )
    assert rc == 0, err
    ours = np.asarray(Image.open(tmp_path / "native.png"), dtype=np.int16)
    ref = np.asarray(Image.open(tmp_path / "ref.png"), dtype=np.int16)
    assert np.abs(ours - ref).max() <= 1  # the same clip, up to uint8 rounding


def test_image_size_follows_the_image_without_height_and_width(capsys, tmp_path, image):
    rc, out, err = run(
        capsys,
        "generate",
        *I2V,
        "--prompt",
        "a fox",
        "--image",
        image,
        "--num-frames",
        "1",
        "--num-inference-steps",
        "1",
        "--output-path",
        str(tmp_path),
    )
    assert rc == 0, err
    assert "144x112, 1 frame" in out  # 56x40 image, the tiny model's 128x128 area


def test_lora_and_memory_options_from_yaml(capsys, tmp_path):
    g = torch.Generator().manual_seed(0)
    lora = tmp_path / "style.safetensors"
    save_file(
        {
            "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, 512, generator=g),
            "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(512, 4, generator=g),
        },
        str(lora),
    )
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"prompt: a fox\nmodel-path: ditattn:tiny-wan\nlora-path: ['{lora}:0.5']\noffload: group\n"
        "offload-group-blocks: 1\n"
        "vae-slicing: true\n"
    )
    rc, out, err = run(capsys, "generate", "--config", str(cfg), *SMALL, "--output-path", str(tmp_path))
    assert rc == 0, err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["generate", *I2V, "--prompt", "x", "--image", "/no/such.png"], "error: --image: no such file: /no/such.png"),
        (["generate", *I2V, "--prompt", "x", *SMALL], "image-to-video: give the first frame"),
        (["generate", "--prompt", "x", "--image", "IMAGE", *SMALL], "text-to-video and takes no image"),
        (["generate", "--prompt", "x", "--guidance-scale-2", "3", *SMALL], "guidance_scale_2 applies to two-expert"),
        (["generate", "--prompt", "x", "--lora-path", "vae=x.safetensors"], "component 'vae' takes no LoRA"),
        (
            ["generate", "--prompt", "x", "--lora-path", "/no/lora.safetensors:0.5"],
            "--lora-path /no/lora.safetensors: no such",
        ),
        (["generate", "--prompt", "x", "--offload", "disk"], "invalid choice: 'disk'"),
        (
            ["generate", "--prompt", "x", "--offload", "group", "--enable-torch-compile"],
            "compiled blocks cannot follow",
        ),
        (
            ["generate", "--prompt", "x", "--backend", "diffusers", "--offload", "text_encoder"],
            "--offload text_encoder applies to the native pipeline only",
        ),
        (["serve", "--config", "SERVE_YAML"], "--image does not apply to serve"),
        (
            ["plan", "--component-attention-backends", "transformer.cross_image=torch_sdpa"],
            "no image cross-attention layer",
        ),
    ],
)
def test_misuse_is_one_error_line(capsys, tmp_path, image, argv, words):
    serve_yaml = tmp_path / "serve.yaml"
    serve_yaml.write_text(f"image: {image}\n")
    argv = [{"IMAGE": image, "SERVE_YAML": str(serve_yaml)}.get(a, a) for a in argv]
    try:
        rc, _, err = run(capsys, *argv)
    except SystemExit as exc:  # argparse's own errors
        rc, err = exc.code, capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and words in lines[-1], err


def test_plan_shows_the_image_cross_attention(capsys):
    rc, out, err = run(
        capsys,
        "plan",
        *I2V,
        "--json",
        "--component-attention-backends",
        "transformer.cross_image=torch_sdpa,image_encoder=torch_sdpa",
    )
    assert rc == 0, err
    plan = json.loads(out)
    tr = next(c for c in plan["components"] if c["name"] == "transformer")
    img = [layer for layer in tr["layers"] if layer["role"] == "cross_image"]
    assert [layer["prefix"] for layer in img] == ["blocks.0.attn2.image", "blocks.1.attn2.image"]
    assert {layer["source"] for layer in img} == {"component_role"}
    enc = next(c for c in plan["components"] if c["name"] == "image_encoder")
    assert enc["selectable"] and {layer["source"] for layer in enc["layers"]} == {"component"}
