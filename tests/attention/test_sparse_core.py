"""Sparse engine core: 3-D tiling and the block-sparse attention kernel (CPU reference + FlexAttention)."""

import math
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from ditattn.attention.backends.base import reference_attention
from ditattn.attention.sparse.block_sparse import (
    block_lists_to_dense_mask,
    block_mask_to_lists,
    block_sparse_attention,
    dense_attention,
    full_lists,
    kept_fraction,
    lists_to_block_mask,
)
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, pooled_blocks, tile, untile
from ditattn.errors import AttentionConfigError

GRIDS = [(3, 5, 7), (2, 6, 9), (1, 1, 1), (5, 4, 3)]


def token_coords(video_shape):
    T, H, W = video_shape
    i = torch.arange(T * H * W)
    return torch.stack([i // (H * W), (i // W) % H, i % W], 1)


# ------------------------------------------------------------------------------------------------
# tiling


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("text_len", [0, 7])
@pytest.mark.parametrize("tile_size", [(4, 4, 4), (1, 2, 2), (2, 3, 2)])
def test_tiling_round_trip_and_tile_contents(grid, text_len, tile_size):
    lay = make_tile_layout(grid, tile_size, text_len)
    n = grid[0] * grid[1] * grid[2]
    S = n + text_len
    x = torch.randn(2, S, 3, 5)
    xt = tile(x, lay)
    assert xt.shape == (2, lay.padded_len, 3, 5)
    assert lay.padded_len % lay.block_size == 0
    assert torch.equal(untile(xt, lay), x)
    # padding positions hold zeros and are exactly the invalid positions
    assert torch.equal(xt[:, ~lay.valid], torch.zeros_like(xt[:, ~lay.valid]))
    assert int(lay.valid.sum()) == S
    # independently: each video block holds exactly the tokens of one tile, in raster order
    coords = token_coords(grid)
    tt, th, tw = tile_size
    tcoord = coords // torch.tensor(tile_size)
    ids = torch.arange(S, dtype=torch.float64).view(1, S, 1, 1)
    src = tile(ids, lay)[0, :, 0, 0]
    seen = set()
    for b in range(lay.n_video_blocks):
        blk = src[b * lay.block_size : (b + 1) * lay.block_size]
        real = [int(t) for t, ok in zip(blk.tolist(), lay.valid[b * lay.block_size : (b + 1) * lay.block_size]) if ok]
        tc = tuple(lay.block_coords[b].tolist())
        expect = [i for i in range(n) if tuple(tcoord[i].tolist()) == tc]
        assert real == expect, (b, tc)
        seen.update(real)
    assert seen == set(range(n))
    # text tokens follow in order in the trailing blocks
    tail = [
        int(t)
        for t, ok in zip(
            src[lay.n_video_blocks * lay.block_size :].tolist(), lay.valid[lay.n_video_blocks * lay.block_size :]
        )
        if ok
    ]
    assert tail == list(range(n, S))
    assert lay.n_special_blocks == -(-text_len // lay.block_size)
    assert lay.n_video_blocks == lay.n_tiles == len(lay.block_coords)


def test_tiling_special_ranges_and_multi_block_tiles():
    grid, text_len = (3, 5, 7), 4
    lay = make_tile_layout(grid, (3, 5, 7), text_len, block_size=16, special_ranges=[(10, 20)])
    S = 105 + text_len
    x = torch.randn(1, S, 2, 3)
    assert torch.equal(untile(tile(x, lay), lay), x)
    ids = tile(torch.arange(S, dtype=torch.float64).view(1, S, 1, 1), lay)[0, :, 0, 0]
    real = ids[lay.valid].long().tolist()
    video = [i for i in range(105) if not 10 <= i < 20]
    assert real == video + list(range(10, 20)) + list(range(105, S))
    assert lay.n_video_blocks == -(-95 // 16)
    assert lay.n_special_blocks == -(-14 // 16)


def test_tiling_errors():
    with pytest.raises(AttentionConfigError, match="video_shape"):
        make_tile_layout((3, 0, 2))
    with pytest.raises(AttentionConfigError, match="tile_size"):
        make_tile_layout((3, 4, 2), (4, 4))
    lay = make_tile_layout((2, 2, 2), (2, 2, 2), 0)
    with pytest.raises(AttentionConfigError, match="does not match the latent grid"):
        tile(torch.randn(1, 9, 1, 1), lay)
    with pytest.raises(AttentionConfigError, match="outside the sequence"):
        TileLayout((2, 2, 2), (2, 2, 2), 0, special_ranges=[(4, 12)])


def test_pooled_blocks_means_real_tokens_only():
    lay = make_tile_layout((3, 5, 7), (2, 2, 2), 3)
    x = torch.randn(1, 108, 2, 4, dtype=torch.float64)
    pooled = pooled_blocks(tile(x, lay), lay)
    coords = token_coords((3, 5, 7)) // 2
    for b in range(lay.n_video_blocks):
        sel = (coords == lay.block_coords[b]).all(1)
        torch.testing.assert_close(pooled[0, :, b], x[0, :105][sel].mean(0), rtol=0, atol=1e-12)
    torch.testing.assert_close(pooled[0, :, -1], x[0, 105:].mean(0), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# packed edge tiles

PACKED_CASES = [  # (grid, tile, text_len, special ranges)
    ((5, 8, 12), (4, 4, 4), 0, ()),  # a 1-frame last slab: 16-token tiles, four to a block
    ((6, 10, 9), (4, 4, 4), 7, ()),  # cut on every axis: 32-, 16-, 8-token ... tiles
    ((9, 7, 13), (4, 4, 4), 3, ()),
    ((3, 5, 7), (1, 2, 3), 0, ()),
    ((7, 9, 11), (2, 4, 4), 5, ((20, 45),)),  # special tokens make some edge tiles smaller
    ((1, 1, 1), (4, 4, 4), 2, ()),
    ((2, 2, 2), (4, 4, 4), 0, ((0, 8),)),  # every video token special: no video block
]


def _block_tiles(lay):
    """Blocks as (sorted tile list, real-token count) read off tile() of the token indices."""
    n = math.prod(lay.video_shape)
    ids = tile(torch.arange(lay.seq_len, dtype=torch.float64).view(1, -1, 1, 1), lay)[0, :, 0, 0].long()
    out = []
    for b in range(lay.n_video_blocks):
        toks = [
            t
            for t, ok in zip(
                ids[b * lay.block_size : (b + 1) * lay.block_size].tolist(),
                lay.valid[b * lay.block_size : (b + 1) * lay.block_size].tolist(),
            )
            if ok
        ]
        assert all(t < n for t in toks)
        out.append((sorted({int(lay.token_tile[t]) for t in toks}), toks))
    return out


@pytest.mark.parametrize("grid,tile_size,text_len,special", PACKED_CASES)
def test_packed_layout_round_trip_and_blocks(grid, tile_size, text_len, special):
    from test_sparse_planners import tile_groups

    lay = make_tile_layout(grid, tile_size, text_len, special_ranges=special, edge_tiles="packed")
    pad = make_tile_layout(grid, tile_size, text_len, special_ranges=special)
    S = lay.seq_len
    x = torch.randn(2, S, 3, 5)
    xt = tile(x, lay)
    assert xt.shape == (2, lay.padded_len, 3, 5) and torch.equal(untile(xt, lay), x)
    assert torch.equal(xt[:, ~lay.valid], torch.zeros_like(xt[:, ~lay.valid])) and int(lay.valid.sum()) == S
    y = torch.randn(2, lay.padded_len, 3, 5)
    assert torch.equal(tile(untile(y, lay), lay)[:, lay.valid], y[:, lay.valid])
    # the blocks are the independent rule's groups; every tile whole inside one block
    n = math.prod(grid)
    is_special = torch.zeros(n, dtype=torch.bool)
    for a, b in special:
        is_special[a : min(b, n)] = True
    groups, counts = tile_groups(grid, tile_size, "packed", is_special)
    blocks = _block_tiles(lay)
    assert [tiles for tiles, _ in blocks] == [sorted(g) for g in groups]
    assert lay.n_video_blocks == len(groups) <= pad.n_video_blocks
    for b, (tiles, toks) in enumerate(blocks):
        assert len(toks) == sum(counts[t] for t in tiles) == int(lay.block_count[b]) <= lay.block_size
        c = token_coords(grid)[toks] // torch.tensor(tile_size)
        torch.testing.assert_close(lay.block_centroid[b], c.double().mean(0), rtol=0, atol=1e-12)
    assert lay.n_packed_blocks == sum(len(g) > 1 for g in groups)
    # text (and other special tokens) follow in order, as in the padded layout
    ids = tile(torch.arange(S, dtype=torch.float64).view(1, S, 1, 1), lay)[0, :, 0, 0]
    assert ids[lay.n_video_blocks * lay.block_size :][
        lay.valid[lay.n_video_blocks * lay.block_size :]
    ].tolist() == ids_pad_tail(pad)


def ids_pad_tail(lay):
    ids = tile(torch.arange(lay.seq_len, dtype=torch.float64).view(1, -1, 1, 1), lay)[0, :, 0, 0]
    return ids[lay.n_video_blocks * lay.block_size :][lay.valid[lay.n_video_blocks * lay.block_size :]].tolist()


def test_packed_runs_are_chains_of_neighbour_tiles_of_one_shape():
    lay = make_tile_layout((6, 10, 9), (4, 4, 4), 0, edge_tiles="packed")
    ids = tile(torch.arange(lay.seq_len, dtype=torch.float64).view(1, -1, 1, 1), lay)[0, :, 0, 0].long()
    grid = torch.tensor(lay.grid)
    packed = 0
    for b in range(lay.n_video_blocks):
        toks = ids[b * 64 : (b + 1) * 64][lay.valid[b * 64 : (b + 1) * 64]]
        walk = list(dict.fromkeys(lay.token_tile[toks].tolist()))  # tiles in layout order
        if len(walk) == 1:
            continue
        packed += 1
        coords = torch.stack(
            [torch.tensor([t // (grid[1] * grid[2]), (t // grid[2]) % grid[1], t % grid[2]]) for t in walk]
        )
        ext = torch.minimum(torch.tensor([4, 4, 4]), torch.tensor([6, 10, 9]) - coords * 4)
        assert (ext == ext[0]).all() and ext[0].prod() < 64  # edge tiles of one shape
        assert ((coords[1:] - coords[:-1]).abs().sum(1) == 1).all()  # each step a face neighbour
    assert packed == lay.n_packed_blocks > 0


@pytest.mark.parametrize(
    "grid,text,blocks",
    [((21, 30, 52), 0, 513), ((21, 30, 52), 512, 521), ((21, 45, 80), 0, 1182), ((21, 45, 80), 512, 1190)],
)
def test_packed_layout_at_wan_grids(grid, text, blocks):
    lay = make_tile_layout(grid, (4, 4, 4), text, edge_tiles="packed")
    pad = make_tile_layout(grid, (4, 4, 4), text)
    assert lay.n_blocks == blocks
    assert lay.n_video_blocks <= -(-math.prod(grid) // 64) + 1  # within one block of the minimum
    assert pad.n_video_blocks == math.prod(pad.grid)  # 624 / 1440: one padded block per tile
    assert int(lay.block_count[: lay.n_video_blocks].sum()) == math.prod(grid)


def test_pooled_blocks_of_packed_layout_are_real_token_means():
    lay = make_tile_layout((6, 10, 9), (4, 4, 4), 5, edge_tiles="packed")
    assert lay.n_packed_blocks > 0
    x = torch.randn(2, lay.seq_len, 3, 4, dtype=torch.float64)
    xt = tile(x, lay)
    pooled = pooled_blocks(xt, lay)
    src = lay.source.view(lay.n_blocks, lay.block_size)
    for b in range(lay.n_blocks):
        real = src[b][src[b] >= 0]
        torch.testing.assert_close(pooled[:, :, b], x[:, real].mean(1), rtol=0, atol=1e-12)
    nv = lay.n_video_blocks
    torch.testing.assert_close(pooled_blocks(xt, lay, nv, scale=0.5), pooled[:, :, :nv] * 0.5, rtol=0, atol=1e-12)


def test_edge_tiles_errors_and_sta_refuses_packed():
    from ditattn.attention.sparse.sta import sta_video_mask

    with pytest.raises(AttentionConfigError, match="edge_tiles must be one of"):
        make_tile_layout((3, 5, 7), edge_tiles="merged")
    with pytest.raises(AttentionConfigError, match="STA windows are defined on tile coordinates"):
        sta_video_mask(make_tile_layout((5, 8, 12), edge_tiles="packed"), [1, 1, 1])
    # a grid with no two edge tiles of one shape packs nothing: the same layout as padded
    a, b = make_tile_layout((5, 6, 7), edge_tiles="packed"), make_tile_layout((5, 6, 7))
    assert a.n_packed_blocks == 0 and torch.equal(a.position, b.position)


def test_sol_neighbour_blocks_padded_is_tile_distance():
    from ditattn.attention.sparse.sol import neighbour_blocks

    lay = make_tile_layout((7, 9, 11), (4, 4, 4), 3, special_ranges=[(0, 64)])  # specials leave holes
    bt = lay.block_tile[: lay.n_video_blocks]
    assert torch.equal(neighbour_blocks(lay, torch.device("cpu")), (bt.view(-1, 1) - bt.view(1, -1)).abs() <= 1)


# ------------------------------------------------------------------------------------------------
# block lists


def test_list_helpers_round_trip():
    g = torch.Generator().manual_seed(0)
    bm = torch.rand(2, 3, 5, 6, generator=g) < 0.4
    bm[0, 0, 1] = False
    idx, cnt = block_mask_to_lists(bm)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx.shape == (2, 3, 5, int(bm.sum(-1).max()))
    assert torch.equal(cnt.long(), bm.sum(-1))
    for b in range(2):
        for h in range(3):
            for i in range(5):
                c = int(cnt[b, h, i])
                assert idx[b, h, i, :c].tolist() == torch.nonzero(bm[b, h, i]).flatten().tolist()
                assert (idx[b, h, i, c:] == 0).all()
    assert torch.equal(lists_to_block_mask(idx, cnt, 6), bm)
    dense = block_lists_to_dense_mask(idx, cnt, block_size=4, seq_len_kv=24)
    assert dense.shape == (2, 3, 20, 24)
    assert torch.equal(dense[:, :, ::4, ::4], bm)
    assert kept_fraction(cnt, 6) == pytest.approx(float(bm.float().mean()))
    fi, fc = full_lists(1, 2, 3, 4)
    assert torch.equal(lists_to_block_mask(fi, fc, 4), torch.ones(1, 2, 3, 4, dtype=torch.bool))


def test_fixed_width_lists_same_plan_and_output():
    """block_mask_to_lists(width=...) pads the same lists with zeros (no sync: the width is given) and
    every kernel gives the same result; list_width is fixed off the CPU only; a bad width is refused."""
    from ditattn.attention.sparse.block_sparse import list_width

    q, k, v, idx, cnt, bs, valid = _case(11)
    bm = lists_to_block_mask(idx, cnt, q.shape[1] // bs)
    nk = bm.shape[-1]
    wide, wcnt = block_mask_to_lists(bm, width=nk)
    assert wide.shape[-1] == nk > idx.shape[-1] and torch.equal(wcnt, cnt)
    assert torch.equal(wide[..., : idx.shape[-1]], idx) and not wide[..., idx.shape[-1] :].any()
    tight = block_sparse_attention(q, k, v, idx, cnt, block_size=bs, kv_valid=valid, return_lse=True)
    padded = block_sparse_attention(q, k, v, wide, wcnt, block_size=bs, kv_valid=valid, return_lse=True)
    assert torch.equal(tight[0], padded[0]) and torch.equal(tight[1], padded[1])
    assert list_width(torch.device("cpu"), nk) is None and list_width(torch.device("meta"), nk) == nk
    with torch.device("meta"):  # shapes only: any read of a value would fail here
        assert block_mask_to_lists(bm.to("meta"), width=3)[0].shape == (*bm.shape[:3], 3)
    for bad in (0, nk + 1):
        with pytest.raises(ValueError, match="width must be in"):
            block_mask_to_lists(bm, width=bad)


# ------------------------------------------------------------------------------------------------
# kernel


def _case(seed, B=2, S=96, H=4, Hkv=4, D=16, bs=16, p=0.4, kv_valid="2d"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    nb = S // bs
    bm = torch.rand(B, H, nb, nb, generator=g) < p
    bm[0, 0, 1] = False  # an empty query block
    idx, cnt = block_mask_to_lists(bm)
    valid = None
    if kv_valid == "2d":
        valid = torch.rand(B, S, generator=g) < 0.85
    elif kv_valid == "3d":
        valid = torch.rand(B, H, S, generator=g) < 0.85
    return q, k, v, idx, cnt, bs, valid


def _check_against_reference(out, lse, q, k, v, idx, cnt, bs, valid, scale=None, atol=2e-6):
    mask = block_lists_to_dense_mask(idx, cnt, block_size=bs, seq_len_kv=k.shape[1], kv_valid=valid)
    ro, rl = reference_attention(q, k, v, mask=mask, scale=scale)
    torch.testing.assert_close(out.float(), ro.float(), rtol=0, atol=atol)
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(rl))
        fin = torch.isfinite(rl)
        torch.testing.assert_close(lse[fin], rl[fin].float(), rtol=0, atol=atol)


@pytest.mark.parametrize("kv_valid", [None, "2d", "3d"])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_reference_kernel_matches_masked_dense(kv_valid, hkv):
    q, k, v, idx, cnt, bs, valid = _case(1, Hkv=hkv, kv_valid=kv_valid)
    out, lse = block_sparse_attention(
        q, k, v, idx, cnt, block_size=bs, kv_valid=valid, return_lse=True, impl="reference"
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 96) and lse.dtype == torch.float32
    assert (out[0, 16:32, 0] == 0).all() and torch.isinf(lse[0, 0, 16:32]).all()
    _check_against_reference(out, lse, q, k, v, idx, cnt, bs, valid)


def test_reference_kernel_options():
    q, k, v, idx, cnt, bs, valid = _case(2, kv_valid=None)
    out, lse = block_sparse_attention(q, k, v, idx, cnt, block_size=bs, scale=0.3)
    assert lse is None
    _check_against_reference(out, None, q, k, v, idx, cnt, bs, None, scale=0.3)
    # broadcast lists over batch and heads; non-square (S_q != S_kv)
    g = torch.Generator().manual_seed(3)
    q2 = torch.randn(2, 32, 3, 8, generator=g)
    k2 = torch.randn(2, 48, 3, 8, generator=g)
    v2 = torch.randn(2, 48, 3, 8, generator=g)
    bm = torch.tensor([[[[1, 0, 1], [0, 1, 1]]]], dtype=torch.bool)
    idx2, cnt2 = block_mask_to_lists(bm)
    out2, _ = block_sparse_attention(q2, k2, v2, idx2, cnt2, block_size=16)
    mask = block_lists_to_dense_mask(idx2, cnt2, block_size=16, seq_len_kv=48)
    torch.testing.assert_close(out2, reference_attention(q2, k2, v2, mask=mask)[0], rtol=0, atol=2e-6)
    # float64 and bf16 inputs keep their dtype
    out64, _ = block_sparse_attention(q.double(), k.double(), v.double(), idx, cnt, block_size=bs)
    assert out64.dtype == torch.float64
    ref64 = reference_attention(
        q.double(),
        k.double(),
        v.double(),
        mask=block_lists_to_dense_mask(idx, cnt, block_size=bs),
        dtype=torch.float64,
    )[0]
    torch.testing.assert_close(out64, ref64, rtol=0, atol=1e-12)
    outb, _ = block_sparse_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), idx, cnt, block_size=bs)
    assert outb.dtype == torch.bfloat16


def test_small_reference_chunks_give_same_result(monkeypatch):
    import ditattn.attention.sparse.block_sparse as bsmod

    q, k, v, idx, cnt, bs, valid = _case(4)
    a, la = block_sparse_attention(q, k, v, idx, cnt, block_size=bs, kv_valid=valid, return_lse=True)
    monkeypatch.setattr(bsmod, "_REF_CHUNK_ELEMS", 1)
    b, lb = block_sparse_attention(q, k, v, idx, cnt, block_size=bs, kv_valid=valid, return_lse=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(la, lb, rtol=0, atol=0)


@pytest.mark.parametrize("kv_valid", [None, "2d", "3d"])
def test_flex_matches_reference(kv_valid):
    q, k, v, idx, cnt, bs, valid = _case(5, B=1, S=64, H=2, Hkv=1, kv_valid=kv_valid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = block_sparse_attention(
            q, k, v, idx, cnt, block_size=bs, kv_valid=valid, return_lse=True, impl="flex"
        )
        out2, none = block_sparse_attention(q, k, v, idx, cnt, block_size=bs, kv_valid=valid, impl="flex")
    assert none is None
    _check_against_reference(out, lse, q, k, v, idx, cnt, bs, valid, atol=1e-5)
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-6)


def test_dispatch_and_argument_errors(monkeypatch):
    q, k, v, idx, cnt, bs, valid = _case(6)
    a, _ = block_sparse_attention(q, k, v, idx, cnt, block_size=bs, impl="auto")
    b, _ = block_sparse_attention(q, k, v, idx, cnt, block_size=bs, impl="reference")
    assert torch.equal(a, b)  # auto = reference on CPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors reach the Triton kernel only when interpreted
    with pytest.raises(AttentionConfigError, match="CUDA"):
        block_sparse_attention(q, k, v, idx, cnt, block_size=bs, impl="triton")
    with pytest.raises(AttentionConfigError, match="impl"):
        block_sparse_attention(q, k, v, idx, cnt, block_size=bs, impl="cuda")
    with pytest.raises(ValueError, match="multiples of block_size"):
        block_sparse_attention(q, k, v, idx, cnt, block_size=17)
    with pytest.raises(ValueError, match="query blocks"):
        block_sparse_attention(q, k, v, idx[:, :, :2], cnt[:, :, :2], block_size=bs)
    with pytest.raises(ValueError, match="kv_valid"):
        block_sparse_attention(q, k, v, idx, cnt, block_size=bs, kv_valid=valid.float())


def test_dense_attention_helper():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 40, 4, 8, generator=g)
    k = torch.randn(1, 40, 2, 8, generator=g)
    v = torch.randn(1, 40, 2, 8, generator=g)
    ro, rl = reference_attention(q, k, v)
    o, l = dense_attention(q, k, v)
    assert l is None
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-6)
    o, l = dense_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(o, ro, rtol=0, atol=2e-6)
    torch.testing.assert_close(l, rl, rtol=0, atol=2e-6)
