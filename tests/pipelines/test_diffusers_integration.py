"""``ditattn.integrations.diffusers``: ditattn's selection inside a stock diffusers pipeline.

With ``torch_sdpa`` a diffusers ``WanPipeline`` gives exactly its own output; with a sparse backend it
gives what ditattn's native pipeline gives on the same checkpoint (the same latent grid and steps reach
the backend); ``remove`` restores the processors; per-call overrides, skip softmax and the plan; the CLI
(``--backend diffusers`` with ditattn flags, ``plan --backend diffusers``); a second family (Flux, a tiny
random model built offline) with its text-first joint attention."""

import os

import numpy as np
import pytest
import torch

from ditattn.attention.context import current_forward
from ditattn.errors import AttentionConfigError
from ditattn.integrations import diffusers as dd

# 64x128 pixels, 9 frames -> a 3x4x8 latent grid: two 4x4x4 VSA tiles, so sparsity 0.5 drops one
SIZE = dict(height=64, width=128, num_frames=9)


@pytest.fixture(scope="module")
def wan():
    from diffusers import WanPipeline

    from ditattn.models.tiny import tiny_model_path

    pipe = WanPipeline.from_pretrained(tiny_model_path("ditattn:tiny-wan"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(pipe, steps=2, guidance=1.0, **size):
    return pipe(
        prompt="a red fox",
        generator=torch.Generator("cpu").manual_seed(0),
        num_inference_steps=steps,
        guidance_scale=guidance,
        output_type="latent",
        **(size or SIZE),
    ).frames


def _native(backend, config=None, steps=2):
    from ditattn.pipelines.wan import WanPipelineNative
    from ditattn.runconfig import RunConfig

    cfg = RunConfig.from_mapping({"attention_backend": backend, "attention_backend_config": config})
    res = WanPipelineNative.from_config(cfg).generate(
        "a red fox",
        seed=0,
        num_inference_steps=steps,
        guidance_scale=1.0,
        output_type="latent",
        progress=False,
        **SIZE,
    )
    return res.frames, res.attention_backends


def test_torch_sdpa_is_exact_and_remove_restores(wan):
    originals = {n: m.processor for n, m in wan.transformer.named_modules() if hasattr(m, "set_processor")}
    stock = _latents(wan)
    record = dd.apply(wan, attention_backend="torch_sdpa")
    routed = {n: m.processor for n, m in wan.transformer.named_modules() if hasattr(m, "set_processor")}
    assert all(routed[n] is not p and isinstance(routed[n], type(p)) for n, p in originals.items())
    assert torch.equal(_latents(wan), stock)
    assert dd.call_backends(wan) == ["torch_sdpa"] and len(record.components["transformer"].layers) == 4
    dd.remove(wan)
    assert all(m.processor is originals[n] for n, m in wan.transformer.named_modules() if hasattr(m, "set_processor"))
    assert dd.applied(wan) is None and torch.equal(_latents(wan), stock)


def test_sparse_backend_matches_the_native_pipeline(wan):
    stock = _latents(wan)
    dd.apply(wan, attention_backend="video_sparse_attn", attention_backend_config={"sparsity": 0.5})
    try:
        sparse = _latents(wan)
        assert dd.call_backends(wan) == ["video_sparse_attn", "torch_sdpa"]  # cross-attention runs dense
    finally:
        dd.remove(wan)
    native, backends = _native("video_sparse_attn", "sparsity=0.5")
    native_dense, _ = _native("torch_sdpa")
    assert backends == ["video_sparse_attn", "torch_sdpa"]
    assert (sparse - stock).abs().max() > 1e-3  # the sparse backend ran: it is not the dense result
    # the same as ditattn's own pipeline, as close as the two dense pipelines are to each other
    dense_gap = (stock - native_dense).abs().max().item()
    assert (sparse - native).abs().max().item() <= max(4 * dense_gap, 1e-5)


def test_layers_see_the_grid_and_the_denoising_step(wan):
    record = dd.apply(wan, attention_backend="torch_sdpa")
    seen = []
    layers = record.components["transformer"].layers
    hooks = [
        layers[0].register_forward_pre_hook(lambda m, a: seen.append(("self", current_forward()))),
        layers[1].register_forward_pre_hook(lambda m, a: seen.append(("cross", current_forward()))),
    ]
    try:
        _latents(wan, steps=3, guidance=5.0)  # classifier-free guidance: two transformer calls per step
    finally:
        for h in hooks:
            h.remove()
        dd.remove(wan)
    selfs = [f for role, f in seen if role == "self"]
    assert [f.step for f in selfs] == [0, 0, 1, 1, 2, 2] and {f.num_steps for f in selfs} == {3}
    assert {f.video_shape for f in selfs} == {(3, 4, 8)} and {f.text_len for f in selfs} == {0}
    assert [layers[0].prefix, layers[1].prefix] == ["blocks.0.attn1", "blocks.0.attn2"]
    assert (layers[0].role, layers[1].role) == ("self", "cross")


def test_per_call_override_and_refusals(wan):
    dd.apply(wan, attention_backend="torch_sdpa")
    try:
        base = _latents(wan, height=32, width=48, num_frames=1)
        with dd.options(wan, attention_backend_override="sage_attn") as state:
            quant = _latents(wan, height=32, width=48, num_frames=1)
            assert dd.call_backends(wan, state) == ["sage_attn"]
        assert 0 < (quant - base).abs().max() < 0.5  # lossy INT8 Q.K, close to the dense result
        assert torch.equal(_latents(wan, height=32, width=48, num_frames=1), base)  # the next call: default again
        with pytest.raises(AttentionConfigError, match="not a per-request drop-in"):
            with dd.options(wan, attention_backend_override="video_sparse_attn"):
                pass
    finally:
        dd.remove(wan)
    dd.apply(wan, attention_backend="video_sparse_attn")
    try:
        with pytest.raises(AttentionConfigError, match="sparse backend video_sparse_attn"):
            with dd.options(wan, attention_backend_override="torch_sdpa"):
                pass
    finally:
        dd.remove(wan)
    with pytest.raises(AttentionConfigError, match="not applied"):
        dd.plan(wan)


def test_skip_softmax_reports_its_tiles():
    from diffusers import WanPipeline

    from ditattn.models.tiny import tiny_model_path

    pipe = WanPipeline.from_pretrained(tiny_model_path("ditattn:tiny-wan"), dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    record = dd.apply(pipe, skip_softmax={"threshold_scale_factor": 0.5, "start_step": 1})
    _latents(pipe, steps=2, height=32, width=48, num_frames=1)
    fractions = record.last_state.stats["skip_softmax_fractions"]
    assert len(fractions) == 2  # two self-attention layers, only from step 1
    _latents(pipe, steps=2, height=32, width=48, num_frames=1)
    assert len(record.last_state.stats["skip_softmax_fractions"]) == 2  # a fresh record per call
    with pytest.raises(AttentionConfigError, match="threshold_scale_factor"):
        dd.apply(pipe, skip_softmax={"start_step": 1})
    assert dd.applied(pipe) is record  # a refused apply leaves the previous selection in place


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(attention_backend="nope"), "unknown attention backend 'nope'"),
        (dict(component_attention_backends={"text_encoder": "torch_sdpa"}), "text_encoder keeps its library's own"),
        (dict(component_attention_backends="transformer_2=torch_sdpa"), "unknown component 'transformer_2'"),
        (dict(attention_backend="video_sparse_attn", attention_backend_config="sparsity=2"), "sparsity"),
        (dict(attention_backend_config="topk=0.5"), "topk"),  # a key no layer's backend uses
    ],
)
def test_apply_refuses_like_the_cli(wan, kwargs, message):
    before = {n: m.processor for n, m in wan.transformer.named_modules() if hasattr(m, "set_processor")}
    with pytest.raises(AttentionConfigError, match=message):
        dd.apply(wan, **kwargs)
    assert dd.applied(wan) is None
    assert all(m.processor is before[n] for n, m in wan.transformer.named_modules() if hasattr(m, "set_processor"))


