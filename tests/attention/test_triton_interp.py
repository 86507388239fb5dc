"""The in-tree Triton kernels, run in the Triton interpreter on CPU (tiny shapes).

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports Triton when no GPU is
present; on a CUDA machine these tests skip (tests/attention/test_gpu_kernels.py covers the compiled kernels).

The interpreter of triton 3.7 mishandles conversions the kernels rely on (bf16 ``tl.dot`` on raw
bits, float32 -> bf16 truncation, fp8 subnormals); ``ditattn.attention.kernels.interpreter_dtypes``
fixes them for the product's CPU path, enabled by the kernels' device check — these tests run
without any patch of their own, so they also check that it is enabled.
"""

import math
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests run on CPU-only machines"
)

triton = pytest.importorskip("triton")

from ditattn.attention.backends.base import reference_attention  # noqa: E402
from ditattn.errors import AttentionConfigError  # noqa: E402


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _sdpa_error(q, k, v):
    """Relative error of plain PyTorch SDPA in q's dtype against float64 on these inputs: the yardstick."""
    rep = q.shape[2] // k.shape[2]
    k2, v2 = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2))
    ref, _ = reference_attention(q, k2, v2, dtype=torch.float64)
    return rel(out.transpose(1, 2), ref)


def _rand(*shape, dtype, gen, shift=0.0):
    return (torch.randn(*shape, generator=gen) + shift).to(dtype)


# ------------------------------------------------------------------------------------------------
# block-sparse


@pytest.mark.parametrize(
    "dtype,kv_per_iter,gqa,tma,ws",
    [
        (torch.float16, 1, False, False, False),
        (torch.bfloat16, 2, True, False, False),
        (torch.bfloat16, 1, True, True, False),
        (torch.bfloat16, 1, False, True, True),
    ],
)
def test_block_sparse_matches_reference(dtype, kv_per_iter, gqa, tma, ws):
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.attention.sparse.block_sparse import block_mask_to_lists, block_sparse_attention

    g = torch.Generator().manual_seed(11 + kv_per_iter)
    B, S, H, D, bs = 2, 160, 2, 32, 32
    hkv = 1 if gqa else H
    q, k, v = (_rand(B, S, h, D, dtype=dtype, gen=g) for h in (H, hkv, hkv))
    nq = S // bs
    bm = torch.rand(B, H, nq, nq, generator=g) < 0.5
    bm[0, 1, 2] = False  # a query block with no key block: zeros and LSE -inf
    bm[1, 0, 3] = True
    idx, cnt = block_mask_to_lists(bm)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, -7:] = False
    valid[0, bs + 3 : bs + 9] = False  # padding inside a key block (tile layouts pad many blocks)
    valid[1, 2 * bs : 3 * bs] = False  # a key block that is all padding
    o, lse = block_sparse_attention_triton(
        q,
        k,
        v,
        idx,
        cnt,
        block_size=bs,
        kv_valid=valid,
        return_lse=True,
        config={"kv_per_iter": kv_per_iter, "tma": tma, "warp_specialize": ws},
    )
    ro, rl = block_sparse_attention(
        q.double(), k.double(), v.double(), idx, cnt, block_size=bs, kv_valid=valid, return_lse=True, impl="reference"
    )
    assert torch.isfinite(o.float()).all()
    assert rel(o, ro) <= 2 * _sdpa_error(q, k, v) + 1e-4
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse))
    assert (lse[fin] - rl[fin]).abs().max() < 1e-2
    assert (o[0, 2 * bs : 3 * bs, 1] == 0).all()


