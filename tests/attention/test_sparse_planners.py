"""Each sparse planner against an explicit token mask built independently here (original token order),
and each planner's output against dense attention with that mask (fp32, tight)."""

import math
import os
import warnings
from fractions import Fraction

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from ditattn.attention.backends.base import reference_attention
from ditattn.attention.sparse.common import plan_token_mask
from ditattn.attention.sparse.sla import sla_attention
from ditattn.attention.sparse.sol import sol_attention
from ditattn.attention.sparse.sparge import sparge_attention
from ditattn.attention.sparse.sta import sliding_tile_attention
from ditattn.attention.sparse.svg2 import kmeans, svg2_attention, svg2_token_mask
from ditattn.attention.sparse.vmoba import vmoba_attention, vmoba_layer_mode
from ditattn.attention.sparse.vsa import video_sparse_attention

ATOL = 3e-6


def qkv(grid, text_len, heads=3, dim=16, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = grid[0] * grid[1] * grid[2] + text_len
    return tuple(torch.randn(batch, S, heads, dim, generator=g) for _ in range(3))


def coords(grid):
    T, H, W = grid
    i = torch.arange(T * H * W)
    return torch.stack([i // (H * W), (i // W) % H, i % W], 1)


def with_text(video_mask, text_len):
    """[..., N, N] video mask -> [..., S, S] with text rows/cols all True."""
    N = video_mask.shape[-1]
    S = N + text_len
    out = torch.ones(*video_mask.shape[:-2], S, S, dtype=torch.bool)
    out[..., :N, :N] = video_mask
    return out


def tile_ids(grid, tile):
    c = coords(grid) // torch.tensor(tile)
    n = [-(-g // t) for g, t in zip(grid, tile)]
    return (c[:, 0] * n[1] + c[:, 1]) * n[2] + c[:, 2], n


def tile_groups(grid, tile, edge_tiles="padded", special=None):
    """Blocks as lists of flat tile ids, in block order, by the rule of tiling.py's docstring written
    here in plain Python (one block per tile; no tile spans several blocks).  ``special``: bool [N] of
    video tokens carried outside the tiles.  Returns ``(groups, counts per tile)``."""
    ids, n = tile_ids(grid, tile)
    keep = torch.ones(ids.numel(), dtype=torch.bool) if special is None else ~special
    counts = torch.bincount(ids[keep], minlength=n[0] * n[1] * n[2]).tolist()
    vol = math.prod(tile)
    runs = []
    packed = set()
    if edge_tiles == "packed":
        by_shape = {}
        for tid in range(len(counts)):
            c = (tid // (n[1] * n[2]), (tid // n[2]) % n[1], tid % n[2])
            ext = tuple(min(tile[a], grid[a] - c[a] * tile[a]) for a in range(3))
            if math.prod(ext) < vol and 0 < counts[tid] < vol:
                by_shape.setdefault(ext, {})[c] = tid
        for cells in by_shape.values():
            axes = [sorted({c[a] for c in cells}) for a in range(3)]
            walk, flip_mid, flip_last = [], False, False
            for a in axes[0]:
                for b in axes[1][::-1] if flip_mid else axes[1]:
                    walk += [cells[(a, b, c)] for c in (axes[2][::-1] if flip_last else axes[2]) if (a, b, c) in cells]
                    flip_last = not flip_last
                flip_mid = not flip_mid
            run, filled = [], 0
            for tid in walk:
                if run and filled + counts[tid] > vol:
                    runs.append(run)
                    run, filled = [], 0
                run.append(tid)
                filled += counts[tid]
            runs.append(run)
        packed = {t for r in runs for t in r}
    groups = runs + [[t] for t in range(len(counts)) if counts[t] and t not in packed]
    return sorted(groups, key=min), counts


def block_ids(grid, tile, edge_tiles="padded", special=None):
    """``(block index of every video token [N] (-1 for special), blocks as tile lists)``."""
    groups, _ = tile_groups(grid, tile, edge_tiles, special)
    tid, _ = tile_ids(grid, tile)
    of_tile = {t: g for g, ts in enumerate(groups) for t in ts}
    ids = torch.tensor([of_tile.get(t, -1) for t in tid.tolist()])
    if special is not None:
        ids[special] = -1
    return ids, groups


def group_means(x, ids, n):
    """x [B, N, H, D], ids [N] -> [B, H, n, D] means (float64)."""
    out = torch.zeros(x.shape[0], x.shape[2], n, x.shape[3], dtype=torch.float64)
    for t in range(n):
        sel = ids == t
        if sel.any():
            out[:, :, t] = x[:, sel].double().mean(1)
    return out


def check_output(res, q, k, v, mask, atol=ATOL, **ref_kw):
    out, lse, _ = res
    ro, rl = reference_attention(q, k, v, mask=mask, **ref_kw)
    torch.testing.assert_close(out.float(), ro.float(), rtol=0, atol=atol)
    if lse is not None:
        torch.testing.assert_close(lse.float(), rl.float(), rtol=0, atol=atol)


CASES = [((3, 5, 7), 0), ((3, 5, 7), 7), ((2, 6, 9), 0), ((2, 6, 9), 7)]


# ------------------------------------------------------------------------------------------------
# STA


def sta_mask_independent(grid, tile, windows, text_len):
    """Per token pair: the key token's tile lies in the query tile's clamped window."""
    tc = coords(grid) // torch.tensor(tile)
    n = [-(-g // t) for g, t in zip(grid, tile)]
    N = tc.shape[0]
    masks = []
    for w in windows:
        keep = torch.ones(N, N, dtype=torch.bool)
        for ax in range(3):
            ww = max(1, min(w[ax], n[ax]))
            start = (tc[:, ax] - (ww - 1) // 2).clamp(min=0).clamp(max=n[ax] - ww)
            kc = tc[:, ax].view(1, -1)
            keep &= (kc >= start.view(-1, 1)) & (kc < start.view(-1, 1) + ww)
        masks.append(keep)
    return with_text(torch.stack(masks).unsqueeze(0), text_len)


@pytest.mark.parametrize("grid,text_len", CASES)
@pytest.mark.parametrize("tile", [(1, 2, 2), (2, 3, 2)])
def test_sta_matches_tile_distance_mask(grid, text_len, tile):
    q, k, v = qkv(grid, text_len)
    windows = [[1, 1, 3], [3, 3, 1], [2, 4, 5]]  # even sizes and windows larger than the grid too
    res = sliding_tile_attention(
        q, k, v, video_shape=grid, windows=windows, tile_size=tile, text_len=text_len, return_lse=True
    )
    mask = sta_mask_independent(grid, tile, windows, text_len)
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)
    assert 0 < res[2].kept_fraction < 1


def test_sta_window_clamps_at_edges_keeps_full_size():
    grid, tile = (1, 1, 10), (1, 1, 1)
    q, k, v = qkv(grid, 0, heads=1)
    _, _, plan = sliding_tile_attention(q, k, v, video_shape=grid, windows=[1, 1, 3], tile_size=tile)
    m = plan_token_mask(plan)[0, 0]
    assert m[0].nonzero().flatten().tolist() == [0, 1, 2]  # shifted inwards at the left edge
    assert m[5].nonzero().flatten().tolist() == [4, 5, 6]
    assert m[9].nonzero().flatten().tolist() == [7, 8, 9]
    assert (m.sum(1) == 3).all()


def test_sta_flex_path_equals_reference():
    grid, text_len = (3, 5, 7), 7
    q, k, v = qkv(grid, text_len, batch=1)
    a = sliding_tile_attention(
        q,
        k,
        v,
        video_shape=grid,
        windows=[1, 3, 3],
        tile_size=(2, 2, 4),
        text_len=text_len,
        return_lse=True,
        impl="reference",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = sliding_tile_attention(
            q,
            k,
            v,
            video_shape=grid,
            windows=[1, 3, 3],
            tile_size=(2, 2, 4),
            text_len=text_len,
            return_lse=True,
            impl="flex",
        )
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# VSA / Sparge (pooled top-k)


def pooled_topk_mask(q, k, grid, tile, text_len, keep_count, scale, edge_tiles="padded"):
    ids, groups = block_ids(grid, tile, edge_tiles)
    nt = len(groups)
    N = ids.numel()
    pq = group_means(q[:, :N], ids, nt)
    pk = group_means(k[:, :N], ids, nt)
    s = pq @ pk.transpose(-1, -2) * scale  # [B,H,nt,nt]
    top = s.topk(keep_count, dim=-1).indices
    sel = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True)
    tok = sel[:, :, ids][:, :, :, ids]
    return with_text(tok, text_len), keep_count, nt


@pytest.mark.parametrize("grid,text_len", CASES)
@pytest.mark.parametrize("sparsity", [0.0, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
def test_vsa_topk_tiles(grid, text_len, sparsity, edge_tiles):
    q, k, v = qkv(grid, text_len, seed=1)
    tile = (1, 2, 3)
    nt = len(tile_groups(grid, tile, edge_tiles)[0])
    kk = max(1, math.ceil((1 - Fraction(str(sparsity))) * nt))
    res = video_sparse_attention(
        q,
        k,
        v,
        video_shape=grid,
        sparsity=sparsity,
        text_len=text_len,
        tile_size=tile,
        return_lse=True,
        edge_tiles=edge_tiles,
    )
    mask, _, _ = pooled_topk_mask(q, k, grid, tile, text_len, kk, 16**-0.5, edge_tiles)
    assert res[2].extra["k"] == kk and res[2].layout.n_video_blocks == nt
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)


def test_vsa_default_tiles_are_4x4x4_and_edge_tiles_packed():
    grid = (5, 9, 6)  # 2x3x2 tiles; edge tiles 1x4x4 (x2), 4x1x4 (x2), 1x1x4, 4x4x2 (x3), ...
    q, k, v = qkv(grid, 0, heads=2, seed=2)
    res = video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.5)
    lay = res[2].layout
    assert lay.tile_size == (4, 4, 4) and lay.block_size == 64 and lay.edge_tiles == "packed"
    nb = len(tile_groups(grid, (4, 4, 4), "packed")[0])
    assert lay.n_video_blocks == nb < 12
    mask, _, _ = pooled_topk_mask(q, k, grid, (4, 4, 4), 0, math.ceil(0.5 * nb), 16**-0.5, "packed")
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)


def pooled_query_scores(q, k, grid, tile, scale, variance=False, edge_tiles="padded"):
    """Independent pooled-query scores in original token order: per block pair (I, J),
    log sum_{j in J} exp(scale * mean_I(q) . k_j (+ 0.5 scale^2 var_I(q) . k_j^2)), float64."""
    ids, groups = block_ids(grid, tile, edge_tiles)
    nt = len(groups)
    N = ids.numel()
    pq = group_means(q[:, :N], ids, nt)  # [B,H,nt,D]
    kk = k[:, :N].double().transpose(1, 2)  # [B,H,N,D]
    s = pq @ kk.transpose(-1, -2) * scale  # [B,H,nt,N]
    if variance:
        var = (group_means(q[:, :N].double().pow(2), ids, nt) - pq.pow(2)).clamp(min=0)
        s = s + 0.5 * scale * scale * (var @ kk.pow(2).transpose(-1, -2))
    out = torch.full((*s.shape[:3], nt), float("-inf"), dtype=torch.float64)
    for t in range(nt):
        sel = ids == t
        if sel.any():
            out[..., t] = torch.logsumexp(s[..., sel], -1)
    return out


def block_similarity(x, grid, tile, edge_tiles="padded"):
    """Mean pairwise cosine similarity of each block's tokens (self-pairs included): [B, H, nt]."""
    ids, groups = block_ids(grid, tile, edge_tiles)
    nt = len(groups)
    N = ids.numel()
    u = torch.nn.functional.normalize(x[:, :N].double(), dim=-1)
    out = torch.zeros(x.shape[0], x.shape[2], nt, dtype=torch.float64)
    for t in range(nt):
        ut = u[:, ids == t].transpose(1, 2)  # [B,H,n,D]
        out[..., t] = (ut @ ut.transpose(-1, -2)).mean((-1, -2))
    return out


def topk_token_mask(s, keep_count, ids, text_len, forced=None):
    """Top-k per row of tile scores ``s`` [B,H,nt,nt] (forced tile pairs added) as a token mask."""
    top = s.topk(keep_count, dim=-1).indices
    sel = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True)
    if forced is not None:
        sel |= forced
    return with_text(sel[:, :, ids][:, :, :, ids], text_len)


SPARGE_TILES = [(32, (2, 4, 4)), (64, (4, 4, 4)), (128, (4, 4, 8))]


@pytest.mark.parametrize("block_size,tile", SPARGE_TILES)
@pytest.mark.parametrize("topk", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
@pytest.mark.parametrize("predictor", ["pooled", "pooled_query", "pooled_query_var"])
def test_sparge_topk_fraction(block_size, tile, topk, edge_tiles, predictor):
    grid, text_len = (3, 9, 10), 7  # partial tiles on every axis (128: 4x4x8 tiles of a 3x9x10 grid)
    q, k, v = qkv(grid, text_len, heads=2, dim=64, seed=3)
    res = sparge_attention(
        q,
        k,
        v,
        video_shape=grid,
        topk=topk,
        block_size=block_size,
        text_len=text_len,
        predictor=predictor,
        return_lse=True,
        edge_tiles=edge_tiles,
    )
    nt = len(tile_groups(grid, tile, edge_tiles)[0])
    kk = max(1, math.ceil(Fraction(str(topk)) * nt))
    assert res[2].extra["k"] == kk
    if predictor == "pooled":
        mask, _, _ = pooled_topk_mask(q, k, grid, tile, text_len, kk, 64**-0.5, edge_tiles)
    else:
        s = pooled_query_scores(
            q, k, grid, tile, 64**-0.5, variance=predictor == "pooled_query_var", edge_tiles=edge_tiles
        )
        mask = topk_token_mask(s, kk, block_ids(grid, tile, edge_tiles)[0], text_len)
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)
    assert res[2].extra["predictor"] == predictor


@pytest.mark.parametrize("grid,text_len,edge_tiles", [((3, 9, 10), 7, "packed"), ((5, 6, 7), 0, "padded")])
def test_sparge_self_similarity_fallback(grid, text_len, edge_tiles):
    """Blocks whose mean pairwise cosine similarity is <= simthreshd1: their query rows attend every
    block and their key columns are kept for every query, the top-k is taken among the others."""
    tile = (4, 4, 4)
    q, k, v = qkv(grid, text_len, heads=2, dim=64, seed=7)
    ids, groups = block_ids(grid, tile, edge_tiles)
    nt = len(groups)
    sq, sk = block_similarity(q, grid, tile, edge_tiles), block_similarity(k, grid, tile, edge_tiles)
    vals = torch.cat([sq.flatten(), sk.flatten()]).sort().values
    mid = vals.numel() // 2
    thr = float(vals[mid - 1] + vals[mid]) / 2  # about half the blocks fall back; no block at the threshold
    kk = math.ceil(0.25 * nt)
    s = pooled_query_scores(q, k, grid, tile, 64**-0.5, edge_tiles=edge_tiles)
    k_odd = (sk <= thr).unsqueeze(2).expand(-1, -1, nt, -1)
    forced = k_odd | (sq <= thr).unsqueeze(3).expand(-1, -1, -1, nt)
    mask = topk_token_mask(s.masked_fill(k_odd, float("-inf")), kk, ids, text_len, forced)
    res = sparge_attention(
        q,
        k,
        v,
        video_shape=grid,
        topk=0.25,
        text_len=text_len,
        simthreshd1=thr,
        return_lse=True,
        edge_tiles=edge_tiles,
    )
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)
    assert res[2].kept_fraction > 0.25 + 0.2  # the fallback adds blocks on top of the top-k
    # the similarity lies in [0, 1]: upstream's top-k default -0.1 (ours) changes nothing
    off = sparge_attention(
        q, k, v, video_shape=grid, topk=0.25, text_len=text_len, simthreshd1=-0.1, edge_tiles=edge_tiles
    )
    plain = sparge_attention(
        q, k, v, video_shape=grid, topk=0.25, text_len=text_len, simthreshd1=0.0, edge_tiles=edge_tiles
    )
    assert torch.equal(plan_token_mask(off[2]), plan_token_mask(plain[2]))
    assert bool((sq >= 0).all() and (sq <= 1 + 1e-12).all())


def cdf_select(log_mass, thr, valid=None, floor=1):
    """Independent ``cdfthreshd`` rule: per row the fewest blocks, largest share first (ties to the lower
    index), whose shares (softmax of ``log_mass`` over the valid blocks, float64) sum to >= ``thr``, but at
    least the first ``floor`` valid blocks."""
    s = log_mass.double()
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    p = torch.softmax(s, -1)
    out = torch.zeros_like(s, dtype=torch.bool)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in s.shape[:-1])).tolist():
        row = p[tuple(idx)].tolist()
        total = 0.0
        for j in sorted(range(len(row)), key=lambda j: (-row[j], j)):
            if valid is not None and not valid[tuple(idx) + (j,)]:
                break
            out[tuple(idx) + (j,)] = True
            total += row[j]
            floor_left = floor - int(out[tuple(idx)].sum())
            if total >= thr and floor_left <= 0:
                break
    return out


def test_mass_mask_keeps_the_fewest_blocks_reaching_the_share():
    from ditattn.attention.sparse.common import mass_mask

    share = torch.tensor([0.05, 0.5, 0.15, 0.3])
    lm = share.log() + 3.0  # unnormalised log masses
    for thr, want in [(0.4, [1]), (0.5 - 1e-4, [1]), (0.75, [1, 3]), (0.81, [1, 2, 3]), (0.96, [0, 1, 2, 3])]:
        got = torch.nonzero(mass_mask(lm, thr)).flatten().tolist()
        assert got == want, (thr, got)  # upstream's searchsorted(right=True) keeps one fewer at 0.75 / 0.81 / 0.96
    # a peaked row keeps one block at any threshold < 1; threshold 1 keeps exactly the blocks with a nonzero share
    peaked = torch.tensor([[-80.0, 0.0, -80.0, -200.0, float("-inf")]])
    assert mass_mask(peaked, 0.999999).tolist() == [[False, True, False, False, False]]
    assert (
        mass_mask(peaked, 1.0).tolist()
        == (torch.softmax(peaked, -1) > 0).tolist()
        == [[True, True, True, False, False]]
    )
    # ties go to the lower index; invalid blocks have no share and are never kept; a row without valid
    # blocks keeps none
    assert mass_mask(torch.zeros(1, 4), 0.5).tolist() == [[True, True, False, False]]
    # min_count: at least that many, the first ones in the same order (all valid ones if fewer)
    assert torch.nonzero(mass_mask(lm, 0.4, min_count=3)).flatten().tolist() == [1, 2, 3]
    assert torch.nonzero(mass_mask(lm, 0.96, min_count=2)).flatten().tolist() == [0, 1, 2, 3]
    valid = torch.tensor([[True, False, True, True], [False, False, False, False]])
    got = mass_mask(torch.tensor([[0.0, 9.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]), 0.6, valid)
    assert got.tolist() == [[True, False, True, False], [False, False, False, False]]


@pytest.mark.parametrize("predictor", ["pooled", "pooled_query"])
@pytest.mark.parametrize("cdf,topk", [(0.3, 0.01), (0.8, 0.01), (0.97, 0.01), (0.8, 0.3)])
@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
def test_sparge_cdfthreshd(predictor, cdf, topk, edge_tiles):
    """``cdfthreshd``: per query block the fewest key blocks whose predicted share reaches it (the shares:
    softmax of the pooled-query log masses, or of the pooled mean logits plus log block size), but at least
    topk's count (topk 0.01: one block, upstream's rule)."""
    grid, text_len, tile = (3, 9, 10), 7, (4, 4, 4)  # partial tiles on every axis: blocks of unequal size
    q, k, v = qkv(grid, text_len, heads=2, dim=64, seed=5)
    # a shared direction: queries weight it 0..1 along the sequence, keys at random, so some query blocks
    # see peaked shares and others flat ones (i.i.d. noise alone gives every row the same count)
    g = torch.Generator().manual_seed(6)
    u = 8 * torch.nn.functional.normalize(torch.randn(64, generator=g), dim=0)
    q = q + torch.linspace(0, 1, q.shape[1]).view(1, -1, 1, 1) * u
    k = k + torch.randn(1, k.shape[1], 1, 1, generator=g) * u
    ids, groups = block_ids(grid, tile, edge_tiles)
    nt = len(groups)
    if predictor == "pooled":
        pq, pk = (group_means(x[:, : ids.numel()], ids, nt) for x in (q, k))
        size = torch.bincount(ids, minlength=nt).double()
        s = pq @ pk.transpose(-1, -2) * 64**-0.5 + size.log()
    else:
        s = pooled_query_scores(q, k, grid, tile, 64**-0.5, edge_tiles=edge_tiles)
    floor = math.ceil(topk * nt)
    sel = cdf_select(s, cdf, floor=floor)
    res = sparge_attention(
        q,
        k,
        v,
        video_shape=grid,
        cdfthreshd=cdf,
        topk=topk,
        text_len=text_len,
        predictor=predictor,
        return_lse=True,
        edge_tiles=edge_tiles,
    )
    mask = with_text(sel[:, :, ids][:, :, :, ids], text_len)
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask, atol=1e-5)  # sharper softmax than the other tests: float32 rounding ~4e-6
    assert res[2].extra["k"] == floor and res[2].extra["cdfthreshd"] == cdf
    counts = sel.sum(-1)
    assert counts.min() == max(1, floor) if cdf < 0.5 else counts.min() >= floor
    assert counts.min() < counts.max()  # lengths vary from row to row
    assert res[2].kept_fraction == pytest.approx(float(plan_token_mask(res[2]).float().mean()), abs=0.2)


def test_sparge_cdfthreshd_lengths_follow_each_heads_spread():
    """A peaked head keeps one key block per query block, a flat one all of them; cdfthreshd=1 with
    ``quantize=False`` keeps every block of shares > 0 and equals dense attention."""
    grid = (4, 8, 16)  # 8 blocks of 4x4x4
    q, k, v = qkv(grid, 0, heads=2, dim=64, batch=1, seed=9)
    u = 8 * torch.nn.functional.normalize(torch.randn(64, generator=torch.Generator().manual_seed(1)), dim=0)
    tile0 = (coords(grid)[:, 1:] < 4).all(1)  # the tokens of the first 4x4x4 tile
    q[:, :, 0] = u  # head 0: every query aims at the first tile's keys (score 8, the others about 0)
    k[:, :, 0] *= 0.01
    k[:, tile0, 0] = u
    q[:, :, 1] = 0.0  # head 1: every score equal -> equal shares
    res = sparge_attention(q, k, v, video_shape=grid, cdfthreshd=0.9, topk=0.1, quantize=False)
    cnt = res[2].kv_counts[0]
    assert cnt[0].tolist() == [1] * 8 and cnt[1].tolist() == [8] * 8
    assert res[2].kv_indices[0, 0, :, 0].tolist() == [0] * 8
    assert res[2].kept_fraction == pytest.approx((8 + 64) / 128)
    floor = sparge_attention(q, k, v, video_shape=grid, cdfthreshd=0.9, topk=0.25, quantize=False)
    assert floor[2].kv_counts[0, 0].tolist() == [2] * 8 and floor[2].kv_counts[0, 1].tolist() == [8] * 8
    full = sparge_attention(q, k, v, video_shape=grid, cdfthreshd=1.0, topk=0.1, quantize=False, return_lse=True)
    assert full[2].kept_fraction == 1.0
    check_output(full, q, k, v, None)


def test_sparge_cdfthreshd_with_the_self_similarity_fallback():
    """With ``simthreshd1``, the shares are renormalised over the non-fallback key blocks (as upstream,
    whose fallback blocks get score -inf before the softmax); fallback rows and columns are added."""
    grid, text_len, edge_tiles, tile = (3, 9, 10), 7, "packed", (4, 4, 4)
    q, k, v = qkv(grid, text_len, heads=2, dim=64, seed=7)
    ids, groups = block_ids(grid, tile, edge_tiles)
    nt = len(groups)
    sq, sk = block_similarity(q, grid, tile, edge_tiles), block_similarity(k, grid, tile, edge_tiles)
    vals = torch.cat([sq.flatten(), sk.flatten()]).sort().values
    thr = float(vals[vals.numel() // 4 - 1] + vals[vals.numel() // 4]) / 2  # about a quarter fall back
    k_odd = (sk <= thr).unsqueeze(2).expand(-1, -1, nt, -1)
    forced = k_odd | (sq <= thr).unsqueeze(3).expand(-1, -1, -1, nt)
    s = pooled_query_scores(q, k, grid, tile, 64**-0.5, edge_tiles=edge_tiles)
    sel = cdf_select(s, 0.6, valid=~k_odd, floor=math.ceil(0.2 * nt)) | forced
    res = sparge_attention(
        q, k, v, video_shape=grid, cdfthreshd=0.6, topk=0.2, text_len=text_len, simthreshd1=thr, edge_tiles=edge_tiles
    )
    mask = with_text(sel[:, :, ids][:, :, :, ids], text_len)
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)


def test_sparge_selection_rule_is_checked():
    from ditattn.errors import AttentionConfigError

    q, k, v = qkv((3, 5, 7), 0, heads=1, dim=64, batch=1)
    for kw, frag in [
        ({"cdfthreshd": 0.0}, r"cdfthreshd must be a number in \(0, 1\], got 0.0"),
        ({"cdfthreshd": 1.5}, "cdfthreshd must"),
        ({"cdfthreshd": True}, "cdfthreshd must"),
        ({"topk": 0}, "topk must"),
    ]:
        with pytest.raises(AttentionConfigError, match=frag):
            sparge_attention(q, k, v, video_shape=(3, 5, 7), **kw)
    plan = sparge_attention(q, k, v, video_shape=(3, 5, 7))[2]
    assert plan.extra["k"] == math.ceil(0.5 * plan.layout.n_video_blocks) and plan.extra["cdfthreshd"] is None


# ------------------------------------------------------------------------------------------------
# V-MoBA


def vmoba_chunk_ids(grid, mode, chunk):
    c = coords(grid)
    T, H, W = grid
    if mode == "temporal":
        return c[:, 0] // chunk
    if mode == "spatial":
        ch, cw = chunk
        return (c[:, 1] // ch) * (-(-W // cw)) + c[:, 2] // cw
    ct, ch, cw = chunk
    return ((c[:, 0] // ct) * (-(-H // ch)) + c[:, 1] // ch) * (-(-W // cw)) + c[:, 2] // cw


def select_independent(gates, own, mode, k, thr):
    """Plain-Python V-MoBA selection inside one group (lists)."""
    n = len(gates)
    if mode == "topk":
        chosen = {i for i in range(n) if own[i]}
        rest = sorted((i for i in range(n) if not own[i]), key=lambda i: -gates[i])
        for i in rest[: max(0, min(k, n) - len(chosen))]:
            chosen.add(i)
        return chosen
    lo, hi = min(gates), max(gates)
    den = hi - lo if hi - lo > 1e-6 else 1.0
    norm = [(g - lo) / den for g in gates]
    total = sum(norm) + 1e-6
    chosen = {i for i in range(n) if own[i]}
    acc = sum(norm[i] for i in chosen) / total
    for i in sorted((i for i in range(n) if not own[i]), key=lambda i: -norm[i]):
        if acc >= thr:
            break
        chosen.add(i)
        acc += norm[i] / total
    return chosen


def vmoba_mask_independent(
    q, k, grid, text_len, mode, chunk, select_mode, topk, thr, ttype, qblock=64, gate_kind="mean"
):
    B, S, H, D = q.shape
    N = S - text_len
    cid = vmoba_chunk_ids(grid, mode, chunk)
    chunks = sorted(set(cid.tolist()))
    remap = {c: i for i, c in enumerate(chunks)}
    cid = torch.tensor([remap[c] for c in cid.tolist()])
    nc = len(chunks)
    # query blocks: consecutive groups of 64 tokens of a chunk (raster order inside the chunk)
    qblocks = []
    for c in range(nc):
        toks = torch.nonzero(cid == c).flatten().tolist()
        for i in range(0, len(toks), qblock):
            qblocks.append((c, toks[i : i + qblock]))
    kmean = group_means(k[:, :N], cid, nc)  # [B,H,nc,D]
    gate = torch.zeros(B, H, len(qblocks), nc, dtype=torch.float64)
    for j, (_, toks) in enumerate(qblocks):
        qm = q[:, toks].double().mean(1)  # [B,H,D]
        if gate_kind == "mean":
            gate[:, :, j] = torch.einsum("bhd,bhcd->bhc", qm, kmean)
        else:  # log sum over the chunk's keys of exp(scale * qm . k_t)
            st = torch.einsum("bhd,bthd->bht", qm, k[:, :N].double()) * q.shape[-1] ** -0.5
            for cc in range(nc):
                gate[:, :, j, cc] = torch.logsumexp(st[:, :, cid == cc], -1)
    own = torch.zeros(len(qblocks), nc, dtype=torch.bool)
    for j, (c, _) in enumerate(qblocks):
        own[j, c] = True
    sel = torch.zeros(B, H, len(qblocks), nc, dtype=torch.bool)
    for b in range(B):
        groups = []
        if ttype == "query_head":
            groups = [[(h, j, c) for c in range(nc)] for h in range(H) for j in range(len(qblocks))]
            per = 1
        elif ttype == "head_global":
            groups = [[(h, j, c) for j in range(len(qblocks)) for c in range(nc)] for h in range(H)]
            per = len(qblocks)
        else:
            groups = [[(h, j, c) for h in range(H) for j in range(len(qblocks)) for c in range(nc)]]
            per = H * len(qblocks)
        for grp in groups:
            gv = [float(gate[b, h, j, c]) for h, j, c in grp]
            ov = [bool(own[j, c]) for h, j, c in grp]
            for idx in select_independent(gv, ov, select_mode, topk * per, thr):
                h, j, c = grp[idx]
                sel[b, h, j, c] = True
    tok = torch.zeros(B, H, N, N, dtype=torch.bool)
    for j, (_, toks) in enumerate(qblocks):
        tok[:, :, toks] = sel[:, :, j][:, :, cid].unsqueeze(2).expand(-1, -1, len(toks), -1)
    return with_text(tok, text_len), sel


VMOBA_CASES = [
    (m, c, s, "query_head")
    for m, c in [("temporal", 2), ("spatial", (3, 4)), ("st", (1, 3, 4))]
    for s in ("topk", "threshold")
]
VMOBA_CASES += [("temporal", 2, s, t) for s in ("topk", "threshold") for t in ("head_global", "overall")]
VMOBA_CASES += [("spatial", (3, 4), "threshold", "overall")]


@pytest.mark.parametrize("mode,chunk,select_mode,ttype", VMOBA_CASES)
@pytest.mark.parametrize("gate", ["pooled_query", "mean"])
def test_vmoba_selection(mode, chunk, select_mode, ttype, gate):
    grid, text_len = (4, 6, 9), 7
    q, k, v = qkv(grid, text_len, heads=2, seed=4)
    res = vmoba_attention(
        q,
        k,
        v,
        video_shape=grid,
        mode=mode,
        chunk=chunk,
        topk=2,
        select_mode=select_mode,
        threshold=0.4,
        threshold_type=ttype,
        gate=gate,
        text_len=text_len,
        return_lse=True,
    )
    vol = {"temporal": 2 * 6 * 9, "spatial": 4 * 3 * 4, "st": 1 * 3 * 4}[mode]
    qblock = 64 if vol >= 64 else max(16, 2 ** math.ceil(math.log2(vol)))  # small chunks: smaller blocks
    assert res[2].layout.block_size == qblock
    mask, sel = vmoba_mask_independent(q, k, grid, text_len, mode, chunk, select_mode, 2, 0.4, ttype, qblock, gate)
    assert torch.equal(res[2].extra["selection"], sel)
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)


def test_vmoba_chunk_ids_are_built_once_per_layout_and_device():
    """The chunk of each block comes from the layout's per-device index: the same tensor on every call (no
    host-to-device copy per call, which on CUDA synchronises a step that should only launch)."""
    grid = (4, 6, 9)
    q, k, v = qkv(grid, 0, heads=2, seed=6)
    plans = [vmoba_attention(q, k, v, video_shape=grid, mode="spatial", chunk=(3, 4))[2] for _ in range(2)]
    first, second = (p.extra["chunk_of_block"] for p in plans)
    assert first is second is plans[0].layout.on(q.device).chunk_of_block
    tiles = plans[0].layout.block_tile[: plans[0].layout.n_video_blocks]
    assert torch.equal(first, torch.unique(tiles, return_inverse=True)[1])  # tiles renumbered in tile order
    assert plans[0].layout.on(q.device).n_chunks == torch.unique(tiles).numel()


def test_vmoba_defaults_and_layer_cycle():
    grid = (5, 6, 9)
    q, k, v = qkv(grid, 0, heads=2, seed=5)
    res = vmoba_attention(q, k, v, video_shape=grid, mode="spatial")
    assert res[2].extra["chunk"] == (2, 3)  # ceil(6/4), ceil(9/4)
    assert res[2].extra["topk"] == math.ceil(res[2].extra["n_chunks"] / 4)
    assert res[2].extra["gate"] == "pooled_query"
    mask, _ = vmoba_mask_independent(
        q, k, grid, 0, "spatial", (2, 3), "threshold", 1, 0.25, "query_head", gate_kind="pooled_query"
    )
    assert torch.equal(plan_token_mask(res[2]), mask)
    check_output(res, q, k, v, mask)
    modes = [vmoba_layer_mode(i, first_full_layer=2, temporal_layer=1, spatial_layer=2, st_layer=1) for i in range(9)]
    assert modes == ["full", "full", "temporal", "spatial", "spatial", "st", "temporal", "spatial", "spatial"]
    assert vmoba_layer_mode(None) == "temporal"


# ------------------------------------------------------------------------------------------------
# SVG2


def svg2_mask_independent(q, k, plan, text_len, top_p, scale, bs, predictor="pooled_query"):
    """The SVG2 token mask from the plan's cluster labels alone: cluster pairs by the top-p rule on
    centroid estimates (``centroids``: scale * cq_i . ck_j + log |K_j|; ``pooled_query``:
    log sum_{t in K_j} exp(scale * cq_i . k_t)), tokens sorted by cluster (stable) then text, blocks of
    ``bs`` positions, block a -> block b iff a selected pair lies in (clusters of a) x (clusters of b) or either block
    holds text."""
    ql, kl = plan.extra["q_labels"], plan.extra["k_labels"]
    B, H, N = ql.shape
    S = N + text_len
    Cq, Ck = plan.extra["selection"].shape[-2:]
    mask = torch.zeros(B, H, S, S, dtype=torch.bool)
    sels = torch.zeros(B, H, Cq, Ck, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            cq = group_means(q[b : b + 1, :N, h : h + 1], ql[b, h], Cq)[0, 0]
            ck = group_means(k[b : b + 1, :N, h : h + 1], kl[b, h], Ck)[0, 0]
            size = torch.bincount(kl[b, h], minlength=Ck).double()
            qsize = torch.bincount(ql[b, h], minlength=Cq)
            for i in range(Cq):
                if qsize[i] == 0:
                    continue
                if predictor == "centroids":
                    logits = [(scale * float(cq[i] @ ck[j]) + math.log(size[j]), j) for j in range(Ck) if size[j] > 0]
                else:
                    st = scale * (k[b, :N, h].double() @ cq[i])
                    logits = [(float(torch.logsumexp(st[kl[b, h] == j], 0)), j) for j in range(Ck) if size[j] > 0]
                m = max(x for x, _ in logits)
                z = sum(math.exp(x - m) for x, _ in logits)
                acc = 0.0
                for x, j in sorted(logits, reverse=True):
                    if acc >= top_p and sels[b, h, i].any():
                        break
                    sels[b, h, i, j] = True
                    acc += math.exp(x - m) / z
            qorder = sorted(range(N), key=lambda t: (int(ql[b, h, t]), t)) + list(range(N, S))
            korder = sorted(range(N), key=lambda t: (int(kl[b, h, t]), t)) + list(range(N, S))

            def blocks(order, labels):
                out = []
                for a in range(0, S, bs):
                    toks = order[a : a + bs]
                    out.append(({int(labels[t]) for t in toks if t < N}, any(t >= N for t in toks), toks))
                return out

            for qc, qtext, qtoks in blocks(qorder, ql[b, h]):
                for kc, ktext, ktoks in blocks(korder, kl[b, h]):
                    on = qtext or ktext or any(bool(sels[b, h, i, j]) for i in qc for j in kc)
                    if on:
                        for t in qtoks:
                            mask[b, h, t, ktoks] = True
    return mask, sels


@pytest.mark.parametrize("grid,text_len", CASES)
@pytest.mark.parametrize("predictor", ["pooled_query", "centroids"])
def test_svg2_cluster_pairs(grid, text_len, predictor):
    q, k, v = qkv(grid, text_len, heads=2, seed=6)
    res = svg2_attention(
        q,
        k,
        v,
        video_shape=grid,
        text_len=text_len,
        num_q_clusters=6,
        num_k_clusters=9,
        kmeans_iters=4,
        top_p=0.6,
        block_size=8,
        predictor=predictor,
        return_lse=True,
    )
    plan = res[2]
    mask, sels = svg2_mask_independent(q, k, plan, text_len, 0.6, 16**-0.5, 8, predictor)
    assert torch.equal(plan.extra["selection"], sels)
    assert torch.equal(svg2_token_mask(plan), mask)
    check_output(res, q, k, v, mask)
    assert 0 < plan.kept_fraction < 1 and plan.extra["mode"] == "cold"


def test_svg2_warm_start_reuse_and_reset():
    from ditattn.attention.sparse.svg2 import reset_svg2_state

    grid = (3, 6, 8)
    q, k, v = qkv(grid, 0, heads=2, seed=8)
    kw = dict(
        video_shape=grid,
        num_q_clusters=5,
        num_k_clusters=7,
        kmeans_iters=6,
        top_p=0.7,
        block_size=16,
        state_key="t",
        warm_iters=1,
    )
    reset_svg2_state()
    modes = []
    for step in (0, 1, 2):
        res = svg2_attention(q, k, v, step=step, **kw)
        modes.append(res[2].extra["mode"])
        check_output(res, q, k, v, svg2_token_mask(res[2]))
    assert modes == ["cold", "warm", "warm"]
    # a step that does not advance is a new request: cold again; step 0 too
    assert svg2_attention(q, k, v, step=2, **kw)[2].extra["mode"] == "cold"
    assert svg2_attention(q, k, v, step=0, **kw)[2].extra["mode"] == "cold"
    # recluster_every: the steps between reuse the cached plan exactly
    reset_svg2_state()
    kw["recluster_every"] = 3
    got = [svg2_attention(q + 0.01 * s, k, v, step=s, **kw) for s in range(5)]
    assert [g[2].extra["mode"] for g in got] == ["cold", "reused", "reused", "warm", "reused"]
    assert got[1][2].kv_indices is got[0][2].kv_indices
    check_output(got[2], q + 0.02, k, v, svg2_token_mask(got[2][2]))
    # shapes change -> cold
    q2, k2, v2 = qkv((3, 6, 9), 0, heads=2, seed=8)
    assert svg2_attention(q2, k2, v2, step=5, **{**kw, "video_shape": (3, 6, 9)})[2].extra["mode"] == "cold"
    reset_svg2_state()


def test_kmeans_warm_start_from_converged_centroids_is_a_fixed_point():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 90, 8, generator=g)
    labels, cent, _ = kmeans(x, 5, 80)
    l2, c2, _ = kmeans(x, 5, 1, init=cent)
    assert torch.equal(l2, labels)
    torch.testing.assert_close(c2, cent)


def test_kmeans_converges_to_a_fixed_point():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 120, 8, generator=g)
    labels, cent, sizes = kmeans(x, 7, 60)
    d = torch.cdist(x.double(), cent.double())
    d = d.masked_fill((sizes == 0).unsqueeze(1), float("inf"))
    assert torch.equal(d.argmin(-1), labels)
    for gi in range(3):
        for c in range(7):
            if sizes[gi, c] > 0:
                torch.testing.assert_close(cent[gi, c], x[gi][labels[gi] == c].mean(0), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# SLA / SAGE_SLA


def sla_masks_independent(q, k, grid, tile, text_len, topk, negl, scale, edge_tiles="padded"):
    ids, groups = block_ids(grid, tile, edge_tiles)
    nt = len(groups)
    N = ids.numel()
    s = group_means(q[:, :N], ids, nt) @ group_means(k[:, :N], ids, nt).transpose(-1, -2) * scale
    n_crit = max(1, math.ceil(Fraction(str(topk)) * nt))
    n_negl = min(math.floor(Fraction(str(negl)) * nt), nt - n_crit)
    order = s.argsort(-1, descending=True)
    crit = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, order[..., :n_crit], True)
    negl_m = torch.zeros_like(crit)
    if n_negl:
        negl_m.scatter_(-1, order[..., nt - n_negl :], True)
    marg = ~crit & ~negl_m
    tok = lambda m: m[:, :, ids][:, :, :, ids]  # noqa: E731
    crit_tok = with_text(tok(crit), text_len)
    marg_tok = torch.zeros_like(crit_tok)
    marg_tok[..., :N, :N] = tok(marg)
    return crit_tok, marg_tok


@pytest.mark.parametrize("grid,text_len", CASES)
@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
def test_sla_sparse_branch_and_linear_branch(grid, text_len, edge_tiles):
    q, k, v = qkv(grid, text_len, heads=2, dim=16, seed=8)
    scale = 16**-0.5
    res = sla_attention(
        q,
        k,
        v,
        video_shape=grid,
        text_len=text_len,
        topk=0.3,
        negligible_fraction=0.3,
        block_size=32,
        return_lse=True,
        edge_tiles=edge_tiles,
    )
    crit, marg = sla_masks_independent(q, k, grid, (2, 4, 4), text_len, 0.3, 0.3, scale, edge_tiles)
    assert torch.equal(plan_token_mask(res[2]), crit)
    check_output(res, q, k, v, crit)  # no projection in the checkpoint: the sparse branch alone
    # with a trained projection the linear branch over marginal blocks is added
    g = torch.Generator().manual_seed(9)
    W = torch.randn(16, 16, generator=g) * 0.1
    bias = torch.randn(16, generator=g) * 0.1
    out, _, _ = sla_attention(
        q,
        k,
        v,
        video_shape=grid,
        text_len=text_len,
        topk=0.3,
        negligible_fraction=0.3,
        block_size=32,
        proj_weight=W,
        proj_bias=bias,
        edge_tiles=edge_tiles,
    )
    fq = torch.softmax(q.double(), -1).transpose(1, 2)
    fk = torch.softmax(k.double(), -1).transpose(1, 2)
    a = (fq @ fk.transpose(-1, -2)) * marg
    den = a.sum(-1, keepdim=True)
    ol = torch.where(den > 0, (a @ v.double().transpose(1, 2)) / den.clamp(min=1e-300), torch.zeros(1).double())
    expect = reference_attention(q, k, v, mask=crit)[0].double() + (
        ol.transpose(1, 2) @ W.double().t() + bias.double()
    )
    torch.testing.assert_close(out.double(), expect, rtol=0, atol=1e-5)


def quantize_independent(x, grid, tile, text_len, smooth, edge_tiles="padded"):
    """Symmetric INT8 per (batch, block, head), text in blocks of the tile volume."""
    x = x.double()
    B, S, H, D = x.shape
    if smooth:
        x = x - x.mean(1, keepdim=True)
    ids, groups = block_ids(grid, tile, edge_tiles)
    bs = math.prod(tile)
    nt = len(groups)
    block = torch.cat([ids, nt + torch.arange(text_len) // bs])
    out = torch.empty_like(x)
    for blk in block.unique():
        sel = block == blk
        amax = x[:, sel].abs().amax(dim=(1, 3), keepdim=True)
        sc = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        out[:, sel] = torch.round(x[:, sel] / sc).clamp(-127, 127) * sc
    return out


@pytest.mark.parametrize("grid,text_len", [((3, 5, 7), 7), ((2, 6, 9), 0)])
@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
def test_sage_sla_quantized_sparse_branch(grid, text_len, edge_tiles):
    q, k, v = qkv(grid, text_len, heads=2, seed=10)
    res = sla_attention(
        q,
        k,
        v,
        video_shape=grid,
        text_len=text_len,
        topk=0.4,
        block_size=32,
        quantize=True,
        return_lse=True,
        edge_tiles=edge_tiles,
    )
    crit, _ = sla_masks_independent(q, k, grid, (2, 4, 4), text_len, 0.4, 0.0, 16**-0.5, edge_tiles)
    assert torch.equal(plan_token_mask(res[2]), crit)
    qd = quantize_independent(q, grid, (2, 4, 4), text_len, smooth=False, edge_tiles=edge_tiles)
    kd = quantize_independent(k, grid, (2, 4, 4), text_len, smooth=True, edge_tiles=edge_tiles)
    ro, _ = reference_attention(qd, kd, v.double(), mask=crit, dtype=torch.float64)
    torch.testing.assert_close(res[0].double(), ro, rtol=0, atol=2e-5)
    exact = sla_attention(
        q, k, v, video_shape=grid, text_len=text_len, topk=0.4, block_size=32, edge_tiles=edge_tiles
    )[0]
    assert 0 < (res[0] - exact).abs().max() < 0.05  # quantization is lossy but close


# ------------------------------------------------------------------------------------------------
# Sol


def sol_reference(
    q,
    k,
    v,
    grid,
    text_len,
    tau,
    thresh_type,
    sink,
    scale,
    edge_tiles="padded",
    predictor="pooled",
    centroid_variance=False,
    tile_size=(4, 4, 4),
):
    """Independent Sol: exact tokens of routed blocks + centroid virtual keys of the other blocks.
    ``pooled_query``: the rule's count per query block, filled with its neighbours, then the best
    log sum_{t in block j} exp(scale * mean_i(q) . k_t); ``centroid_variance``: virtual key j's
    score gains 0.5 * scale^2 * q^2 . var_j(k)."""
    B, S, H, D = q.shape
    N = S - text_len
    special = torch.zeros(S, dtype=torch.bool)
    special[N:] = True
    special[sink[0] : sink[1]] = True
    tid, groups = block_ids(grid, tile_size, edge_tiles, special[:N])
    tiles = range(len(groups))
    nv = len(groups)
    cq = torch.stack([q[:, :N][:, tid == t].double().mean(1) for t in tiles], 2)  # [B,H,nv,D]
    ck = torch.stack([k[:, :N][:, tid == t].double().mean(1) for t in tiles], 2)
    cv = torch.stack([v[:, :N][:, tid == t].double().mean(1) for t in tiles], 2)
    cnt = torch.tensor([int((tid == t).sum()) for t in tiles], dtype=torch.float64)
    s = cq @ ck.transpose(-1, -2) * scale
    if thresh_type == "diag":
        mu = ck.mean(2, keepdim=True)
        var_k = (ck**2).mean(2, keepdim=True) - mu**2
        m = (cq * mu).sum(-1) * scale
        var = (cq**2 * var_k.clamp(min=0)).sum(-1) * scale**2
    else:
        m = s.mean(-1)
        var = (s**2).mean(-1) - m**2
    thr = m + tau * torch.sqrt(var.clamp(min=0) + 1e-6)
    near = torch.tensor([[any(abs(a - b) <= 1 for a in gi for b in gj) for gj in groups] for gi in groups])
    exact = (s > thr.unsqueeze(-1)) | near
    if predictor == "pooled_query":
        lse = torch.stack(
            [
                torch.logsumexp(torch.einsum("bhid,bthd->bhit", cq, k[:, :N][:, tid == t].double()) * scale, -1)
                for t in tiles
            ],
            -1,
        )  # [B,H,nv,nv]
        count = exact.sum(-1)
        routed = torch.zeros_like(exact)
        for b, h, i in torch.cartesian_prod(*(torch.arange(x) for x in exact.shape[:3])).tolist():
            rest = [j for j in sorted(range(nv), key=lambda j: -float(lse[b, h, i, j])) if not near[i, j]]
            for j in [j for j in range(nv) if near[i, j]] + rest[: int(count[b, h, i]) - int(near[i].sum())]:
                routed[b, h, i, j] = True
        exact = routed
    blk = torch.cat([tid, torch.full((text_len,), -1)])  # [S]
    is_vid = blk >= 0
    bi = blk.clamp(min=0)
    tok = exact[:, :, bi][:, :, :, bi] & is_vid.view(-1, 1) & is_vid.view(1, -1)
    tok = tok | ~is_vid.view(-1, 1) | ~is_vid.view(1, -1)
    approx = (~exact)[:, :, bi] & is_vid.view(-1, 1)  # [B,H,S,nv]
    kx = torch.cat([k.double(), ck.transpose(1, 2)], 1)
    vx = torch.cat([v.double(), cv.transpose(1, 2)], 1)
    mask = torch.cat([tok, approx], -1)
    bias = torch.cat([torch.zeros(S), cnt.log()]).view(1, 1, 1, -1).expand(B, H, S, -1)
    if centroid_variance:
        kvar = torch.stack([k[:, :N][:, tid == t].double().var(1, unbiased=False) for t in tiles], 2)  # [B,H,nv,D]
        jensen = 0.5 * scale**2 * torch.einsum("bshd,bhjd->bhsj", q.double() ** 2, kvar)
        bias = bias + torch.cat([torch.zeros(B, H, S, S, dtype=torch.float64), jensen], -1)
    return reference_attention(q.double(), kx, vx, mask=mask, attn_bias=bias, scale=scale, dtype=torch.float64), exact


@pytest.mark.parametrize("grid,text_len", [((5, 9, 7), 7), ((6, 8, 9), 0)])
@pytest.mark.parametrize("thresh_type", ["diag", "exact"])
@pytest.mark.parametrize("tau,sink", [(0.5, (0, 0)), (1.5, (10, 30))])
@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
@pytest.mark.parametrize("predictor,centroid_variance", [("pooled", False), ("pooled_query", True)])
def test_sol_routing_and_centroid_branch(
    grid, text_len, thresh_type, tau, sink, edge_tiles, predictor, centroid_variance
):
    q, k, v = qkv(grid, text_len, heads=2, dim=16, batch=1, seed=11)
    scale = 16**-0.5
    out, lse, plan = sol_attention(
        q,
        k,
        v,
        video_shape=grid,
        text_len=text_len,
        tau=tau,
        thresh_type=thresh_type,
        sink_start=sink[0],
        sink_tokens=sink[1] - sink[0],
        return_lse=True,
        edge_tiles=edge_tiles,
        predictor=predictor,
        centroid_variance=centroid_variance,
    )
    (ro, rl), exact = sol_reference(
        q, k, v, grid, text_len, tau, thresh_type, sink, scale, edge_tiles, predictor, centroid_variance
    )
    assert plan.layout.n_video_blocks == exact.shape[-1]
    assert torch.equal(plan.extra["exact"], exact)
    assert 0 < float(exact.float().mean()) < 1
    torch.testing.assert_close(out.double(), ro, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), rl, rtol=0, atol=1e-5)


@pytest.mark.parametrize("edge_tiles", ["padded", "packed"])
def test_sol_block_size_128_routes_4x4x8_tiles(edge_tiles):
    """block_size=128: the same rule on 4x4x8 tiles (128-token blocks) against the independent reference,
    routes, output and LSE; an unknown block size is refused with the accepted ones."""
    grid, text_len = (5, 9, 19), 5
    q, k, v = qkv(grid, text_len, heads=2, dim=16, batch=1, seed=12)
    kw = dict(video_shape=grid, text_len=text_len, tau=0.5, return_lse=True, edge_tiles=edge_tiles)
    out, lse, plan = sol_attention(q, k, v, block_size=128, **kw)
    (ro, rl), exact = sol_reference(
        q, k, v, grid, text_len, 0.5, "diag", (0, 0), 16**-0.5, edge_tiles, "pooled_query", True, tile_size=(4, 4, 8)
    )
    assert plan.layout.block_size == 128 and plan.layout.n_video_blocks == exact.shape[-1]
    assert torch.equal(plan.extra["exact"], exact)
    assert 0 < float(exact.float().mean()) < 1
    torch.testing.assert_close(out.double(), ro, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), rl, rtol=0, atol=1e-5)
    from ditattn.errors import AttentionConfigError

    with pytest.raises(AttentionConfigError, match=r"block_size must be one of \[64, 128\], got 96"):
        sol_attention(q, k, v, block_size=96, **kw)
