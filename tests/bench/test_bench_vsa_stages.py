"""bench/vsa_stages.py: the block counts it prints (docs/benchmarks.md, sparse frontier) and its stages on CPU."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
vsa_stages = pytest.importorskip("vsa_stages")


def test_counts_at_the_wan_grids():
    rows = {(r["grid"], r["text_len"], r["edge_tiles"]): r for r in vsa_stages.count_table(0.9)}
    got = {key: (r["blocks"], r["k"], r["pairs_per_head"]) for key, r in rows.items()}
    assert got[("21x30x52", 0, "padded")] == (624, 63, 624 * 63)
    assert got[("21x30x52", 0, "packed")] == (513, 52, 513 * 52)
    assert got[("21x30x52", 512, "packed")] == (521, 52, 513 * (52 + 8) + 8 * 521)
    assert got[("21x45x80", 0, "packed")] == (1182, 119, 1182 * 119)
    assert got[("21x45x80", 512, "padded")] == (1448, 144, 1440 * (144 + 8) + 8 * 1448)


def test_stages_compute_what_the_call_computes():
    from ditattn.attention.sparse.vsa import video_sparse_attention

    grid = (5, 8, 12)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 480, 2, 32, generator=g) for _ in range(3))
    for edge_tiles in ("padded", "packed"):
        fns = vsa_stages.stages(q, k, v, grid, 0.5, edge_tiles)
        out, _, plan = video_sparse_attention(q, k, v, video_shape=grid, sparsity=0.5, edge_tiles=edge_tiles)
        assert torch.equal(fns["call"]()[0], out)
        idx, cnt, _ = fns["select"]()
        assert torch.equal(idx, plan.kv_indices) and torch.equal(cnt, plan.kv_counts)
        assert torch.equal(fns["topk"]()[0], idx)
        assert torch.equal(fns["rest"]()[0], out)
        # the replaced selection: the same lists on these (tie-free) inputs, the same call
        old_idx, old_scores = fns["select_torch"]()
        assert torch.equal(old_idx, idx) and torch.equal(old_scores, plan.extra["scores"])
        assert torch.equal(fns["topk_torch"](), idx) and torch.equal(fns["call_torchsel"]()[0], out)
        assert vsa_stages.agreement(fns, grid, 0.5, edge_tiles) == {"same_rows": 1.0, "exact": True}


def test_grid_flags_shared_by_the_sparse_benches():
    import argparse

    import common

    ap = argparse.ArgumentParser()
    common.add_grid_args(ap, grids="wan480,wan720", heads="12,40")
    assert common.grid_args(ap, ap.parse_args([])) == ([("wan480", (21, 30, 52)), ("wan720", (21, 45, 80))], [12, 40])
    assert common.grid_args(ap, ap.parse_args(["--grid", "5,8,12", "--heads", "2"])) == ([("5x8x12", (5, 8, 12))], [2])
    for bad in (["--grid", "5,8"], ["--grids", "wan999"], ["--heads", "0"], ["--heads", "x"]):
        with pytest.raises(SystemExit) as ei:
            common.grid_args(ap, ap.parse_args(bad))
        assert ei.value.code == 2
