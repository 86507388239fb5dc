"""Image-to-video: the native CLIP image encoder and I2V DiT against transformers / diffusers, the three
image-conditioned layouts (Wan 2.1 I2V, Wan 2.2 TI2V-5B, Wan 2.2 I2V-A14B) against diffusers' pipelines
frame for frame, the image cross-attention role in plans and overrides, and input image checks."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ditattn.attention.config import parse_component_overrides
from ditattn.attention.context import AttentionSettings, component_scope
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.errors import AttentionConfigError
from ditattn.pipelines.conditioning import (
    MAX_IMAGE_ASPECT,
    ImageInputError,
    load_image,
    output_size_for_image,
    size_for_image,
)
from ditattn.pipelines.wan import WanPipelineNative

I2V, TI2V, A14B = "ditattn:tiny-wan-i2v", "ditattn:tiny-wan2.2-ti2v", "ditattn:tiny-wan2.2-i2v"


@pytest.fixture(scope="module")
def image():
    return Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8))


@pytest.fixture(scope="module")
def pipes():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = WanPipelineNative.from_pretrained(name)
        return cache[name]

    return get


def _diffusers_i2v(path):
    from diffusers import WanImageToVideoPipeline

    ref = WanImageToVideoPipeline.from_pretrained(path)
    ref.set_progress_bar_config(disable=True)
    return ref


def _run_ref(ref, **kw):
    return ref(output_type="np", generator=torch.Generator().manual_seed(kw.pop("seed")), **kw).frames


# ------------------------------------------------------------------------------------------------
# models


def test_clip_vision_encoder_matches_transformers(tmp_path):
    """The native encoder returns CLIPVisionModel's penultimate hidden states; hub checkpoints store
    the keys under ``vision_model.``, transformers 5 without it: both load."""
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from ditattn.models.clip_vision import load_clip_vision_encoder

    torch.manual_seed(0)
    cfg = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        hidden_act="quick_gelu",
    )
    ref = CLIPVisionModel(cfg).eval()
    ref.save_pretrained(tmp_path / "plain")
    (tmp_path / "prefixed").mkdir()
    save_file(
        {f"vision_model.{k}": v.contiguous() for k, v in ref.state_dict().items()},
        str(tmp_path / "prefixed" / "model.safetensors"),
    )
    (tmp_path / "prefixed" / "config.json").write_text(json.dumps(cfg.to_dict()))
    px = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = ref(pixel_values=px, output_hidden_states=True).hidden_states[-2]
    for sub in ("plain", "prefixed"):
        with component_scope("image_encoder") as scope:
            ours = load_clip_vision_encoder(str(tmp_path / sub))
        assert len(ours.encoder.layers) == 2  # the last layer is never needed
        assert [d.prefix for d in scope.decisions] == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
        with torch.no_grad():
            torch.testing.assert_close(ours(px), want, rtol=0, atol=1e-6)


def test_i2v_transformer_matches_diffusers(tmp_path):
    """The DiT with image cross-attention against WanTransformer3DModel, cached K/V or per block."""
    from diffusers import WanTransformer3DModel

    from ditattn.models.wan.transformer import load_wan_transformer

    torch.manual_seed(0)
    ref = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=36,
        out_channels=16,
        text_dim=64,
        freq_dim=64,
        ffn_dim=128,
        num_layers=2,
        image_dim=48,
        added_kv_proj_dim=128,
    ).eval()
    ref.save_pretrained(tmp_path)
    with component_scope("transformer") as scope:
        ours = load_wan_transformer(str(tmp_path))
    roles = [(d.prefix, d.role) for d in scope.decisions]
    assert ("blocks.1.attn2.image", "cross_image") in roles and len(roles) == 6
    x, t = torch.randn(2, 36, 3, 8, 8), torch.tensor([500.0, 20.0])
    text, img = torch.randn(2, 512, 64), torch.randn(2, 257, 48)  # diffusers splits text at 512 tokens
    with torch.no_grad():
        want = ref(x, t, text, encoder_hidden_states_image=img, return_dict=False)[0]
        torch.testing.assert_close(ours(x, t, text, img), want, rtol=0, atol=1e-6)
        cache = ours.encode_text(text, img, per_block=False)
        torch.testing.assert_close(ours(x, t, text_cache=cache), want, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="encoder_hidden_states_image"):
            ours(x, t, text)


# ------------------------------------------------------------------------------------------------
# pipelines against diffusers


def test_wan21_i2v_matches_diffusers(pipes, image):
    """Wan 2.1 I2V layout: CLIP image tokens + mask/condition latents, classifier-free guidance."""
    pipe = pipes(I2V)
    assert pipe.mode == "i2v" and pipe.image_embeds
    kw = dict(height=32, width=48, num_frames=5, num_inference_steps=3, guidance_scale=4.0)
    ours = pipe.generate("a red fox", "blurry", seed=3, image=image, output_type="float", progress=False, **kw)
    want = _run_ref(
        _diffusers_i2v(pipe.model_index.path), image=image, prompt="a red fox", negative_prompt="blurry", seed=3, **kw
    )
    assert ours.frames.shape == want.shape == (1, 5, 32, 48, 3)
    np.testing.assert_allclose(ours.frames, want, rtol=0, atol=2e-5)
    assert ours.attention_backends == ["torch_sdpa"] and "image" in ours.timings


def test_wan22_ti2v_matches_diffusers_with_and_without_image(pipes, image):
    """TI2V-5B layout (48-channel VAE, expand_timesteps): image-to-video against WanImageToVideoPipeline
    (first latent frame fixed to the image's) and text-to-video against WanPipeline."""
    from diffusers import WanPipeline

    pipe = pipes(TI2V)
    assert pipe.mode == "ti2v" and pipe.z_dim == 48 and pipe.size_multiple() == 32
    kw = dict(height=64, width=64, num_frames=5, num_inference_steps=3, guidance_scale=3.0)
    ours = pipe.generate("a boat", seed=5, image=image, output_type="float", progress=False, **kw)
    want = _run_ref(_diffusers_i2v(pipe.model_index.path), image=image, prompt="a boat", seed=5, **kw)
    np.testing.assert_allclose(ours.frames, want, rtol=0, atol=2e-5)
    t2v = WanPipeline.from_pretrained(pipe.model_index.path)
    t2v.set_progress_bar_config(disable=True)
    ours_t2v = pipe.generate("a boat", seed=5, output_type="float", progress=False, **kw)
    np.testing.assert_allclose(ours_t2v.frames, _run_ref(t2v, prompt="a boat", seed=5, **kw), rtol=0, atol=2e-5)
    assert not np.allclose(ours.frames, ours_t2v.frames, atol=1e-3)  # the image conditions the clip


def test_wan22_i2v_a14b_matches_diffusers(pipes, image):
    """I2V-A14B layout: two experts switched at the checkpoint's boundary_ratio (0.9), each with its
    own guidance scale (guidance_scale_2 for the low-noise expert)."""
    pipe = pipes(A14B)
    assert pipe.boundary_ratio == 0.9 and not pipe.image_embeds
    calls = []
    hooks = [
        pipe.components[n].register_forward_pre_hook(lambda m, a, n=n: calls.append(n))
        for n in ("transformer", "transformer_2")
    ]
    kw = dict(height=32, width=48, num_frames=5, num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0)
    try:
        ours = pipe.generate("a cat", "dark", seed=7, image=image, output_type="float", progress=False, **kw)
    finally:
        for h in hooks:
            h.remove()
    assert set(calls) == {"transformer", "transformer_2"}
    want = _run_ref(
        _diffusers_i2v(pipe.model_index.path), image=image, prompt="a cat", negative_prompt="dark", seed=7, **kw
    )
    np.testing.assert_allclose(ours.frames, want, rtol=0, atol=2e-5)
    same = pipe.generate(
        "a cat", "dark", seed=7, image=image, output_type="float", progress=False, **{**kw, "guidance_scale_2": 4.0}
    )
    assert not np.allclose(same.frames, ours.frames, atol=1e-4)  # guidance_scale_2 reaches the low-noise expert


def test_image_rules_per_layout(pipes, image):
    kw = dict(num_inference_steps=1, num_frames=1, progress=False, output_type="latent")
    with pytest.raises(AttentionConfigError, match="image-to-video: give the first frame"):
        pipes(I2V).generate("x", height=32, width=32, **kw)
    with pytest.raises(AttentionConfigError, match="text-to-video and takes no image"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", load_weights=True).generate("x", image=image, **kw)
    with pytest.raises(AttentionConfigError, match="image has 3 entries for 2 prompts"):
        pipes(I2V).generate(["a", "b"], image=[image] * 3, height=32, width=32, **kw)
    with pytest.raises(AttentionConfigError, match="guidance_scale_2 applies to two-expert"):
        pipes(I2V).generate("x", image=image, guidance_scale_2=3.0, height=32, width=32, **kw)
    # no size given: the default area at the image's aspect ratio (56x40 -> wider than tall)
    res = pipes(I2V).generate("x", image=image, **kw)
    d = pipes(I2V).defaults
    assert (res.height, res.width) == size_for_image(56, 40, d["height"] * d["width"], 16)
    assert res.width > res.height


def test_batch_with_one_image_per_prompt(pipes, image):
    other = Image.fromarray((np.random.RandomState(1).rand(32, 32, 3) * 255).astype(np.uint8))
    kw = dict(
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=3.0,
        progress=False,
        output_type="float",
    )
    pipe = pipes(I2V)
    both = pipe.generate(["a", "b"], seed=[1, 2], image=[image, other], **kw)
    alone = pipe.generate("b", seed=2, image=other, **kw)
    np.testing.assert_allclose(both.frames[1], alone.frames[0], atol=1e-5)


# ------------------------------------------------------------------------------------------------
# the image cross-attention role


def _roles(plan, comp):
    c = next(c for c in plan["components"] if c["name"] == comp)
    return {(l["role"], l["backend"], l["source"]) for l in c["layers"]}


def test_plan_lists_image_cross_attention_and_image_encoder():
    p = WanPipelineNative.from_pretrained(I2V, load_weights=False)
    plan = p.plan()
    assert [c["name"] for c in plan["components"]][:3] == ["text_encoder", "image_encoder", "transformer"]
    assert ("cross_image", "torch_sdpa", "auto") in _roles(plan, "transformer")
    assert _roles(plan, "image_encoder") == {("self", "torch_sdpa", "auto")}


def test_role_overrides_reach_image_cross_attention():
    ov = parse_component_overrides("transformer.cross_image=torch_sdpa,image_encoder=torch_sdpa")
    p = WanPipelineNative.from_pretrained(I2V, AttentionSettings(component_overrides=ov), load_weights=False)
    assert ("cross_image", "torch_sdpa", "component_role") in _roles(p.plan(), "transformer")
    assert ("cross", "torch_sdpa", "auto") in _roles(p.plan(), "transformer")
    assert _roles(p.plan(), "image_encoder") == {("self", "torch_sdpa", "component")}
    # .cross covers every cross-attention layer, .cross_image beats it on the image layers
    ov = parse_component_overrides({"transformer.cross": "torch_sdpa"})
    p = WanPipelineNative.from_pretrained(I2V, AttentionSettings(component_overrides=ov), load_weights=False)
    assert {r for r, _, s in _roles(p.plan(), "transformer") if s == "component_role"} == {"cross", "cross_image"}
    # a text-to-video checkpoint has no image cross-attention: the override is refused, not ignored
    ov = parse_component_overrides("transformer.cross_image=torch_sdpa")
    with pytest.raises(AttentionConfigError, match="no image cross-attention layer"):
        WanPipelineNative.from_pretrained(
            "ditattn:tiny-wan", AttentionSettings(component_overrides=ov), load_weights=False
        )
    with pytest.raises(AttentionConfigError, match=r"\.cross_image"):
        parse_component_overrides("transformer.image=torch_sdpa")


def test_sparse_backends_never_reach_image_cross_attention():
    """A global sparse backend, or a sparse .cross_image key, runs dense on the image layers (the
    one exception to strict overrides); self-attention keeps the sparse backend."""
    p = WanPipelineNative.from_pretrained(I2V, AttentionSettings(backend=B.VIDEO_SPARSE_ATTN), load_weights=False)
    layers = next(c for c in p.plan()["components"] if c["name"] == "transformer")["layers"]
    by_role = {(l["role"], l["backend"]) for l in layers}
    assert by_role == {("self", "video_sparse_attn"), ("cross", "torch_sdpa"), ("cross_image", "torch_sdpa")}
    img = [l for l in layers if l["role"] == "cross_image"]
    assert all("cannot serve cross-attention" in l["fallback_reason"] for l in img)
    ov = parse_component_overrides("transformer.cross_image=video_sparse_attn")
    p = WanPipelineNative.from_pretrained(I2V, AttentionSettings(component_overrides=ov), load_weights=False)
    assert ("cross_image", "torch_sdpa", "component_role") in _roles(p.plan(), "transformer")


def test_request_override_switches_image_layers(pipes, image):
    pipe = pipes(I2V)
    kw = dict(height=32, width=32, num_frames=1, num_inference_steps=1, progress=False, output_type="latent")
    state = pipe.prepare_request("torch_sdpa")
    image_layers = [l for l in pipe.components["transformer"].modules() if getattr(l, "role", None) == "cross_image"]
    assert len(image_layers) == 2 and all(id(l) in state.override_table for l in image_layers)
    res = pipe.generate("x", image=image, request_state=state, **kw)
    assert res.attention_backends == ["torch_sdpa"]


# ------------------------------------------------------------------------------------------------
# input images


def test_load_image_checks(tmp_path):
    good = tmp_path / "a.png"
    Image.new("RGB", (40, 30), (10, 20, 30)).save(good)
    img = load_image(str(good))
    assert img.size == (40, 30) and img.mode == "RGB"
    rgba = np.zeros((20, 20, 4), np.uint8)
    assert load_image(rgba).mode == "RGB"
    assert load_image(good.read_bytes()).size == (40, 30)
    with pytest.raises(ImageInputError, match="no such file"):
        load_image(str(tmp_path / "missing.png"))
    (tmp_path / "t.txt").write_text("hello")
    with pytest.raises(ImageInputError, match="not a readable image; accepted formats: png, jpeg, webp, bmp"):
        load_image(str(tmp_path / "t.txt"))
    Image.new("RGB", (20, 20)).save(tmp_path / "g.gif")
    with pytest.raises(ImageInputError, match="format GIF is not supported"):
        load_image(str(tmp_path / "g.gif"))
    with pytest.raises(ImageInputError, match="at least 16 pixels"):
        load_image(np.zeros((8, 40, 3), np.uint8))
    with pytest.raises(ImageInputError, match="at most 100 pixels"):
        load_image(good.read_bytes(), max_pixels=100)
    with pytest.raises(ImageInputError, match="uint8"):
        load_image(np.zeros((20, 20, 3), np.float32))
    with pytest.raises(ImageInputError, match="damaged"):
        load_image(good.read_bytes()[:60])
    assert issubclass(ImageInputError, AttentionConfigError)


def test_size_for_image():
    assert size_for_image(832, 480, 480 * 832, 16) == (480, 832)
    assert size_for_image(480, 832, 480 * 832, 16) == (832, 480)
    h, w = size_for_image(1000, 1000, 480 * 832, 32)
    assert h == w and h % 32 == 0 and abs(h * w - 480 * 832) < 0.1 * 480 * 832


def _encoded(img, fmt="PNG", **kw) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_sixteen_bit_images_are_scaled_not_clipped(pipes):
    """A 16-bit grayscale PNG (mode I;16) of 32768 is mid-gray, not white: it conditions the clip as an
    8-bit gray 128 image does (PIL's convert("RGB") clipped every value above 255 to white)."""
    png16 = _encoded(Image.fromarray(np.full((32, 32), 32768, np.uint16)))
    assert Image.open(__import__("io").BytesIO(png16)).mode == "I;16"
    assert load_image(png16).getpixel((0, 0)) == (128, 128, 128)
    for mode in ("I;16", "I;16B", "I"):  # PIL images too; full scale stays full scale
        assert load_image(Image.new(mode, (20, 20), 32768)).getpixel((0, 0)) == (128, 128, 128)
        assert load_image(Image.new(mode, (20, 20), 65535)).getpixel((0, 0)) == (255, 255, 255)
    with pytest.raises(ImageInputError, match="float \\(mode F\\) images are not accepted"):
        load_image(Image.new("F", (20, 20), 0.5))
    with pytest.raises(ImageInputError, match="values outside 0-65535"):
        load_image(Image.new("I", (20, 20), 70000))
    kw = dict(height=32, width=32, num_frames=1, num_inference_steps=1, progress=False, output_type="latent")
    gray16 = pipes(I2V).generate("x", image=png16, **kw).frames
    gray8 = pipes(I2V).generate("x", image=np.full((32, 32, 3), 128, np.uint8), **kw).frames
    white = pipes(I2V).generate("x", image=np.full((32, 32, 3), 255, np.uint8), **kw).frames
    assert torch.equal(gray16, gray8) and not torch.equal(gray16, white)


def test_exif_orientation_is_applied(tmp_path, pipes):
    """A JPEG stored 64x32 with EXIF Orientation 6 (rotate 90 degrees) is shown 32 wide, 64 tall: it is
    read upright, as diffusers' load_image reads it, and sizes the clip as a portrait image."""
    from PIL import ImageOps

    arr = np.zeros((32, 64, 3), np.uint8)
    arr[:, :16] = 255  # the stored left edge: the top once rotated
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    Image.fromarray(arr).save(path, exif=exif, quality=100)
    upright = ImageOps.exif_transpose(Image.open(path))
    assert upright.size == (32, 64)
    for value in (str(path), path.read_bytes(), Image.open(path)):
        img = load_image(value)
        assert img.size == (32, 64)
        np.testing.assert_array_equal(np.asarray(img), np.asarray(upright.convert("RGB")))
    res = pipes(I2V).generate(
        "x", image=str(path), num_frames=1, num_inference_steps=1, progress=False, output_type="latent"
    )
    assert res.height > res.width


def test_image_path_messages(tmp_path, monkeypatch):
    with pytest.raises(ImageInputError, match="^--image: expected a non-empty value"):
        load_image("", where="--image")
    with pytest.raises(ImageInputError, match="^--image: .* is a folder; expected an image file"):
        load_image(str(tmp_path), where="--image")
    with pytest.raises(ImageInputError, match="^--image: remote URLs are not fetched"):
        load_image("https://example.com/first.png", where="--image")
    monkeypatch.setenv("HOME", str(tmp_path))
    Image.new("RGB", (20, 20)).save(tmp_path / "first.png")
    assert load_image("~/first.png").size == (20, 20)


def test_extreme_aspect_ratios_keep_the_default_area(pipes):
    """A 16x10000 image with no size gave a 16-pixel-wide clip many times the default area; the aspect
    ratio is now clamped to MAX_IMAGE_ASPECT : 1 at the default area.  With only a height (or width) the
    other side follows the image's aspect ratio, not the model's default."""
    area = 128 * 128
    for w, h in ((16, 10000), (10000, 16)):
        oh, ow = size_for_image(w, h, area, 16)
        assert max(oh, ow) / min(oh, ow) == MAX_IMAGE_ASPECT and oh * ow <= area * 1.1
    assert output_size_for_image(56, 40, 64, None, area, 16) == (64, 96)  # 64 * 56 / 40 = 89.6 -> 96
    assert output_size_for_image(56, 40, None, 112, area, 16) == (80, 112)
    assert output_size_for_image(16, 10000, 256, None, area, 16) == (256, 64)  # clamped too
    assert output_size_for_image(56, 40, 48, 32, area, 16) == (48, 32)  # both given: kept
    kw = dict(num_frames=1, num_inference_steps=1, progress=False, output_type="latent")
    tall = np.zeros((2000, 16, 3), np.uint8)
    res = pipes(I2V).generate("x", image=tall, **kw)
    assert (res.height, res.width) == (256, 64)
    res = pipes(I2V).generate("x", image=np.zeros((40, 56, 3), np.uint8), height=64, **kw)
    assert (res.height, res.width) == (64, 96)


def test_public_wan_pipeline_runs_image_to_video(pipes, image):
    """ditattn.WanPipeline (the README's Python API) takes image=, guidance_scale_2= and lora= as the
    native pipeline does (generate() had none of them: a TypeError), and the offload / VAE options."""
    import ditattn

    pipe = ditattn.WanPipeline.from_pretrained(A14B, device="cpu", dtype="float32", vae_tiling=True)
    assert pipe.native.components["vae"].use_tiling
    kw = dict(height=32, width=32, num_frames=1, num_inference_steps=2, guidance_scale=3.0, progress=False)
    ours = pipe.generate("a cat", image=image, guidance_scale_2=2.0, seed=3, **kw).frames
    want = pipes(A14B).generate("a cat", image=image, guidance_scale_2=2.0, seed=3, **kw).frames
    np.testing.assert_array_equal(ours, want)
    with pytest.raises(AttentionConfigError, match="image-to-video: give the first frame"):
        pipe.generate("a cat", **kw)
    with pytest.raises(AttentionConfigError, match="guidance_scale_2"):
        pipe.generate("a cat", image=image, guidance_scale_2=-1.0, **kw)
    with pytest.raises(AttentionConfigError, match="no LoRA adapters loaded"):
        pipe.generate("a cat", image=image, lora={"style": 1.0}, **kw)


def _sp_i2v_worker(groups, image_bytes):
    from ditattn.attention.context import AttentionSettings

    pipe = WanPipelineNative.from_pretrained(I2V, AttentionSettings(ulysses_degree=2), device="cpu", dtype="float32")
    return pipe.generate(
        "a fox",
        seed=2,
        image=image_bytes,
        height=48,
        width=48,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=3.0,
        output_type="float",
        progress=False,
    ).frames


def test_image_to_video_under_ulysses_matches_single_process(pipes):
    """2 gloo ranks, Ulysses 2 (27 video tokens: padded shards); the image cross-attention attends each
    rank's query shard to the replicated image tokens."""
    import io

    from ditattn.distributed.launch import spawn_ranks

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(2).rand(48, 48, 3) * 255).astype(np.uint8)).save(buf, format="PNG")
    want = (
        pipes(I2V)
        .generate(
            "a fox",
            seed=2,
            image=buf.getvalue(),
            height=48,
            width=48,
            num_frames=9,
            num_inference_steps=2,
            guidance_scale=3.0,
            output_type="float",
            progress=False,
        )
        .frames
    )
    for frames in spawn_ranks(_sp_i2v_worker, 2, args=(buf.getvalue(),), ulysses_degree=2, timeout_s=300):
        np.testing.assert_allclose(frames, want, atol=1e-4)


