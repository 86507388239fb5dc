"""The registered sparse video backends: call contract, dense-step/dense-layer rules through the step
metadata, STA search -> strategy file -> inference, statistics, and config validation of every
parameter (valid and invalid)."""

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from ditattn.attention.backends.base import AttnCall, get_impl, reference_attention
from ditattn.attention.config import parse_attention_backend_config, validate_backend_config
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.sparse import last_stats
from ditattn.attention.sparse.common import plan_token_mask
from ditattn.attention.sparse.sla import sla_attention
from ditattn.attention.sparse.sol import sol_attention
from ditattn.attention.sparse.sparge import sparge_attention
from ditattn.attention.sparse.sta import flush_sta_search, reset_sta_search, sliding_tile_attention
from ditattn.attention.sparse.svg2 import svg2_attention, svg2_token_mask
from ditattn.attention.sparse.vmoba import vmoba_attention
from ditattn.attention.sparse.vsa import video_sparse_attention
from ditattn.errors import AttentionConfigError

#: the training-free backends with an error budget: the planner tests below turn it off (error_budget 0) to
#: compare the plain rules with the engine; tests/attention/test_sparse_budget.py covers the budget
BUDGETED = (B.SPARGE_ATTN, B.SOL_ATTN, B.VMOBA_ATTN, B.SPARSE_VIDEO_GEN_2_ATTN)
SPARSE = [
    B.SLIDING_TILE_ATTN,
    B.VIDEO_SPARSE_ATTN,
    B.SPARGE_ATTN,
    B.VMOBA_ATTN,
    B.SPARSE_VIDEO_GEN_2_ATTN,
    B.SLA_ATTN,
    B.SAGE_SLA_ATTN,
    B.SOL_ATTN,
]
GRID, TEXT = (3, 5, 7), 7  # 105 video + 7 text tokens


