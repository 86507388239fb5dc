"""LoRA: adapters built with PEFT on the tiny models change the native pipeline's output exactly as
diffusers' ``load_lora_weights`` changes diffusers' (fused or unfused, with the file's alpha metadata,
without metadata, with lora_B biases, into the low-noise expert), per-call scales, and refusals."""

import os
import re
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ditattn.errors import AttentionConfigError
from ditattn.models.lora import Adapter, LoRAError, LoRASpec, parse_lora_spec, read_lora, resolve_request_lora
from ditattn.models.tiny import tiny_model_path
from ditattn.pipelines.wan import WanPipelineNative
from ditattn.runconfig import ModelConfig

peft = pytest.importorskip("peft")

KW = dict(height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=3.0)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def _diffusers(name):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(tiny_model_path(name))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _make_lora(folder, model_name, *, seed, metadata=True, lora_bias=False, alpha_pattern=None):
    """A random LoRA built with PEFT on the tiny DiT, saved as diffusers does (with or without the
    LoraConfig as metadata)."""
    from diffusers import WanPipeline
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = _diffusers(model_name).transformer
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=TARGETS,
        init_lora_weights=False,
        lora_bias=lora_bias,
        alpha_pattern=alpha_pattern or {},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer.add_adapter(cfg, adapter_name="a")
    with torch.no_grad():  # PEFT initialises lora_B biases to zero: give them values
        for n, p in transformer.named_parameters():
            if "lora_B" in n and n.endswith("bias"):
                p.normal_(0, 0.05)
    with warnings.catch_warnings():  # PEFT 0.21 takes lora_B biases for unsharded ZeRO-3 tensors
        warnings.simplefilter("ignore")
        layers = get_peft_model_state_dict(transformer, adapter_name="a")
    kw = {"transformer_lora_adapter_metadata": cfg.to_dict()} if metadata else {}
    WanPipeline.save_lora_weights(str(folder), transformer_lora_layers=layers, **kw)
    return os.path.join(str(folder), "pytorch_lora_weights.safetensors")


def _frames(pipe, **kw):
    return pipe.generate("a fox", seed=1, output_type="float", progress=False, **{**KW, **kw}).frames


def _reference(model_name, loads, weights, **kw):
    ref = _diffusers(model_name)
    for path, name, into_2 in loads:
        ref.load_lora_weights(path, adapter_name=name, load_into_transformer_2=into_2)
    if weights:
        ref.set_adapters(list(weights), list(weights.values()))
    return ref("a fox", generator=torch.Generator().manual_seed(1), output_type="np", **{**KW, **kw}).frames


def test_peft_lora_matches_diffusers_fused_and_unfused(tmp_path):
    path = _make_lora(tmp_path / "style", "ditattn:tiny-wan", seed=0, alpha_pattern={"ffn.net.2": 2})
    want = _reference("ditattn:tiny-wan", [(path, "style", False)], {"style": 0.7})
    base = _frames(WanPipelineNative.from_pretrained("ditattn:tiny-wan"))
    assert np.abs(base - want).max() > 5e-3  # the LoRA changes the clip
    for fuse in (False, True):
        pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[f"{path}:0.7"], lora_fuse=fuse)
        assert [(a.name, a.scale, a.fused, a.layers) for a in pipe.adapters] == [("style", 0.7, fuse, 20)]
        np.testing.assert_allclose(_frames(pipe), want, rtol=0, atol=2e-6)


def test_lora_without_metadata_and_with_bias(tmp_path):
    """No LoraConfig in the file: alpha = rank (scale 1), as diffusers reads it; lora_B biases added."""
    path = _make_lora(tmp_path / "plain", "ditattn:tiny-wan", seed=1, metadata=False, lora_bias=True)
    want = _reference("ditattn:tiny-wan", [(path, "plain", False)], {})
    for fuse in (False, True):
        pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[path], lora_fuse=fuse)
        np.testing.assert_allclose(_frames(pipe), want, rtol=0, atol=2e-6)


