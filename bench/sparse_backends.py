"""Each sparse video backend at the PERF.md video shapes: time and error against exact attention.

Runs every in-tree sparse backend through the public ``ditattn.attention`` API with its default
parameters (STA: a mask strategy file written here with a 3x3x3-tile window for every head;
VSA: sparsity 0.9 besides its default 0.0), on random bf16 inputs with the latent grid of the
shape, and reports median time (planning included), the kept block fraction, the speed-up over
the fastest dense kernel in the same run (``fa``), and ‖out − exact‖/‖exact‖ where exact is dense
attention computed in float32.

    python bench/sparse_backends.py --out $OUT/sparse_backends.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import profile_step  # noqa: E402

SHAPES = {"wan480": (21, 30, 52), "wan720": (21, 45, 80)}
CASES = [
    ("sliding_tile_attn", "STA"),
    ("video_sparse_attn", {}),
    ("video_sparse_attn", {"sparsity": 0.9}),
    ("sparge_attn", {}),
    ("vmoba_attn", {"first_full_step": 0}),
    ("sparse_video_gen_2_attn", {}),
    ("sla_attn", {}),
    ("sage_sla_attn", {}),
    ("sol_attn", {"dense_steps": 0, "dense_layers": ""}),
]


def timed(fn, repeats):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="wan480,wan720")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--grid", default=None, help="override: T,H,W (e.g. 3,4,6 for a CPU smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ref-rows", type=int, default=1024, help="query rows checked against the float32 reference")
    ap.add_argument("--backends", default=None, help="comma list: only these backends (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also profile one call per backend (GPU time per kernel, top kernels; CUDA only)")
    args = ap.parse_args()

    import ditattn
    from ditattn.attention.sparse import clear_stats, last_stats

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sta_file = os.path.join(tempfile.mkdtemp(), "sta.json")
    rows = []
    grids = [tuple(int(x) for x in args.grid.split(","))] if args.grid else [SHAPES[s] for s in args.shapes.split(",")]
    for grid in grids:
        S = grid[0] * grid[1] * grid[2]
        g = torch.Generator(device=dev).manual_seed(S)
        q, k, v = (torch.randn(1, S, args.heads, 128, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(3))
        sel = torch.randperm(S, generator=torch.Generator().manual_seed(0))[: args.ref_rows].to(dev)
        exact = ditattn.attention(q[:, sel].float(), k.float(), v.float(), backend="torch_sdpa")
        dense_backend = "fa" if dev.type == "cuda" else "torch_sdpa"
        dense_ms = timed(lambda: ditattn.attention(q, k, v, backend=dense_backend), args.repeats)
        print(f"grid {grid} S={S} heads={args.heads}: dense {dense_backend} {dense_ms:.2f} ms", flush=True)
        n_tiles = [(-(-d // 4)) for d in grid]
        with open(sta_file, "w") as fh:  # every (step, layer, head): a 3x3x3-tile window
            json.dump({f"0_0_{h}": [3, 3, 3] for h in range(args.heads)}, fh)
        only = set(args.backends.split(",")) if args.backends else None
        for name, cfg in CASES:
            if only is not None and name not in only:
                continue
            if cfg == "STA":
                cfg = {"mask_strategy_file_path": sta_file, "skip_time_steps": 0}
            label = name + ("" if not cfg or name == "sliding_tile_attn" else ":" + ",".join(f"{a}={b}" for a, b in cfg.items()))
            try:
                run = lambda: ditattn.attention(q, k, v, backend=name, config=cfg, video_shape=grid, step=0, layer_idx=0)
                clear_stats()  # the kept fraction read below is this backend's
                out = run()
                ms = timed(run, args.repeats)
                err = ((out[:, sel].float() - exact).norm() / exact.norm()).item()
                stats = next(reversed(last_stats.values())) if last_stats else {}
                kept = stats.get("kept_fraction")
                row = {"grid": grid, "seq": S, "heads": args.heads, "backend": label, "ms": ms, "dense_ms": dense_ms,
                       "dense_backend": dense_backend, "speedup_vs_dense": dense_ms / ms, "kept_fraction": kept,
                       "rel_err": err}
                if args.profile and dev.type == "cuda":
                    row["profile"] = profile_step(run, top=12)
                    print(f"  profile wall {row['profile']['wall_ms']:.1f} busy {row['profile']['busy_ms']:.1f}", flush=True)
                    for kern in row["profile"]["top_kernels"]:
                        print(f"    {kern['ms']:8.2f} ms x{kern['calls']:<3} {kern['name'][:110]}", flush=True)
            except Exception as exc:  # report and go on
                row = {"grid": grid, "seq": S, "backend": label, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # written after every row, so a time limit keeps what was measured
                with open(args.out, "w") as fh:
                    json.dump(rows, fh, indent=2)
        del q, k, v
    print(f"\n{'S':>6} {'backend':<40} {'ms':>8} {'x dense':>8} {'kept':>6} {'rel err':>9}")
    for r in rows:
        if "ms" in r:
            kept = f"{r['kept_fraction']:.2f}" if r["kept_fraction"] is not None else "-"
            print(f"{r['seq']:>6} {r['backend']:<40} {r['ms']:8.2f} {r['speedup_vs_dense']:8.2f} {kept:>6} {r['rel_err']:9.2e}")
        else:
            print(f"{r['seq']:>6} {r['backend']:<40} ERROR {r['error'][:80]}")


if __name__ == "__main__":
    main()
