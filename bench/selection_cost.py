"""Cost of the block predictors of the training-free sparse backends against their whole call.

    python3 bench/selection_cost.py --out $OUT/selcost            # GPU: wan480, 12 and 40 heads
    BENCH_DEVICE=cpu python bench/selection_cost.py --grid 4,8,8 --heads 2   # smoke test

Per head count (bf16, batch 1, head dim 128, structured q/k/v of ``ditattn.evaluation.structured``,
the backends' default packed tiles), median wall time (do_bench) and GPU kernel time of:

* ``pooled``            upstream's predictor: pooled q . pooled k (Sparge ``predictor=pooled``);
* ``pooled_query``      pooled q against every key, log-sum-exp per key block (Triton kernel);
* ``pooled_query_var``  the same with the query variance term;
* ``svg2_clusters``     SVG2's pooled-query cluster-pair scores (64 query centroids against every key);
* ``sparge_call``       ``sparge_attention`` at topk 0.5 with each predictor, end to end (tiling, INT8
  quantization, selection, block-sparse kernel, untiling);
* ``dense_fa``          the dense attention of the same call (FA4 when installed, else SDPA).

The last table prints each predictor's time as a share of the Sparge call with it (target: well
below 10 %) and of dense attention, next to its FLOPs as a share of dense attention's ``4 N^2 D``.
Full rows go to ``<out>/selection_cost.json``.

``--cdf`` times instead sparge_attn's ``cdfthreshd`` selection, the list builder
(``mass_lists``: the rule's sort, then its Triton list kernel on CUDA — ``select cdf lists`` — or its
PyTorch scatter — ``select cdf lists torch``) against the mask path it replaced (``mass_mask`` ->
``add_special_blocks`` -> ``block_mask_to_lists``: a dense ``[nb, nb]`` mask and a second sort), all
from the same log masses, and the top-k lists, then the whole Sparge call each way and dense attention::

    python3 bench/selection_cost.py --cdf --heads 40 --out $OUT/selcost_cdf     # H200, wan480
    BENCH_DEVICE=cpu python bench/selection_cost.py --cdf --grid 4,8,8 --heads 2   # smoke test

(``--cdfthreshd`` 0.93, ``--floor`` 0.3: the cdf rule; ``--topk`` 0.4: the top-k comparison; ``--exact``:
``quantize=False``; ``--select-only``: skip the whole calls.)  It also checks that both paths' lists are
identical on the device and that the list path runs under ``torch.cuda.set_sync_debug_mode("error")``
(a NOTE otherwise).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
from common import DEVICE, Recorder, bench_ms, env_info, fmt_table, guarded, kernel_ms  # noqa: E402


def _dense(q, k, v):
    import ditattn

    backend = "fa" if DEVICE == "cuda" else "torch_sdpa"
    return ditattn.attention(q, k, v, backend=backend)


def measure(rec, grid, heads):
    from ditattn.attention.sparse.block_scores import pooled_query_block_scores
    from ditattn.attention.sparse.sparge import sparge_attention, sparge_tile_size
    from ditattn.attention.sparse.svg2 import pooled_query_cluster_scores
    from ditattn.attention.sparse.tiling import make_tile_layout, tile
    from ditattn.attention.sparse.vsa import pooled_video_scores
    from ditattn.evaluation.structured import StructuredSpec, structured_qkv

    q, k, v, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=heads), device=DEVICE)
    S, D = q.shape[1], q.shape[-1]
    scale = D**-0.5
    lay = make_tile_layout(grid, sparge_tile_size(64), 0, edge_tiles="packed")
    qt, kt = tile(q, lay), tile(k, lay)
    nv = lay.n_video_blocks
    g = torch.Generator(device="cpu").manual_seed(0)
    labels = torch.randint(0, 128, (heads, S), generator=g).to(DEVICE)
    cq = torch.randn(heads, 64, D, generator=g).to(DEVICE)
    keys = k[0].transpose(0, 1)  # [H, S, D]
    dense_flops = 4.0 * heads * S * S * D
    cases = {
        "pooled": (lambda: pooled_video_scores(qt, kt, lay, scale), 2.0 * heads * nv * nv * D),
        "pooled_query": (lambda: pooled_query_block_scores(qt, kt, lay, scale), 2.0 * heads * nv * nv * 64 * D),
        "pooled_query_var": (
            lambda: pooled_query_block_scores(qt, kt, lay, scale, variance=True),
            4.0 * heads * nv * nv * 64 * D,
        ),
        "svg2_clusters": (lambda: pooled_query_cluster_scores(cq, keys, labels, 128, scale), 2.0 * heads * 64 * S * D),
        "sparge_call pooled": (
            lambda: sparge_attention(q, k, v, video_shape=grid, topk=0.5, quantize=True, predictor="pooled"),
            None,
        ),
        "sparge_call pooled_query": (
            lambda: sparge_attention(q, k, v, video_shape=grid, topk=0.5, quantize=True),
            None,
        ),
        "dense_fa": (lambda: _dense(q, k, v), dense_flops),
    }
    out = {}
    for name, (fn, flops) in cases.items():
        ms = guarded(rec, f"{name} H={heads}", lambda fn=fn: bench_ms(fn))
        kms = guarded(rec, f"{name} H={heads} (kernels)", lambda fn=fn: kernel_ms(fn))
        out[name] = (ms, kms)
        rec.add(
            grid="x".join(map(str, grid)),
            heads=heads,
            case=name,
            ms=ms,
            kernel_ms=kms,
            flops_share=None if flops is None else flops / dense_flops,
        )
        print(
            f"  H={heads} {name:<26} {ms if ms is not None else float('nan'):9.3f} ms  kernels "
            f"{kms if kms is not None else float('nan'):9.3f} ms",
            flush=True,
        )
    summary = []
    for name, call in (
        ("pooled", "sparge_call pooled"),
        ("pooled_query", "sparge_call pooled_query"),
        ("pooled_query_var", "sparge_call pooled_query"),
        ("svg2_clusters", None),
    ):
        ms, kms = out[name]
        cms = out[call][0] if call else None
        dms = out["dense_fa"][0]
        summary.append(
            {
                "heads": heads,
                "predictor": name,
                "ms": ms,
                "of_call": ms / cms if ms and cms else None,
                "of_dense": ms / dms if ms and dms else None,
                "flops_of_dense": cases[name][1] / dense_flops,
            }
        )
    return summary


def measure_cdf(rec, grid, heads, args):
    """The cdfthreshd selection, list builder vs mask path (module docstring); rows of the summary table."""
    import ditattn.attention.sparse.sparge as sp
    from ditattn.attention.sparse.block_sparse import list_width
    from ditattn.attention.sparse.common import ceil_fraction, mass_lists, mass_lists_via_mask, topk_lists
    from ditattn.attention.sparse.tiling import make_tile_layout, tile
    from ditattn.evaluation.structured import StructuredSpec, structured_qkv

    q, k, v, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=heads), device=DEVICE)
    scale = q.shape[-1] ** -0.5
    lay = make_tile_layout(grid, sp.sparge_tile_size(64), 0, edge_tiles="packed")
    nv, nb = lay.n_video_blocks, lay.n_blocks
    scores = sp.sparge_scores(tile(q, lay), tile(k, lay), lay, scale, "pooled_query")
    lm = sp.sparge_log_mass(scores, lay, "pooled_query")
    thr, floor = args.cdfthreshd, ceil_fraction(args.floor, nv)
    width = list_width(q.device, nb)
    kt = ceil_fraction(args.topk, nv)
    masked = mass_lists_via_mask(lay, lm, thr, floor, width=width)
    for impl in ("auto", "reference"):
        lists = mass_lists(lay, lm, thr, floor, width=width, impl=impl)
        if not (torch.equal(lists[0], masked[0]) and torch.equal(lists[1], masked[1])):
            rec.note(f"H={heads}: mass_lists(impl={impl!r}) differs from the mask path on {DEVICE}")
    if DEVICE == "cuda":
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            guarded(
                rec,
                f"H={heads}: mass_lists under sync debug mode 'error'",
                lambda: mass_lists(lay, lm, thr, floor, width=width),
            )
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    kept_cdf = float(lists[1].sum()) / (lists[1].numel() * nb)
    kept_topk = topk_lists(lay, scores, kt)[2]
    call = dict(video_shape=grid, quantize=not args.exact)
    cdf_kw = dict(call, cdfthreshd=thr, topk=args.floor)

    def via_mask():
        sp.mass_lists, saved = mass_lists_via_mask, sp.mass_lists
        try:
            return sp.sparge_attention(q, k, v, **cdf_kw)
        finally:
            sp.mass_lists = saved

    cases = {
        "select cdf mask path": (lambda: mass_lists_via_mask(lay, lm, thr, floor, width=width), kept_cdf),
        "select cdf lists": (lambda: mass_lists(lay, lm, thr, floor, width=width), kept_cdf),
        "select cdf lists torch": (lambda: mass_lists(lay, lm, thr, floor, width=width, impl="reference"), kept_cdf),
        f"select topk {args.topk:g}": (lambda: topk_lists(lay, scores, kt), kept_topk),
    }
    if not args.select_only:
        cases.update(
            {
                "sparge cdf mask path": (via_mask, kept_cdf),
                "sparge cdf lists": (lambda: sp.sparge_attention(q, k, v, **cdf_kw), kept_cdf),
                f"sparge topk {args.topk:g}": (
                    lambda: sp.sparge_attention(q, k, v, topk=args.topk, **call),
                    kept_topk,
                ),
                "dense_fa": (lambda: _dense(q, k, v), 1.0),
            }
        )
    out = []
    for name, (fn, kept) in cases.items():
        ms = guarded(rec, f"{name} H={heads}", lambda fn=fn: bench_ms(fn))
        kms = guarded(rec, f"{name} H={heads} (kernels)", lambda fn=fn: kernel_ms(fn))
        row = rec.add(
            grid="x".join(map(str, grid)),
            heads=heads,
            nv=nv,
            case=name,
            ms=ms,
            kernel_ms=kms,
            kept=kept,
            cdfthreshd=thr,
            floor=args.floor,
            topk=args.topk,
            quantize=not args.exact,
        )
        out.append(row)
        print(
            f"  H={heads} nv={nv} {name:<24} {ms if ms is not None else float('nan'):9.3f} ms  kernels "
            f"{kms if kms is not None else float('nan'):9.3f} ms  kept {kept:.4f}",
            flush=True,
        )
    dense = next((r["ms"] for r in out if r["case"] == "dense_fa"), None)
    for r in out:
        r["x_dense"] = dense / r["ms"] if dense and r["ms"] and r["case"].startswith("sparge") else None
    return out


def run(ap, args, measure_fn, label: str, title: str, cols: list) -> None:
    """``measure_fn(rec, grid, heads)`` over every grid and head count of the command line, recorded under
    ``--out``; the summary table (``cols``) last."""
    grids, heads_list = common.grid_args(ap, args)
    rec = Recorder(args.out, "selection_cost", {"env": env_info(), "argv": sys.argv[1:], "device": DEVICE})
    summary = []
    for _, grid in grids:
        for heads in heads_list:
            print(f"[grid {grid}, {heads} heads{label}]", flush=True)
            summary += measure_fn(rec, grid, heads)
    rec.data["summary"] = summary
    rec.flush()
    print(f"\n## {title}\n")
    print(fmt_table(summary, cols))
    for n in rec.data["notes"]:
        print("NOTE:", n)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_grid_args(ap, grids="wan480", heads="12,40")
    ap.add_argument("--out", default="selection_cost_out")
    ap.add_argument("--cdf", action="store_true", help="time the cdfthreshd selection paths (module docstring)")
    ap.add_argument("--cdfthreshd", type=float, default=0.93, help="--cdf: the threshold (default 0.93)")
    ap.add_argument("--floor", type=float, default=0.3, help="--cdf: topk, the floor under cdfthreshd (default 0.3)")
    ap.add_argument("--topk", type=float, default=0.4, help="--cdf: topk of the top-k comparison (default 0.4)")
    ap.add_argument("--exact", action="store_true", help="--cdf: quantize=False in the whole calls")
    ap.add_argument("--select-only", action="store_true", help="--cdf: the selection stages only")
    args = ap.parse_args()
    if args.cdf:
        return run(
            ap,
            args,
            lambda rec, grid, heads: measure_cdf(rec, grid, heads, args),
            f", cdfthreshd {args.cdfthreshd} floor {args.floor}",
            "cdfthreshd selection: list builder vs mask path (x dense: dense ms / call ms)",
            [
                ("heads", "H", ""),
                ("nv", "nv", ""),
                ("case", "case", ""),
                ("ms", "ms", ".3f"),
                ("kernel_ms", "kernel ms", ".3f"),
                ("kept", "kept", ".4f"),
                ("x_dense", "x dense", ".3f"),
            ],
        )
    return run(
        ap,
        args,
        measure,
        "",
        "Predictor cost (share of the Sparge call at topk 0.5 with it, and of dense attention)",
        [
            ("heads", "H", ""),
            ("predictor", "predictor", ""),
            ("ms", "ms", ".3f"),
            ("of_call", "of call", ".3f"),
            ("of_dense", "of dense", ".3f"),
            ("flops_of_dense", "FLOPs of dense", ".4f"),
        ],
    )


if __name__ == "__main__":
    main()
