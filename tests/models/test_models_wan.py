"""Native Wan DiT and UMT5 encoder against diffusers / transformers on the same weights (fp32)."""

import os

import pytest
import torch

from ditattn.attention.context import AttentionSettings, attention_settings, component_scope
from ditattn.errors import AttentionConfigError
from ditattn.models.tiny import tiny_model_path
from ditattn.models.umt5 import load_umt5_encoder, relative_position_buckets
from ditattn.models.wan import load_wan_transformer
from ditattn.models.wan.transformer import WanTransformerConfig


@pytest.fixture(scope="module")
def tiny():
    return tiny_model_path("ditattn:tiny-wan")


@pytest.fixture(scope="module")
def ref_transformer(tiny):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(os.path.join(tiny, "transformer")).eval()


@pytest.fixture(scope="module")
def native_transformer(tiny):
    with component_scope("transformer"):
        return load_wan_transformer(os.path.join(tiny, "transformer"))


def test_state_dict_is_diffusers_layout(native_transformer, ref_transformer):
    ours = {k: v.shape for k, v in native_transformer.state_dict().items()}
    ref = {k: v.shape for k, v in ref_transformer.state_dict().items()}
    assert ours == ref


@pytest.mark.parametrize("grid", [(3, 8, 10), (1, 4, 6)])
def test_transformer_matches_diffusers(native_transformer, ref_transformer, grid):
    g = torch.Generator().manual_seed(0)
    T, H, W = grid
    x = torch.randn(2, 16, T, 2 * H, 2 * W, generator=g)
    t = torch.tensor([999, 431])
    ctx = torch.randn(2, 24, 64, generator=g)
    with torch.no_grad():
        ours = native_transformer(x, t, ctx)
        ref = ref_transformer(x, t, ctx, return_dict=False)[0]
    assert ours.shape == ref.shape == x.shape
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_transformer_per_token_timesteps_match_diffusers(native_transformer, ref_transformer):
    """Wan 2.2 TI2V passes one timestep per token ([B, S]); the 4-D modulation path must match."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 2, 4, 4, generator=g)
    t = torch.randint(0, 1000, (1, 2 * 2 * 2), generator=g)
    ctx = torch.randn(1, 8, 64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(
            native_transformer(x, t, ctx), ref_transformer(x, t, ctx, return_dict=False)[0], rtol=1e-5, atol=1e-5
        )


def test_transformer_attention_layers_and_roles(native_transformer):
    from ditattn.attention.layer import LocalAttention

    layers = [(n, m) for n, m in native_transformer.named_modules() if isinstance(m, LocalAttention)]
    assert [m.prefix for _, m in layers] == ["blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn1", "blocks.1.attn2"]
    assert [m.role for _, m in layers] == ["self", "cross", "self", "cross"]
    assert all(m.num_heads == 4 and m.head_dim == 128 for _, m in layers)
    assert [m.layer_idx for _, m in layers] == [0, 0, 1, 1]


def test_transformer_sets_video_shape_for_backends(native_transformer):
    from ditattn.attention.context import current_forward

    seen = []
    hooks = [
        b.attn1.attn.register_forward_pre_hook(lambda m, a: seen.append((m.prefix, current_forward().video_shape)))
        for b in native_transformer.blocks
    ]
    try:
        with torch.no_grad():
            native_transformer(torch.zeros(1, 16, 3, 8, 12), torch.tensor([5]), torch.zeros(1, 4, 64))
    finally:
        for h in hooks:
            h.remove()
    assert seen == [("blocks.0.attn1", (3, 4, 6)), ("blocks.1.attn1", (3, 4, 6))]


def test_umt5_matches_transformers_with_padding(tiny):
    from transformers import UMT5EncoderModel

    folder = os.path.join(tiny, "text_encoder")
    with component_scope("text_encoder") as scope:
        ours = load_umt5_encoder(folder)
    assert [d.backend.value for d in scope.decisions] == ["torch_sdpa", "torch_sdpa"]
    assert all(d.source == "layer_default" for d in scope.decisions)
    ref = UMT5EncoderModel.from_pretrained(folder).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (3, 40), generator=g)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, 25:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        a = ours(ids, mask)
        b = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    for i, n in enumerate((40, 25, 3)):  # rows of real tokens
        torch.testing.assert_close(a[i, :n], b[i, :n], rtol=1e-5, atol=1e-5)
    # a sequence longer than max_distance exercises the logarithmic buckets
    ids = torch.randint(3, 259, (1, 300), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, None), ref(input_ids=ids).last_hidden_state, rtol=1e-5, atol=1e-5)


def test_relative_buckets_match_transformers(tiny):
    from transformers import UMT5Config
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    cfg = UMT5Config(
        num_heads=2, d_model=8, d_kv=4, relative_attention_num_buckets=32, relative_attention_max_distance=128
    )
    attn = UMT5Attention(cfg, has_relative_attention_bias=True)
    rel = torch.arange(300)[None, :] - torch.arange(250)[:, None]
    assert torch.equal(relative_position_buckets(250, 300, 32, 128, "cpu"), attn._relative_position_bucket(rel))


def test_text_encoder_rejects_fa_because_of_bias(tiny):
    """An explicit text_encoder=fa is refused with the bias reason (even where fa would run)."""
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.platforms import Platform, use_platform

    plat = Platform.simulate("cuda", capability=(9, 0), packages={"flash_attn.cute"})
    st = AttentionSettings(component_overrides={"text_encoder": B.FA})
    with use_platform(plat), attention_settings(st), component_scope("text_encoder"):
        with pytest.raises(AttentionConfigError, match="bias"):
            load_umt5_encoder(os.path.join(tiny, "text_encoder"), dtype=torch.bfloat16, load_weights=False)


def test_checkpoint_mismatch_is_a_clear_error(tiny, tmp_path):
    import json
    import shutil

    bad = tmp_path / "transformer"
    shutil.copytree(os.path.join(tiny, "transformer"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_layers"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AttentionConfigError, match="missing .* tensor"):
        load_wan_transformer(str(bad))
    with pytest.raises(AttentionConfigError, match="no weights for variant 'fp16'"):
        load_wan_transformer(os.path.join(tiny, "transformer"), variant="fp16")


def test_image_to_video_config_checks():
    cfg = WanTransformerConfig.from_dict({"image_dim": 1280, "added_kv_proj_dim": 5120})  # Wan2.1-I2V-14B
    assert cfg.has_image_input and not WanTransformerConfig().has_image_input
    with pytest.raises(AttentionConfigError, match="needs both"):
        WanTransformerConfig.from_dict({"image_dim": 1280})
    with pytest.raises(AttentionConfigError, match="added_kv_proj_dim 64 must equal the model width"):
        WanTransformerConfig.from_dict({"image_dim": 1280, "added_kv_proj_dim": 64})


def test_bfloat16_keeps_fp32_modules(tiny, native_transformer):
    with component_scope("transformer"):
        m = load_wan_transformer(os.path.join(tiny, "transformer"), dtype=torch.bfloat16)
    assert m.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert m.blocks[0].scale_shift_table.dtype == torch.float32
    assert m.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    # kept modules load straight from the float32 checkpoint (no round trip through bfloat16)
    assert torch.equal(m.blocks[1].scale_shift_table, native_transformer.blocks[1].scale_shift_table)
    assert torch.equal(
        m.condition_embedder.time_embedder.linear_2.weight,
        native_transformer.condition_embedder.time_embedder.linear_2.weight,
    )
    with torch.no_grad():
        out = m(
            torch.randn(1, 16, 1, 4, 4, dtype=torch.bfloat16),
            torch.tensor([500]),
            torch.randn(1, 6, 64, dtype=torch.bfloat16),
        )
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_tiny_model_is_built_deterministically(tiny, tmp_path):
    import json

    from safetensors.torch import load_file

    again = tiny_model_path("ditattn:tiny-wan", root=str(tmp_path))
    assert again != tiny and again.startswith(str(tmp_path))
    assert tiny_model_path("ditattn:tiny-wan", root=str(tmp_path)) == again  # reused, not rebuilt
    for comp, fn in (
        ("transformer", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "model.safetensors"),
        ("vae", "diffusion_pytorch_model.safetensors"),
    ):
        a, b = load_file(os.path.join(tiny, comp, fn)), load_file(os.path.join(again, comp, fn))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    index = json.load(open(os.path.join(again, "model_index.json")))
    assert index["_class_name"] == "WanPipeline"
    assert {k for k, v in index.items() if isinstance(v, list) and v[0]} == {
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    }
    cfg = json.load(open(os.path.join(again, "transformer", "config.json")))
    assert (cfg["num_attention_heads"], cfg["attention_head_dim"], cfg["num_layers"]) == (4, 128, 2)


def test_byte_tokenizer_round_trip(tiny):
    from ditattn.pipelines.text import PromptTokenizer

    tok = PromptTokenizer(os.path.join(tiny, "tokenizer"))
    ids, mask = tok(["héllo  wörld", ""], max_length=20)
    text = "héllo wörld".encode()  # whitespace runs are collapsed, as diffusers' prompt_clean does
    assert ids[0, : len(text)].tolist() == [3 + b for b in text]
    assert ids[0, len(text)] == 1 and mask[0].sum() == len(text) + 1  # eos appended
    assert ids[1, 0] == 1 and mask[1].sum() == 1 and ids[1, 1:].eq(0).all()  # empty prompt: eos, then padding
    ids, mask = tok(["x" * 50], max_length=8)
    assert ids.shape == (1, 8) and ids[0, -1] == 1  # truncation keeps the eos
