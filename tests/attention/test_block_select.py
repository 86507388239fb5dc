"""The selection stage of the pooled planners (VSA, Sparge, SLA): the top-k rule (ties to the lower
block id), the PyTorch path against the implementation it replaced, and the two Triton kernels of
``ditattn.attention.kernels.block_select`` against the PyTorch path in Triton's CPU interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` on CPU-only machines; tests/attention/test_gpu_kernels.py
covers the compiled kernels)."""

import math
import os

import pytest
import torch

from ditattn.attention.sparse.block_sparse import block_mask_to_lists
from ditattn.attention.sparse.common import (
    add_special_blocks,
    mass_lists,
    mass_lists_via_mask,
    mass_mask,
    topk_indices,
    topk_lists,
    topk_mask,
    video_mask_lists,
)
from ditattn.attention.sparse.tiling import make_tile_layout, pooled_blocks, tile
from ditattn.attention.sparse.vsa import pooled_video_scores, video_sparse_attention, vsa_num_selected
from ditattn.errors import AttentionConfigError

interp = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests run on CPU-only machines"
)


def rule_topk(row: list, k: int) -> set:
    """The documented rule, spelled out: higher first, NaN above everything, -0.0 == +0.0, then the lower index."""

    def key(j):
        x = row[j]
        return (0, 0.0, j) if math.isnan(x) else (1, -(x + 0.0), j)

    return set(sorted(range(len(row)), key=key)[:k])


