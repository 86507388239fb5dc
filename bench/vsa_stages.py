"""VSA's selection stage against the whole sparse call, padded vs packed edge tiles.

    python3 bench/vsa_stages.py --out $OUT/vsa_stages              # GPU: counts, then timings
    python3 bench/vsa_stages.py --counts-only                      # any machine: block counts and pairs

Counts (host arithmetic, no GPU): for the Wan latent grids (480p 21x30x52, 720p 21x45x80), without
and with 512 text tokens, and both edge-tile layouts (``padded``: every 4x4x4 tile its own block;
``packed``: edge tiles cut by the grid share blocks, :mod:`ditattn.attention.sparse.tiling`): the
blocks, the tiles kept per query block ``k`` at the sparsity, and the (query block, key block)
pairs per head the kernel computes.

Timings (CUDA, bf16, batch 1, head dim 128, random q/k/v; 12 and 40 heads; no text — Wan's text
enters through cross-attention): each stage of ``video_sparse_attention`` as do_bench median wall
time, as GPU kernel time (torch.profiler, no launch gaps) and as GPU launches (kernels and copies
per call):

* ``call``    ``video_sparse_attention(q, k, v)`` end to end (the Triton selection on CUDA);
* ``call_torchsel`` the same call with the selection it replaced (PyTorch pooling, ``torch.topk``,
  int32 sort, concatenations: :func:`torch_select`), for the before/after;
* ``tile_qk`` ``tile(q)``, ``tile(k)`` (the kernel needs them too);
* ``select``  the selection stage on tiled q/k: pooling + compressed scores + top-k lists, and its
  parts ``pool`` (pooled q and k: one Triton launch), ``scores`` (pooled q @ pooled k^T) and
  ``topk`` (:func:`topk_lists`: the Triton kernel writing the int32 lists);
* ``select_torch`` / ``topk_torch`` the replaced selection and its top-k + lists part;
* ``kernel``  the block-sparse kernel on tiled q/k/v with the lists;
* ``rest``    ``tile(v)`` + kernel + untiling (``run_block_lists`` given tiled q/k).

Each row also records ``same_rows``: the fraction of (head, query block) rows whose lists equal the
replaced selection's (they differ only where two scores are within float32 rounding), and
``exact``: whether the Triton top-k equals the PyTorch reference path on the same scores (must be
True).  The last table prints ``select / call`` (target below 10 %) for both timings, before and
after.  Full rows go to ``<out>/vsa_stages.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
from common import Recorder, bench_ms, env_info, fmt_table, guarded, kernel_ms, make_qkv  # noqa: E402

LAYOUTS = ("padded", "packed")


def block_counts(grid, text_len: int, sparsity: float, edge_tiles: str) -> dict:
    """Blocks and block pairs of VSA at ``sparsity`` on one layout (host arithmetic)."""
    from ditattn.attention.sparse.common import rows_kept_fraction
    from ditattn.attention.sparse.tiling import make_tile_layout
    from ditattn.attention.sparse.vsa import vsa_num_selected

    lay = make_tile_layout(grid, (4, 4, 4), text_len, edge_tiles=edge_tiles)
    nv, nb = lay.n_video_blocks, lay.n_blocks
    k = vsa_num_selected(sparsity, nv)
    kept = rows_kept_fraction(lay, k)
    return {
        "grid": "x".join(map(str, grid)),
        "text_len": text_len,
        "edge_tiles": edge_tiles,
        "video_blocks": nv,
        "blocks": nb,
        "min_blocks": -(-math.prod(grid) // 64) + -(-text_len // 64),
        "k": k,
        "pairs_per_head": round(kept * nb * nb),
        "kept_fraction": kept,
    }


def count_table(sparsity: float) -> list[dict]:
    rows = []
    for grid in common.WAN_GRIDS.values():
        for text in (0, 512):
            pair = [block_counts(grid, text, sparsity, e) for e in LAYOUTS]
            pair[1]["pairs_vs_padded"] = pair[1]["pairs_per_head"] / pair[0]["pairs_per_head"]
            rows += pair
    return rows


COUNT_COLS = [
    ("grid", "grid", ""),
    ("text_len", "text", ""),
    ("edge_tiles", "edge tiles", ""),
    ("video_blocks", "video blocks", ""),
    ("blocks", "blocks", ""),
    ("min_blocks", "ceil(S/64)", ""),
    ("k", "k", ""),
    ("pairs_per_head", "block pairs / head", ""),
    ("pairs_vs_padded", "pairs vs padded", ".3f"),
]


def torch_select(qt, kt, lay, kk: int, scale: float):
    """The selection stage before the Triton kernels: PyTorch pooling of q and k, the
    score matmul, ``torch.topk`` (its own choice among ties), an int32 sort of the ids and the special
    columns concatenated.  Returns ``(kv_indices, scores)``."""
    from ditattn.attention.sparse.tiling import pooled_blocks

    nv = lay.n_video_blocks
    scores = pooled_blocks(qt, lay, nv, scale=scale) @ pooled_blocks(kt, lay, nv).transpose(-1, -2)
    return torch_topk_lists(lay, scores, kk), scores


def torch_topk_lists(lay, scores, kk: int):
    """The replaced top-k + lists part of :func:`torch_select`."""
    from ditattn.attention.sparse.common import _topk_constants

    tail, special_rows, _ = _topk_constants(lay, scores.device, kk, *scores.shape[:2])
    sel = scores.topk(kk, dim=-1, sorted=not scores.is_cuda).indices.to(torch.int32).sort(dim=-1).values
    if lay.n_blocks > lay.n_video_blocks:
        sel = torch.cat([torch.cat([sel, tail], dim=-1), special_rows], dim=2)
    return sel


def stages(q, k, v, grid, sparsity: float, edge_tiles: str) -> dict:
    """Callables of every stage on one input (see the module docstring)."""
    from ditattn.attention.sparse.block_sparse import block_sparse_attention
    from ditattn.attention.sparse.common import run_block_lists, topk_lists
    from ditattn.attention.sparse.tiling import make_tile_layout, tile
    from ditattn.attention.sparse.vsa import (
        pooled_video_blocks,
        pooled_video_scores,
        video_sparse_attention,
        vsa_num_selected,
    )

    lay = make_tile_layout(grid, (4, 4, 4), 0, edge_tiles=edge_tiles)
    scale = q.shape[-1] ** -0.5
    nv = lay.n_video_blocks
    kk = vsa_num_selected(sparsity, nv)
    qt, kt, vt = tile(q, lay), tile(k, lay), tile(v, lay)
    pq, pk = pooled_video_blocks(qt, kt, lay, scale)
    scores = pq @ pk.transpose(-1, -2)
    idx, cnt, _ = topk_lists(lay, scores, kk)
    old_scores = torch_select(qt, kt, lay, kk, scale)[1]
    kvv = lay.kv_valid(q.shape[0], q.device)
    run = dict(scale=scale, return_lse=False, q_tiled=qt, k_tiled=kt)

    def call_torchsel():
        qt2, kt2 = tile(q, lay), tile(k, lay)
        sel = torch_select(qt2, kt2, lay, kk, scale)[0]
        return run_block_lists(q, k, v, lay, sel, cnt, **dict(run, q_tiled=qt2, k_tiled=kt2))

    return {
        "call": lambda: video_sparse_attention(q, k, v, video_shape=grid, sparsity=sparsity, edge_tiles=edge_tiles),
        "call_torchsel": call_torchsel,
        "tile_qk": lambda: (tile(q, lay), tile(k, lay)),
        "select": lambda: topk_lists(lay, pooled_video_scores(qt, kt, lay, scale), kk),
        "pool": lambda: pooled_video_blocks(qt, kt, lay, scale),
        "scores": lambda: pq @ pk.transpose(-1, -2),
        "topk": lambda: topk_lists(lay, scores, kk),
        "select_torch": lambda: torch_select(qt, kt, lay, kk, scale),
        "topk_torch": lambda: torch_topk_lists(lay, old_scores, kk),
        "kernel": lambda: block_sparse_attention(qt, kt, vt, idx, cnt, block_size=64, scale=scale, kv_valid=kvv),
        "rest": lambda: run_block_lists(q, k, v, lay, idx, cnt, **run),
    }


def agreement(fns: dict, grid, sparsity: float, edge_tiles: str) -> dict:
    """``same_rows`` (new vs replaced selection) and ``exact`` (Triton top-k vs the PyTorch path on
    the same scores) of one input."""
    from ditattn.attention.sparse.common import topk_lists
    from ditattn.attention.sparse.tiling import make_tile_layout
    from ditattn.attention.sparse.vsa import vsa_num_selected

    lay = make_tile_layout(grid, (4, 4, 4), 0, edge_tiles=edge_tiles)
    kk = vsa_num_selected(sparsity, lay.n_video_blocks)
    new_idx = fns["select"]()[0]
    old_idx, old_scores = fns["select_torch"]()
    same = float((new_idx == old_idx).all(-1).float().mean())
    exact = torch.equal(topk_lists(lay, old_scores, kk)[0], topk_lists(lay, old_scores, kk, "reference")[0])
    return {"same_rows": same, "exact": exact}


def gpu_launches(fn, iters: int = 5) -> Optional[float]:
    """Kernels (and copies) one ``fn()`` call puts on the GPU timeline (profiler); None off CUDA."""
    if common.DEVICE != "cuda":
        return None
    fn()
    prof = common.profile_step(lambda: [fn() for _ in range(iters)], top=10**6)
    return sum(k["calls"] for k in prof["top_kernels"]) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for vsa_stages.json (default: print only)")
    common.add_grid_args(ap, grids="wan480,wan720", heads="12,40")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of edge-tile layouts {list(LAYOUTS)}")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--counts-only", action="store_true", help="only the block counts (no timing; any machine)")
    args = ap.parse_args()
    grids, heads_list = common.grid_args(ap, args)

    counts = count_table(args.sparsity)
    print(f"VSA sparsity {args.sparsity}: blocks and block pairs per head")
    print(fmt_table(counts, COUNT_COLS), flush=True)
    if args.counts_only:
        return
    common.require_cuda()
    rec = Recorder(
        args.out or os.path.join("/tmp", "vsa_stages"),
        "vsa_stages",
        {"env": env_info(), "sparsity": args.sparsity, "counts": counts},
    )
    summary = []
    for _, grid in grids:
        for heads in heads_list:
            S = math.prod(grid)
            q, k, v = make_qkv(1, S, heads, 128, seed=S + heads)
            for edge_tiles in args.layouts.split(","):
                fns = guarded(
                    rec,
                    f"{grid} H{heads} {edge_tiles} setup",
                    lambda: stages(q, k, v, grid, args.sparsity, edge_tiles),
                )
                if fns is None:
                    continue
                row = {"grid": "x".join(map(str, grid)), "heads": heads, "edge_tiles": edge_tiles}
                row.update(
                    guarded(
                        rec,
                        f"{grid} H{heads} {edge_tiles} agreement",
                        lambda: agreement(fns, grid, args.sparsity, edge_tiles),
                    )
                    or {}
                )
                for name, fn in fns.items():
                    row[f"{name}_ms"] = guarded(rec, f"{grid} H{heads} {edge_tiles} {name}", lambda: bench_ms(fn))
                    row[f"{name}_gpu_ms"] = guarded(
                        rec, f"{grid} H{heads} {edge_tiles} {name} (kernel time)", lambda: kernel_ms(fn)
                    )
                    row[f"{name}_launches"] = guarded(
                        rec, f"{grid} H{heads} {edge_tiles} {name} (launches)", lambda: gpu_launches(fn)
                    )
                for t in ("", "_gpu"):
                    for sel, call, key in (
                        ("select", "call", "select_share"),
                        ("select_torch", "call_torchsel", "select_share_torch"),
                    ):
                        a, b = row.get(f"{sel}{t}_ms"), row.get(f"{call}{t}_ms")
                        row[f"{key}{t}"] = a / b if a and b else None
                rec.add(**row)
                summary.append(row)
                print(row, flush=True)
                del fns
                common.empty_cache()
            del q, k, v
            common.empty_cache()
    cols = [
        ("grid", "grid", ""),
        ("heads", "H", ""),
        ("edge_tiles", "edge tiles", ""),
        ("call_ms", "call ms", ".3f"),
        ("tile_qk_ms", "tile q,k", ".3f"),
        ("select_ms", "select", ".3f"),
        ("pool_ms", "pool", ".3f"),
        ("scores_ms", "scores", ".3f"),
        ("topk_ms", "top-k+lists", ".3f"),
        ("kernel_ms", "kernel", ".3f"),
        ("rest_ms", "tile v+kernel+untile", ".3f"),
        ("select_share", "select/call", ".1%"),
        ("call_gpu_ms", "call GPU ms", ".3f"),
        ("select_gpu_ms", "select GPU ms", ".3f"),
        ("select_share_gpu", "select/call GPU", ".1%"),
    ]
    print(fmt_table(summary, cols))
    before = [
        ("grid", "grid", ""),
        ("heads", "H", ""),
        ("edge_tiles", "edge tiles", ""),
        ("call_torchsel_ms", "call ms before", ".3f"),
        ("call_ms", "after", ".3f"),
        ("call_torchsel_gpu_ms", "call GPU ms before", ".3f"),
        ("call_gpu_ms", "after", ".3f"),
        ("select_torch_gpu_ms", "select GPU ms before", ".3f"),
        ("select_gpu_ms", "after", ".3f"),
        ("topk_torch_gpu_ms", "top-k GPU ms before", ".3f"),
        ("topk_gpu_ms", "after", ".3f"),
        ("select_share_torch_gpu", "select/call GPU before", ".1%"),
        ("select_share_gpu", "after", ".1%"),
        ("call_torchsel_launches", "call launches before", ".0f"),
        ("call_launches", "after", ".0f"),
        ("select_torch_launches", "select launches before", ".0f"),
        ("select_launches", "after", ".0f"),
        ("same_rows", "same rows", ".4f"),
        ("exact", "top-k exact", ""),
    ]
    print("\nbefore (PyTorch selection) / after (Triton selection)")
    print(fmt_table(summary, before))


if __name__ == "__main__":
    main()
