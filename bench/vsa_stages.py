"""VSA's selection stage against the whole sparse call, padded vs packed edge tiles (issue 18 item 3).

    python3 bench/vsa_stages.py --out $OUT/vsa_stages              # GPU: counts, then timings
    python3 bench/vsa_stages.py --counts-only                      # any machine: block counts and pairs

Counts (host arithmetic, no GPU): for the Wan latent grids (480p 21x30x52, 720p 21x45x80), without
and with 512 text tokens, and both edge-tile layouts (``padded``: every 4x4x4 tile its own block;
``packed``: edge tiles cut by the grid share blocks, :mod:`ditattn.attention.sparse.tiling`): the
blocks, the tiles kept per query block ``k`` at the sparsity, and the (query block, key block)
pairs per head the kernel computes.

Timings (CUDA, bf16, batch 1, head dim 128, random q/k/v; 12 and 40 heads; no text — Wan's text
enters through cross-attention): each stage of ``video_sparse_attention`` as do_bench median wall
time and as GPU kernel time (torch.profiler, no launch gaps):

* ``call``    ``video_sparse_attention(q, k, v)`` end to end;
* ``tile_qk`` ``tile(q)``, ``tile(k)`` (the kernel needs them too);
* ``select``  the selection stage on tiled q/k: pooling + compressed scores + top-k + list building,
  and its parts ``pool`` (pooled q and k), ``scores`` (pooled q @ pooled k^T) and ``topk``
  (:func:`topk_lists`: top-k indices to sorted int32 lists);
* ``kernel``  the block-sparse kernel on tiled q/k/v with the lists;
* ``rest``    ``tile(v)`` + kernel + untiling (``run_block_lists`` given tiled q/k).

The last table prints ``select / call`` (target below 10 %) for both timings.  Full rows go to
``<out>/vsa_stages.json``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
from common import Recorder, bench_ms, env_info, fmt_table, guarded, kernel_ms, make_qkv  # noqa: E402

GRIDS = {"wan480": (21, 30, 52), "wan720": (21, 45, 80)}
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
    return {"grid": "x".join(map(str, grid)), "text_len": text_len, "edge_tiles": edge_tiles,
            "video_blocks": nv, "blocks": nb, "min_blocks": -(-math.prod(grid) // 64) + -(-text_len // 64),
            "k": k, "pairs_per_head": round(kept * nb * nb), "kept_fraction": kept}


def count_table(sparsity: float) -> list[dict]:
    rows = []
    for grid in GRIDS.values():
        for text in (0, 512):
            pair = [block_counts(grid, text, sparsity, e) for e in LAYOUTS]
            pair[1]["pairs_vs_padded"] = pair[1]["pairs_per_head"] / pair[0]["pairs_per_head"]
            rows += pair
    return rows


COUNT_COLS = [("grid", "grid", ""), ("text_len", "text", ""), ("edge_tiles", "edge tiles", ""),
              ("video_blocks", "video blocks", ""), ("blocks", "blocks", ""), ("min_blocks", "ceil(S/64)", ""),
              ("k", "k", ""), ("pairs_per_head", "block pairs / head", ""),
              ("pairs_vs_padded", "pairs vs padded", ".3f")]


def stages(q, k, v, grid, sparsity: float, edge_tiles: str) -> dict:
    """Callables of every stage on one input (see the module docstring)."""
    from ditattn.attention.sparse.block_sparse import block_sparse_attention
    from ditattn.attention.sparse.common import run_block_lists, topk_lists
    from ditattn.attention.sparse.tiling import make_tile_layout, pooled_blocks, tile
    from ditattn.attention.sparse.vsa import pooled_video_scores, video_sparse_attention, vsa_num_selected

    lay = make_tile_layout(grid, (4, 4, 4), 0, edge_tiles=edge_tiles)
    scale = q.shape[-1] ** -0.5
    nv = lay.n_video_blocks
    kk = vsa_num_selected(sparsity, nv)
    qt, kt, vt = tile(q, lay), tile(k, lay), tile(v, lay)
    pq, pk = pooled_blocks(qt, lay, nv, scale=scale), pooled_blocks(kt, lay, nv)
    scores = pq @ pk.transpose(-1, -2)
    idx, cnt, _ = topk_lists(lay, scores, kk)
    kvv = lay.kv_valid(q.shape[0], q.device)
    return {
        "call": lambda: video_sparse_attention(q, k, v, video_shape=grid, sparsity=sparsity, edge_tiles=edge_tiles),
        "tile_qk": lambda: (tile(q, lay), tile(k, lay)),
        "select": lambda: topk_lists(lay, pooled_video_scores(qt, kt, lay, scale), kk),
        "pool": lambda: (pooled_blocks(qt, lay, nv, scale=scale), pooled_blocks(kt, lay, nv)),
        "scores": lambda: pq @ pk.transpose(-1, -2),
        "topk": lambda: topk_lists(lay, scores, kk),
        "kernel": lambda: block_sparse_attention(qt, kt, vt, idx, cnt, block_size=64, scale=scale, kv_valid=kvv),
        "rest": lambda: run_block_lists(q, k, v, lay, idx, cnt, scale=scale, return_lse=False, q_tiled=qt,
                                        k_tiled=kt),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for vsa_stages.json (default: print only)")
    ap.add_argument("--grids", default="wan480,wan720", help=f"comma list of {sorted(GRIDS)}")
    ap.add_argument("--grid", default=None, help="override: T,H,W (e.g. 5,8,12 for a CPU smoke run)")
    ap.add_argument("--heads", default="12,40", help="comma list of head counts")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--counts-only", action="store_true", help="only the block counts (no timing; any machine)")
    args = ap.parse_args()

    counts = count_table(args.sparsity)
    print(f"VSA sparsity {args.sparsity}: blocks and block pairs per head")
    print(fmt_table(counts, COUNT_COLS), flush=True)
    if args.counts_only:
        return
    if common.DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("error: no CUDA device (set BENCH_DEVICE=cpu with --grid for a smoke run, or use --counts-only)")
    rec = Recorder(args.out or os.path.join("/tmp", "vsa_stages"), "vsa_stages",
                   {"env": env_info(), "sparsity": args.sparsity, "counts": counts})
    grids = [tuple(int(x) for x in args.grid.split(","))] if args.grid else [GRIDS[g] for g in args.grids.split(",")]
    summary = []
    for grid in grids:
        for heads in (int(h) for h in args.heads.split(",")):
            S = math.prod(grid)
            q, k, v = make_qkv(1, S, heads, 128, seed=S + heads)
            for edge_tiles in LAYOUTS:
                fns = guarded(rec, f"{grid} H{heads} {edge_tiles} setup",
                              lambda: stages(q, k, v, grid, args.sparsity, edge_tiles))
                if fns is None:
                    continue
                row = {"grid": "x".join(map(str, grid)), "heads": heads, "edge_tiles": edge_tiles}
                for name, fn in fns.items():
                    row[f"{name}_ms"] = guarded(rec, f"{grid} H{heads} {edge_tiles} {name}", lambda: bench_ms(fn))
                    row[f"{name}_gpu_ms"] = guarded(rec, f"{grid} H{heads} {edge_tiles} {name} (kernel time)",
                                                    lambda: kernel_ms(fn))
                for t in ("", "_gpu"):
                    sel, call = row.get(f"select{t}_ms"), row.get(f"call{t}_ms")
                    row[f"select_share{t}"] = sel / call if sel and call else None
                rec.add(**row)
                summary.append(row)
                print(row, flush=True)
                del fns
                common.empty_cache()
            del q, k, v
            common.empty_cache()
    cols = [("grid", "grid", ""), ("heads", "H", ""), ("edge_tiles", "edge tiles", ""),
            ("call_ms", "call ms", ".3f"), ("tile_qk_ms", "tile q,k", ".3f"), ("select_ms", "select", ".3f"),
            ("pool_ms", "pool", ".3f"), ("scores_ms", "scores", ".3f"), ("topk_ms", "top-k+lists", ".3f"),
            ("kernel_ms", "kernel", ".3f"), ("rest_ms", "tile v+kernel+untile", ".3f"),
            ("select_share", "select/call", ".1%"), ("call_gpu_ms", "call GPU ms", ".3f"),
            ("select_gpu_ms", "select GPU ms", ".3f"), ("select_share_gpu", "select/call GPU", ".1%")]
    print(fmt_table(summary, cols))


if __name__ == "__main__":
    main()