@pytest.mark.parametrize("has_var", [False, True])
def test_block_centroid_kernel_matches_torch(has_var):
    """Virtual keys with log-weights and a per-query-block route, no initial state: equal to a
    float64 masked softmax; a query block with no routed key gives zeros and LSE -inf; NV is not a
    multiple of the key chunk; with ``kvar`` the score gains 0.5 * scale^2 * q^2 . kvar_j."""
    from ditattn.attention.kernels.block_centroid import block_centroid_attention

    g = torch.Generator().manual_seed(5)
    B, H, D, bs, nb, NV = 1, 2, 32, 16, 4, 37
    q = _rand(B, nb * bs, H, D, dtype=torch.bfloat16, gen=g)
    kc, vc = (_rand(B, H, NV, D, dtype=torch.bfloat16, gen=g) for _ in range(2))
    logw = torch.rand(NV, generator=g) * 3
    approx = torch.rand(B, H, nb, NV, generator=g) < 0.6
    approx[0, 1, 2] = False
    kvar = torch.rand(B, H, NV, D, generator=g) * 2 if has_var else None
    out, lse = block_centroid_attention(q, kc, vc, logw, approx, block_size=bs, scale=D**-0.5, block_n=16, kvar=kvar)
    s = torch.einsum("bphd,bhnd->bhpn", q.double(), kc.double()) * D**-0.5 + logw.double()
    if has_var:
        s = s + 0.5 / D * torch.einsum("bphd,bhnd->bhpn", q.double() ** 2, kvar.bfloat16().double())
    s = s.masked_fill(~approx.repeat_interleave(bs, dim=2), float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - ref_lse[..., None]))
    ref = torch.einsum("bhpn,bhnd->bphd", p, vc.double())
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and not fin[0, 1, 2 * bs : 3 * bs].any()
    assert (out[0, 2 * bs : 3 * bs, 1] == 0).all()
    assert rel(out, ref) < 1e-2 and (lse[fin] - ref_lse[fin]).abs().max() < 1e-2


@pytest.mark.parametrize("variance", [False, True])
def test_pooled_query_block_scores_kernel_matches_torch(variance):
    """The selection kernel of sparge_attn's pooled_query predictor against its PyTorch path in
    float64: a partial edge tile (padding keys masked), a query count that is not a multiple of the
    kernel's chunk, with and without the variance term."""
    from ditattn.attention.sparse.block_scores import pooled_query_block_scores
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    g = torch.Generator().manual_seed(8)
    grid = (3, 8, 6)  # 4x4x4 tiles: 1 x 2 x 2 tiles, all partial in T and W
    lay = make_tile_layout(grid, (4, 4, 4))
    q, k = (_rand(1, 144, 2, 32, dtype=torch.bfloat16, gen=g, shift=0.3) for _ in range(2))
    qt, kt = tile(q, lay), tile(k, lay)
    got = pooled_query_block_scores(qt, kt, lay, 32**-0.5, variance=variance, impl="triton")
    want = pooled_query_block_scores(qt.double(), kt.double(), lay, 32**-0.5, variance=variance, impl="reference")
    assert got.dtype == torch.float32 and got.shape == want.shape == (1, 2, 4, 4)
    assert (got.double() - want).abs().max() < 3e-2
    from ditattn.attention.kernels.block_scores import pooled_query_lse

    with pytest.raises(AttentionConfigError, match="block_size"):
        pooled_query_lse(
            torch.zeros(1, 2, 4, 32), None, kt[:, :96], torch.ones(96, dtype=torch.bool), block_size=48, scale=1.0
        )


def test_sage_sla_triton_path_matches_reference_path():
    """sage_sla on the Triton path (fused quantization + block-sparse kernel, bf16) against the
    PyTorch quantization + float64 reference kernel on the same inputs."""
    from ditattn.attention.sparse.sla import sla_attention

    grid, text_len = (4, 8, 8), 5
    g = torch.Generator().manual_seed(9)
    q, k, v = (_rand(1, 256 + text_len, 2, 32, dtype=torch.bfloat16, gen=g) for _ in range(3))
    kw = dict(video_shape=grid, text_len=text_len, topk=0.4, negligible_fraction=0.25, block_size=32, quantize=True)
    out, _, plan = sla_attention(q, k, v, impl="triton", **kw)
    ro, _, rplan = sla_attention(q, k, v, impl="reference", **kw)
    assert torch.equal(plan.extra["critical"], rplan.extra["critical"])
    from ditattn.attention.sparse.block_sparse import kept_fraction

    nb = plan.layout.n_blocks  # the host-side fractions equal what the lists and masks hold
    assert abs(plan.kept_fraction - kept_fraction(plan.kv_counts, nb)) < 1e-12
    assert abs(plan.extra["marginal_fraction"] - float(plan.extra["marginal"].sum()) / (2 * nb * nb)) < 1e-12
    assert rel(out, ro) <= 2 * _sdpa_error(q, k, v) + 1e-3


