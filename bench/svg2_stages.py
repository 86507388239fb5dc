"""Where a warm ``sparse_video_gen_2_attn`` step spends its time: a work count per stage and, on a GPU, timings.

    python3 bench/svg2_stages.py --counts-only                    # any machine: FLOPs / bytes per stage
    python3 bench/svg2_stages.py --heads 12 --out $OUT/svg2       # GPU: counts, then timings

A warm step (issue 19: "never slower than dense") is: one Lloyd iteration of the query and of the
key k-means from the previous step's centroids (``warm_iters``), the pooled-query cluster scores,
the cluster-pair selection and block lists, the per-head permutation of q/k/v, the block-sparse
kernel and the inverse permutation.  Stages:

* ``call``        ``svg2_attention`` warm (each call one more step: k-means from the last centroids);
* ``reused_call`` ``svg2_attention`` reusing its cached plan (``recluster_every`` huge): gathers,
                  kernel and scatter only — the floor a warm step adds its planning to;
* ``kmeans_q`` / ``kmeans_k`` one warm Lloyd run each (distances in float32; one-hot sums in bf16);
* ``scores``      :func:`pooled_query_cluster_scores` (logits, row exponentials, one-hot product);
* ``plan``        ``scores`` + selection + label sorts + block mask + fixed-width lists;
* ``gather``      q, k, v permuted per head (padded to whole blocks);
* ``kernel``      the block-sparse kernel on the permuted tensors (FA4's block-sparse path at
                  128-token blocks when installed);
* ``scatter``     the output back to token order.

Counts (host arithmetic): per stage the float32 GEMM FLOPs (SIMT: ``torch.bmm`` without TF32), the
bf16 GEMM FLOPs and the bytes moved, and a time from those at the ``--fp32-tflops`` /
``--bf16-tflops`` / ``--hbm-tbs`` rates (no launch gaps: a floor, not a prediction of the wall time).
Timings (CUDA, structured 480p inputs): do_bench median wall time and GPU kernel time
(torch.profiler) per stage; the last table puts them next to FA4 dense attention on the same inputs.
Full rows go to ``<out>/svg2_stages.json``.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import Recorder, bench_ms, env_info, fmt_table, guarded, kernel_ms  # noqa: E402



def work(grid, heads: int, *, num_q_clusters: int = 64, num_k_clusters: int = 128, warm_iters: int = 1,
         head_dim: int = 128, kept: float = 0.35) -> dict:
    """FLOPs and bytes of one warm step per stage (bf16 inputs, batch 1, no text; see the module
    docstring): ``{stage: {"fp32_flop", "bf16_flop", "bytes"}}``.  ``kept``: the kernel's kept
    fraction (its FLOPs only; its time is measured, not modelled)."""
    from ditattn.attention.sparse.svg2 import svg2_block_size

    G, N, D = heads, math.prod(grid), head_dim
    Cq, Ck = num_q_clusters, num_k_clusters
    bs = svg2_block_size(N, max(Cq, Ck))
    P = -(-N // bs) * bs

    def lloyd(C):
        # x -> float32 (read bf16, write fp32); per iteration: the fused |c|^2 - 2 x.c product and its argmin
        # (write + read the [N, C] distances, labels out), the one-hot (zero, scatter, row sums) and its
        # bf16 product with the points
        it_bytes = 4 * G * N * D + 8 * G * N * C + 8 * G * N + 6 * G * C * N + 2 * G * N * D + 10 * G * N
        return {"fp32_flop": warm_iters * 2 * G * N * C * D, "bf16_flop": warm_iters * 2 * G * C * N * D,
                "bytes": 6 * G * N * D + warm_iters * it_bytes}

    scores = {"fp32_flop": 2 * G * Cq * N * D, "bf16_flop": 2 * G * Cq * N * Ck,
              # keys (fp32) read; logits written, scaled, max, minus max, exp, to bf16; one-hot read
              "bytes": 4 * G * N * D + 40 * G * Cq * N + 2 * G * Ck * N}
    nb = P // bs
    rest = {"fp32_flop": 0, "bf16_flop": 0,
            # two stable sorts of the labels (radix passes over int64 keys + indices), masks and lists
            "bytes": 2 * 64 * G * N + 16 * G * nb * nb + 64 * G * Cq * Ck}
    plan = {key: scores[key] + rest[key] for key in scores}
    gather = {"fp32_flop": 0, "bf16_flop": 0, "bytes": 3 * (2 * G * N * D + 2 * G * P * D)}
    scatter = {"fp32_flop": 0, "bf16_flop": 0, "bytes": 2 * G * P * D + 2 * G * N * D}
    kernel = {"fp32_flop": 0, "bf16_flop": 4 * G * kept * P * P * D, "bytes": 0}
    return {"kmeans_q": lloyd(Cq), "kmeans_k": lloyd(Ck), "scores": scores, "plan": plan, "gather": gather,
            "kernel": kernel, "scatter": scatter}


def floor_ms(w: dict, fp32_tflops: float, bf16_tflops: float, hbm_tbs: float) -> float:
    return 1e3 * (w["fp32_flop"] / (fp32_tflops * 1e12) + w["bf16_flop"] / (bf16_tflops * 1e12)
                  + w["bytes"] / (hbm_tbs * 1e12))


def count_table(grids, heads_list, rates, **kw) -> list[dict]:
    rows = []
    for name, grid in grids:
        for heads in heads_list:
            w = work(grid, heads, **kw)
            planning = 0.0
            for stage in ("kmeans_q", "kmeans_k", "plan", "gather", "scatter", "kernel"):
                ms = floor_ms(w[stage], *rates) if stage != "kernel" else None
                if stage in ("kmeans_q", "kmeans_k", "plan"):
                    planning += ms
                rows.append({"grid": name, "heads": heads, "stage": stage, "fp32_gflop": w[stage]["fp32_flop"] / 1e9,
                             "bf16_gflop": w[stage]["bf16_flop"] / 1e9, "mbytes": w[stage]["bytes"] / 1e6,
                             "floor_ms": ms})
            rows.append({"grid": name, "heads": heads, "stage": "planning (k-means + plan)", "floor_ms": planning})
    return rows


COUNT_COLS = [("grid", "grid", ""), ("heads", "H", ""), ("stage", "stage", ""), ("fp32_gflop", "fp32 GFLOP", ".2f"),
              ("bf16_gflop", "bf16 GFLOP", ".2f"), ("mbytes", "MB moved", ".0f"), ("floor_ms", "floor ms", ".3f")]


def stages(q, k, v, grid, *, num_q_clusters: int = 64, num_k_clusters: int = 128, warm_iters: int = 1,
           top_p: float = 0.9) -> dict:
    """Callables of every stage on one input (module docstring), after a cold clustering."""
    from ditattn.attention.sparse import svg2
    from ditattn.attention.sparse.block_sparse import block_sparse_attention

    B, S, H, D = q.shape
    N = math.prod(grid)
    scale = D ** -0.5
    Cq, Ck = num_q_clusters, num_k_clusters
    bs = svg2.svg2_block_size(N, max(Cq, Ck))
    xq, xk = svg2._video_rows(q, N), svg2._video_rows(k, N)
    _, cq0, *_ = svg2._lloyd(xq, Cq, 5, None)
    _, ck0, *_ = svg2._lloyd(xk, Ck, 5, None)
    ql, cq, qs, _, _ = svg2._lloyd(xq, Cq, warm_iters, cq0)
    kl, ck, ks, k_onehot, keys = svg2._lloyd(xk, Ck, warm_iters, ck0)

    def plan():
        return svg2._plan(q, N, cq, ck, qs, ks, ql, kl, scale, top_p, bs, "pooled_query", keys=keys,
                          k_onehot=k_onehot)

    q_perm, k_perm, idx, cnt, _, _ = plan()
    P = -(-S // bs) * bs
    kvv = svg2._kv_valid(B, P, S, q.device)
    qp, kp, vp = (svg2._gather_tokens(t, p, P) for t, p in ((q, q_perm), (k, k_perm), (v, k_perm)))
    out_p, _ = block_sparse_attention(qp, kp, vp, idx, cnt, block_size=bs, scale=scale, kv_valid=kvv,
                                      nonempty_rows=True)
    kw = dict(video_shape=grid, num_q_clusters=Cq, num_k_clusters=Ck, warm_iters=warm_iters, top_p=top_p)
    steps, reused_steps = itertools.count(), itertools.count()
    svg2.reset_svg2_state("svg2_stages")
    svg2.reset_svg2_state("svg2_stages_reused")
    return {
        "call": lambda: svg2.svg2_attention(q, k, v, state_key="svg2_stages", step=next(steps), **kw),
        "reused_call": lambda: svg2.svg2_attention(q, k, v, state_key="svg2_stages_reused", step=next(reused_steps),
                                                   recluster_every=1 << 30, **kw),
        "kmeans_q": lambda: svg2._lloyd(xq, Cq, warm_iters, cq0),
        "kmeans_k": lambda: svg2._lloyd(xk, Ck, warm_iters, ck0),
        "scores": lambda: svg2.pooled_query_cluster_scores(cq, keys, kl, Ck, scale, onehot=k_onehot),
        "plan": plan,
        "gather": lambda: tuple(svg2._gather_tokens(t, p, P) for t, p in ((q, q_perm), (k, k_perm), (v, k_perm))),
        "kernel": lambda: block_sparse_attention(qp, kp, vp, idx, cnt, block_size=bs, scale=scale, kv_valid=kvv,
                                                 nonempty_rows=True),
        "scatter": lambda: svg2._scatter_tokens(out_p, q_perm),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for svg2_stages.json (default: print only)")
    common.add_grid_args(ap, grids="wan480", heads="12")
    ap.add_argument("--num-q-clusters", type=int, default=64)
    ap.add_argument("--num-k-clusters", type=int, default=128)
    ap.add_argument("--warm-iters", type=int, default=1)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--fp32-tflops", type=float, default=50.0, help="float32 GEMM rate of the floor (H200 SIMT)")
    ap.add_argument("--bf16-tflops", type=float, default=700.0, help="bf16 GEMM rate of the floor")
    ap.add_argument("--hbm-tbs", type=float, default=3.5, help="achieved memory bandwidth of the floor, TB/s")
    ap.add_argument("--counts-only", action="store_true", help="only the work counts (no timing; any machine)")
    args = ap.parse_args()

    grids, heads_list = common.grid_args(ap, args)
    kw = dict(num_q_clusters=args.num_q_clusters, num_k_clusters=args.num_k_clusters, warm_iters=args.warm_iters)
    counts = count_table(grids, heads_list, (args.fp32_tflops, args.bf16_tflops, args.hbm_tbs), **kw)
    print(f"SVG2 warm step ({args.num_q_clusters}/{args.num_k_clusters} clusters, warm_iters {args.warm_iters}): "
          f"work per stage; floor at {args.fp32_tflops:g} fp32 / {args.bf16_tflops:g} bf16 TFLOP/s, "
          f"{args.hbm_tbs:g} TB/s")
    print(fmt_table(counts, COUNT_COLS), flush=True)
    if args.counts_only:
        return
    common.require_cuda()
    from ditattn.evaluation.structured import StructuredSpec, structured_qkv

    rec = Recorder(args.out or os.path.join("/tmp", "svg2_stages"), "svg2_stages",
                   {"env": env_info(), "args": vars(args), "counts": counts})
    summary = []
    for name, grid in grids:
        for heads in heads_list:
            q, k, v, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=heads), device=common.DEVICE)
            row = {"grid": name, "heads": heads}
            dense = "fa" if common.DEVICE == "cuda" else "torch_sdpa"
            import ditattn

            row["dense_ms"] = guarded(rec, f"{name} H{heads} dense",
                                      lambda: bench_ms(lambda: ditattn.attention(q, k, v, backend=dense)))
            fns = guarded(rec, f"{name} H{heads} setup", lambda: stages(q, k, v, grid, top_p=args.top_p, **kw))
            for stage, fn in (fns or {}).items():
                row[f"{stage}_ms"] = guarded(rec, f"{name} H{heads} {stage}", lambda: bench_ms(fn))
                row[f"{stage}_gpu_ms"] = guarded(rec, f"{name} H{heads} {stage} (kernel time)", lambda: kernel_ms(fn))
            for t in ("", "_gpu"):
                call, dense_ms = row.get(f"call{t}_ms"), row.get("dense_ms")
                row[f"x_dense{t}"] = dense_ms / call if call and dense_ms else None
            rec.add(**row)
            summary.append(row)
            print(row, flush=True)
            del fns, q, k, v
            common.empty_cache()
    cols = [("grid", "grid", ""), ("heads", "H", ""), ("dense_ms", "dense", ".3f"), ("call_ms", "warm call", ".3f"),
            ("x_dense", "x dense", ".2f"), ("reused_call_ms", "reused call", ".3f"),
            ("kmeans_q_ms", "kmeans q", ".3f"), ("kmeans_k_ms", "kmeans k", ".3f"), ("scores_ms", "scores", ".3f"),
            ("plan_ms", "plan", ".3f"), ("gather_ms", "gather", ".3f"), ("kernel_ms", "kernel", ".3f"),
            ("scatter_ms", "scatter", ".3f"), ("call_gpu_ms", "call GPU", ".3f"), ("kmeans_k_gpu_ms", "kmeans k GPU", ".3f"),
            ("plan_gpu_ms", "plan GPU", ".3f")]
    print("\n## SVG2 warm step by stage (ms; wall = do_bench median, GPU = kernel time)\n")
    print(fmt_table(summary, cols))
    for n in rec.data["notes"]:
        print("NOTE:", n)


if __name__ == "__main__":
    main()