def qkv(grid=GRID, text_len=TEXT, heads=4, kv_heads=None, dim=64, batch=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = math.prod(grid) + text_len
    q = torch.randn(batch, S, heads, dim, generator=g)
    k = torch.randn(batch, S, kv_heads or heads, dim, generator=g)
    v = torch.randn(batch, S, kv_heads or heads, dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def call(**kw):
    kw.setdefault("video_shape", GRID)
    kw.setdefault("text_len", TEXT)
    return AttnCall(**kw)


@pytest.fixture
def strategy_file(tmp_path):
    path = tmp_path / "sta.json"
    data = {f"{s}_{l}_{h}": [1, 1 + 2 * (h % 2), 3] for s in (0, 20) for l in range(4) for h in range(4)}
    path.write_text(json.dumps(data))
    return str(path)


def config_for(backend, strategy_path="/nonexistent.json", **extra):
    raw = dict(extra)
    if backend is B.SLIDING_TILE_ATTN:
        raw.setdefault("mask_strategy_file_path", strategy_path)
        raw.setdefault("tile_size", [1, 2, 2])
    if backend is B.VIDEO_SPARSE_ATTN:
        raw.setdefault("sparsity", 0.25)  # the default 0.0 keeps every tile and runs dense
    if backend in BUDGETED:
        raw.setdefault("error_budget", 0.0)
    return validate_backend_config(backend, raw)


def inputs_for(backend, **kw):
    if backend is B.SOL_ATTN:
        kw.setdefault("dim", 128)
        kw.setdefault("dtype", torch.bfloat16)
        kw.setdefault("heads", 2)
    if backend is B.SPARGE_ATTN:  # FP16/BF16 only (seed)
        kw.setdefault("dtype", torch.bfloat16)
    return qkv(**kw)


# ------------------------------------------------------------------------------------------------
# call contract


@pytest.mark.parametrize("backend", SPARSE)
def test_needs_video_shape_and_matching_length(backend, strategy_file):
    impl = get_impl(backend)
    cfg = config_for(backend, strategy_file)
    q, k, v = inputs_for(backend, grid=(3, 8, 9), text_len=0)
    if backend in (B.SPARGE_ATTN, B.SOL_ATTN):  # plain sequences: 1-D blocks
        out, _ = impl(q, k, v, AttnCall(video_shape=None, step=30, layer_idx=3), cfg)
        assert out.shape == q.shape
    else:
        with pytest.raises(AttentionConfigError, match=r"needs the latent grid video_shape=\(T,H,W\)"):
            impl(q, k, v, AttnCall(video_shape=None, step=30), cfg)
    with pytest.raises(AttentionConfigError, match="sequence length"):
        impl(q, k, v, AttnCall(video_shape=(3, 8, 8), step=30), cfg)
    with pytest.raises(AttentionConfigError, match="causal"):
        impl(q, k, v, AttnCall(video_shape=(3, 8, 9), causal=True, step=30), cfg)


@pytest.mark.parametrize("backend", [b for b in SPARSE if b is not B.SPARGE_ATTN])
def test_cross_attention_is_refused(backend, strategy_file):
    q, k, v = inputs_for(backend)
    with pytest.raises(AttentionConfigError, match="self-attention"):
        get_impl(backend)(q, k[:, :50], v[:, :50], call(step=30), config_for(backend, strategy_file))


@pytest.mark.parametrize("backend", SPARSE)
def test_gqa_equals_expanded_heads_and_stats(backend, strategy_file):
    impl = get_impl(backend)
    cfg = config_for(backend, strategy_file)
    q, k, v = inputs_for(backend, kv_heads=1, grid=(3, 8, 9), text_len=TEXT)
    rep = q.shape[2]
    c = AttnCall(
        video_shape=(3, 8, 9), text_len=TEXT, step=30, layer_idx=3, layer_key="blocks.3.attn1", return_lse=True
    )
    last_stats.clear()
    o1, l1 = impl(q, k, v, c, cfg)
    o2, l2 = impl(q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2), c, cfg)
    assert o1.shape == q.shape and o1.dtype == q.dtype
    assert l1.shape == (1, rep, q.shape[1]) and l1.dtype == torch.float32
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    st = last_stats["blocks.3.attn1"]
    assert st["backend"] == backend.value and st["dense"] is False and st["step"] == 30
    assert 0 < st["kept_fraction"] <= 1


# ------------------------------------------------------------------------------------------------
# outputs equal dense attention with the plan's explicit mask


def test_backend_outputs_match_engine_and_explicit_masks(strategy_file):
    grid = (3, 8, 9)
    q, k, v = qkv(grid=grid, text_len=TEXT, heads=4, seed=1)
    c = AttnCall(video_shape=grid, text_len=TEXT, step=25, layer_idx=1)

    def check(backend, cfg, res, mask=None):
        cfg = dict(cfg, error_budget=0.0) if backend in BUDGETED else cfg
        out, _ = get_impl(backend)(q, k, v, c, validate_backend_config(backend, cfg))
        torch.testing.assert_close(out, res[0], rtol=0, atol=0)
        m = plan_token_mask(res[2]) if mask is None else mask
        torch.testing.assert_close(out, reference_attention(q, k, v, mask=m)[0], rtol=0, atol=3e-6)

    check(
        B.VIDEO_SPARSE_ATTN,
        {"sparsity": 0.6},
        video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.6, text_len=TEXT),
    )
    padded = video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.6, text_len=TEXT, edge_tiles="padded")
    check(B.VIDEO_SPARSE_ATTN, {"sparsity": 0.6, "edge_tiles": "padded"}, padded)
    assert (
        padded[2].layout.n_video_blocks
        > video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.6, text_len=TEXT)[2].layout.n_video_blocks
    )
    # sparge (fp16/bf16 only): the planner in float32 against its explicit mask; the backend in bf16 equals it
    res = sparge_attention(q, k, v, video_shape=grid, topk=0.3, block_size=32, text_len=TEXT)
    torch.testing.assert_close(
        res[0], reference_attention(q, k, v, mask=plan_token_mask(res[2]))[0], rtol=0, atol=3e-6
    )
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    for quant in (False, True):
        out, _ = get_impl(B.SPARGE_ATTN)(
            qb,
            kb,
            vb,
            c,
            validate_backend_config(
                B.SPARGE_ATTN, {"topk": 0.3, "block_size": 32, "quantize": quant, "error_budget": 0.0}
            ),
        )
        want = sparge_attention(qb, kb, vb, video_shape=grid, topk=0.3, block_size=32, text_len=TEXT, quantize=quant)
        torch.testing.assert_close(out, want[0], rtol=0, atol=0)
    # layer 1 with the default cycle is a spatial layer
    check(
        B.VMOBA_ATTN,
        {"spatial_chunk_size": [4, 3], "spatial_topk": 3, "moba_select_mode": "topk"},
        vmoba_attention(
            q, k, v, video_shape=grid, mode="spatial", chunk=(4, 3), topk=3, select_mode="topk", text_len=TEXT
        ),
    )
    svg = svg2_attention(q, k, v, video_shape=grid, text_len=TEXT, num_q_clusters=4, num_k_clusters=6, top_p=0.5)
    check(
        B.SPARSE_VIDEO_GEN_2_ATTN,
        {"num_q_clusters": 4, "num_k_clusters": 6, "top_p": 0.5},
        svg,
        svg2_token_mask(svg[2]),
    )
    check(
        B.SLA_ATTN,
        {"topk": 0.4, "block_size": 32},
        sla_attention(q, k, v, video_shape=grid, text_len=TEXT, topk=0.4, block_size=32),
    )
    out, _ = get_impl(B.SAGE_SLA_ATTN)(
        q, k, v, c, validate_backend_config(B.SAGE_SLA_ATTN, {"topk": 0.4, "block_size": 32})
    )
    ref = sla_attention(q, k, v, video_shape=grid, text_len=TEXT, topk=0.4, block_size=32, quantize=True)[0]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # STA with the strategy file: windows for layer 1, step 20 (<= 25): head h -> [1, 1 + 2*(h%2), 3]
    out, _ = get_impl(B.SLIDING_TILE_ATTN)(q, k, v, c, config_for(B.SLIDING_TILE_ATTN, strategy_file))
    windows = [[1, 1 + 2 * (h % 2), 3] for h in range(4)]
    res = sliding_tile_attention(q, k, v, video_shape=grid, windows=windows, tile_size=(1, 2, 2), text_len=TEXT)
    torch.testing.assert_close(out, res[0], rtol=0, atol=0)
    mask = sta_mask(grid, (1, 2, 2), windows, TEXT)
    torch.testing.assert_close(out, reference_attention(q, k, v, mask=mask)[0], rtol=0, atol=3e-6)