def test_sparse_triton_paths_under_inference_mode():
    """The pipelines run under torch.inference_mode (tensors without version counters): the Triton
    paths of VSA, SLA and Sol, with padded tile layouts, run there and equal their results outside."""
    from ditattn.attention.sparse.sla import sla_attention
    from ditattn.attention.sparse.sol import sol_attention
    from ditattn.attention.sparse.vsa import video_sparse_attention

    grid = (3, 5, 11)  # a grid no other test uses: its tile layout (cached) is first built in inference mode
    g = torch.Generator().manual_seed(4)
    q, k, v = (_rand(1, 165, 2, 32, dtype=torch.bfloat16, gen=g) for _ in range(3))
    runs = [
        lambda: video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.5, impl="triton")[0],
        lambda: sla_attention(q, k, v, video_shape=grid, topk=0.4, block_size=32, quantize=True, impl="triton")[0],
        lambda: sol_attention(q, k, v, video_shape=grid, tau=0.5, impl="triton")[0],
    ]
    for run in runs:
        with torch.inference_mode():
            inside = run()
            again = run()
        outside = run()
        assert torch.equal(inside, outside) and torch.equal(again, outside)
    from ditattn.attention.kernels import block_sparse_triton as bst
    from ditattn.attention.sparse.tiling import make_tile_layout

    with torch.inference_mode():  # the layout's cached key mask is an ordinary tensor: per-plan caches work
        kvv = make_tile_layout(grid, (4, 4, 4), edge_tiles="packed").kv_valid(1)  # the default layout
        assert kvv is not None and not kvv.is_inference()
        assert any(k[0] == id(kvv) for k in bst._VALID_CACHE)


@pytest.mark.parametrize("backend", ["vsa", "sol"])
def test_packed_edge_tiles_on_the_triton_kernels(backend):
    """A packed layout (16-token edge tiles four to a block, a 32-token partial block, a padded text
    block): the Triton block-sparse kernel (and Sol's centroid kernel) against the reference kernel on
    the same plan."""
    from ditattn.attention.sparse.sol import sol_attention
    from ditattn.attention.sparse.vsa import video_sparse_attention

    grid, text_len = (5, 8, 12), 5
    g = torch.Generator().manual_seed(21)
    S = grid[0] * grid[1] * grid[2] + text_len
    q, k, v = (_rand(1, S, 2, 32, dtype=torch.bfloat16, gen=g) for _ in range(3))
    if backend == "vsa":
        run = lambda impl: video_sparse_attention(
            q,
            k,
            v,
            video_shape=grid,
            sparsity=0.5,
            text_len=text_len,  # noqa: E731
            return_lse=True,
            impl=impl,
        )
    else:
        run = lambda impl: sol_attention(
            q,
            k,
            v,
            video_shape=grid,
            text_len=text_len,
            tau=0.5,  # noqa: E731
            return_lse=True,
            impl=impl,
        )
    out, lse, plan = run("triton")
    ro, rl, rplan = run("reference")
    lay = plan.layout
    assert lay.edge_tiles == "packed" and lay.n_packed_blocks == 2 and lay.n_video_blocks == 8
    assert sorted(lay.block_count.tolist()) == [5, 32, 64, 64, 64, 64, 64, 64, 64]
    assert torch.equal(plan.kv_indices, rplan.kv_indices) and torch.equal(plan.kv_counts, rplan.kv_counts)
    assert rel(out, ro) <= 2 * _sdpa_error(q, k, v) + 1e-4
    assert (lse - rl).abs().max() < 2e-2


