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


def test_backend_diffusers_image_to_video_without_ftfy_is_one_clear_error(capsys, tmp_path, image, monkeypatch):
    """diffusers' WanImageToVideoPipeline calls ftfy unguarded: without it the run stops before loading,
    naming the package, instead of a NameError from inside diffusers at the first prompt."""
    from diffusers import utils

    monkeypatch.setattr(utils, "is_ftfy_available", lambda: False)  # what diffusers sees without ftfy
    rc, out, err = run(
        capsys, "generate", *I2V, "--prompt", "a fox", "--image", image, *SMALL,
        "--output-path", str(tmp_path), "--backend", "diffusers",
    )  # fmt: skip
    assert rc == 2 and "WanImageToVideoPipeline cleans every prompt with ftfy" in err and "pip install ftfy" in err
    assert "Traceback" not in err and "NameError" in err and list(tmp_path.iterdir()) == []


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
        (["generate", *I2V, "--prompt", "x", "--image", ""], "error: --image: expected a non-empty value"),
        (["generate", *I2V, "--prompt", "x", "--image", "https://a.example/f.png"], "remote URLs are not fetched"),
        (["generate", *I2V, "--prompt", "x", "--image", "/"], "error: --image: / is a folder; expected an image"),
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


def _error_line(capsys, *argv):
    rc, _, err = run(capsys, *argv)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: "), err
    return lines[-1]


def test_backend_diffusers_refuses_lora_keys_like_the_native_pipeline(capsys, tmp_path, monkeypatch):
    """--backend diffusers dropped LoRA keys that match nothing (transformer.* plus text_encoder.*) and
    crashed on a file with no transformer keys (diffusers' set_adapters: "Adapter name(s) {'te'} not in
    the list of present adapters"); both are now the native pipeline's one-line refusal."""
    g = torch.Generator().manual_seed(0)
    pair = {
        "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, 512, generator=g),
        "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(512, 4, generator=g),
    }
    te = {
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_A.weight": torch.randn(4, 512, generator=g),
        "text_encoder.encoder.block.0.layer.0.SelfAttention.q.lora_B.weight": torch.randn(512, 4, generator=g),
    }
    nan = {k: v.clone() for k, v in pair.items()}
    nan["transformer.blocks.0.attn1.to_q.lora_A.weight"][0, 0] = float("nan")
    files = {"mixed": {**pair, **te}, "te": te, "nan": nan}
    for name, state in files.items():
        save_file(state, str(tmp_path / f"{name}.safetensors"))
    common = ["generate", "--model-path", "ditattn:tiny-wan", "--prompt", "x", *SMALL, "--output-path", str(tmp_path)]
    for name, words in (
        ("mixed", "which is not a linear layer of this transformer"),
        ("te", "which is not a linear layer of this transformer"),
        ("nan", "holds NaN or infinite values"),
    ):
        lora = ["--lora-path", str(tmp_path / f"{name}.safetensors")]
        native = _error_line(capsys, *common, *lora)
        diffusers = _error_line(capsys, *common, *lora, "--backend", "diffusers")
        assert diffusers == native and words in native, (native, diffusers)
    # an error of diffusers' set_adapters / fuse_lora is one line too
    from diffusers import WanPipeline

    def refuse(self, *a, **k):
        raise ValueError("Adapter name(s) {'x'} not in the list of present adapters: set().")

    monkeypatch.setattr(WanPipeline, "set_adapters", refuse)
    save_file(pair, str(tmp_path / "good.safetensors"))
    line = _error_line(capsys, *common, "--lora-path", str(tmp_path / "good.safetensors"), "--backend", "diffusers")
    assert "--lora-path: diffusers cannot apply the adapters good (Adapter name(s)" in line, line


def test_non_finite_weights_stop_both_backends_before_anything_is_saved(capsys, tmp_path):
    """A checkpoint with a NaN weight decoded into an all-black clip that was saved with exit 0 (native and
    --backend diffusers); both now end with one error line and write nothing."""
    import shutil

    from ditattn.models.tiny import tiny_model_path

    model = tmp_path / "nan-model"
    shutil.copytree(tiny_model_path("ditattn:tiny-wan"), model)
    weights = next((model / "transformer").glob("*.safetensors"))
    from safetensors.torch import load_file

    state = load_file(str(weights))
    state["proj_out.weight"][0, 0] = float("nan")  # the output projection: one channel of every token is NaN
    save_file(state, str(weights))
    out = tmp_path / "out"
    common = ["generate", "--model-path", str(model), "--prompt", "x", *SMALL, "--output-path", str(out)]
    for extra in ([], ["--backend", "diffusers"]):
        line = _error_line(capsys, *common, *extra)
        assert "NaN or inf values" in line and ("nothing is saved" in line or "no frames are decoded" in line), line
    assert not out.exists() or not any(out.iterdir())


def test_backend_diffusers_sizes_an_image_like_the_native_pipeline(capsys, tmp_path):
    """With only --height and a conditioning image, --backend diffusers used the model's default width;
    the native pipeline follows the image's aspect ratio, and so does diffusers now."""
    Image.fromarray(np.full((128, 64, 3), 90, np.uint8)).save(tmp_path / "tall.png")  # 1:2, portrait
    common = ["generate", *I2V, "--prompt", "x", "--image", str(tmp_path / "tall.png"), "--height", "64"]
    common += ["--num-inference-steps", "2", "--num-frames", "1", "--output-path", str(tmp_path)]
    sizes = []
    for extra in ([], ["--backend", "diffusers"]):
        rc, out, err = run(capsys, *common, *extra)
        assert rc == 0, err
        saved = out.split("saved: ")[1].split()[0]
        sizes.append(Image.open(saved).size)
    assert sizes[0] == sizes[1] == (32, 64), sizes
