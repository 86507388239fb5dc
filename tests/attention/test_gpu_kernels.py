"""GPU numerics of the dense GPU backends and the in-tree Triton kernels (skipped without CUDA).

Every kernel is compared with a float32 reference on fresh random inputs of odd sizes.  Exact
kernels must stay within about 2x the error of plain PyTorch SDPA in the same dtype; quantized ones
within their documented bounds.  Speed is never asserted here (bench/ measures it).
"""

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from ditattn.attention.backends.base import AttnCall, get_impl, reference_attention  # noqa: E402
from ditattn.attention.names import AttentionBackendEnum as B  # noqa: E402
from ditattn.errors import AttentionConfigError  # noqa: E402


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def rand(*shape, dtype=torch.bfloat16, seed=0, shift=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") + shift).to(dtype)


def qkv(b, sq, skv, h, hkv, d, dtype=torch.bfloat16, seed=0):
    return (
        rand(b, sq, h, d, dtype=dtype, seed=seed),
        rand(b, skv, hkv, d, dtype=dtype, seed=seed + 1, shift=0.3),
        rand(b, skv, hkv, d, dtype=dtype, seed=seed + 2),
    )


def sdpa_err(q, k, v, causal=False):
    rep = q.shape[2] // k.shape[2]
    k2, v2 = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k2.transpose(1, 2), v2.transpose(1, 2), is_causal=causal
    ).transpose(1, 2)
    ref, _ = reference_attention(q, k2, v2, causal=causal)
    return rel(out, ref)


def _fa_installed():
    from ditattn.attention.backends.flash import fa_runtime

    return fa_runtime() is not None


# ------------------------------------------------------------------------------------------------
# dense backends


@pytest.mark.parametrize("backend", [B.TORCH_SDPA, B.TORCH_CUDNN_SDPA, B.FA])
@pytest.mark.parametrize("d,causal,gqa", [(128, False, False), (64, True, True)])
def test_dense_backend_numerics(backend, d, causal, gqa):
    if backend is B.FA and not _fa_installed():
        pytest.skip("no FlashAttention runtime installed")
    q, k, v = qkv(1, 1000, 1000, 8, 2 if gqa else 8, d, seed=d)
    out, lse = get_impl(backend)(q, k, v, AttnCall(causal=causal, return_lse=True), {})
    ref, ref_lse = reference_attention(q, k, v, causal=causal)
    assert out.shape == q.shape and lse.shape == (1, 8, 1000) and lse.dtype == torch.float32
    assert rel(out, ref) <= 2 * sdpa_err(q, k, v, causal) + 1e-4
    assert (lse - ref_lse).abs().max() < 2e-2


def test_cudnn_precheck_agrees_with_dispatch():
    """The per-call check behind the SM100 cuDNN -> FA fallback: a call cuDNN serves
    passes; one it has no kernel for (fp32) raises NoKernelError instead of a raw RuntimeError."""
    from ditattn.attention.backends.base import NoKernelError
    from ditattn.attention.backends.sdpa import cudnn_no_kernel_reason

    q, k, v = qkv(1, 256, 256, 4, 4, 128)
    assert cudnn_no_kernel_reason(q, k, v, AttnCall()) is None
    assert cudnn_no_kernel_reason(q, k, v, AttnCall(causal=True)) is None
    with pytest.raises(NoKernelError, match="no kernel"):
        get_impl(B.TORCH_CUDNN_SDPA)(q.float(), k.float(), v.float(), AttnCall(), {})


def test_fa_rejects_bias_and_float32():
    if not _fa_installed():
        pytest.skip("no FlashAttention runtime installed")
    q, k, v = qkv(1, 64, 64, 2, 2, 64)
    with pytest.raises(AttentionConfigError, match="bias"):
        get_impl(B.FA)(q, k, v, AttnCall(attn_bias=torch.zeros(1, 1, 64, 64, device="cuda")), {})
    with pytest.raises(AttentionConfigError, match="dtype"):
        get_impl(B.FA)(q.float(), k.float(), v.float(), AttnCall(), {})


@pytest.mark.parametrize("pv", ["fp16", "fp8"])
def test_sage_attn_backend(pv):
    q, k, v = qkv(2, 777, 1001, 8, 4, 128, seed=5)
    k0 = k.clone()
    out, lse = get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(return_lse=True), {"impl": "triton", "pv_dtype": pv})
    ref, ref_lse = reference_attention(q, k, v)
    assert torch.equal(k, k0)
    assert rel(out, ref) < (0.02 if pv == "fp16" else 0.06)
    assert (lse - ref_lse).abs().max() < 0.05