@pytest.mark.parametrize("predictor,centroid_variance", [("pooled_query", True), ("pooled", False)])
def test_sol_fused_centroids_match_float32_path(predictor, centroid_variance):
    """sol_attention with impl="triton": block-sparse kernel + the fused centroid kernel in bf16
    (with and without the key-variance term), against the float32 PyTorch path on the same
    (bf16-valued) inputs."""
    from ditattn.attention.sparse.sol import sol_attention

    grid, text_len, H, D = (5, 8, 9), 7, 2, 32
    g = torch.Generator().manual_seed(3)
    S = grid[0] * grid[1] * grid[2] + text_len
    q, k, v = (_rand(1, S, H, D, dtype=torch.bfloat16, gen=g) for _ in range(3))
    kw = dict(
        video_shape=grid,
        text_len=text_len,
        tau=0.5,
        sink_start=3,
        sink_tokens=20,
        return_lse=True,
        predictor=predictor,
        centroid_variance=centroid_variance,
    )
    out, lse, plan = sol_attention(q, k, v, impl="triton", **kw)
    ro, rl, rplan = sol_attention(q.double(), k.double(), v.double(), impl="reference", **kw)
    assert torch.equal(plan.extra["exact"], rplan.extra["exact"])
    assert 0 < float(plan.extra["exact"].float().mean()) < 1
    assert rel(out, ro) <= 2 * _sdpa_error(q, k, v) + 1e-4
    assert (lse.double() - rl).abs().max() < 2e-2


@pytest.mark.parametrize("smooth", [False, True])
def test_block_int8_fake_quant_matches_reference(smooth):
    """The one-pass Triton quantize-dequantize equals SageSLA's PyTorch reference on a padded tile
    layout (padding rows zero and excluded from the mean and the block scales)."""
    from ditattn.attention.kernels.block_quant import fake_quant_int8_blocks
    from ditattn.attention.sparse.sla import quantize_blocks_int8
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    layout = make_tile_layout((5, 6, 7), (2, 4, 4), 9)  # 32-token blocks, partial tiles, text
    g = torch.Generator().manual_seed(7 + smooth)
    x = _rand(2, 5 * 6 * 7 + 9, 3, 32, dtype=torch.bfloat16, gen=g, shift=0.5)
    xt = tile(x, layout)
    got = fake_quant_int8_blocks(xt, layout.valid, block_size=layout.block_size, smooth=smooth)
    ref = quantize_blocks_int8(xt, layout, smooth=smooth)[2].to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and (got[:, ~layout.valid] == 0).all()
    same = (got == ref).float().mean().item()
    step = quantize_blocks_int8(xt, layout, smooth=smooth)[1].max().item()
    assert same > 0.999 and (got.float() - ref.float()).abs().max() <= 1.01 * step


def test_block_sparse_broadcast_lists_and_no_lse():
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton

    g = torch.Generator().manual_seed(5)
    B, S, H, D, bs = 1, 128, 2, 32, 64
    q, k, v = (_rand(B, S, H, D, dtype=torch.float16, gen=g) for _ in range(3))
    idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)  # [1, 1, 2, 2] broadcast over heads
    cnt = torch.tensor([[[1, 2]]], dtype=torch.int32)
    o, lse = block_sparse_attention_triton(q, k, v, idx, cnt, block_size=bs)
    assert lse is None
    mask = torch.zeros(S, S, dtype=torch.bool)
    mask[:64, 64:] = True
    mask[64:, :] = True
    ro, _ = reference_attention(q, k, v, mask=mask.view(1, 1, S, S))
    assert rel(o, ro) <= 2 * _sdpa_error(q, k, v) + 1e-4


