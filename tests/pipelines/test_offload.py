"""Memory options: CPU offload (which components and DiT blocks are on the device while each one runs,
checked from forward hooks; same output as without offload), VAE tiling / slicing, and refusals.
On a CUDA machine the same checks run on the real devices."""

import shutil

import numpy as np
import pytest
import torch

from ditattn.attention.context import AttentionSettings
from ditattn.errors import AttentionConfigError
from ditattn.models.tiny import tiny_model_path
from ditattn.pipelines.offload import ComponentPlacement
from ditattn.pipelines.wan import WanPipelineNative

KW = dict(
    height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.0, progress=False, output_type="float"
)


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    """tiny-wan with a 4-block DiT, so that block streaming has something to stream."""
    from diffusers import WanTransformer3DModel

    from ditattn.models import tiny

    root = tmp_path_factory.mktemp("four") / "model"
    shutil.copytree(tiny_model_path("ditattn:tiny-wan"), root)
    shutil.rmtree(root / "transformer")
    torch.manual_seed(5)
    WanTransformer3DModel(**{**tiny.TRANSFORMER, "num_layers": 4}).save_pretrained(root / "transformer")
    return str(root)


def _watch(pipe, targets):
    """Record ``(what, resident components, resident DiT blocks)`` at each forward of ``targets``."""
    seen, hooks = [], []
    pl = pipe.placement
    for what, module in targets:
        hooks.append(
            module.register_forward_pre_hook(
                lambda m, a, what=what: seen.append((what, pl.resident(), pl.resident_blocks("transformer")))
            )
        )
    return seen, hooks


def test_model_offload_moves_each_component_only_while_it_runs():
    base = WanPipelineNative.from_pretrained("ditattn:tiny-wan").generate("a fox", seed=2, **KW)
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", offload="model")
    assert set(pipe.placement.offloaded) == {"text_encoder", "transformer", "vae"}
    assert pipe.placement.resident() == set()
    c = pipe.components
    seen, hooks = _watch(pipe, [("text", c["text_encoder"]), ("dit", c["transformer"]), ("vae", c["vae"].decoder)])
    try:
        res = pipe.generate("a fox", seed=2, **KW)
    finally:
        for h in hooks:
            h.remove()
    assert {(w, frozenset(r)) for w, r, _ in seen} == {
        ("text", frozenset({"text_encoder"})),
        ("dit", frozenset({"transformer"})),
        ("vae", frozenset({"vae"})),
    }
    assert [w for w, _, _ in seen].count("dit") == 2
    assert pipe.placement.resident() == set()  # everything back home after the call
    np.testing.assert_allclose(res.frames, base.frames, atol=1e-6)
    assert res.peak_memory is None  # CPU run: no CUDA peak


def test_group_offload_streams_the_dit_blocks(four_blocks):
    base = WanPipelineNative.from_pretrained(four_blocks).generate("a fox", seed=4, **KW)
    pipe = WanPipelineNative.from_pretrained(four_blocks, offload="group", offload_group_blocks=1)
    blocks = pipe.components["transformer"].blocks
    seen, hooks = _watch(pipe, [(i, b) for i, b in enumerate(blocks)])
    try:
        res = pipe.generate("a fox", seed=4, **KW)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 8  # 4 blocks x 2 steps
    for i, resident, on_device in seen:
        assert resident == {"transformer"}  # the DiT's non-block weights, not the text encoder or VAE
        assert on_device == {i, (i + 1) % 4}  # this block and the prefetched next one, no other
    assert pipe.placement.resident_blocks("transformer") == set()
    np.testing.assert_allclose(res.frames, base.frames, atol=1e-6)
    # two blocks per group
    pipe2 = WanPipelineNative.from_pretrained(four_blocks, offload="group", offload_group_blocks=2)
    seen, hooks = _watch(pipe2, [(i, b) for i, b in enumerate(pipe2.components["transformer"].blocks)])
    try:
        pipe2.generate("a fox", seed=4, **{**KW, "num_inference_steps": 1})
    finally:
        for h in hooks:
            h.remove()
    assert [b for _, _, b in seen] == [{0, 1, 2, 3}] * 4  # the current group of 2 and the next one


def test_text_encoder_offload_keeps_the_dit_on_the_device(four_blocks):
    pipe = WanPipelineNative.from_pretrained(four_blocks, offload="text_encoder")
    assert pipe.placement.offloaded == ["text_encoder"]
    c = pipe.components
    seen, hooks = _watch(pipe, [("text", c["text_encoder"]), ("dit", c["transformer"])])
    try:
        pipe.generate("a fox", seed=1, **{**KW, "num_inference_steps": 1})
    finally:
        for h in hooks:
            h.remove()
    assert [(w, r) for w, r, _ in seen] == [("text", {"text_encoder"}), ("dit", set())]