def sta_mask(grid, tile, windows, text_len):
    T, H, W = grid
    i = torch.arange(T * H * W)
    tc = torch.stack([i // (H * W), (i // W) % H, i % W], 1) // torch.tensor(tile)
    n = [-(-g // t) for g, t in zip(grid, tile)]
    S = T * H * W + text_len
    out = torch.ones(1, len(windows), S, S, dtype=torch.bool)
    for hi, w in enumerate(windows):
        keep = torch.ones(len(i), len(i), dtype=torch.bool)
        for ax in range(3):
            ww = min(w[ax], n[ax])
            start = (tc[:, ax] - (ww - 1) // 2).clamp(min=0).clamp(max=n[ax] - ww)
            keep &= (tc[:, ax].view(1, -1) >= start.view(-1, 1)) & (tc[:, ax].view(1, -1) < start.view(-1, 1) + ww)
        out[0, hi, : len(i), : len(i)] = keep
    return out


# ------------------------------------------------------------------------------------------------
# dense phases through the step / layer metadata


def _dense_ref(q, k, v):
    return reference_attention(q, k, v)[0]


def test_sta_skip_time_steps(strategy_file):
    q, k, v = qkv(seed=2)
    impl = get_impl(B.SLIDING_TILE_ATTN)
    cfg = config_for(B.SLIDING_TILE_ATTN, strategy_file, skip_time_steps=3)
    for step, dense in ((0, True), (2, True), (3, False), (None, False)):
        last_stats.clear()
        out, _ = impl(q, k, v, call(step=step, layer_idx=0), cfg)
        st = last_stats["sliding_tile_attn/layer0"]
        assert st["dense"] is dense, step
        if dense:
            torch.testing.assert_close(out, _dense_ref(q, k, v), rtol=0, atol=3e-6)
            assert "skip_time_steps" in st["reason"]
        else:
            assert st["kept_fraction"] < 1
    assert validate_backend_config(B.SLIDING_TILE_ATTN, {"mask_strategy_file_path": "x.json"})["skip_time_steps"] == 15


def test_vmoba_first_full_step_and_layer_cycle():
    q, k, v = qkv(seed=3)
    impl = get_impl(B.VMOBA_ATTN)
    cfg = validate_backend_config(
        B.VMOBA_ATTN,
        {"first_full_step": 2, "first_full_layer": 1, "temporal_layer": 1, "spatial_layer": 1, "st_layer": 2},
    )
    last_stats.clear()
    out, _ = impl(q, k, v, call(step=1, layer_idx=4), cfg)
    assert last_stats["vmoba_attn/layer4"]["dense"] and "first_full_step" in last_stats["vmoba_attn/layer4"]["reason"]
    torch.testing.assert_close(out, _dense_ref(q, k, v), rtol=0, atol=3e-6)
    out, _ = impl(q, k, v, call(step=2, layer_idx=0), cfg)
    assert last_stats["vmoba_attn/layer0"]["dense"] and "first_full_layer" in last_stats["vmoba_attn/layer0"]["reason"]
    torch.testing.assert_close(out, _dense_ref(q, k, v), rtol=0, atol=3e-6)
    modes = []
    for layer in range(1, 7):
        impl(q, k, v, call(step=2, layer_idx=layer), cfg)
        modes.append(last_stats[f"vmoba_attn/layer{layer}"]["mode"])
    assert modes == ["temporal", "spatial", "st", "st", "temporal", "spatial"]
    assert validate_backend_config(B.VMOBA_ATTN, {})["first_full_step"] == 12
    with pytest.raises(AttentionConfigError, match="must be > 0"):
        impl(
            q,
            k,
            v,
            call(step=20, layer_idx=0),
            validate_backend_config(B.VMOBA_ATTN, {"temporal_layer": 0, "spatial_layer": 0, "st_layer": 0}),
        )


def test_svg2_first_full_steps():
    q, k, v = qkv(seed=4)
    impl = get_impl(B.SPARSE_VIDEO_GEN_2_ATTN)
    cfg = validate_backend_config(
        B.SPARSE_VIDEO_GEN_2_ATTN,
        {"first_full_steps": 1, "num_q_clusters": 4, "num_k_clusters": 4, "top_p": 0.3, "error_budget": 0.0},
    )
    last_stats.clear()
    out, _ = impl(q, k, v, call(step=0), cfg)
    assert last_stats["sparse_video_gen_2_attn/layer0"]["dense"]
    torch.testing.assert_close(out, _dense_ref(q, k, v), rtol=0, atol=3e-6)
    impl(q, k, v, call(step=1), cfg)
    assert not last_stats["sparse_video_gen_2_attn/layer0"]["dense"]


def test_sparge_dense_sdpa_for_shapes_it_does_not_sparsify():
    impl = get_impl(B.SPARGE_ATTN)
    cfg = validate_backend_config(B.SPARGE_ATTN, {"topk": 0.2, "error_budget": 0.0})
    bf = torch.bfloat16
    last_stats.clear()
    q, k, v = qkv(grid=(2, 5, 7), text_len=7, dtype=bf)  # 77 tokens < 128
    out, _ = impl(q, k, v, AttnCall(video_shape=(2, 5, 7), text_len=7), cfg)
    assert last_stats["sparge_attn/layer0"]["dense"] and "< 128" in last_stats["sparge_attn/layer0"]["reason"]
    torch.testing.assert_close(out.float(), _dense_ref(q.float(), k.float(), v.float()), rtol=0, atol=2e-2)
    q, k, v = qkv(grid=(3, 8, 9), text_len=0, dim=32, dtype=bf)  # head dim 32
    out, _ = impl(q, k, v, AttnCall(video_shape=(3, 8, 9)), cfg)
    assert "head dim 32" in last_stats["sparge_attn/layer0"]["reason"]
    torch.testing.assert_close(out.float(), _dense_ref(q.float(), k.float(), v.float()), rtol=0, atol=2e-2)
    q, k, v = qkv(grid=(3, 8, 9), text_len=0, dtype=bf)
    out, _ = impl(q, k[:, :150], v[:, :150], AttnCall(video_shape=(3, 8, 9)), cfg)  # cross-attention shape
    assert "not square" in last_stats["sparge_attn/layer0"]["reason"]
    torch.testing.assert_close(
        out.float(), _dense_ref(q.float(), k[:, :150].float(), v[:, :150].float()), rtol=0, atol=2e-2
    )
    impl(q, k, v, AttnCall(video_shape=(3, 8, 9)), cfg)
    assert not last_stats["sparge_attn/layer0"]["dense"]


def test_sparge_is_fp16_bf16_only():
    impl = get_impl(B.SPARGE_ATTN)
    cfg = validate_backend_config(B.SPARGE_ATTN, {})
    q, k, v = qkv(grid=(3, 8, 9), text_len=0)
    with pytest.raises(AttentionConfigError, match="float16 or bfloat16"):
        impl(q, k, v, AttnCall(video_shape=(3, 8, 9)), cfg)


def _int8_blocks(x, block):
    """Symmetric INT8 quantize-dequantize per (batch, block of ``block`` rows, head), float32."""
    B, S, H, D = x.shape
    xb = x.float().view(B, S // block, block, H, D)
    sc = xb.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-30) / 127.0
    return (torch.round(xb / sc).clamp(-127, 127) * sc).view(B, S, H, D)


def test_sparge_quantizes_kept_blocks_int8_like_sage():
    """At topk=1 every block is kept, and the output is attention over INT8
    Q / INT8 smoothed K per 64-token tile (not exact SDPA); quantize=false is exact."""
    grid = (4, 8, 8)  # whole 4x4x4 tiles: tile order only permutes tokens
    q, k, v = qkv(grid=grid, text_len=0, heads=2, dim=64, dtype=torch.bfloat16, seed=3)
    impl = get_impl(B.SPARGE_ATTN)
    c = AttnCall(video_shape=grid)
    exact = _dense_ref(q.float(), k.float(), v.float())
    out_q, _ = impl(q, k, v, c, validate_backend_config(B.SPARGE_ATTN, {"topk": 1.0, "error_budget": 0.0}))
    out_x, _ = impl(
        q, k, v, c, validate_backend_config(B.SPARGE_ATTN, {"topk": 1.0, "quantize": False, "error_budget": 0.0})
    )
    err_q = float((out_q.float() - exact).norm() / exact.norm())
    err_x = float((out_x.float() - exact).norm() / exact.norm())
    assert err_x < 5e-3 < err_q < 5e-2, (err_x, err_q)
    # the expected quantization, built independently: tile order, per-tile INT8 of q and of k minus its mean
    from ditattn.attention.sparse.tiling import make_tile_layout, tile, untile

    lay = make_tile_layout(grid, (4, 4, 4), 0)
    qt, kt = tile(q, lay).float(), tile(k, lay).float()
    kt = kt - kt.mean(dim=1, keepdim=True)
    qd = untile(_int8_blocks(qt, 64).to(torch.bfloat16), lay)
    kd = untile(_int8_blocks(kt, 64).to(torch.bfloat16), lay)
    want = _dense_ref(qd.float(), kd.float(), v.float())
    torch.testing.assert_close(out_q.float(), want, rtol=0, atol=2e-2)
    assert float((out_q.float() - want).norm() / want.norm()) < 5e-3 < err_q


def test_sparge_cdfthreshd_config():
    """cdfthreshd: validated like the other keys (unset by default); the backend's plan is the planner's
    (bf16, exact and INT8 kept blocks; topk the floor) and its statistics count the varying rows."""
    for bad in (0.0, 1.5, -0.2, "high"):
        with pytest.raises(AttentionConfigError, match=r"'cdfthreshd'.*accepted: a number in \(0, 1\]"):
            validate_backend_config(B.SPARGE_ATTN, {"cdfthreshd": bad})
    cfg = validate_backend_config(B.SPARGE_ATTN, {})
    assert cfg["cdfthreshd"] is None and cfg["topk"] == 0.5
    grid = (4, 8, 8)
    q, k, v = qkv(grid=grid, text_len=TEXT, heads=2, dim=64, dtype=torch.bfloat16, seed=4)
    impl = get_impl(B.SPARGE_ATTN)
    c = AttnCall(video_shape=grid, text_len=TEXT, layer_idx=0)
    for quant, topk in ((False, 0.2), (True, 0.5)):
        cfg = {"cdfthreshd": 0.9, "quantize": quant, "error_budget": 0.0} | ({"topk": topk} if topk != 0.5 else {})
        out, _ = impl(q, k, v, c, validate_backend_config(B.SPARGE_ATTN, cfg))
        want = sparge_attention(q, k, v, video_shape=grid, cdfthreshd=0.9, topk=topk, text_len=TEXT, quantize=quant)
        torch.testing.assert_close(out, want[0], rtol=0, atol=0)
        assert float(last_stats["sparge_attn/layer0"]["kept_fraction"]) == pytest.approx(want[2].kept_fraction)


def test_sol_dense_steps_layers_and_dense_backend(monkeypatch):
    q, k, v = qkv(grid=(4, 8, 8), text_len=7, heads=2, dim=128, dtype=torch.bfloat16, seed=5)
    c = dict(video_shape=(4, 8, 8), text_len=7)
    impl = get_impl(B.SOL_ATTN)
    seen = []

    def fake_functional(q_, k_, v_, *, backend, scale=None, return_lse=False):
        seen.append(backend)
        return reference_attention(q_, k_, v_)[0].to(q_.dtype), None

    import ditattn.attention.functional as functional_mod

    monkeypatch.setattr(functional_mod, "attention", fake_functional)
    cfg = validate_backend_config(
        B.SOL_ATTN,
        {"dense_steps": 2, "dense_layers": "0-2,5", "dense_backend": "sage_attn", "tau": 0.5, "error_budget": 0.0},
    )
    last_stats.clear()
    for step, layer, dense in (
        (0, 7, True),
        (1, 7, True),
        (2, 0, True),
        (2, 2, True),
        (2, 5, True),
        (2, 3, False),
        (None, 4, False),
        (5, None, True),
    ):
        out, _ = impl(q, k, v, AttnCall(step=step, layer_idx=layer, **c), cfg)
        key = f"sol_attn/layer{layer if layer is not None else 0}"
        assert last_stats[key]["dense"] is dense, (step, layer)
        if dense:
            assert seen[-1] == "sage_attn"
    assert len(seen) == 6
    # the sparse path equals the engine (computed in float32 on the same inputs) within bf16 rounding
    out, _ = impl(q, k, v, AttnCall(step=3, layer_idx=3, **c), cfg)
    ref = sol_attention(q.float(), k.float(), v.float(), tau=0.5, **c)[0]
    assert (out.float() - ref).abs().max() < 3e-2


def test_sol_requires_bf16_and_head_dim_128():
    impl = get_impl(B.SOL_ATTN)
    cfg = validate_backend_config(B.SOL_ATTN, {})
    q, k, v = qkv(heads=2, dim=128)
    with pytest.raises(AttentionConfigError, match="bfloat16 q/k/v with head dim 128.*float32"):
        impl(q, k, v, call(step=20, layer_idx=5), cfg)
    q, k, v = qkv(heads=2, dim=64, dtype=torch.bfloat16)
    with pytest.raises(AttentionConfigError, match="head dim 64"):
        impl(q, k, v, call(step=20, layer_idx=5), cfg)
    q, k, v = qkv(grid=(4, 8, 8), heads=2, dim=128, dtype=torch.bfloat16)
    with pytest.raises(AttentionConfigError, match="exact KV sink"):
        impl(
            q,
            k,
            v,
            AttnCall(video_shape=(4, 8, 8), text_len=TEXT, step=20, layer_idx=5),
            validate_backend_config(B.SOL_ATTN, {"sink_start": 250, "sink_tokens": 100}),
        )


# ------------------------------------------------------------------------------------------------
# STA search -> strategy file -> inference


def _sq_errors(q, k, v, cands, tile):
    """Per head: squared L2 error of each candidate vs full attention [H, C], squared norm [H]."""
    full = reference_attention(q, k, v)[0].double()
    errs = []
    for cnd in cands:
        o = sliding_tile_attention(q, k, v, video_shape=GRID, windows=cnd, tile_size=tile, text_len=TEXT)[0].double()
        errs.append(((o - full) ** 2).sum(dim=(0, 1, 3)))
    return torch.stack(errs, 1), (full**2).sum(dim=(0, 1, 3))


@pytest.mark.parametrize("mode", ["STA_searching", "STA_tuning"])
def test_sta_search_writes_strategy_that_inference_loads(tmp_path, mode):
    path = str(tmp_path / "found.json")
    reset_sta_search()
    cands = [[1, 1, 1], [1, 3, 3], [3, 1, 3], [3, 3, 1]]
    flat = [x for c in cands for x in c]
    tile = (1, 2, 2)
    impl = get_impl(B.SLIDING_TILE_ATTN)
    cfg = validate_backend_config(
        B.SLIDING_TILE_ATTN,
        {
            "mask_strategy_file_path": path,
            "sta_mode": mode,
            "skip_time_steps": 1,
            "window_candidates": flat,
            "tile_size": list(tile),
        },
    )
    inputs = {}
    last_stats.clear()
    for step in (0, 1, 2):
        for layer in (0, 1):
            q, k, v = qkv(heads=3, dim=16, seed=10 * step + layer)
            inputs[(step, layer)] = (q, k, v)
            out, _ = impl(q, k, v, call(step=step, layer_idx=layer), cfg)
            torch.testing.assert_close(out, _dense_ref(q, k, v), rtol=0, atol=3e-6)  # search returns full attention
            assert last_stats[f"sliding_tile_attn/layer{layer}"]["dense"]
    flush_sta_search(path)
    data = json.loads(open(path).read())
    assert sorted(data) == sorted(f"{s}_{l}_{h}" for s in (1, 2) for l in (0, 1) for h in range(3))
    errors = json.loads(open(path + ".errors.json").read())
    assert errors["candidates"] == cands and errors["mode"] == mode
    chosen = set()
    for layer in (0, 1):
        sq = {s: _sq_errors(*inputs[(s, layer)], cands, tile) for s in (1, 2)}
        for h in range(3):
            for s in (1, 2):
                rel = (sq[s][0][h] / sq[s][1][h]).sqrt()
                torch.testing.assert_close(
                    torch.tensor(errors["relative_l2_error"][f"{s}_{layer}_{h}"], dtype=torch.float64),
                    rel,
                    rtol=1e-4,
                    atol=1e-7,
                )
                if mode == "STA_searching":
                    expect = cands[int(rel.argmin())]
                else:  # one window per (layer, head): lowest error pooled over the calibrated steps
                    pooled = (sq[1][0][h] + sq[2][0][h]) / (sq[1][1][h] + sq[2][1][h])
                    expect = cands[int(pooled.argmin())]
                assert data[f"{s}_{layer}_{h}"] == expect
                chosen.add(tuple(expect))
    assert len(chosen) > 1  # the calibration actually discriminates between candidates
    # inference loads the file
    inf = validate_backend_config(
        B.SLIDING_TILE_ATTN, {"mask_strategy_file_path": path, "skip_time_steps": 1, "tile_size": list(tile)}
    )
    q, k, v = qkv(heads=3, dim=16, seed=99)
    out, _ = impl(q, k, v, call(step=2, layer_idx=1), inf)
    windows = [data[f"2_1_{h}"] for h in range(3)]
    torch.testing.assert_close(
        out, reference_attention(q, k, v, mask=sta_mask(GRID, tile, windows, TEXT))[0], rtol=0, atol=3e-6
    )
    assert last_stats["sliding_tile_attn/layer1"]["windows"] == windows
    reset_sta_search()


def test_sta_tuning_pools_steps():
    from ditattn.attention.sparse.sta import StaSearch

    s = StaSearch("/unused.json", "STA_tuning", [(1, 1, 1), (3, 3, 3)])
    # step 1 prefers candidate 0, step 2 prefers candidate 1 strongly: pooled -> candidate 1
    s.record(1, 0, 0, torch.tensor([[1.0, 2.0]]), torch.tensor([10.0]), [1, 27])
    s.record(2, 0, 0, torch.tensor([[9.0, 1.0]]), torch.tensor([10.0]), [1, 27])
    assert s.strategy() == {(1, 0, 0): (3, 3, 3), (2, 0, 0): (3, 3, 3)}
    s.mode = "STA_searching"
    assert s.strategy() == {(1, 0, 0): (1, 1, 1), (2, 0, 0): (3, 3, 3)}
    # ties go to the candidate keeping fewer tiles
    t = StaSearch("/unused.json", "STA_searching", [(3, 3, 3), (1, 1, 1)])
    t.record(0, 0, 0, torch.tensor([[0.0, 0.0]]), torch.tensor([1.0]), [27, 1])
    assert t.strategy() == {(0, 0, 0): (1, 1, 1)}


def test_sta_strategy_file_errors(tmp_path, strategy_file):
    impl = get_impl(B.SLIDING_TILE_ATTN)
    q, k, v = qkv(heads=4, dim=16)
    with pytest.raises(AttentionConfigError, match="mask strategy file not found"):
        impl(q, k, v, call(step=20), config_for(B.SLIDING_TILE_ATTN, str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1_2": [1, 1, 1]}))
    with pytest.raises(AttentionConfigError, match="bad key '1_2'"):
        impl(q, k, v, call(step=20), config_for(B.SLIDING_TILE_ATTN, str(bad)))
    bad.write_text(json.dumps({"1_0_0": [1, 0, 1]}))
    with pytest.raises(AttentionConfigError, match="bad window"):
        impl(q, k, v, call(step=20), config_for(B.SLIDING_TILE_ATTN, str(bad)))
    with pytest.raises(AttentionConfigError, match="no window for layer 7, head 0"):
        impl(q, k, v, call(step=20, layer_idx=7), config_for(B.SLIDING_TILE_ATTN, strategy_file))
    # step lookup: the latest stored step <= the requested one (step 5 -> entries of step 0)
    last_stats.clear()
    impl(q, k, v, call(step=19, layer_idx=1), config_for(B.SLIDING_TILE_ATTN, strategy_file, skip_time_steps=0))
    assert last_stats["sliding_tile_attn/layer1"]["windows"][1] == [1, 3, 3]


# ------------------------------------------------------------------------------------------------
# config: every parameter valid and invalid; defaults as upstream (SGLang) documents them

VALID = {
    B.SLIDING_TILE_ATTN: {
        "mask_strategy_file_path": "/x/s.json",
        "sta_mode": "STA_searching",
        "skip_time_steps": 0,
        "tile_size": [2, 4, 4],
        "window_candidates": [1, 3, 3, 3, 3, 3],
    },
    B.VIDEO_SPARSE_ATTN: {"sparsity": 0.9, "edge_tiles": "padded"},
    B.SPARGE_ATTN: {
        "topk": 1.0,
        "block_size": 128,
        "edge_tiles": "padded",
        "predictor": "pooled_query_var",
        "simthreshd1": 0.6,
    },
    B.VMOBA_ATTN: {
        "temporal_chunk_size": 2,
        "temporal_topk": 3,
        "spatial_chunk_size": [3, 4],
        "spatial_topk": 20,
        "st_chunk_size": [4, 6, 4],
        "st_topk": 15,
        "moba_select_mode": "topk",
        "moba_threshold": 1.0,
        "moba_threshold_type": "head_global",
        "first_full_step": 0,
        "first_full_layer": 2,
        "temporal_layer": 0,
        "spatial_layer": 2,
        "st_layer": 1,
        "gate": "mean",
    },
    B.SOL_ATTN: {
        "tau": 2.5,
        "thresh_type": "exact",
        "sink_tokens": 256,
        "sink_start": 10,
        "dense_steps": 0,
        "dense_layers": "0-2",
        "dense_backend": "sage_attn",
        "kv_splits": 4,
        "edge_tiles": "padded",
        "predictor": "pooled",
        "centroid_variance": False,
        "dense_above": 0.75,
        "min_seq_len": 8192,
    },
    B.SLA_ATTN: {"topk": 0.1, "negligible_fraction": 0.5, "block_size": 32, "edge_tiles": "packed"},
    B.SAGE_SLA_ATTN: {"topk": 1.0, "negligible_fraction": 0.0, "block_size": 128},
    B.SPARSE_VIDEO_GEN_2_ATTN: {
        "num_q_clusters": 8,
        "num_k_clusters": 16,
        "kmeans_iters": 1,
        "top_p": 1.0,
        "first_full_steps": 3,
        "predictor": "centroids",
    },
}

INVALID = [
    (B.SLIDING_TILE_ATTN, "mask_strategy_file_path", ["a.json"]),
    (B.SLIDING_TILE_ATTN, "sta_mode", "STA_fast"),
    (B.SLIDING_TILE_ATTN, "skip_time_steps", -1),
    (B.SLIDING_TILE_ATTN, "skip_time_steps", 1.5),
    (B.SLIDING_TILE_ATTN, "tile_size", [4, 4]),
    (B.SLIDING_TILE_ATTN, "tile_size", [0, 4, 4]),
    (B.SLIDING_TILE_ATTN, "window_candidates", [1, 3]),
    (B.VIDEO_SPARSE_ATTN, "sparsity", -0.1),
    (B.VIDEO_SPARSE_ATTN, "sparsity", 1.5),
    (B.VIDEO_SPARSE_ATTN, "sparsity", "high"),
    (B.VIDEO_SPARSE_ATTN, "edge_tiles", "merged"),
    (B.SPARGE_ATTN, "edge_tiles", True),
    (B.SOL_ATTN, "edge_tiles", "pad"),
    (B.SAGE_SLA_ATTN, "edge_tiles", ""),
    (B.SPARGE_ATTN, "topk", 0.0),
    (B.SPARGE_ATTN, "topk", 1.01),
    (B.SPARGE_ATTN, "block_size", 48),
    (B.SPARGE_ATTN, "predictor", "antidiagonal"),
    (B.SPARGE_ATTN, "simthreshd1", 1.5),
    (B.SPARGE_ATTN, "simthreshd1", "high"),
    (B.VMOBA_ATTN, "temporal_chunk_size", 0),
    (B.VMOBA_ATTN, "temporal_topk", -2),
    (B.VMOBA_ATTN, "spatial_chunk_size", [3]),
    (B.VMOBA_ATTN, "spatial_topk", 0),
    (B.VMOBA_ATTN, "st_chunk_size", [4, 6]),
    (B.VMOBA_ATTN, "st_chunk_size", [4, 0, 4]),
    (B.VMOBA_ATTN, "st_topk", "many"),
    (B.VMOBA_ATTN, "moba_select_mode", "random"),
    (B.VMOBA_ATTN, "moba_threshold", 0.0),
    (B.VMOBA_ATTN, "moba_threshold", 1.5),
    (B.VMOBA_ATTN, "moba_threshold_type", "per_token"),
    (B.VMOBA_ATTN, "gate", "max"),
    (B.VMOBA_ATTN, "first_full_step", -1),
    (B.VMOBA_ATTN, "first_full_layer", -1),
    (B.VMOBA_ATTN, "temporal_layer", -1),
    (B.VMOBA_ATTN, "spatial_layer", 1.5),
    (B.VMOBA_ATTN, "st_layer", -3),
    (B.SOL_ATTN, "tau", 0.0),
    (B.SOL_ATTN, "tau", -1.0),
    (B.SOL_ATTN, "thresh_type", "approx"),
    (B.SOL_ATTN, "sink_tokens", -1),
    (B.SOL_ATTN, "sink_start", -5),
    (B.SOL_ATTN, "dense_steps", -1),
    (B.SOL_ATTN, "dense_layers", "a,b"),
    (B.SOL_ATTN, "dense_layers", "3-1"),
    (B.SOL_ATTN, "dense_backend", "torch_sdpa"),
    (B.SOL_ATTN, "kv_splits", 0),
    (B.SOL_ATTN, "kv_splits", "many"),
    (B.SOL_ATTN, "predictor", "pooled_query_var"),
    (B.SOL_ATTN, "centroid_variance", "yes"),
    (B.SLA_ATTN, "topk", 0.0),
    (B.SLA_ATTN, "negligible_fraction", 1.0),
    (B.SLA_ATTN, "negligible_fraction", -0.1),
    (B.SLA_ATTN, "block_size", 100),
    (B.SAGE_SLA_ATTN, "topk", 2.0),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "num_q_clusters", 0),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "num_k_clusters", -1),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "kmeans_iters", 0),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "top_p", 0.0),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "top_p", 1.2),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "first_full_steps", -1),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "predictor", "pooled"),
    (B.SPARGE_ATTN, "dense_above", 0.0),
    (B.SOL_ATTN, "dense_above", 1.5),
    (B.VMOBA_ATTN, "min_seq_len", -1),
    (B.SPARSE_VIDEO_GEN_2_ATTN, "min_seq_len", "long"),
]