def test_block_sparse_rejects_bad_input():
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton

    q = torch.randn(1, 96, 2, 32, dtype=torch.float16)
    idx = torch.zeros(1, 2, 3, 1, dtype=torch.int32)
    cnt = torch.ones(1, 2, 3, dtype=torch.int32)
    with pytest.raises(AttentionConfigError, match="block_size 48"):
        block_sparse_attention_triton(q, q, q, idx, cnt, block_size=48)
    with pytest.raises(AttentionConfigError, match="multiples of block_size"):
        block_sparse_attention_triton(q, q, q, idx, cnt, block_size=64)
    with pytest.raises(AttentionConfigError, match="int32"):
        block_sparse_attention_triton(q, q, q, idx.long(), cnt, block_size=32)
    with pytest.raises(AttentionConfigError, match="dtype"):
        block_sparse_attention_triton(q.float(), q.float(), q.float(), idx, cnt, block_size=32)


# ------------------------------------------------------------------------------------------------
# int8 attention


@pytest.mark.parametrize(
    "pv,gran,causal", [("fp16", "token", False), ("fp16", "block", True), ("fp8", "token", False)]
)
def test_int8_attention_kernel(pv, gran, causal):
    from ditattn.attention.kernels.int8_attention import int8_attention, int8_attention_reference

    g = torch.Generator().manual_seed(3)
    B, Sq, Skv, H, Hkv, D = 1, 100, 130 if not causal else 100, 4, 2, 32
    q = _rand(B, Sq, H, D, dtype=torch.bfloat16, gen=g)
    k = _rand(B, Skv, Hkv, D, dtype=torch.bfloat16, gen=g, shift=0.7)  # a key mean for smoothing to remove
    v = _rand(B, Skv, Hkv, D, dtype=torch.bfloat16, gen=g)
    k_before = k.clone()
    o, lse = int8_attention(
        q, k, v, causal=causal, return_lse=True, pv=pv, q_granularity=gran, config={"block_m": 64, "block_n": 64}
    )
    assert torch.equal(k, k_before)  # inputs untouched
    qo, ql = int8_attention_reference(
        q, k, v, causal=causal, return_lse=True, pv=pv, q_granularity=gran, block_m=64, block_n=64
    )
    ro, rl = reference_attention(q, k, v, causal=causal)
    bound = 0.025 if pv == "fp16" else 0.06
    assert rel(o, ro) < bound
    assert rel(o, qo) < 2e-3  # same quantization as the PyTorch reference (fp8: the same key blocks)
    assert (lse - rl).abs().max() < 0.05
    assert (lse - ql).abs().max() < 2e-3


def test_int8_attention_rejects_bad_input():
    from ditattn.attention.kernels.int8_attention import int8_attention

    q = torch.randn(1, 64, 2, 32, dtype=torch.float16)
    with pytest.raises(AttentionConfigError, match="pv"):
        int8_attention(q, q, q, pv="int4")
    with pytest.raises(AttentionConfigError, match="head dim 48"):
        int8_attention(
            torch.randn(1, 64, 2, 48, dtype=torch.float16),
            torch.randn(1, 64, 2, 48, dtype=torch.float16),
            torch.randn(1, 64, 2, 48, dtype=torch.float16),
        )
    with pytest.raises(AttentionConfigError, match="multiple of key/value heads"):
        int8_attention(torch.randn(1, 64, 3, 32, dtype=torch.float16), q, q)


# ------------------------------------------------------------------------------------------------
# skip softmax