def test_cli_backend_diffusers_with_ditattn_flags(capsys, tmp_path):
    from PIL import Image

    from ditattn.cli import main

    common = [
        "generate",
        "--prompt",
        "a lighthouse",
        "--num-frames",
        "1",
        "--seed",
        "2",
        "--height",
        "32",
        "--width",
        "48",
        "--num-inference-steps",
        "2",
        "--backend",
        "diffusers",
        "--output-path",
        str(tmp_path),
    ]
    assert main([*common, "--output-file", "stock.png", "--attention-backend", "native"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                *common,
                "--output-file",
                "ours.png",
                "--attention-backend",
                "torch_sdpa",
                "--component-attention-backends",
                "transformer.cross=torch_sdpa",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].endswith("DiT attention: torch_sdpa (ditattn in diffusers)")
    assert np.array_equal(
        np.asarray(Image.open(tmp_path / "stock.png")), np.asarray(Image.open(tmp_path / "ours.png"))
    )
    rc = main([*common, "--attention-backend", "flash", "--attention-backend-config", "sparsity=0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs a ditattn --attention-backend; 'flash' is diffusers' own" in err


def test_plan_explains_the_diffusers_pipeline(capsys):
    import json

    from ditattn.cli import main

    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                "--backend",
                "diffusers",
                "--model-path",
                "ditattn:tiny-wan2.2",
                "--json",
                "--attention-backend",
                "video_sparse_attn",
                "--component-attention-backends",
                "transformer_2=torch_sdpa",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    comps = {c["name"]: c for c in plan["components"]}
    assert plan["pipeline"] == "diffusers" and set(comps) == {"transformer", "transformer_2", "text_encoder", "vae"}
    assert not comps["text_encoder"]["selectable"] and not comps["vae"]["selectable"]
    t1 = {(l["prefix"], l["role"], l["backend"], l["source"]) for l in comps["transformer"]["layers"]}
    assert ("blocks.0.attn1", "self", "video_sparse_attn", "cli") in t1
    assert ("blocks.0.attn2", "cross", "torch_sdpa", "cli") in t1  # sparse cannot serve cross-attention
    assert {l["backend"] for l in comps["transformer_2"]["layers"]} == {"torch_sdpa"}
    assert {l["source"] for l in comps["transformer_2"]["layers"]} == {"component"}


# ------------------------------------------------------------------------------------------------
# a second family: Flux (joint attention, text tokens first), a tiny random model

H, W, TEXT = 8, 12, 7


@pytest.fixture(scope="module")
def flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    ids = torch.zeros(H * W, 3)
    ids[:, 1], ids[:, 2] = torch.arange(H * W) // W, torch.arange(H * W) % W
    inputs = dict(
        hidden_states=torch.randn(1, H * W, 16),
        encoder_hidden_states=torch.randn(1, TEXT, 32),
        pooled_projections=torch.randn(1, 32),
        timestep=torch.tensor([0.5]),
        img_ids=ids,
        txt_ids=torch.zeros(TEXT, 3),
        return_dict=False,
    )
    return model, inputs


class _Pipe:
    def __init__(self, transformer):
        self.components = {"transformer": transformer}


@torch.no_grad()
def test_flux_dense_exact_and_sparse_with_its_grid(flux):
    model, inputs = flux
    stock = model(**inputs)[0]
    pipe = _Pipe(model)
    record = dd.apply(pipe, attention_backend="torch_sdpa")
    assert torch.equal(model(**inputs)[0], stock)
    assert len(record.components["transformer"].layers) == 2 and dd.family_of(model).text_first
    dd.apply(pipe, attention_backend="video_sparse_attn", attention_backend_config={"sparsity": 0.0})
    assert torch.allclose(model(**inputs)[0], stock, atol=1e-5)  # every tile kept: dense attention
    dd.apply(pipe, attention_backend="video_sparse_attn", attention_backend_config={"sparsity": 0.75})
    assert (model(**inputs)[0] - stock).abs().max() > 1e-3
    dd.remove(pipe)
    assert torch.equal(model(**inputs)[0], stock)


@torch.no_grad()
def test_text_first_tokens_move_after_the_grid_for_sparse_backends(flux):
    """The routed dispatch equals ditattn.attention on [image, text] (ditattn's order) put back."""
    import ditattn
    from ditattn.attention.context import forward_context

    model, _ = flux
    pipe = _Pipe(model)
    record = dd.apply(pipe, attention_backend="video_sparse_attn", attention_backend_config={"sparsity": 0.5})
    try:
        layer = record.components["transformer"].layers[0]
        dispatch = dd.make_dispatch(layer, dd.family_of(model))
        torch.manual_seed(1)
        q, k, v = (torch.randn(1, TEXT + H * W, 2, 16) for _ in range(3))
        with forward_context(video_shape=(1, H, W), text_len=TEXT):
            out = dispatch(q, k, v)
        move = lambda t: torch.cat([t[:, TEXT:], t[:, :TEXT]], dim=1)  # noqa: E731
        ref = ditattn.attention(
            move(q),
            move(k),
            move(v),
            backend="video_sparse_attn",
            config={"sparsity": 0.5},
            video_shape=(1, H, W),
            text_len=TEXT,
        )
        assert torch.equal(out, torch.cat([ref[:, -TEXT:], ref[:, :-TEXT]], dim=1))
        with pytest.raises(AttentionConfigError, match="chosen for cpu but the pipeline now runs on meta"):
            dispatch(*(t.to("meta") for t in (q, k, v)))
    finally:
        dd.remove(pipe)


def test_sparse_needs_a_family_with_a_grid(flux, monkeypatch):
    model, _ = flux
    from ditattn.integrations.diffusers import routing

    monkeypatch.setattr(routing, "family_of", lambda m: dd.GENERIC)
    with pytest.raises(AttentionConfigError, match="needs the latent grid"):
        dd.apply(_Pipe(model), attention_backend="video_sparse_attn")
    record = dd.apply(_Pipe(model), attention_backend="torch_sdpa")  # dense backends serve any family
    assert {d.backend.value for d in record.components["transformer"].scope.decisions} == {"torch_sdpa"}


def test_readme_example_runs(wan, monkeypatch):
    """The README's diffusers example, as written, on the tiny model on the CPU (its model id, device and
    frame count replaced): every line runs, the override call is lossy but close, and the pipeline is
    left with ditattn's sparse backend applied."""
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "ditattn_diffusers.options" in b)
    from diffusers import WanPipeline

    monkeypatch.setattr(WanPipeline, "from_pretrained", classmethod(lambda cls, *a, **k: wan))
    code = block.replace('.to("cuda")', "").replace(
        "num_frames=33", "num_frames=1, height=32, width=48, num_inference_steps=2, output_type='np'"
    )
    scope: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), scope)
        assert scope["video"].shape == scope["video_fast"].shape
        assert dd.plan(wan) is not None  # the sparse backend is applied at the end
    finally:
        dd.remove(wan)