def test_image_to_video_offload_visits_image_encoder_and_vae():
    from PIL import Image

    img = Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype(np.uint8))
    base = WanPipelineNative.from_pretrained("ditattn:tiny-wan-i2v").generate("a", seed=1, image=img, **KW)
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan-i2v", offload="model")
    c = pipe.components
    seen, hooks = _watch(pipe, [("clip", c["image_encoder"]), ("vae_enc", c["vae"].encoder)])
    try:
        res = pipe.generate("a", seed=1, image=img, **KW)
    finally:
        for h in hooks:
            h.remove()
    assert seen[0][:2] == ("clip", {"image_encoder"})
    assert {w for w, _, _ in seen[1:]} == {"vae_enc"} and all(r == {"vae"} for _, r, _ in seen[1:])
    np.testing.assert_allclose(res.frames, base.frames, atol=1e-6)


def test_vae_tiling_and_slicing(monkeypatch):
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", vae_tiling=True, vae_slicing=True)
    vae = pipe.components["vae"]
    assert vae.use_tiling and vae.use_slicing
    calls = {"tiled": 0, "decode": 0}
    real_tiled, real_decode = vae.tiled_decode, vae._decode

    def tiled(*a, **k):
        calls["tiled"] += 1
        return real_tiled(*a, **k)

    def decode(*a, **k):
        calls["decode"] += 1
        return real_decode(*a, **k)

    monkeypatch.setattr(vae, "tiled_decode", tiled)
    monkeypatch.setattr(vae, "_decode", decode)
    res = pipe.generate(
        ["a", "b"],
        seed=1,
        height=288,
        width=288,
        num_frames=1,
        num_inference_steps=1,
        guidance_scale=1.0,
        progress=False,
        output_type="float",
    )
    assert res.frames.shape == (2, 1, 288, 288, 3) and np.isfinite(res.frames).all()
    assert calls["tiled"] == 2  # one sample at a time (slicing), each larger than a 256-pixel tile
    assert not WanPipelineNative.from_pretrained("ditattn:tiny-wan").components["vae"].use_tiling


def test_offload_refusals():
    with pytest.raises(AttentionConfigError, match="unknown offload mode 'disk'; accepted: none, text_encoder"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", offload="disk")
    with pytest.raises(AttentionConfigError, match="compiled blocks cannot follow"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", AttentionSettings(compiled=True), offload="group")
    with pytest.raises(AttentionConfigError, match="group_blocks must be a positive integer"):
        ComponentPlacement({}, torch.device("cpu"), "group", 0)
    # plan-only pipelines never move anything
    plan_only = WanPipelineNative.from_pretrained("ditattn:tiny-wan", load_weights=False, offload="group")
    assert plan_only.placement.offloaded == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_moves_weights(four_blocks):
    pipe = WanPipelineNative.from_pretrained(four_blocks, device="cuda", dtype="bfloat16", offload="group")
    tr = pipe.components["transformer"]
    devices = []
    hooks = [
        b.register_forward_pre_hook(
            lambda m, a, i=i: devices.append([blk.attn1.to_q.weight.device.type for blk in tr.blocks])
        )
        for i, b in enumerate(tr.blocks)
    ]
    try:
        res = pipe.generate("a fox", seed=1, **{**KW, "num_inference_steps": 1})
    finally:
        for h in hooks:
            h.remove()
    assert devices[0] == ["cuda", "cuda", "cpu", "cpu"]
    assert devices[2] == ["cpu", "cpu", "cuda", "cuda"]
    assert all(p.device.type == "cpu" for p in tr.parameters())
    assert res.peak_memory is not None and res.peak_memory > 0


def test_offload_that_saves_nothing_says_so(caplog, four_blocks):
    """--offload on the CPU, or a group as large as the DiT, ran without a word although it saves no memory."""
    import logging

    with caplog.at_level(logging.WARNING, logger="ditattn"):
        WanPipelineNative.from_pretrained(four_blocks, device="cpu", offload="group", offload_group_blocks=4)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "--offload group saves no memory on the CPU" in said
    assert "--offload-group-blocks 4 streams the whole DiT (4 blocks) as one group" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ditattn"):
        WanPipelineNative.from_pretrained(four_blocks, device="cpu")
    assert not [r for r in caplog.records if "offload" in r.getMessage()]
