"""The per-layer glue of the sparse video path (tiling, lists from top-k, lazy plan statistics):
exact equality with the mask-based path and no host synchronisation on the VSA call path."""

import pytest
import torch

from ditattn.attention.backends.base import AttnCall, get_impl
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.sparse import last_stats
from ditattn.attention.sparse.block_sparse import block_mask_to_lists, kept_fraction
from ditattn.attention.sparse.common import (
    SparsePlan,
    add_special_blocks,
    run_block_mask,
    topk_lists,
    topk_mask,
)
from ditattn.attention.sparse.tiling import gather_rows, make_tile_layout, pooled_blocks, tile, untile
from ditattn.attention.sparse.vsa import video_sparse_attention, vsa_block_mask, vsa_num_selected

# (video_shape, tile_size, text_len, block_size, special_ranges)
LAYOUTS = [
    ((5, 6, 7), (4, 4, 4), 0, None, ()),
    ((5, 6, 7), (4, 4, 4), 9, None, ()),
    ((3, 5, 9), (2, 4, 4), 70, None, ()),
    ((4, 4, 4), (2, 2, 2), 0, None, ()),
    ((3, 7, 5), (2, 3, 2), 5, 4, ((0, 6),)),
]


def _layout(case):
    vs, ts, text, bs, special = case
    return make_tile_layout(vs, ts, text, block_size=bs, special_ranges=special)


def _old_tile(x, lay, dim=1):
    shape = list(x.shape)
    shape[dim] = lay.padded_len
    return x.new_zeros(shape).index_copy_(dim, lay.position, x)