def test_transparent_pixels_are_composited_over_white_and_said(tmp_path, caplog):
    """An RGBA PNG whose lower half is transparent (its hidden colour black, as image editors often leave it) is read
    with that half white, and a warning names it; an opaque RGBA image and a palette image with a transparent
    index are treated alike (the opaque one unchanged, without a warning)."""
    import logging

    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[:16, :, 3] = 255
    rgba[16:24, :, 3] = 128  # half transparent: blended
    path = tmp_path / "cutout.png"
    Image.fromarray(rgba, "RGBA").save(path)
    with caplog.at_level(logging.WARNING, logger="ditattn.pipelines"):
        got = np.asarray(load_image(str(path), where="--image"))
    assert got[0, 0].tolist() == [200, 0, 0] and got[-1, -1].tolist() == [255, 255, 255]
    assert abs(int(got[20, 0, 1]) - 127) <= 1 and abs(int(got[20, 0, 0]) - 228) <= 1  # 200 a + 255 (1 - a)
    assert "cutout.png" in caplog.text and "has transparent pixels: they are composited over white" in caplog.text
    caplog.clear()
    rgba[..., 3] = 255
    with caplog.at_level(logging.WARNING, logger="ditattn.pipelines"):
        opaque = np.asarray(load_image(Image.fromarray(rgba, "RGBA")))
    assert (opaque == rgba[..., :3]).all() and "transparent" not in caplog.text
    pal = Image.fromarray(np.array([[0, 1] * 16] * 32, np.uint8), "P")
    pal.putpalette([10, 20, 30, 40, 50, 60] + [0] * 762)
    pal.info["transparency"] = 1
    keyed = tmp_path / "keyed.png"
    pal.save(keyed, transparency=1)
    got = np.asarray(load_image(str(keyed)))
    assert got[0, 0].tolist() == [10, 20, 30] and got[0, 1].tolist() == [255, 255, 255]