def test_sage_attn_package_keeps_k():
    pytest.importorskip("sageattention")
    q, k, v = qkv(1, 512, 512, 4, 4, 128, seed=9)
    k0 = k.clone()
    out, lse = get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"impl": "package"})
    assert lse is None and torch.equal(k, k0)
    assert rel(out, reference_attention(q, k, v)[0]) < 0.03


def test_sage_attn_3_refused_off_blackwell():
    major, _ = torch.cuda.get_device_capability()
    if major in (10, 12):
        pytest.skip("Blackwell GPU")
    from ditattn.errors import BackendUnavailableError

    q, k, v = qkv(1, 64, 64, 2, 2, 64)
    with pytest.raises(BackendUnavailableError, match="Blackwell"):
        get_impl(B.SAGE_ATTN_3)(q, k, v, AttnCall(), {})


# ------------------------------------------------------------------------------------------------
# kernels


@pytest.mark.parametrize(
    "pv,gran,causal,d",
    [
        ("fp16", "token", False, 128),
        ("fp16", "block", True, 64),
        ("fp8", "token", False, 128),
        ("fp8", "token", True, 64),
    ],
)
def test_int8_kernel(pv, gran, causal, d):
    from ditattn.attention.kernels.int8_attention import default_config, int8_attention, int8_attention_reference

    q, k, v = qkv(1, 1000, 1000 if causal else 1234, 6, 3, d, seed=3)
    o, lse = int8_attention(q, k, v, causal=causal, return_lse=True, pv=pv, q_granularity=gran)
    cfg = default_config(d, pv)  # same scale blocks as the kernel
    qo, ql = int8_attention_reference(
        q,
        k,
        v,
        causal=causal,
        return_lse=True,
        pv=pv,
        q_granularity=gran,
        block_m=cfg["block_m"],
        block_n=cfg["block_n"],
    )
    ref, rl = reference_attention(q, k, v, causal=causal)
    assert rel(o, ref) < (0.02 if pv == "fp16" else 0.06)
    assert rel(o, qo) < (3e-3 if pv == "fp16" else 0.03)
    assert (lse - rl).abs().max() < 0.05 and (lse - ql).abs().max() < 5e-3


@pytest.mark.parametrize(
    "bs,kvpi,dtype,impl",
    [
        (64, 1, torch.bfloat16, "triton"),
        (64, 2, torch.float16, "triton"),
        (128, 1, torch.bfloat16, "triton"),
        (64, 1, torch.bfloat16, "fa4"),
        (128, 1, torch.float16, "fa4"),
        (128, 1, torch.bfloat16, "fa4-mask"),
        (64, 1, torch.float16, "fa4-mask"),
        (64, 1, torch.bfloat16, "triton-tma"),
        (128, 1, torch.float16, "triton-tma"),
    ],
)
def test_block_sparse_kernel(bs, kvpi, dtype, impl):
    tma = impl == "triton-tma"
    masked = impl == "fa4-mask"
    impl = "triton" if tma else "fa4" if masked else impl
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.attention.sparse.block_sparse import block_lists_to_dense_mask, block_mask_to_lists

    S = 12 * bs
    q, k, v = qkv(2, S, S, 6, 3, 128, dtype=dtype, seed=bs + kvpi)
    g = torch.Generator(device="cuda").manual_seed(1)
    bm = torch.rand(2, 6, 12, 12, generator=g, device="cuda") < 0.3
    bm[1, 2, 4] = False
    idx, cnt = block_mask_to_lists(bm)
    valid = torch.ones(2, S, dtype=torch.bool, device="cuda")
    if impl == "fa4":
        from ditattn.attention.kernels.block_sparse_fa4 import fits

        if fits(q, bs) is not None:
            pytest.skip(fits(q, bs))
    if masked:  # padding inside key blocks, one row shared by the batch (a tile layout's kv_valid): FA4's mask path
        row = torch.ones(S, dtype=torch.bool, device="cuda")
        row[bs + 3 : bs + 9] = False
        row[5 * bs : 6 * bs] = False  # a listed key block that is all padding
        row[-11:] = False
        valid = row.unsqueeze(0).expand(2, -1)
    elif impl == "fa4":
        valid[:, -11:] = False  # one valid prefix shared by the batch: FA4 masks the ragged end
    else:
        valid[0, -11:] = False
        valid[1, bs + 3 : bs + 9] = False  # padding inside a key block (tile layouts pad many blocks)
        valid[1, 5 * bs : 6 * bs] = False  # a key block that is all padding
    o, lse = block_sparse_attention_triton(
        q,
        k,
        v,
        idx,
        cnt,
        block_size=bs,
        kv_valid=valid,
        return_lse=True,
        config={"kv_per_iter": kvpi, "tma": tma},
        impl=impl,
    )
    mask = block_lists_to_dense_mask(idx, cnt, block_size=bs, kv_valid=valid)
    ref, rl = reference_attention(q, k, v, mask=mask)
    assert rel(o, ref) <= 2 * sdpa_err(q, k, v) + 1e-4
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - rl[fin]).abs().max() < 1e-2
    assert (o[1, 4 * bs : 5 * bs, 2] == 0).all()