def structured_scores(B, H, nv, seed):
    """Random rows and rows full of ties, signed zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, nv, nv, generator=g)
    r = s[0, 0]
    r[0] = 1.5  # one value everywhere
    r[1] = r[1].round()  # a few values, many ties
    r[2, ::3] = float("-inf")
    r[3, ::5] = float("inf")
    r[3, 1::7] = float("nan")
    r[4, : nv // 2] = -0.0
    r[4, nv // 2 :] = 0.0
    r[4, ::4] = -1.0
    r[5] = -torch.rand(nv, generator=g) * 1e-38  # subnormals
    r[6] = torch.randint(0, 3, (nv,), generator=g).float() * 1e30
    return s


def old_topk_lists(layout, scores, k):
    """The implementation this stage replaced (torch.topk; its choice among ties is the kernel's)."""
    nv, nb = layout.n_video_blocks, layout.n_blocks
    sel = scores.topk(k, dim=-1).indices.to(torch.int32).sort(dim=-1).values
    if nb > nv:
        B, H = scores.shape[:2]
        tail = torch.zeros(nb - k, dtype=torch.int32)
        tail[: nb - nv] = torch.arange(nv, nb, dtype=torch.int32)
        special = torch.arange(nb, dtype=torch.int32).expand(B, H, nb - nv, nb)
        sel = torch.cat([torch.cat([sel, tail.expand(B, H, nv, -1)], -1), special], 2)
    return sel


LAYOUTS = [((5, 6, 7), 0), ((9, 13, 17), 70)]  # packed: edge tiles share blocks; with special blocks


def test_topk_indices_follow_the_rule():
    s = structured_scores(1, 2, 23, seed=3)
    for k in (1, 4, 11, 23):
        got = topk_indices(s, k)
        for h in range(2):
            for i in range(23):
                assert set(got[0, h, i].tolist()) == rule_topk(s[0, h, i].tolist(), k), (h, i, k)
    mask = topk_mask(s, 5)
    assert torch.equal(mask.sum(-1), torch.full((1, 2, 23), 5))
    assert mask[0, 0, 0, :5].all() and not mask[0, 0, 0, 5:].any()  # all tied: the first five


@pytest.mark.parametrize("shape,text", LAYOUTS)
def test_reference_lists_equal_the_replaced_implementation_without_ties(shape, text):
    """Random float scores have no ties: the new rule picks exactly what torch.topk picked."""
    lay = make_tile_layout(shape, (4, 4, 4), text, edge_tiles="packed")
    nv = lay.n_video_blocks
    s = torch.randn(2, 3, nv, nv, generator=torch.Generator().manual_seed(nv))
    for k in (1, 7, nv // 2, nv):
        idx, cnt, _ = topk_lists(lay, s, k, "reference")
        assert torch.equal(idx, old_topk_lists(lay, s, k)), k
        ref_idx, ref_cnt = block_mask_to_lists(add_special_blocks(lay, topk_mask(s, k)))
        assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt)


def test_topk_lists_rejects_unknown_impl():
    lay = make_tile_layout((5, 6, 7), (4, 4, 4), edge_tiles="packed")
    with pytest.raises(AttentionConfigError, match="'auto', 'reference' or 'triton'"):
        topk_lists(lay, torch.zeros(1, 1, lay.n_video_blocks, lay.n_video_blocks), 2, "flex")


# ------------------------------------------------------------------------------------------------
# the cdfthreshd rule's lists (mass_lists) against the mask path

CDF_LAYOUTS = [
    ((5, 6, 7), 0, "packed"),
    ((5, 6, 7), 0, "padded"),
    ((9, 13, 17), 70, "packed"),
    ((3, 9, 10), 7, "padded"),
    ((4, 9, 30), 1, "packed"),
]


def assert_same_lists(got, want, what=""):
    (idx, cnt), (ridx, rcnt) = got, want
    assert idx.dtype == cnt.dtype == torch.int32 and idx.is_contiguous() and cnt.is_contiguous(), what
    assert torch.equal(cnt, rcnt), what
    assert torch.equal(idx, ridx), (what, (idx != ridx).any(-1).nonzero()[:4].tolist())


def cdf_cases(lay):
    """(threshold, min_count, width) triples: low / typical / high / exact thresholds, floors from one block to
    every block, the tight width (None), the fixed accelerator width (n_blocks) and a cut one."""
    nv, nb = lay.n_video_blocks, lay.n_blocks
    for thr in (0.3, 0.9, 0.93, 0.999, 1.0):
        for floor in (1, math.ceil(0.3 * nv), nv):
            for width in (None, nb, max(1, nb // 3)):
                yield thr, floor, width


@pytest.mark.parametrize("shape,text,edge", CDF_LAYOUTS)
def test_mass_lists_equal_the_mask_path(shape, text, edge):
    """torch.equal to block_mask_to_lists(add_special_blocks(mass_mask(...))) on random rows (several scales:
    peaked and flat shares) and on rows of ties, signed zeros, +-inf, NaN and subnormals."""
    lay = make_tile_layout(shape, (4, 4, 4), text, edge_tiles=edge)
    nv = lay.n_video_blocks
    g = torch.Generator().manual_seed(nv)
    inputs = [torch.randn(2, 3, nv, nv, generator=g) * sc for sc in (0.1, 3.0, 30.0)]
    inputs.append(structured_scores(1, 2, nv, seed=nv))
    inputs.append(torch.randint(0, 3, (1, 2, nv, nv), generator=g).float())  # ties everywhere
    for s in inputs:
        for thr, floor, width in cdf_cases(lay):
            what = (tuple(s.shape), thr, floor, width)
            assert_same_lists(
                mass_lists(lay, s, thr, floor, width=width), mass_lists_via_mask(lay, s, thr, floor, width=width), what
            )


def test_mass_lists_on_structured_scores():
    """Pooled-query log masses of structured q/k (3-D RoPE heads of every type, sinks; rows of very different
    spread), with and without text blocks."""
    from ditattn.attention.sparse.block_scores import pooled_query_block_scores
    from ditattn.evaluation.structured import StructuredSpec, structured_qkv

    grid = (8, 12, 16)
    q, k, _, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=5, seed=3), dtype=torch.float32)
    for text in (0, 9):
        lay = make_tile_layout(grid, (4, 4, 4), text, edge_tiles="packed")
        if text:
            pad = torch.randn(1, text, 5, 128, generator=torch.Generator().manual_seed(4))
            q2, k2 = torch.cat([q, pad], 1), torch.cat([k, pad], 1)
        else:
            q2, k2 = q, k
        lm = pooled_query_block_scores(tile(q2, lay), tile(k2, lay), lay, 128**-0.5, impl="reference")
        counts = set()
        for thr, floor, width in cdf_cases(lay):
            got = mass_lists(lay, lm, thr, floor, width=width)
            assert_same_lists(got, mass_lists_via_mask(lay, lm, thr, floor, width=width), (text, thr, floor, width))
            counts |= set(got[1][0, :, : lay.n_video_blocks].flatten().tolist())
        assert len(counts) > 5  # row lengths vary


def test_mass_lists_with_valid_blocks():
    """``valid``: invalid blocks have no share and are never listed; a row with fewer valid blocks than the
    floor lists all of them, a row without any lists only the special blocks."""
    lay = make_tile_layout((9, 13, 17), (4, 4, 4), 70, edge_tiles="packed")
    nv, ns = lay.n_video_blocks, lay.n_blocks - lay.n_video_blocks
    g = torch.Generator().manual_seed(8)
    s = torch.randn(2, 3, nv, nv, generator=g) * 4
    valid = torch.rand(2, 3, nv, nv, generator=g) < 0.6
    valid[0, 0, 0] = False
    valid[0, 0, 1] = False
    valid[0, 0, 1, :2] = True
    s[0, 1, 2, ::2] = float("-inf")  # -inf entries in a valid row: no share
    for thr, floor, width in cdf_cases(lay):
        got = mass_lists(lay, s, thr, floor, valid=valid, width=width)
        assert_same_lists(got, mass_lists_via_mask(lay, s, thr, floor, valid=valid, width=width), (thr, floor, width))
    idx, cnt = mass_lists(lay, s, 0.9, 5, valid=valid, width=lay.n_blocks)
    assert cnt[0, 0, 0] == ns and idx[0, 0, 0, :ns].tolist() == list(range(nv, lay.n_blocks))
    assert cnt[0, 0, 1] == 2 + ns and idx[0, 0, 1, :2].tolist() == [0, 1]
    # broadcast valid (one key-block set per head, as the self-similarity fallback passes it)
    kv = torch.rand(2, 3, 1, nv, generator=g) < 0.7
    assert_same_lists(mass_lists(lay, s, 0.8, 3, valid=kv), mass_lists_via_mask(lay, s, 0.8, 3, valid=kv))


@pytest.mark.parametrize("shape,text,edge", CDF_LAYOUTS[:3])
def test_video_mask_lists_equal_block_mask_to_lists(shape, text, edge):
    """Any video mask (empty rows, full rows, random rows) -> the lists of the widened dense mask."""
    lay = make_tile_layout(shape, (4, 4, 4), text, edge_tiles=edge)
    nv, nb = lay.n_video_blocks, lay.n_blocks
    g = torch.Generator().manual_seed(11)
    m = torch.rand(2, 3, nv, nv, generator=g) < 0.4
    m[0, 0, 0] = False
    m[0, 0, 1] = True
    m[1, 2] = False  # a whole head empty
    for width in (None, nb, 1, max(1, nb // 2)):
        assert_same_lists(
            video_mask_lists(lay, m, width), block_mask_to_lists(add_special_blocks(lay, m), width), width
        )
    with pytest.raises(ValueError, match="width must be in"):
        video_mask_lists(lay, m, nb + 1)
    with pytest.raises(ValueError, match="bool tensor"):
        video_mask_lists(lay, m.int())
    with pytest.raises(ValueError, match="video blocks"):
        video_mask_lists(lay, m[..., 1:])


def test_mass_lists_sorts_once():
    """One sort (the rule's own), no argsort: the mask path sorts twice (the rule, then an argsort per row of
    the widened [nb, nb] mask)."""
    from torch.profiler import ProfilerActivity, profile

    lay = make_tile_layout((9, 13, 17), (4, 4, 4), 70, edge_tiles="packed")
    nv, nb = lay.n_video_blocks, lay.n_blocks
    s = torch.randn(1, 2, nv, nv, generator=torch.Generator().manual_seed(1))
    for fn, sorts in ((mass_lists, 1), (mass_lists_via_mask, 2)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(lay, s, 0.9, 3, width=nb)
        ops = [e for e in prof.events() if e.name in ("aten::sort", "aten::argsort")]
        assert len([e for e in ops if e.name == "aten::sort"]) == sorts, [e.name for e in ops]
        assert any(e.name == "aten::argsort" for e in ops) == (sorts == 2)


def test_mass_mask_suffix_sum_unchanged():
    """mass_mask compares the flipped suffix sums before flipping back: the same mask as comparing the sums
    flipped back (the implementation it replaced), ties and -inf included."""
    s = structured_scores(2, 2, 31, seed=4)
    s[1, 1, 3, 5:] = float("-inf")
    for thr in (0.2, 0.9, 0.999, 1.0):
        for floor in (1, 4):
            sv, si = torch.sort(s, dim=-1, descending=True, stable=True)
            p = torch.softmax(sv, dim=-1).nan_to_num_(0.0)
            take = p.flip(-1).cumsum(-1).flip(-1) > 1.0 - thr
            take[..., :floor] = True
            assert torch.equal(mass_mask(s, thr, min_count=floor), torch.zeros_like(take).scatter_(-1, si, take))


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize(
    "text,quantize,predictor", [(0, False, "pooled_query"), (7, True, "pooled_query"), (7, False, "pooled")]
)
def test_sparge_cdfthreshd_lists_path_equals_the_mask_path(monkeypatch, impl, text, quantize, predictor):
    """sparge_attention with cdfthreshd and no self-similarity fallback (the list builder) gives the output,
    LSE and plan of the mask path it replaced (swapped back in through the module attribute)."""
    import ditattn.attention.sparse.sparge as sp
    from ditattn.evaluation.structured import StructuredSpec, structured_qkv

    grid = (4, 12, 16)
    q, k, v, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=3, seed=5), dtype=torch.float32)
    if text:
        t = torch.randn(3, 1, text, 3, 128, generator=torch.Generator().manual_seed(6))
        q, k, v = (torch.cat([a, b], 1) for a, b in zip((q, k, v), t))
    kw = dict(
        video_shape=grid,
        text_len=text,
        cdfthreshd=0.9,
        topk=0.2,
        quantize=quantize,
        predictor=predictor,
        return_lse=True,
        impl=impl,
    )
    calls = []
    monkeypatch.setattr(sp, "mass_lists", lambda *a, **k: calls.append(1) or mass_lists(*a, **k))
    out, lse, plan = sp.sparge_attention(q, k, v, **kw)
    assert calls == [1]  # the list builder's path
    monkeypatch.setattr(sp, "mass_lists", mass_lists_via_mask)
    rout, rlse, rplan = sp.sparge_attention(q, k, v, **kw)
    assert torch.equal(plan.kv_indices, rplan.kv_indices) and torch.equal(plan.kv_counts, rplan.kv_counts)
    assert torch.equal(out, rout) and torch.equal(lse, rlse)
    assert plan.kept_fraction == rplan.kept_fraction and 0 < plan.kept_fraction < 1
    assert plan.extra.keys() == rplan.extra.keys() and torch.equal(plan.extra["scores"], rplan.extra["scores"])
    counts = plan.kv_counts[0, :, : plan.layout.n_video_blocks]
    assert int(counts.min()) < int(counts.max())  # rows of varying length
    # and both are the mask of sparge_block_mask (the documented rule)
    from ditattn.attention.sparse.sparge import sparge_block_mask

    lay = plan.layout
    mask, _ = sparge_block_mask(
        tile(q, lay), tile(k, lay), lay, 0.2, 128**-0.5, predictor=predictor, cdfthreshd=0.9, impl=impl
    )
    assert_same_lists((plan.kv_indices, plan.kv_counts), block_mask_to_lists(mask))


# ------------------------------------------------------------------------------------------------
# the Triton kernels in the interpreter


@interp
@pytest.mark.parametrize("shape,text", LAYOUTS)
def test_topk_kernel_equals_reference(shape, text):
    """Exactly the reference's lists (same blocks, same order, same padding) on random rows and on
    rows of ties, signed zeros, infinities, NaN and subnormals, with and without special blocks."""
    lay = make_tile_layout(shape, (4, 4, 4), text, edge_tiles="packed")
    nv = lay.n_video_blocks
    s = structured_scores(1, 1, nv, seed=nv)
    for k in (1, nv // 3, nv):
        want, cnt, kept = topk_lists(lay, s, k, "reference")
        got, cnt2, kept2 = topk_lists(lay, s, k, "triton")
        assert got.dtype == torch.int32 and got.is_contiguous()
        assert torch.equal(got, want), (k, (got != want).any(-1).nonzero()[:4].tolist())
        assert cnt2 is cnt and kept2 == kept
    for i in range(7):  # and the structured rows by the rule itself
        assert set(got[0, 0, i, :k].tolist()) == rule_topk(s[0, 0, i].tolist(), k)


@interp
@pytest.mark.parametrize("shape,text,edge", CDF_LAYOUTS)
def test_mask_list_kernel_equals_reference(shape, text, edge):
    """The Triton mask list kernel: the PyTorch path's lists and counts exactly (empty, full and random rows,
    the cdfthreshd masks; the fixed width, cut widths and the tight one)."""
    lay = make_tile_layout(shape, (4, 4, 4), text, edge_tiles=edge)
    nv, nb = lay.n_video_blocks, lay.n_blocks
    g = torch.Generator().manual_seed(nb)
    m = torch.rand(2, 3, nv, nv, generator=g) < 0.4
    m[0, 0, 0] = False
    m[0, 0, 1] = True
    m[1, 2] = False
    s = torch.randn(2, 3, nv, nv, generator=g) * 3
    for width in (None, nb, 1, max(1, nb // 3)):
        assert_same_lists(
            video_mask_lists(lay, m, width, "triton"), video_mask_lists(lay, m, width, "reference"), width
        )
        assert_same_lists(
            mass_lists(lay, s, 0.9, 2, width=width, impl="triton"),
            mass_lists_via_mask(lay, s, 0.9, 2, width=width),
            width,
        )
    # strided mask rows (a view of a wider mask)
    wide = torch.rand(1, 2, nv, nv + 5, generator=g) < 0.5
    assert_same_lists(
        video_mask_lists(lay, wide[..., :nv], nb, "triton"),
        video_mask_lists(lay, wide[..., :nv].contiguous(), nb, "reference"),
    )


@interp
def test_sparge_cdfthreshd_triton_lists_equal_reference():
    """sparge_attention(impl="triton") with cdfthreshd takes the mask list kernel (fixed width is the CPU's tight
    one here) and plans what the PyTorch path plans from the same scores."""
    import ditattn.attention.sparse.sparge as sp
    from ditattn.evaluation.structured import StructuredSpec, structured_qkv

    grid, text = (8, 12, 16), 5
    q, k, v, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=2, seed=43), dtype=torch.float16)
    t = torch.randn(3, 1, text, 2, 128, generator=torch.Generator().manual_seed(8)).to(torch.float16)
    q, k, v = (torch.cat([a, b], 1) for a, b in zip((q, k, v), t))
    kw = dict(video_shape=grid, text_len=text, cdfthreshd=0.9, topk=0.2, quantize=False)
    out, _, plan = sp.sparge_attention(q, k, v, impl="triton", **kw)
    rout, _, rplan = sp.sparge_attention(q, k, v, impl="reference", **kw)
    assert torch.equal(plan.extra["scores"], rplan.extra["scores"])
    assert torch.equal(plan.kv_indices, rplan.kv_indices) and torch.equal(plan.kv_counts, rplan.kv_counts)
    counts = plan.kv_counts[0, :, : plan.layout.n_video_blocks]
    assert int(counts.min()) < int(counts.max())
    assert (out.float() - rout.float()).abs().max() < 2e-3


def test_mask_list_impl_is_checked():
    lay = make_tile_layout((5, 6, 7), (4, 4, 4), edge_tiles="packed")
    m = torch.zeros(1, 1, lay.n_video_blocks, lay.n_video_blocks, dtype=torch.bool)
    with pytest.raises(AttentionConfigError, match="'auto', 'reference' or 'triton'"):
        video_mask_lists(lay, m, impl="flex")


@interp
def test_topk_kernel_batch_heads_and_strided_scores():
    lay = make_tile_layout((4, 8, 8), (4, 4, 4), 5, edge_tiles="packed")
    nv = lay.n_video_blocks
    big = torch.randn(2, 3, nv, nv + 3, generator=torch.Generator().manual_seed(5)).round()
    s = big[..., :nv]  # row stride nv + 3
    got, _, _ = topk_lists(lay, s, 3, "triton")
    assert torch.equal(got, topk_lists(lay, s.contiguous(), 3, "reference")[0])


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pool_kernel_equals_pooled_blocks(dtype):
    """Bitwise on integer-valued tokens (every sum exact: the same division and scale follow), within
    float32 rounding of the sums on random tokens; only the video blocks; padding rows ignored."""
    from ditattn.attention.kernels.block_select import pool_qk_blocks

    lay = make_tile_layout((5, 6, 7), (4, 4, 4), 9, edge_tiles="packed")
    nv = lay.n_video_blocks
    count = lay.on("cpu").count_as(torch.float32).view(-1)
    g = torch.Generator().manual_seed(2)
    for integer in (True, False):
        q, k = (
            (
                torch.randint(-8, 9, (2, lay.seq_len, 3, 32), generator=g).float()
                if integer
                else torch.randn(2, lay.seq_len, 3, 32, generator=g)
            ).to(dtype)
            for _ in range(2)
        )
        qt, kt = tile(q, lay), tile(k, lay)
        pq, pk = pool_qk_blocks(qt, kt, count, n_blocks=nv, block_size=64, scale=0.3)
        rq, rk = pooled_blocks(qt, lay, nv, scale=0.3), pooled_blocks(kt, lay, nv)
        assert pq.shape == (2, 3, nv, 32) and pq.dtype == torch.float32 and pq.is_contiguous()
        if integer:
            assert torch.equal(pq, rq) and torch.equal(pk, rk)
        else:
            assert (pq - rq).abs().max() < 1e-6 and (pk - rk).abs().max() < 1e-6


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tiles,edge_tiles", [((4, 4, 4), "packed"), ((4, 4, 8), "padded")])
def test_block_moments_kernel_equals_the_pytorch_path(dtype, tiles, edge_tiles):
    """Sol's block moments (mean, and for the keys the per-channel variance) against pooled_blocks /
    pooled_query_features on partial tiles of an odd grid: bitwise on integer-valued tokens (the sums are
    exact), within float32 rounding on random ones with a large common offset (the variance's cancellation);
    padding rows ignored, never negative."""
    from ditattn.attention.kernels.block_select import pool_block_moments
    from ditattn.attention.sparse.block_scores import pooled_query_features

    lay = make_tile_layout((5, 6, 7), tiles, 9, edge_tiles=edge_tiles)
    nv, bs = lay.n_video_blocks, lay.block_size
    count = lay.on("cpu").count_as(torch.float32).view(-1)
    g = torch.Generator().manual_seed(5)
    for integer in (True, False):
        x = (
            torch.randint(-8, 9, (2, lay.seq_len, 3, 32), generator=g).float()
            if integer
            else torch.randn(2, lay.seq_len, 3, 32, generator=g) + 6.0
        ).to(dtype)
        xt = tile(x, lay)
        mean, var = pool_block_moments(xt, count, n_blocks=nv, block_size=bs, variance=True)
        alone, none = pool_block_moments(xt, count, n_blocks=nv, block_size=bs)
        rm, rv = pooled_query_features(xt, lay, nv, variance=True)
        assert none is None and torch.equal(alone, mean)
        assert mean.shape == var.shape == (2, 3, nv, 32) and mean.dtype == var.dtype == torch.float32
        assert bool((var >= 0).all())
        if integer:
            assert torch.equal(mean, rm) and torch.equal(var, rv)
        else:
            assert (mean - rm).abs().max() < 1e-5 and (var - rv).abs().max() < 1e-4
            # and against float64 from the real tokens alone
            m64, v64 = pooled_query_features(xt.double(), lay, nv, variance=True)
            assert (var.double() - v64).abs().max() < 1e-3


@interp
@pytest.mark.parametrize("shape,text", [((5, 6, 7), 0), ((5, 8, 8), 7)])
def test_vsa_triton_selection_equals_reference(shape, text):
    """The whole VSA call with the Triton selection (and core) against the PyTorch path: on
    integer-valued q/k the pooled scores are bitwise equal, so the plans must be identical."""
    S = math.prod(shape) + text
    g = torch.Generator().manual_seed(S)
    q, k = (torch.randint(-4, 5, (1, S, 2, 16), generator=g).to(torch.float16) for _ in range(2))
    v = torch.randn(1, S, 2, 16, generator=g).to(torch.float16)
    kw = dict(video_shape=shape, sparsity=0.7, text_len=text, return_lse=True)
    out, lse, plan = video_sparse_attention(q, k, v, impl="triton", **kw)
    rout, rlse, rplan = video_sparse_attention(q, k, v, impl="reference", **kw)
    assert torch.equal(plan.extra["scores"], rplan.extra["scores"])
    assert torch.equal(plan.kv_indices, rplan.kv_indices) and torch.equal(plan.kv_counts, rplan.kv_counts)
    assert plan.kept_fraction == rplan.kept_fraction
    assert (out.float() - rout.float()).abs().max() < 2e-3 and (lse - rlse).abs().max() < 2e-3


@interp
def test_triton_selection_is_three_launches():
    """Pooling, scores and lists on the Triton path: two kernel launches and one matmul; nothing
    else computes (the PyTorch path is ~11-13 ops: sums, divides, scale, copies, top-k, cast, sort, cats)."""
    from torch.profiler import ProfilerActivity, profile

    import ditattn.attention.kernels.block_select as bsel

    lay = make_tile_layout((5, 8, 12), (4, 4, 4), 7, edge_tiles="packed")
    q, k = (torch.randn(1, lay.seq_len, 2, 32).to(torch.float16) for _ in range(2))
    qt, kt = tile(q, lay), tile(k, lay)
    kk = vsa_num_selected(0.9, lay.n_video_blocks)
    launches = []

    class Count:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    def select():
        return topk_lists(lay, pooled_video_scores(qt, kt, lay, 32**-0.5, "triton"), kk, "triton")

    with pytest.MonkeyPatch.context() as m:
        for name in ("_pool_qk", "_topk_lists"):
            m.setattr(bsel, name, Count(name, getattr(bsel, name)))
        select()
        launches.clear()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            select()
    top = [
        e.name
        for e in prof.events()
        if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    ]
    # the interpreter's own host copies (new_empty / set_ / copy_) do not exist on a GPU
    computing = [
        n
        for n in top
        if n
        not in {
            "aten::new_empty",
            "aten::set_",
            "aten::copy_",
            "aten::empty",
            "aten::empty_like",
            "aten::view",
            "aten::transpose",
            "aten::expand",
            "aten::reshape",
            "aten::alias",
            "aten::slice",
            "aten::permute",
        }
    ]
    assert launches == ["_pool_qk", "_topk_lists"] and computing == ["aten::matmul"], (launches, computing)


@interp
def test_kernels_reject_bad_input():
    from ditattn.attention.kernels.block_select import pool_qk_blocks, topk_block_lists

    s = torch.zeros(1, 1, 4, 4)
    with pytest.raises(AttentionConfigError, match="1 <= k <= nv"):
        topk_block_lists(s, 5, n_blocks=4)
    with pytest.raises(AttentionConfigError, match="float32"):
        topk_block_lists(s.double(), 2, n_blocks=4)
    x = torch.zeros(1, 128, 2, 32, dtype=torch.float16)
    with pytest.raises(AttentionConfigError, match="block_size"):
        pool_qk_blocks(x, x, torch.ones(2), n_blocks=2, block_size=48, scale=1.0)
    with pytest.raises(AttentionConfigError, match="one shape"):
        pool_qk_blocks(x, x[:, :64], torch.ones(2), n_blocks=1, block_size=64, scale=1.0)
    from ditattn.attention.kernels.block_select import pool_block_moments

    with pytest.raises(AttentionConfigError, match="block_size"):
        pool_block_moments(x, torch.ones(2), n_blocks=2, block_size=48)
    with pytest.raises(AttentionConfigError, match="count must be float32"):
        pool_block_moments(x, torch.ones(1), n_blocks=2, block_size=64)