def test_lora_into_the_low_noise_expert(tmp_path):
    path = _make_lora(tmp_path / "low", "ditattn:tiny-wan2.2", seed=2)
    kw = dict(num_inference_steps=4)
    want = _reference("ditattn:tiny-wan2.2", [(path, "low", True)], {}, **kw)
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan2.2", lora=[f"transformer_2={path}"])
    assert pipe.adapters[0].component == "transformer_2"
    np.testing.assert_allclose(_frames(pipe, **kw), want, rtol=0, atol=2e-6)
    with pytest.raises(LoRAError, match="no transformer_2"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[f"transformer_2={path}"])


def test_per_call_scales_of_unfused_adapters(tmp_path):
    a = _make_lora(tmp_path / "a", "ditattn:tiny-wan", seed=3)
    b = _make_lora(tmp_path / "b", "ditattn:tiny-wan", seed=4)
    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[f"{a}:0.5", b])
    assert [x.name for x in pipe.adapters] == ["a", "b"]
    default = _frames(pipe)
    np.testing.assert_allclose(_frames(pipe, lora={"a": 0.5, "b": 1.0}), default, atol=1e-6)
    base = _frames(WanPipelineNative.from_pretrained("ditattn:tiny-wan"))
    np.testing.assert_allclose(_frames(pipe, lora={}), base, atol=1e-6)  # none active
    only_b = _frames(pipe, lora={"b": 1.0})
    assert not np.allclose(only_b, default, atol=1e-4) and not np.allclose(only_b, base, atol=1e-4)
    np.testing.assert_allclose(_frames(pipe), default, atol=1e-6)  # a call's scales do not stick
    with pytest.raises(LoRAError, match="unknown adapter 'c'; loaded: a, b"):
        _frames(pipe, lora={"c": 1.0})
    with pytest.raises(LoRAError, match="finite number"):
        _frames(pipe, lora={"a": float("nan")})
    fused = WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[a], lora_fuse=True)
    with pytest.raises(LoRAError, match="fused into the weights"):
        _frames(fused, lora={"a": 1.0})
    with pytest.raises(LoRAError, match="fused into the weights"):  # {}: every adapter off, which fused ones cannot be
        _frames(fused, lora={})


def test_empty_lora_mapping_on_fused_adapters_is_refused():
    fused = [Adapter("a", "transformer", 1.0, True, "a.safetensors", 1)]
    with pytest.raises(LoRAError, match="fused into the weights"):
        resolve_request_lora({}, fused)
    assert resolve_request_lora({}, []) == {}  # no adapters: nothing to turn off
    assert resolve_request_lora(None, fused) is None


def test_lora_refusals(tmp_path):
    good = _make_lora(tmp_path / "g", "ditattn:tiny-wan", seed=5)
    state = load_file(good)
    bad_shape = {k: (v[:, :8].contiguous() if k.endswith("to_q.lora_A.weight") else v) for k, v in state.items()}
    save_file(bad_shape, str(tmp_path / "shape.safetensors"))
    with pytest.raises(LoRAError, match="to_q is 512x512 but the LoRA is 512x8"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[str(tmp_path / "shape.safetensors")])
    save_file(
        {
            "transformer.blocks.0.attn9.to_q.lora_A.weight": torch.zeros(4, 512),
            "transformer.blocks.0.attn9.to_q.lora_B.weight": torch.zeros(512, 4),
        },
        str(tmp_path / "other.safetensors"),
    )
    with pytest.raises(LoRAError, match="not a linear layer of this transformer"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[str(tmp_path / "other.safetensors")])
    save_file({"transformer.blocks.0.attn1.to_q.weight": torch.zeros(4, 4)}, str(tmp_path / "full.safetensors"))
    with pytest.raises(LoRAError, match="not a LoRA file"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[str(tmp_path / "full.safetensors")])
    with pytest.raises(LoRAError, match="no such file"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[str(tmp_path / "missing.safetensors")])
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoRAError, match="not a valid safetensors file"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[str(tmp_path / "junk.safetensors")])