def test_fa4_list_split_on_the_device_matches_the_cpu_split():
    from ditattn.attention.kernels.block_sparse_fa4 import split_lists

    g = torch.Generator().manual_seed(4)
    n_kv, m = 259, 259
    idx = torch.stack([torch.randperm(n_kv, generator=g) for _ in range(3 * 7)]).view(1, 3, 7, m).to(torch.int32)
    cnt = torch.randint(0, m + 1, (1, 3, 7), generator=g, dtype=torch.int32)
    partial = torch.rand(n_kv, generator=g) < 0.05
    cpu = split_lists(idx, cnt, partial)
    gpu = split_lists(idx.cuda(), cnt.cuda(), partial.cuda())
    for c, d, n in ((cpu[0], gpu[0], cpu[1]), (cpu[2], gpu[2], cpu[3])):
        live = torch.arange(m) < n[..., None]
        assert torch.equal(c[live], d.cpu()[live])
    assert torch.equal(cpu[1], gpu[1].cpu()) and torch.equal(cpu[3], gpu[3].cpu())


def test_fa4_refuses_padding_that_differs_per_batch_entry():
    from ditattn.attention.kernels.block_sparse_fa4 import fits
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton

    q, k, v = qkv(2, 256, 256, 2, 2, 128)
    if fits(q, 128) is not None:
        pytest.skip(fits(q, 128))
    idx = torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32, device="cuda")
    cnt = torch.full((1, 1, 2), 2, dtype=torch.int32, device="cuda")
    valid = torch.ones(2, 256, dtype=torch.bool, device="cuda")
    valid[1, 10:20] = False
    with pytest.raises(AttentionConfigError, match="differently per batch entry"):
        block_sparse_attention_triton(q, k, v, idx, cnt, block_size=128, kv_valid=valid, impl="fa4")
    out, _ = block_sparse_attention_triton(q, k, v, idx, cnt, block_size=128, kv_valid=valid)  # auto: Triton
    assert torch.isfinite(out).all()


def test_skip_softmax_kernel():
    from ditattn.attention.kernels.skip_softmax import skip_softmax_attention, skip_softmax_reference

    q, k, v = qkv(1, 1100, 1100, 4, 2, 128, seed=8)
    o, lse, frac = skip_softmax_attention(q, k, v, return_lse=True)
    ref, rl = reference_attention(q, k, v)
    assert float(frac) == 0 and rel(o, ref) <= 2 * sdpa_err(q, k, v) + 1e-4 and (lse - rl).abs().max() < 1e-2
    # attention-sink inputs: most tiles after the first carry little mass and are skipped
    g = torch.Generator(device="cuda").manual_seed(2)
    u = torch.randn(128, generator=g, device="cuda")
    u = u / u.norm()
    a = math.sqrt(14.0 * math.sqrt(128))  # sink score gap of 14 (natural log units)
    qs = torch.randn(1, 1024, 4, 128, generator=g, device="cuda")
    qs = qs - (qs @ u)[..., None] * u + a * u
    ks = torch.randn(1, 1024, 4, 128, generator=g, device="cuda")
    ks = ks - (ks @ u)[..., None] * u
    ks[:, :16] += a * u
    vs = torch.randn(1, 1024, 4, 128, generator=g, device="cuda")
    qs, ks, vs = qs.half(), ks.half(), vs.half()
    o2, _, frac2 = skip_softmax_attention(qs, ks, vs, threshold_scale_factor=4.0)
    so, _, sfrac = skip_softmax_reference(qs, ks, vs, threshold_scale_factor=4.0)
    assert sfrac > 0.5 and abs(float(frac2) - sfrac) < 0.05
    assert rel(o2, so) < 1e-2 and rel(o2, reference_attention(qs, ks, vs)[0]) < 0.05