@pytest.mark.parametrize("backend", list(VALID))
def test_every_parameter_valid(backend):
    got = validate_backend_config(backend, VALID[backend])
    for key, val in VALID[backend].items():
        assert got[key] == val, key
    # the same values through the k=v CLI syntax
    text = ",".join(f"{k_}={json.dumps(v_) if isinstance(v_, list) else v_}" for k_, v_ in VALID[backend].items())
    assert validate_backend_config(backend, parse_attention_backend_config(text)) == got


@pytest.mark.parametrize("backend,key,value", INVALID)
def test_every_parameter_invalid(backend, key, value):
    raw = {"mask_strategy_file_path": "/x/s.json"} if backend is B.SLIDING_TILE_ATTN else {}
    raw[key] = value
    with pytest.raises(AttentionConfigError, match=f"'{key}'.*accepted"):
        validate_backend_config(backend, raw)


@pytest.mark.parametrize("backend", SPARSE)
def test_unknown_key_rejected(backend):
    raw = {"mask_strategy_file_path": "/x/s.json"} if backend is B.SLIDING_TILE_ATTN else {}
    raw["not_a_key"] = 1
    with pytest.raises(AttentionConfigError, match="unknown config key.*not_a_key"):
        validate_backend_config(backend, raw)


def test_predictor_choices_match_the_planners():
    """The schemas' choice lists are the planners' own (a new predictor needs both)."""
    from ditattn.attention import schemas
    from ditattn.attention.sparse import sol, sparge, svg2, vmoba

    assert schemas.SPARGE_PREDICTORS == sparge.SPARGE_PREDICTORS
    assert schemas.SOL_PREDICTORS == sol.SOL_PREDICTORS
    assert schemas.VMOBA_GATES == vmoba.VMOBA_GATES
    assert schemas.SVG2_PREDICTORS == svg2.SVG2_PREDICTORS