def test_lora_spec_parsing():
    assert parse_lora_spec("a/b.safetensors") == LoRASpec("a/b.safetensors", 1.0, "transformer")
    assert parse_lora_spec("a/b.safetensors:0.5") == LoRASpec("a/b.safetensors", 0.5, "transformer")
    assert parse_lora_spec("transformer_2=x.safetensors:-1") == LoRASpec("x.safetensors", -1.0, "transformer_2")
    assert parse_lora_spec("dir/with:colon").path == "dir/with:colon"  # not a number: part of the path
    assert LoRASpec("out/lightx2v/pytorch_lora_weights.safetensors").name == "lightx2v"
    assert LoRASpec("loras/style_v2.safetensors").name == "style_v2"
    with pytest.raises(LoRAError, match="finite"):
        parse_lora_spec("x.safetensors:nan")
    with pytest.raises(LoRAError, match="component 'vae' takes no LoRA"):
        parse_lora_spec("vae=x.safetensors")
    assert ModelConfig(lora_path="x.safetensors:2").lora_path == ("x.safetensors:2",)
    with pytest.raises(AttentionConfigError, match="lora_path"):
        ModelConfig(lora_path=["x:inf"])


def _pair(module="blocks.0.attn1.to_q", rank=4):
    g = torch.Generator().manual_seed(0)
    return {
        f"transformer.{module}.lora_A.weight": torch.randn(rank, 512, generator=g),
        f"transformer.{module}.lora_B.weight": torch.randn(512, rank, generator=g),
    }


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_lora_is_refused(tmp_path, bad):
    """A LoRA holding NaN / Inf made an all-black clip with exit 0; it is refused naming file and tensor."""
    state = _pair()
    state["transformer.blocks.0.attn1.to_q.lora_B.weight"][3, 1] = bad
    path = tmp_path / "broken.safetensors"
    save_file(state, str(path))
    words = f"--lora-path {path}: tensor 'transformer.blocks.0.attn1.to_q.lora_B.weight' holds NaN or infinite"
    with pytest.raises(LoRAError, match=re.escape(words)):
        read_lora(LoRASpec(str(path)))
    with pytest.raises(LoRAError, match=re.escape(words)):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", lora=[str(path)], lora_fuse=True)


def test_unreadable_lora_files_are_one_clear_line(tmp_path):
    """Empty, random and truncated files, kohya / SD keys and an empty folder: one line saying what is
    wrong (not diffusers' "Unable to load weights", a bare KeyError or pytorch_lora_weights.bin)."""
    good = tmp_path / "good.safetensors"
    save_file(_pair(), str(good))
    (tmp_path / "empty.safetensors").write_bytes(b"")
    (tmp_path / "random.safetensors").write_bytes(np.random.RandomState(0).bytes(4096))
    (tmp_path / "cut.safetensors").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    g = torch.Generator().manual_seed(1)
    save_file(
        {
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.randn(4, 320, generator=g),
            "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.randn(320, 4, generator=g),
            "lora_unet_down_blocks_0_attentions_0_proj_in.alpha": torch.tensor(4.0),
        },
        str(tmp_path / "kohya.safetensors"),
    )
    (tmp_path / "empty_dir").mkdir()
    cases = {
        "empty.safetensors": "not a valid safetensors file (0 bytes)",
        "random.safetensors": "not a valid safetensors file (4096 bytes; header too large)",
        "cut.safetensors": "not a valid safetensors file (",
        "kohya.safetensors": "keys look like a kohya / SD LoRA (lora_down / lora_up",
        "empty_dir": "the folder holds no .safetensors LoRA",
    }
    for name, words in cases.items():
        with pytest.raises(LoRAError) as ei:
            read_lora(LoRASpec(str(tmp_path / name)))
        msg = str(ei.value)
        assert msg.startswith(f"--lora-path {tmp_path / name}: {words}") and "\n" not in msg, msg
        assert "Unable to load" not in msg and "pytorch_lora_weights.bin" not in msg
    assert "accepted: a diffusers / PEFT Wan LoRA (transformer.<module>.lora_A / lora_B)" in str(
        pytest.raises(LoRAError, read_lora, LoRASpec(str(tmp_path / "kohya.safetensors"))).value
    )
    assert list(read_lora(LoRASpec(str(good))).modules) == ["blocks.0.attn1.to_q"]