def _sinky(B, S, H, D, gen, dtype, a=8.0, n_sink=8):
    """Inputs whose attention concentrates on the first ``n_sink`` keys (an attention sink), so that
    later key tiles carry little softmax mass and skip."""
    u = torch.randn(D, generator=gen)
    u = u / u.norm()
    q = torch.randn(B, S, H, D, generator=gen) + a * u
    k = torch.randn(B, S, H, D, generator=gen)
    k = k - (k @ u)[..., None] * u
    k[:, :n_sink] += a * u
    v = torch.randn(B, S, H, D, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_skip_softmax_dense_path_and_skipping():
    from ditattn.attention.kernels.skip_softmax import skip_softmax_attention, skip_softmax_reference

    g = torch.Generator().manual_seed(7)
    B, S, H, D = 1, 256, 2, 64
    q, k, v = _sinky(B, S, H, D, g, torch.float16)
    cfg = {"block_m": 64, "block_n": 64}
    o, lse, frac = skip_softmax_attention(q, k, v, return_lse=True, allow_any_head_dim=True, config=cfg)
    ro, rl = reference_attention(q, k, v)
    assert float(frac) == 0.0 and rel(o, ro) < 3e-3 and (lse - rl).abs().max() < 1e-2

    o2, lse2, frac2 = skip_softmax_attention(
        q, k, v, threshold_scale_factor=16.0, return_lse=True, allow_any_head_dim=True, config=cfg
    )
    so, sl, sfrac = skip_softmax_reference(
        q, k, v, threshold_scale_factor=16.0, block_m=64, block_n=64, return_lse=True
    )
    assert 0.5 < sfrac < 1.0
    assert abs(float(frac2) - sfrac) <= 1.0 / 32 + 1e-6  # at most one of 32 tile decisions differs
    assert rel(o2, so) < 1e-2
    assert rel(o2, ro) < 0.05  # skipped tiles held little mass
    assert (lse2 - sl).abs().max() < 1e-2


def test_skip_softmax_rejects():
    from ditattn.attention.kernels.skip_softmax import check_skip_softmax_request, skip_softmax_attention

    q = torch.randn(1, 64, 2, 64, dtype=torch.float16)
    with pytest.raises(AttentionConfigError, match="head dim"):
        skip_softmax_attention(q, q, q, threshold_scale_factor=1.0)
    with pytest.raises(AttentionConfigError, match="> 0"):
        skip_softmax_attention(q, q, q, threshold_scale_factor=0.0, allow_any_head_dim=True)
    with pytest.raises(AttentionConfigError, match="dtype"):
        skip_softmax_attention(q.float(), q.float(), q.float(), threshold_scale_factor=1.0, allow_any_head_dim=True)
    for kw, pat in [
        ({"has_mask": True}, "mask"),
        ({"causal": True}, "causal"),
        ({"ring_degree": 2}, "ring"),
        ({"role": "cross"}, "self-attention"),
        ({"dtype": torch.float32}, "float16"),
        ({"head_dim": 64}, "head dim"),
        ({"threshold_scale_factor": -1}, "> 0"),
        ({"start_step": -1}, "start_step"),
    ]:
        with pytest.raises(AttentionConfigError, match=pat):
            check_skip_softmax_request(**kw)
    check_skip_softmax_request(dtype=torch.bfloat16, head_dim=128, threshold_scale_factor=math.pi)


def test_tma_descriptor_paths_match_pointer_paths():
    """The TMA-descriptor variants (2-D descriptors whose tail rows cross into the next batch) give
    the same results as the pointer variants."""
    from ditattn.attention.kernels.int8_attention import int8_attention
    from ditattn.attention.kernels.skip_softmax import skip_softmax_attention

    g = torch.Generator().manual_seed(21)
    q = _rand(2, 100, 4, 64, dtype=torch.float16, gen=g)
    k = _rand(2, 90, 2, 64, dtype=torch.float16, gen=g)
    v = _rand(2, 90, 2, 64, dtype=torch.float16, gen=g)
    for pv in ("fp16", "fp8"):
        a, la = int8_attention(q, k, v, pv=pv, return_lse=True, config={"block_m": 64, "block_n": 64})
        b, lb = int8_attention(q, k, v, pv=pv, return_lse=True, config={"block_m": 64, "block_n": 64, "tma": True})
        assert torch.equal(a, b) and torch.equal(la, lb)
    cfg = {"block_m": 64, "block_n": 64}
    a, la, _ = skip_softmax_attention(q, k, v, return_lse=True, allow_any_head_dim=True, config=cfg)
    b, lb, _ = skip_softmax_attention(q, k, v, return_lse=True, allow_any_head_dim=True, config=dict(cfg, tma=True))
    assert torch.equal(a, b) and torch.equal(la, lb)


# ------------------------------------------------------------------------------------------------
# fused DiT elementwise kernels (models/fused.py)


def _ulp_close(a, b, dtype):
    """Within one rounding step of the dtype (sum order differs between Triton and PyTorch)."""
    tol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[dtype]
    return bool(((a.float() - b.float()).abs() <= tol * b.float().abs() + tol).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["modulated", "affine", "plain", "residual-only", "norm-only", "per-token"])
def test_residual_norm_kernel_matches_reference(dtype, mode):
    from ditattn.models.fused import residual_norm

    g = torch.Generator().manual_seed(11)
    B, S, N = 2, 9, 40  # N not a power of two: masked lanes
    x, y = _rand(B, S, N, dtype=dtype, gen=g), _rand(B, S, N, dtype=dtype, gen=g)
    gate = torch.randn(B, 1, N, generator=g)
    kw = {}
    if mode in ("modulated", "norm-only"):
        kw = dict(scale=0.3 * torch.randn(B, 1, N, generator=g), shift=torch.randn(B, 1, N, generator=g))
    elif mode == "per-token":
        kw = dict(scale=0.3 * torch.randn(B, S, N, generator=g), shift=torch.randn(B, S, N, generator=g))
        gate = torch.randn(B, S, N, generator=g)
    elif mode == "affine":
        kw = dict(weight=torch.randn(N, generator=g), bias=torch.randn(N, generator=g))
    if mode == "norm-only":
        y = gate = None
    if mode == "residual-only":
        kw["norm"] = False
    ref = residual_norm(x, y, gate, impl="torch", **kw)
    out = residual_norm(x, y, gate, impl="triton", **kw)
    assert _ulp_close(out[0], ref[0], dtype)
    if mode == "residual-only":
        assert out[1] is None and ref[1] is None
    else:
        assert _ulp_close(out[1], ref[1], dtype) and rel(out[1], ref[1]) < (1e-6 if dtype == torch.float32 else 5e-3)
    if mode == "norm-only":
        assert out[0] is x  # x unchanged is x itself


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_kernel_matches_reference(dtype):
    from ditattn.models.fused import qk_norm_rope

    g = torch.Generator().manual_seed(12)
    B, S, D, H = 2, 7, 16, 3
    q, k = _rand(B, S, H * D, dtype=dtype, gen=g, shift=0.5), _rand(B, S, H * D, dtype=dtype, gen=g)
    wq, wk = torch.randn(H * D, generator=g).to(dtype), torch.randn(H * D, generator=g).to(dtype)
    ang = 3 * torch.rand(1, S, 1, D // 2, generator=g)
    ref = qk_norm_rope(q, k, wq, wk, ang.cos(), ang.sin(), eps=1e-6, head_dim=D, impl="torch")
    out = qk_norm_rope(q, k, wq, wk, ang.cos(), ang.sin(), eps=1e-6, head_dim=D, impl="triton")
    for o, r in zip(out, ref):
        assert o.dtype == dtype and o.shape == (B, S, H * D)
        assert rel(o, r) < (1e-6 if dtype == torch.float32 else 5e-3)
    # against a float64 computation: the kernel is as accurate as the PyTorch ops in the same dtype
    ref64 = qk_norm_rope(
        q.double(),
        k.double(),
        wq.double(),
        wk.double(),
        ang.cos().double(),
        ang.sin().double(),
        eps=1e-6,
        head_dim=D,
        impl="torch",
    )
    for o, r, e in zip(out, ref, ref64):
        assert rel(o, e) <= 2 * rel(r, e) + 1e-7


def test_wan_transformer_fused_kernels_match_plain_ops():
    """A tiny bf16 Wan transformer with every block on the Triton fused kernels equals the plain ops."""
    from ditattn.attention.context import component_scope
    from ditattn.models.wan.transformer import WanTransformer, WanTransformerConfig

    cfg = WanTransformerConfig(
        num_attention_heads=2, attention_head_dim=16, ffn_dim=48, num_layers=2, text_dim=24, freq_dim=32
    )
    torch.manual_seed(0)
    with component_scope("transformer"):
        model = WanTransformer(cfg, dtype=torch.bfloat16)
    model = model.to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 2, 4, 6, generator=g).to(torch.bfloat16)
    txt = torch.randn(1, 5, 24, generator=g).to(torch.bfloat16)
    t = torch.tensor([700.0])
    with torch.no_grad():
        plain = model.set_fused_ops(False)(x, t, txt)
        for block in model.blocks:
            block.fused = "triton"
        fused = model(x, t, txt)
    assert fused.shape == plain.shape and torch.isfinite(fused).all()
    assert rel(fused, plain) < 1e-2


def test_interpreter_without_dtype_fixes_refuses_bf16(monkeypatch):
    """If this Triton's interpreter lacks the hooks the bf16/fp8 fixes need, a bf16 launch on CPU is
    refused with the reason instead of computing on raw bits; float16 still runs."""
    from ditattn.attention.kernels import check_device, interpreter_dtypes

    monkeypatch.setattr(interpreter_dtypes, "enable", lambda: False)
    with pytest.raises(AttentionConfigError, match="cannot compute in torch.bfloat16.*float16"):
        check_device(torch.zeros(2, dtype=torch.bfloat16), what="kernel")
    check_device(torch.zeros(2, dtype=torch.float16), what="kernel")


def test_pooled_query_lse_reads_permuted_probe_rows_without_a_copy():
    """The error budget's probe rows reach the kernel as a permuted view of gathered rows ([B, M, H, D] ->
    [B, H, M, D]); the kernel reads them through their strides and gives what the contiguous copy gives."""
    from ditattn.attention.kernels.block_scores import pooled_query_lse

    g = torch.Generator().manual_seed(9)
    k = _rand(1, 96, 2, 32, dtype=torch.bfloat16, gen=g, shift=0.3)
    rows = _rand(1, 5, 2, 32, dtype=torch.bfloat16, gen=g, shift=0.3).permute(0, 2, 1, 3)  # [B, H, M, D] view
    assert not rows.is_contiguous() and rows.stride(-1) == 1
    valid = torch.ones(96, dtype=torch.bool)
    valid[90:] = False
    got = pooled_query_lse(rows, None, k, valid, block_size=32, scale=0.2)
    want = pooled_query_lse(rows.contiguous(), None, k, valid, block_size=32, scale=0.2)
    assert torch.equal(got, want)
    ref = torch.logsumexp(
        (0.2 * torch.einsum("bhmd,bnhd->bhmn", rows.double(), k.double()))
        .masked_fill(~valid, float("-inf"))
        .view(1, 2, 5, 3, 32),
        -1,
    )
    assert (got.double() - ref).abs().max() < 3e-2


def test_pooled_query_lse_gathers_key_blocks_through_an_index():
    """The early budget check reads k's blocks in k's own order through the tile layout's index (partial edge
    tiles: padding keys masked); the scores equal those of the tiled copy."""
    from ditattn.attention.kernels.block_scores import pooled_query_lse
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    g = torch.Generator().manual_seed(10)
    grid = (3, 8, 6)
    lay = make_tile_layout(grid, (4, 4, 4))
    nv, bs = lay.n_video_blocks, lay.block_size
    k = _rand(1, 144, 2, 32, dtype=torch.bfloat16, gen=g, shift=0.3)
    rows = _rand(1, 2, 5, 32, dtype=torch.bfloat16, gen=g, shift=0.3)
    dev = lay.on(k.device)
    got = pooled_query_lse(
        rows, None, k, dev.valid[: nv * bs], block_size=bs, scale=0.2, key_index=dev.source_clamped[: nv * bs]
    )
    want = pooled_query_lse(rows, None, tile(k, lay)[:, : nv * bs], dev.valid[: nv * bs], block_size=bs, scale=0.2)
    assert torch.equal(got, want) and torch.isfinite(got).all()