def test_seed_defaults():
    with pytest.raises(AttentionConfigError, match="'mask_strategy_file_path' is required"):
        validate_backend_config(B.SLIDING_TILE_ATTN, {})
    sta = validate_backend_config(B.SLIDING_TILE_ATTN, {"mask_strategy_file_path": "s.json"})
    assert (sta["sta_mode"], sta["skip_time_steps"]) == ("STA_inference", 15)
    assert validate_backend_config(B.VIDEO_SPARSE_ATTN, {})["sparsity"] == 0.0
    assert validate_backend_config(B.SPARGE_ATTN, {})["topk"] == 0.5
    vm = validate_backend_config(B.VMOBA_ATTN, {})
    assert {
        k_: vm[k_]
        for k_ in (
            "moba_select_mode",
            "moba_threshold",
            "moba_threshold_type",
            "first_full_step",
            "first_full_layer",
            "temporal_layer",
            "spatial_layer",
            "st_layer",
        )
    } == {
        "moba_select_mode": "threshold",
        "moba_threshold": 0.25,
        "moba_threshold_type": "query_head",
        "first_full_step": 12,
        "first_full_layer": 0,
        "temporal_layer": 1,
        "spatial_layer": 1,
        "st_layer": 1,
    }
    assert all(
        vm[k_] is None
        for k_ in (
            "temporal_chunk_size",
            "temporal_topk",
            "spatial_chunk_size",
            "spatial_topk",
            "st_chunk_size",
            "st_topk",
        )
    )
    sol = validate_backend_config(B.SOL_ATTN, {})
    assert sol == {
        "tau": 1.0,
        "thresh_type": "diag",
        "sink_tokens": 0,
        "sink_start": 0,
        "dense_steps": 10,
        "dense_layers": "0,1",
        "dense_backend": "fa",
        "kv_splits": "auto",
        "predictor": "pooled_query",
        "centroid_variance": True,
        "block_size": 64,
        "edge_tiles": "packed",
        "block_sparse_impl": "auto",
        "error_budget": 0.01,
        "max_rel_err": 0.045,
        "dense_above": 0.6,
        "min_seq_len": None,
    }
    for backend in (B.VIDEO_SPARSE_ATTN, B.SPARGE_ATTN, B.SLA_ATTN, B.SAGE_SLA_ATTN):
        assert validate_backend_config(backend, {})["edge_tiles"] == "packed"
    for backend in (B.VMOBA_ATTN, B.SPARSE_VIDEO_GEN_2_ATTN):  # chunks / clusters are their unit: no packing
        assert "edge_tiles" not in validate_backend_config(backend, {})
    assert "edge_tiles" not in sta


def test_backends_accept_partial_config_and_fill_defaults():
    q, k, v = qkv(seed=6)
    last_stats.clear()
    get_impl(B.VIDEO_SPARSE_ATTN)(q, k, v, call(), {"sparsity": 0.5})
    assert last_stats["video_sparse_attn/layer0"]["tiles_per_query"] == 2  # 1x2x2 tiles of 4x4x4: ceil(0.5 * 4)
    with pytest.raises(AttentionConfigError, match="required"):
        get_impl(B.SLIDING_TILE_ATTN)(q, k, v, call(), {})


def test_vsa_sparsity_zero_is_exact_dense_attention():
    from ditattn.attention.backends.base import reference_attention

    q, k, v = qkv(grid=(3, 8, 9), text_len=TEXT)
    c = AttnCall(video_shape=(3, 8, 9), text_len=TEXT, step=0, layer_idx=0, layer_key="vsa0")
    last_stats.clear()
    out, _ = get_impl(B.VIDEO_SPARSE_ATTN)(q, k, v, c, validate_backend_config(B.VIDEO_SPARSE_ATTN, {}))
    ref, _ = reference_attention(q, k, v, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert last_stats["vsa0"]["dense"] is True and "every tile" in last_stats["vsa0"]["reason"]