def test_skip_softmax_rejects_graph_capture():
    from ditattn.attention.kernels.skip_softmax import skip_softmax_attention

    q, k, v = qkv(1, 256, 256, 2, 2, 128)
    skip_softmax_attention(q, k, v, threshold_scale_factor=1.0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(AttentionConfigError, match="CUDA graph"):
        with torch.cuda.graph(graph):
            skip_softmax_attention(q, k, v, threshold_scale_factor=1.0)
    assert math.isfinite(float(skip_softmax_attention(q, k, v, threshold_scale_factor=1.0)[2]))


# ------------------------------------------------------------------------------------------------
# fused DiT elementwise kernels and the GELU-epilogue GEMM (models/fused.py, models/wan/transformer.py)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_dit_kernels(dtype):
    from ditattn.models.fused import qk_norm_rope, residual_norm

    B, S, H, D = 2, 1001, 5, 128
    N = H * D
    x, y = rand(B, S, N, dtype=dtype, seed=1), rand(B, S, N, dtype=dtype, seed=2)
    gate, scale, shift = (rand(B, 1, N, dtype=torch.float32, seed=s) for s in (3, 4, 5))
    for kw in (dict(scale=scale, shift=shift), dict(weight=scale[0, 0], bias=shift[0, 0])):
        ref = residual_norm(x, y, gate, impl="torch", **kw)
        out = residual_norm(x, y, gate, impl="triton", **kw)
        for o, r in zip(out, ref):
            assert rel(o, r) < (1e-6 if dtype == torch.float32 else 4e-3)
    q, k = rand(B, S, N, dtype=dtype, seed=6, shift=0.5), rand(B, S, N, dtype=dtype, seed=7)
    wq, wk = rand(N, dtype=dtype, seed=8), rand(N, dtype=dtype, seed=9)
    ang = 3 * torch.rand(1, S, 1, D // 2, device="cuda")
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
    ref = qk_norm_rope(q, k, wq, wk, ang.cos(), ang.sin(), eps=1e-6, head_dim=D, impl="torch")
    out = qk_norm_rope(q, k, wq, wk, ang.cos(), ang.sin(), eps=1e-6, head_dim=D, impl="triton")
    for o, r, e in zip(out, ref, ref64):
        assert rel(o, e) <= 2 * rel(r, e) + 1e-7


def test_wan_transformer_fused_matches_plain_on_cuda():
    """bf16 Wan transformer: fused kernels + GELU epilogue vs the plain PyTorch ops, both vs float32."""
    from ditattn.attention.context import component_scope
    from ditattn.models.wan.transformer import KEEP_FP32, WanTransformer, WanTransformerConfig, cast_model

    cfg = WanTransformerConfig(
        num_attention_heads=4, attention_head_dim=128, ffn_dim=1000, num_layers=3, text_dim=96, freq_dim=64
    )
    torch.manual_seed(0)
    with component_scope("transformer"):
        model32 = WanTransformer(cfg, dtype=torch.float32).cuda().eval()
        model = WanTransformer(cfg, dtype=torch.bfloat16)
    model.load_state_dict(model32.state_dict())
    model = cast_model(model, torch.bfloat16, KEEP_FP32).cuda().eval()
    x, txt = rand(1, 16, 3, 14, 18, dtype=torch.float32, seed=1), rand(1, 7, 96, dtype=torch.float32, seed=2)
    t = torch.tensor([600.0], device="cuda")
    with torch.no_grad():
        ref32 = model32.set_fused_ops(False)(x, t, txt)
        plain = model.set_fused_ops(False)(x.bfloat16(), t, txt.bfloat16())
        fused = model.set_fused_ops(True)(x.bfloat16(), t, txt.bfloat16())
    assert rel(fused, ref32) <= 2 * rel(plain, ref32) + 1e-4


@pytest.mark.parametrize("centroid_variance,block_size", [(True, 64), (False, 64), (True, 128)])
def test_sol_fused_centroid_kernel(centroid_variance, block_size):
    """sol_attention on CUDA in bf16 (block-sparse kernel + the fused centroid kernel, with and
    without the key-variance term; at 128-token blocks FlashAttention-4's block-sparse kernel where
    installed) against its float64 PyTorch path on the same inputs: same routes (upstream's pooled
    predictor: the pooled-query route is checked in the next test), error within 2x SDPA's."""
    from ditattn.attention.sparse.sol import sol_attention

    grid, text_len = (7, 10, 13), 33
    S = grid[0] * grid[1] * grid[2] + text_len
    q, k, v = qkv(1, S, S, 4, 4, 128, seed=21)
    kw = dict(
        video_shape=grid,
        text_len=text_len,
        tau=0.8,
        sink_start=0,
        sink_tokens=64,
        return_lse=True,
        predictor="pooled",
        centroid_variance=centroid_variance,
        block_size=block_size,
    )
    out, lse, plan = sol_attention(q, k, v, **kw)
    ro, rl, rplan = sol_attention(q.double(), k.double(), v.double(), impl="reference", **kw)
    assert torch.equal(plan.extra["exact"], rplan.extra["exact"])
    assert rel(out, ro) <= 2 * sdpa_err(q, k, v) + 1e-4
    assert (lse.double() - rl).abs().max() < 2e-2


@pytest.mark.parametrize("block_size,variance", [(64, False), (64, True), (128, False), (32, False)])
def test_pooled_query_block_scores_kernel(block_size, variance):
    """The selection kernel of the pooled-query predictor (Sparge, Sol, V-MoBA) in bf16 against the
    float64 PyTorch path: scores within bf16 rounding, the top half of each row nearly the same set
    (ties within rounding may swap), padding keys of partial tiles masked."""
    from ditattn.attention.sparse.block_scores import pooled_query_block_scores
    from ditattn.attention.sparse.sparge import sparge_tile_size
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    grid = (7, 10, 13)  # partial tiles on every axis
    lay = make_tile_layout(grid, sparge_tile_size(block_size))
    q, k, _ = qkv(1, 910, 910, 3, 3, 128, seed=31)
    qt, kt = tile(q, lay), tile(k, lay)
    got = pooled_query_block_scores(qt, kt, lay, 128**-0.5, variance=variance)  # auto: the Triton kernel
    want = pooled_query_block_scores(qt.double(), kt.double(), lay, 128**-0.5, variance=variance, impl="reference")
    assert got.is_cuda and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 5e-2
    half = max(1, want.shape[-1] // 2)
    top = lambda x: torch.zeros_like(x, dtype=torch.bool).scatter_(-1, x.topk(half, -1).indices, True)  # noqa: E731
    assert float((top(got.double()) == top(want)).float().mean()) > 0.97


@pytest.mark.parametrize(
    "grid,text,heads,k",
    [((21, 30, 52), 0, 4, 52), ((21, 30, 52), 512, 2, 52), ((21, 45, 80), 0, 2, 119), ((5, 8, 12), 7, 3, 1)],
)
def test_vsa_topk_lists_kernel(grid, text, heads, k):
    """The compiled top-k list kernel (VSA's selection at the Wan grids: 513 and 1182 packed blocks,
    with and without text blocks) gives exactly the PyTorch path's lists on the same scores: random
    rows, rows of ties, signed zeros, infinities and NaN."""
    from ditattn.attention.sparse.common import topk_lists
    from ditattn.attention.sparse.tiling import make_tile_layout

    lay = make_tile_layout(grid, (4, 4, 4), text, edge_tiles="packed")
    nv = lay.n_video_blocks
    s = rand(1, heads, nv, nv, dtype=torch.float32, seed=nv + k)
    r = s[0, 0]
    r[0] = 0.5
    r[1] = (r[1] * 2).round()
    r[2, ::3] = float("-inf")
    r[3, ::5] = float("inf")
    r[3, 1::7] = float("nan")
    r[4, ::2] = -0.0
    r[4, 1::2] = 0.0
    for kk in (k, nv):
        got, cnt, kept = topk_lists(lay, s, kk)  # auto: the kernel for float32 CUDA scores
        want, _, _ = topk_lists(lay, s, kk, "reference")
        assert got.is_cuda and got.dtype == torch.int32
        assert torch.equal(got, want), (kk, (got != want).any(-1).nonzero()[:4].tolist())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vsa_pool_kernel(dtype):
    """The compiled pooling kernel against pooled_blocks: bitwise on integer-valued tokens (exact
    sums), within float32 rounding on random ones; packed edge blocks with fewer than 64 real tokens."""
    from ditattn.attention.kernels.block_select import pool_qk_blocks
    from ditattn.attention.sparse.tiling import make_tile_layout, pooled_blocks, tile

    lay = make_tile_layout((21, 30, 52), (4, 4, 4), 0, edge_tiles="packed")
    nv, S = lay.n_video_blocks, lay.seq_len
    count = lay.on("cuda").count_as(torch.float32).view(-1)
    for integer in (True, False):
        q, k, _ = qkv(1, S, S, 4, 4, 128, dtype=dtype, seed=11)
        if integer:
            q, k = (q * 4).round(), (k * 4).round()
        qt, kt = tile(q, lay), tile(k, lay)
        pq, pk = pool_qk_blocks(qt, kt, count, n_blocks=nv, block_size=64, scale=128**-0.5)
        rq, rk = pooled_blocks(qt, lay, nv, scale=128**-0.5), pooled_blocks(kt, lay, nv)
        if integer:
            assert torch.equal(pq, rq) and torch.equal(pk, rk)
        else:
            assert (pq - rq).abs().max() < 1e-6 and (pk - rk).abs().max() < 1e-5


@pytest.mark.parametrize("tiles", [(4, 4, 4), (4, 4, 8)])
def test_sol_block_moments_kernel(tiles):
    """The compiled block-moments kernel (Sol's pooled q, k, v and the keys' variance) against the PyTorch
    path at the 480p grid (packed edge blocks): means bitwise on integer-valued tokens (exact sums), the
    variance within float32 rounding (the compiler fuses ``E[x^2] - mean * mean`` into one FMA), and both
    within rounding on random bf16 tokens with a common offset (the variance's cancellation)."""
    from ditattn.attention.kernels.block_select import pool_block_moments
    from ditattn.attention.sparse.block_scores import pooled_query_features
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    lay = make_tile_layout((21, 30, 52), tiles, 0, edge_tiles="packed")
    nv, S = lay.n_video_blocks, lay.seq_len
    count = lay.on("cuda").count_as(torch.float32).view(-1)
    for integer in (True, False):
        _, k, _ = qkv(1, S, S, 4, 4, 128, dtype=torch.bfloat16, seed=13)
        k = (k * 4).round() if integer else k + 6
        kt = tile(k, lay)
        mean, var = pool_block_moments(kt, count, n_blocks=nv, block_size=lay.block_size, variance=True)
        rm, rv = pooled_query_features(kt, lay, nv, variance=True)
        if integer:
            assert torch.equal(mean, rm)
        assert (mean - rm).abs().max() < 1e-5 and (var - rv).abs().max() < 1e-4 and bool((var >= 0).all())


def test_vsa_selection_on_cuda():
    """video_sparse_attention on CUDA (Triton selection) against the replaced selection (pooled_blocks,
    torch.topk) on the same bf16 inputs: every row keeps the same blocks except where the two scores
    of a swapped pair lie within float32 rounding of each other; outputs agree when the plans do;
    and the call makes no host synchronisation."""
    from ditattn.attention.sparse.block_sparse import lists_to_block_mask
    from ditattn.attention.sparse.tiling import make_tile_layout, pooled_blocks, tile
    from ditattn.attention.sparse.vsa import video_sparse_attention, vsa_num_selected

    grid = (9, 16, 20)
    S = math.prod(grid)
    q, k, v = qkv(1, S, S, 8, 8, 128, seed=7)
    out, _, plan = video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.9)
    lay = plan.layout
    nv, kk = lay.n_video_blocks, vsa_num_selected(0.9, lay.n_video_blocks)
    old = pooled_blocks(tile(q, lay), lay, nv, scale=128**-0.5) @ pooled_blocks(tile(k, lay), lay, nv).mT
    new = plan.extra["scores"]
    assert (new - old).abs().max() <= 1e-5 * old.abs().max()
    m_old = torch.zeros_like(old, dtype=torch.bool).scatter_(-1, old.topk(kk, -1).indices, True)
    m_new = lists_to_block_mask(plan.kv_indices, plan.kv_counts, lay.n_blocks)[..., :nv, :nv]
    kth = old.topk(kk, -1).values[..., -1:]
    swapped = m_old != m_new
    assert float(swapped.float().mean()) < 1e-3
    assert ((old - kth).abs()[swapped] <= 1e-5 * old.abs().max()).all()
    ref, _, _ = video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.9, impl="reference")
    if not swapped.any():
        assert rel(out, ref) <= 2 * sdpa_err(q, k, v) + 1e-3
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.9)
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    assert make_tile_layout(grid, (4, 4, 4), edge_tiles="packed") is lay


