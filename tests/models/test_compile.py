"""Compiled DiT blocks keep attention eager: same output, backend selection and overrides still apply."""

import torch

from ditattn.attention.context import AttentionSettings, attention_settings, component_scope
from ditattn.attention.layer import LocalAttention
from ditattn.models.wan.compile import compile_blocks
from ditattn.models.wan.transformer import WanTransformer, WanTransformerConfig


def test_compiled_blocks_match_eager_and_attention_stays_eager(monkeypatch):
    cfg = WanTransformerConfig(
        num_attention_heads=2,
        attention_head_dim=32,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=2,
    )
    torch.manual_seed(0)
    with attention_settings(AttentionSettings()), component_scope("transformer"):
        model = WanTransformer(cfg, dtype=torch.float32).eval()
    x = torch.randn(1, 4, 2, 8, 8)
    t = torch.tensor([500.0])
    txt = torch.randn(1, 5, 16)
    with torch.no_grad():
        eager = model(x, t, txt)
        compile_blocks(model, backend="eager")
        calls = []
        for layer in (m for m in model.modules() if isinstance(m, LocalAttention)):
            real = layer.impl

            def spy(q, k, v, call, cfg, real=real):
                calls.append(torch.compiler.is_compiling())
                return real(q, k, v, call, cfg)

            layer._impl = spy
        compiled = model(x, t, txt)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert calls == [False] * 4  # 2 blocks x (self, cross), every call outside the traced graph
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None for b in model.blocks)