@pytest.mark.parametrize("case", LAYOUTS)
@pytest.mark.parametrize("ties", [False, True])
def test_topk_lists_equal_mask_lists(case, ties):
    lay = _layout(case)
    nv, nb = lay.n_video_blocks, lay.n_blocks
    g = torch.Generator().manual_seed(nv * 31 + nb)
    scores = torch.randn(2, 3, nv, nv, generator=g)
    if ties:
        scores = scores.round()  # many equal scores: the chosen set must still match
    for k in sorted({1, 2, nv // 2, nv - 1, nv, nv + 3}):
        if k < 1:
            continue
        idx, cnt, kept = topk_lists(lay, scores, k)
        ref_idx, ref_cnt = block_mask_to_lists(add_special_blocks(lay, topk_mask(scores, k)))
        assert idx.dtype == cnt.dtype == torch.int32
        assert idx.shape == ref_idx.shape and cnt.shape == ref_cnt.shape, k
        assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt), k
        assert kept == kept_fraction(ref_cnt, nb)


def test_topk_lists_k_zero():
    lay = _layout(LAYOUTS[1])
    scores = torch.randn(1, 2, lay.n_video_blocks, lay.n_video_blocks)
    idx, cnt, kept = topk_lists(lay, scores, 0)
    ref_idx, ref_cnt = block_mask_to_lists(add_special_blocks(lay, topk_mask(scores, 0)))
    assert torch.equal(idx, ref_idx) and torch.equal(cnt, ref_cnt) and kept == kept_fraction(ref_cnt, lay.n_blocks)


@pytest.mark.parametrize("case", LAYOUTS)
def test_tile_untile_equal_scatter_version(case):
    lay = _layout(case)
    x = torch.randn(2, lay.seq_len, 3, 8, dtype=torch.bfloat16)
    xt = tile(x, lay)
    assert xt.is_contiguous() and torch.equal(xt, _old_tile(x, lay))
    assert not xt[:, ~lay.valid].any()  # padding is zero
    assert torch.equal(untile(xt, lay), x)
    # non-contiguous input, other dims
    xn = torch.randn(3, 8, lay.seq_len, 2).transpose(0, 2)
    assert torch.equal(tile(xn, lay, dim=0), _old_tile(xn, lay, dim=0))
    lse = torch.randn(2, 3, lay.padded_len)
    assert torch.equal(untile(lse, lay, dim=2), lse.index_select(2, lay.position))


def test_gather_rows_zero_and_plain():
    x = torch.arange(24.0).view(2, 4, 3)
    out = gather_rows(x, 1, torch.tensor([3, 0, 0, 1]), zero=torch.tensor([2]))
    assert torch.equal(out, torch.stack([x[:, 3], x[:, 0], torch.zeros(2, 3), x[:, 1]], dim=1))
    assert torch.equal(gather_rows(x, -1, torch.tensor([2, 0])), x[..., [2, 0]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_pooled_blocks_equal_float_copy_version(dtype):
    lay = _layout(LAYOUTS[2])
    xt = tile(torch.randn(2, lay.seq_len, 3, 16).to(dtype), lay)
    dt = torch.float64 if dtype == torch.float64 else torch.float32
    s = xt.to(dt).view(2, lay.n_blocks, lay.block_size, 3, 16).sum(2)
    ref = (s / lay.block_count.clamp(min=1).to(dt).view(1, -1, 1, 1)).permute(0, 2, 1, 3).contiguous()
    got = pooled_blocks(xt, lay)
    assert got.dtype == dt and torch.equal(got, ref)


def test_kv_valid_view_is_cached():
    lay = _layout(LAYOUTS[1])
    a = lay.kv_valid(2)
    assert a is lay.kv_valid(2) and a.shape == (2, lay.padded_len)
    assert torch.equal(a[1], lay.valid) and lay.kv_valid(3).shape[0] == 3
    assert make_tile_layout((4, 4, 4), (4, 4, 4)).kv_valid(2) is None


@pytest.mark.parametrize("shape,text", [((5, 6, 7), 0), ((5, 6, 7), 11), ((3, 8, 9), 0), ((4, 4, 8), 6)])
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
def test_vsa_equals_mask_path(shape, text, sparsity, edge_tiles):
    """video_sparse_attention (lists from top-k) == the mask path (vsa_block_mask + run_block_mask)."""
    S = shape[0] * shape[1] * shape[2] + text
    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(2, S, 2, 16, generator=g) for _ in range(3))
    out, lse, plan = video_sparse_attention(
        q, k, v, video_shape=shape, sparsity=sparsity, text_len=text, return_lse=True, edge_tiles=edge_tiles
    )
    lay = make_tile_layout(shape, (4, 4, 4), text, edge_tiles=edge_tiles)
    assert plan.layout is lay
    scale = 16**-0.5
    bm, scores = vsa_block_mask(tile(q, lay), tile(k, lay), lay, sparsity, scale)
    ref_out, ref_lse, ref_plan = run_block_mask(q, k, v, lay, bm, scale=scale, return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(plan.kv_indices, ref_plan.kv_indices) and torch.equal(plan.kv_counts, ref_plan.kv_counts)
    assert torch.equal(plan.extra["scores"], scores)
    assert plan.extra["k"] == vsa_num_selected(sparsity, lay.n_video_blocks)
    old_float = float(ref_plan.kv_counts.sum()) / (ref_plan.kv_counts.numel() * lay.n_blocks)
    assert plan.kept_fraction == ref_plan.kept_fraction == old_float


def test_sparse_plan_kept_fraction_lazy():
    lay = _layout(LAYOUTS[1])
    cnt = torch.randint(0, lay.n_blocks + 1, (2, 3, lay.n_blocks), dtype=torch.int32)
    idx = torch.zeros(2, 3, lay.n_blocks, 1, dtype=torch.int32)
    expect = kept_fraction(cnt, lay.n_blocks)
    lazy = SparsePlan(lay, idx, cnt)
    assert "pending" in repr(lazy)
    assert isinstance(lazy.kept_fraction, float) and lazy.kept_fraction == expect
    from_tensor = SparsePlan(lay, idx, cnt, torch.tensor(0.25))
    assert from_tensor.kept_fraction == 0.25 and isinstance(from_tensor.kept_fraction, float)
    assert SparsePlan(None, idx, cnt, 0.5, {"a": 1}).kept_fraction == 0.5
    with pytest.raises(ValueError, match="needs kept_fraction"):
        SparsePlan(None, idx, cnt)


def _forbid_host_reads(monkeypatch):
    """Make every Python-level tensor -> host conversion raise (what syncs a CUDA stream)."""

    def boom(*_a, **_k):
        raise AssertionError("host synchronisation on the VSA path")

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for name in ("nonzero", "unique", "argwhere", "masked_select"):
        monkeypatch.setattr(torch, name, boom)


@pytest.mark.parametrize("text", [0, 7])
def test_vsa_path_has_no_host_reads(monkeypatch, text):
    shape = (5, 6, 7)
    S = 5 * 6 * 7 + text
    q, k, v = (torch.randn(1, S, 2, 16) for _ in range(3))
    kw = dict(video_shape=shape, sparsity=0.75, text_len=text, return_lse=True)
    want = video_sparse_attention(q, k, v, **kw)  # builds the cached layout / constants first
    impl = get_impl(B.VIDEO_SPARSE_ATTN)
    call = AttnCall(video_shape=shape, text_len=text, step=3, layer_idx=2, return_lse=True)
    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        got = video_sparse_attention(q, k, v, **kw)
        out, lse = impl(q, k, v, call, {"sparsity": 0.75})
    assert torch.equal(got[0], want[0]) and torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert last_stats["video_sparse_attn/layer2"]["kept_fraction"] == want[2].kept_fraction


@pytest.mark.parametrize("name", ["sparge", "sparge_int8", "sla"])
def test_sparge_and_sla_paths_have_no_host_reads(monkeypatch, name):
    """Sparge's and SLA's lists come from the top-k of the pooled scores, their fractions from host
    arithmetic: no device synchronisation on a (packed edge tiles) call either."""
    from ditattn.attention.sparse.sla import sla_attention
    from ditattn.attention.sparse.sparge import sparge_attention

    shape, text = (5, 8, 12), 7
    S = 5 * 8 * 12 + text
    q, k, v = (torch.randn(1, S, 2, 64) for _ in range(3))
    kw = dict(video_shape=shape, text_len=text, topk=0.4, return_lse=True)
    fn = sla_attention if name == "sla" else sparge_attention
    if name == "sparge_int8":  # the backend's default: INT8 Q.K in the kept blocks
        kw["quantize"] = True
    want = fn(q, k, v, **kw)
    assert want[2].layout.n_packed_blocks > 0
    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        got = fn(q, k, v, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].kept_fraction == want[2].kept_fraction


@pytest.mark.parametrize("name", ["svg2", "sol", "sparge_cdf"])
def test_svg2_and_sol_paths_have_no_host_reads(monkeypatch, name):
    """SVG2 (cold then warm k-means steps, the cluster plan, the per-head gathers), Sol and Sparge with
    ``cdfthreshd`` (rows of varying length) run their
    whole backend call without reading a value back from the device: on the meta device (where any
    such read fails) with every tensor -> host conversion and every host -> device copy (a stream
    wait on CUDA) forbidden besides.  Their kept fraction
    is recorded as a device scalar that the statistics entry reads on first access."""
    from ditattn.attention.sparse import LayerStats, clear_stats
    from ditattn.attention.sparse.svg2 import reset_svg2_state

    shape, text = (5, 8, 12), 7
    S = 5 * 8 * 12 + text
    q, k, v = (torch.randn(1, S, 2, 128, device="meta", dtype=torch.bfloat16) for _ in range(3))
    backend = {"svg2": B.SPARSE_VIDEO_GEN_2_ATTN, "sol": B.SOL_ATTN, "sparge_cdf": B.SPARGE_ATTN}[name]
    impl = get_impl(backend)
    # the plain rules (error_budget 0): the budget's dense decision reads one flag per call
    cfg = {
        "svg2": {"num_q_clusters": 6, "num_k_clusters": 9},
        "sol": {},
        "sparge_cdf": {"cdfthreshd": 0.9, "topk": 0.2},
    }[name] | {"error_budget": 0.0}
    steps = (0, 1, 2) if name == "svg2" else (12,)
    reset_svg2_state()
    if name != "svg2":  # builds the cached tile layout's device constants first (once per layout)
        impl(q, k, v, AttnCall(video_shape=shape, text_len=text, step=12, layer_idx=2), cfg)
    clear_stats()
    real_to = torch.Tensor.to

    def to_without_upload(self, *a, **kw):  # a host -> device copy waits for the stream on CUDA too
        out = real_to(self, *a, **kw)
        if self.device.type == "cpu" and out.device.type != "cpu":
            raise AssertionError("host-to-device copy on the call path")
        return out

    with monkeypatch.context() as m:
        _forbid_host_reads(m)
        m.setattr(torch.Tensor, "to", to_without_upload)
        for step in steps:
            out, lse = impl(
                q, k, v, AttnCall(video_shape=shape, text_len=text, step=step, layer_idx=2, return_lse=True), cfg
            )
            assert out.shape == q.shape and lse.shape == (1, 2, S)
    entry = last_stats[f"{backend.value}/layer2"]
    assert isinstance(entry, LayerStats) and not entry["dense"]
    assert isinstance(dict.__getitem__(entry, "kept_fraction"), torch.Tensor)  # not read yet
    if name == "svg2":
        assert entry["mode"] == "warm"
    reset_svg2_state()


def test_lazy_kept_fraction_reads_as_float():
    """On the CPU the same backends record the kept fraction of their plan; reading the entry (in
    any way) gives the float."""
    import json

    from ditattn.attention.sparse import clear_stats
    from ditattn.attention.sparse.svg2 import reset_svg2_state, svg2_attention

    shape, text = (4, 8, 8), 5
    S = 4 * 8 * 8 + text
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, S, 2, 32, generator=g) for _ in range(3))
    reset_svg2_state()
    clear_stats()
    kw = dict(num_q_clusters=8, num_k_clusters=16, top_p=0.5)
    get_impl(B.SPARSE_VIDEO_GEN_2_ATTN)(
        q, k, v, AttnCall(video_shape=shape, text_len=text, step=None, layer_idx=1), dict(kw, error_budget=0.0)
    )
    want = svg2_attention(q, k, v, video_shape=shape, text_len=text, **kw)[2].kept_fraction
    entry = last_stats["sparse_video_gen_2_attn/layer1"]
    assert isinstance(dict.__getitem__(entry, "kept_fraction"), torch.Tensor)
    assert dict(entry)["kept_fraction"] == want and isinstance(dict(entry)["kept_fraction"], float)
    assert json.loads(json.dumps(entry))["kept_fraction"] == pytest.approx(want)
    assert entry.get("kept_fraction") == want and 0 < want < 1 and entry == dict(entry)