def test_pooled_query_selection_on_cuda():
    """sparge_attn / sol_attn with their default pooled-query predictor on CUDA: outputs match the
    PyTorch path run on CUDA with the same (bf16) inputs within 2x SDPA's error when the plans agree,
    and the kept fractions equal the requested ones."""
    from ditattn.attention.sparse.sol import sol_attention
    from ditattn.attention.sparse.sparge import sparge_attention

    grid = (8, 12, 16)
    S = grid[0] * grid[1] * grid[2]
    q, k, v = qkv(1, S, S, 4, 4, 128, seed=41)
    out, _, plan = sparge_attention(q, k, v, video_shape=grid, topk=0.5, quantize=False)
    ref, _, rplan = sparge_attention(q, k, v, video_shape=grid, topk=0.5, quantize=False, impl="reference")
    from ditattn.attention.sparse.block_sparse import lists_to_block_mask

    assert plan.kept_fraction == rplan.kept_fraction == 0.5
    nb = plan.layout.n_blocks
    m, rm = (lists_to_block_mask(p.kv_indices, p.kv_counts, nb) for p in (plan, rplan))
    assert float((m == rm).float().mean()) > 0.97
    if torch.equal(m, rm):
        assert rel(out, ref) <= 2 * sdpa_err(q, k, v) + 1e-4
    out, _, plan = sol_attention(q, k, v, video_shape=grid)
    ref, _, rplan = sol_attention(q, k, v, video_shape=grid, impl="reference")
    assert float((plan.extra["exact"] == rplan.extra["exact"]).float().mean()) > 0.97
    assert abs(plan.kept_fraction - rplan.kept_fraction) < 1e-9  # tau's rule sets the counts


