"""bench/svg2_stages.py: its work counts (docs/benchmarks.md §11) and its stages on CPU."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
svg2_stages = pytest.importorskip("svg2_stages")


def test_work_counts_at_480p():
    w = svg2_stages.work((21, 30, 52), 12)
    G, N, D = 12, 21 * 30 * 52, 128
    assert w["kmeans_k"]["fp32_flop"] == 2 * G * N * 128 * D == w["kmeans_k"]["bf16_flop"]
    assert w["kmeans_q"]["fp32_flop"] == 2 * G * N * 64 * D
    assert w["scores"]["bf16_flop"] == 2 * G * 64 * N * 128
    assert w["plan"]["bytes"] > w["scores"]["bytes"]
    # two warm iterations double the per-iteration work, not the float32 copy of the points
    w2 = svg2_stages.work((21, 30, 52), 12, warm_iters=2)
    assert w2["kmeans_k"]["fp32_flop"] == 2 * w["kmeans_k"]["fp32_flop"]
    assert 6 * G * N * D < w2["kmeans_k"]["bytes"] - w["kmeans_k"]["bytes"] < w["kmeans_k"]["bytes"]
    rows = svg2_stages.count_table([("wan480", (21, 30, 52))], [12], (50.0, 700.0, 3.5))
    total = next(r for r in rows if r["stage"].startswith("planning"))["floor_ms"]
    assert total == pytest.approx(sum(r["floor_ms"] for r in rows if r["stage"] in ("kmeans_q", "kmeans_k", "plan")))


def test_stages_compute_what_the_call_computes():
    from ditattn.attention.sparse.svg2 import reset_svg2_state, svg2_attention

    grid = (4, 8, 8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 256, 2, 32, generator=g) for _ in range(3))
    kw = dict(num_q_clusters=6, num_k_clusters=8, top_p=0.6)
    fns = svg2_stages.stages(q, k, v, grid, **kw)
    fns["call"]()  # step 0: cold (5 iterations), as the stages' own clustering
    out, _, plan = fns["call"]()  # step 1: one warm iteration
    assert plan.extra["mode"] == "warm"
    reset_svg2_state("ref")
    svg2_attention(q, k, v, video_shape=grid, state_key="ref", step=0, **kw)
    ref = svg2_attention(q, k, v, video_shape=grid, state_key="ref", step=1, **kw)
    assert torch.equal(out, ref[0])
    q_perm, k_perm, idx, cnt, kept, _ = fns["plan"]()
    assert torch.equal(idx, plan.kv_indices) and torch.equal(q_perm, plan.extra["q_perm"])
    assert float(kept) == plan.kept_fraction
    assert torch.equal(fns["scatter"](), out)
    assert fns["reused_call"]()[2].extra["mode"] == "cold" and fns["reused_call"]()[2].extra["mode"] == "reused"