def test_sparge_cdfthreshd_on_cuda():
    """sparge_attn with cdfthreshd on CUDA (rows of varying length, fixed-width lists): exact attention
    under the plan's own token mask, no host synchronisation, and the plan of the PyTorch path."""
    from ditattn.attention.sparse.block_sparse import lists_to_block_mask
    from ditattn.attention.sparse.common import plan_token_mask
    from ditattn.attention.sparse.sparge import sparge_attention
    from ditattn.evaluation.structured import StructuredSpec, structured_qkv

    # structured inputs (3-D RoPE): on i.i.d. noise the pooled block scores are flat, so every row needs
    # the same number of blocks and the varying-length path would go untested (23 of 25 blocks everywhere)
    grid = (8, 12, 16)
    q, k, v, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=4, seed=43), device="cuda")
    text = qkv(1, 7, 7, 4, 4, 128, seed=44)
    q, k, v = (torch.cat([a, b], 1) for a, b in zip((q, k, v), text))
    kw = dict(video_shape=grid, text_len=7, cdfthreshd=0.9, topk=0.2, quantize=False)
    sparge_attention(q, k, v, **kw)  # layout constants and kernels built first
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _, plan = sparge_attention(q, k, v, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    assert rel(out, reference_attention(q, k, v, mask=plan_token_mask(plan))[0]) <= 2 * sdpa_err(q, k, v) + 1e-4
    counts = plan.kv_counts[0, :, : plan.layout.n_video_blocks]
    assert int(counts.min()) < int(counts.max())
    _, _, rplan = sparge_attention(q, k, v, impl="reference", **kw)
    nb = plan.layout.n_blocks
    m, rm = (lists_to_block_mask(p.kv_indices, p.kv_counts, nb) for p in (plan, rplan))
    assert float((m == rm).float().mean()) > 0.97
    # the list builder (mass_lists, used above) gives the mask path's lists on CUDA too, at nb columns
    import ditattn.attention.sparse.sparge as sp
    from ditattn.attention.sparse.common import mass_lists_via_mask

    saved, sp.mass_lists = sp.mass_lists, mass_lists_via_mask
    try:
        _, _, mplan = sparge_attention(q, k, v, **kw)
    finally:
        sp.mass_lists = saved
    assert plan.kv_indices.shape[-1] == nb
    assert torch.equal(plan.kv_indices, mplan.kv_indices) and torch.equal(plan.kv_counts, mplan.kv_counts)


@pytest.mark.parametrize("block", [128, 32])
def test_svg2_on_cuda_matches_its_token_mask(block):
    """sparse_video_gen_2_attn on CUDA (128-token blocks: FA4's block-sparse path when installed, told
    that no query block is empty; 32: the Triton kernel) with fixed-width lists: the output is exact
    attention under the plan's own token mask, cold and warm."""
    from ditattn.attention.sparse.svg2 import reset_svg2_state, svg2_attention, svg2_token_mask

    grid = (8, 16, 32) if block == 128 else (4, 8, 16)
    clusters = (16, 32) if block == 128 else (8, 16)
    S = math.prod(grid) + 7
    q, k, v = qkv(1, S, S, 4, 4, 128, seed=51)
    reset_svg2_state("cuda-test")
    for step in (0, 1):
        out, lse, plan = svg2_attention(
            q,
            k,
            v,
            video_shape=grid,
            text_len=7,
            num_q_clusters=clusters[0],
            num_k_clusters=clusters[1],
            top_p=0.7,
            state_key="cuda-test",
            step=step,
            return_lse=True,
        )
        assert plan.extra["block_size"] == block and plan.kv_indices.shape[-1] == plan.kv_counts.shape[-1]
        assert (plan.kv_counts > 0).all() and 0 < plan.kept_fraction < 1
        ref, rl = reference_attention(q, k, v, mask=svg2_token_mask(plan))
        assert rel(out, ref) <= 2 * sdpa_err(q, k, v) + 1e-4
        assert (lse - rl).abs().max() < 1e-2
    reset_svg2_state("cuda-test")


def test_sparse_paths_do_not_synchronise():
    """The warm SVG2 step, Sol and Sparge (their backends, stats recorded; the error budget off, every length
    sparsified) launch without one CUDA synchronisation once compiled: torch's sync debug mode "error" raises
    on any."""
    from ditattn.attention.sparse import last_stats
    from ditattn.attention.sparse.svg2 import reset_svg2_state

    grid = (8, 16, 32)
    S = math.prod(grid)
    q, k, v = qkv(1, S, S, 4, 4, 128, seed=61)
    off = {"error_budget": 0.0, "min_seq_len": 0}
    cases = [
        (B.SPARSE_VIDEO_GEN_2_ATTN, {"num_q_clusters": 16, "num_k_clusters": 32, **off}, (0, 1, 2, 3)),
        (B.SOL_ATTN, off, (12, 13)),
        (B.SPARGE_ATTN, off, (0, 1)),
    ]
    reset_svg2_state()
    for backend, cfg, steps in cases:
        impl = get_impl(backend)
        call = lambda step: impl(q, k, v, AttnCall(video_shape=grid, step=step, layer_idx=3), cfg)  # noqa: E731
        for step in steps[:2]:  # compilation, the layout constants, the probe of kv_valid, a warm step
            call(step)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in steps[2:] or steps[1:]:
                out = call(step)[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(out.float()).all()
        assert 0 < last_stats[f"{backend.value}/layer3"]["kept_fraction"] < 1
    reset_svg2_state()


def test_budgeted_steps_that_reuse_a_sparse_decision_do_not_synchronise():
    """With the error budget on, the first step of a request decides (its syncs allowed); the later steps of
    a layer that stayed sparse enforce the budget on the device and launch without one synchronisation."""
    from ditattn.attention.sparse import budget as eb
    from ditattn.attention.sparse import last_stats
    from ditattn.evaluation.structured import family_spec, structured_qkv

    grid = (8, 16, 32)
    q, k, v, _ = structured_qkv(family_spec("original", grid, 4, seed=3), device="cuda", dtype=torch.bfloat16)
    # stays sparse unless every block is kept; a budget that leaves Sparge sparse on this small grid (at its
    # default budget it needs every block there and runs dense)
    on = {"dense_above": 1.0, "min_seq_len": 0, "error_budget": 0.05}
    cases = [
        (B.SPARGE_ATTN, on, (0, 1, 2)),
        (B.SOL_ATTN, on, (12, 13, 14)),
        (B.VMOBA_ATTN, {**on, "first_full_step": 0}, (0, 1, 2)),
    ]
    eb.clear_memory()
    for backend, cfg, steps in cases:
        impl = get_impl(backend)
        call = lambda step: impl(q, k, v, AttnCall(video_shape=grid, step=step, layer_idx=3), cfg)  # noqa: E731
        for step in steps[:2]:  # the deciding step, then a compiled reusing step
            call(step)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = call(steps[2])[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        st = last_stats[f"{backend.value}/layer3"]
        assert torch.isfinite(out.float()).all() and not st["dense"], (backend.value, st)
        assert 0 < float(st["kept_fraction"]) < 1 and float(st["dropped_mass_max"]) <= st["error_budget"] + 1e-4, (
            backend.value,
            st,
        )
    eb.clear_memory()
