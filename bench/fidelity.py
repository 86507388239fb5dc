"""Fidelity of the sparse backends on structured inputs (and captured activations): the quality-vs-speed frontier.

For each grid, head count and structured family (``--families``, default ``original``; ``all`` = every
family of :data:`ditattn.evaluation.structured.FAMILIES`: ``original`` — per-head content vectors plus
noise rotated by Wan's 3-D RoPE, spatial / temporal / global heads, sink tokens, v i.i.d.; ``weak`` —
content norms 3-8; ``mixed`` — very local and near-global heads in one layer; ``smooth`` — spatially
smooth values; ``weak_mixed_smooth`` — all three) structured q/k/v, bf16.  Every case (a backend and a
config) runs through ``ditattn.attention`` exactly as a DiT layer calls it (``video_shape``, a step and a
layer index past the dense phases, so the sparse path is what is measured); reported per case:

* ``ms``: median time of one call (planning included), and ``x dense``: the dense kernel's time
  (``fa`` = FlashAttention-4 on the H200; ``torch_sdpa`` on CPU) divided by it, same run;
* ``rel_err`` = |out - exact| / |exact| and ``cosine`` against float32 exact attention over all
  keys, on ``--ref-rows`` sampled query rows;
* ``kept``: fraction of (query block, key block) pairs computed; ``dense``: the call ran dense (a size
  rule or the error budget), ``dense heads``: heads the error budget ran dense, ``est err``: the
  budget's error estimate.

``--budget`` sets ``error_budget`` of every case of a backend that has one (Sparge, Sol, V-MoBA, SVG2):
``default`` (each backend's default, on), ``off`` (0: the plain selection rules) or a number; a comma list
(``default,off``) runs each such case once per value.

Stateful backends run as in a denoising loop: ``sparse_video_gen_2_attn`` is called with
increasing steps (warm-started k-means), its time is the steady state and its error that of the
last timed call.  ``sliding_tile_attn`` runs its workflow end to end: one ``STA_searching`` call
(full attention plus every candidate window, the search cost reported as ``search_s``) writes the
mask-strategy file, then ``STA_inference`` reads it.

``sage_attn`` (INT8 Q·K, every pair computed) is the quantized dense reference.  Skip softmax (BLASST, a
request option rather than a backend: ``--backends skip_softmax``) runs its CUDA kernel on the GPU and its
PyTorch reference of the same tile rule elsewhere; its ``kept`` is the fraction of 128×128 tiles not skipped.

``--activations FILE`` (repeatable) adds the entries of activation files (``bench/capture_qkv.py``, format
``ditattn-qkv-v1``) as inputs next to the structured ones; with them a second table gives each case's
mean / median / max error over those inputs and its mean error per captured step and layer.  Writes
``fidelity.json`` and ``fidelity.png`` (error against speed-up, log scale) into ``--out`` and prints the
frontier table last.  CPU smoke run: ``BENCH_DEVICE=cpu python bench/fidelity.py --grid 3,8,8 --heads 2``.

    python bench/fidelity.py --grids wan480 --heads 12,40 --out $OUT/fid

The frontier of the training-free defaults over every family, the captured activations, the fallback cost, sage_attn
against fa and the budget's GPU tests in one H200 call (under 7 minutes): ``python bench/frontier.py --out $OUT``.
Its fidelity part is::

    python bench/fidelity.py --grids wan480 --heads 12,40 --families all --preset training-free \
        --budget default,off --loop --overhead --activations-error-only --summary --activations FILE --out $OUT/fid
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import common  # noqa: E402
from common import DEVICE, Deadline, Recorder, bench_ms, env_info, fmt_table, reference_rows, sample_rows  # noqa: E402

LAYER = 2  # past sol_attn's default dense_layers 0,1
#: pseudo backend name of the skip-softmax cases (``--backends skip_softmax`` selects them)
SKIP_SOFTMAX = "skip_softmax"
#: (label, backend, config); "defaults" rows keep every default except the dense phases
CASES = [
    ("sparge_attn (defaults)", "sparge_attn", {}),
    ("sparge_attn topk=0.4", "sparge_attn", {"topk": 0.4}),
    ("sparge_attn topk=0.3", "sparge_attn", {"topk": 0.3}),
    ("sparge_attn topk=0.15", "sparge_attn", {"topk": 0.15}),
    ("sparge_attn exact topk=0.3", "sparge_attn", {"topk": 0.3, "quantize": False}),
    ("sparge_attn exact topk=0.35", "sparge_attn", {"topk": 0.35, "quantize": False}),
    ("sparge_attn exact topk=0.4", "sparge_attn", {"topk": 0.4, "quantize": False}),
    ("sparge_attn exact topk=0.45", "sparge_attn", {"topk": 0.45, "quantize": False}),
    ("sparge_attn exact topk=0.5", "sparge_attn", {"quantize": False}),
    # cdfthreshd: the fewest blocks reaching that predicted share of each row's mass, topk the floor
    ("sparge_attn exact cdf=0.9 topk=0.3", "sparge_attn", {"cdfthreshd": 0.9, "topk": 0.3, "quantize": False}),
    ("sparge_attn exact cdf=0.93 topk=0.3", "sparge_attn", {"cdfthreshd": 0.93, "topk": 0.3, "quantize": False}),
    ("sparge_attn exact cdf=0.94 topk=0.28", "sparge_attn", {"cdfthreshd": 0.94, "topk": 0.28, "quantize": False}),
    ("sparge_attn exact cdf=0.95 topk=0.25", "sparge_attn", {"cdfthreshd": 0.95, "topk": 0.25, "quantize": False}),
    ("sparge_attn exact cdf=0.92 topk=0.3", "sparge_attn", {"cdfthreshd": 0.92, "topk": 0.3, "quantize": False}),
    ("sparge_attn exact cdf=0.91 topk=0.3", "sparge_attn", {"cdfthreshd": 0.91, "topk": 0.3, "quantize": False}),
    # 4x4x8-token tiles: the kernels' 128-row regime (docs/benchmarks.md, block-sparse kernels), coarser selection
    ("sparge_attn exact topk=0.4 block_size=128", "sparge_attn", {"topk": 0.4, "quantize": False, "block_size": 128}),
    (
        "sparge_attn exact cdf=0.93 topk=0.3 block_size=128",
        "sparge_attn",
        {"cdfthreshd": 0.93, "topk": 0.3, "quantize": False, "block_size": 128},
    ),
    (
        "sparge_attn exact cdf=0.95 topk=0.3 block_size=128",
        "sparge_attn",
        {"cdfthreshd": 0.95, "topk": 0.3, "quantize": False, "block_size": 128},
    ),
    (
        "sparge_attn exact cdf=0.95 topk=0.35 block_size=128",
        "sparge_attn",
        {"cdfthreshd": 0.95, "topk": 0.35, "quantize": False, "block_size": 128},
    ),
    (
        "sparge_attn exact cdf=0.97 topk=0.3 block_size=128",
        "sparge_attn",
        {"cdfthreshd": 0.97, "topk": 0.3, "quantize": False, "block_size": 128},
    ),
    ("sparge_attn exact cdf=0.95 topk=0.3", "sparge_attn", {"cdfthreshd": 0.95, "topk": 0.3, "quantize": False}),
    ("sparge_attn cdf=0.95 topk=0.3", "sparge_attn", {"cdfthreshd": 0.95, "topk": 0.3}),
    ("sparge_attn exact cdf=0.95 no floor", "sparge_attn", {"cdfthreshd": 0.95, "topk": 0.001, "quantize": False}),
    ("sparge_attn topk=0.4 predictor=pooled_query_var", "sparge_attn", {"topk": 0.4, "predictor": "pooled_query_var"}),
    ("sparge_attn upstream predictor=pooled", "sparge_attn", {"predictor": "pooled"}),
    ("sparge_attn block_size=128", "sparge_attn", {"block_size": 128}),
    ("sparge_attn topk=0.4 block_size=128", "sparge_attn", {"topk": 0.4, "block_size": 128}),
    ("sparse_video_gen_2_attn (defaults)", "sparse_video_gen_2_attn", {}),
    ("sparse_video_gen_2_attn top_p=0.95", "sparse_video_gen_2_attn", {"top_p": 0.95}),
    ("sparse_video_gen_2_attn top_p=0.8", "sparse_video_gen_2_attn", {"top_p": 0.8}),
    ("sparse_video_gen_2_attn recluster_every=4", "sparse_video_gen_2_attn", {"recluster_every": 4}),
    (
        "sparse_video_gen_2_attn top_p=0.95 recluster_every=4",
        "sparse_video_gen_2_attn",
        {"top_p": 0.95, "recluster_every": 4},
    ),
    ("sparse_video_gen_2_attn warm_iters=2", "sparse_video_gen_2_attn", {"warm_iters": 2}),
    (
        "sparse_video_gen_2_attn 32/64 clusters",
        "sparse_video_gen_2_attn",
        {"num_q_clusters": 32, "num_k_clusters": 64},
    ),
    ("sparse_video_gen_2_attn upstream predictor=centroids", "sparse_video_gen_2_attn", {"predictor": "centroids"}),
    ("sol_attn (defaults)", "sol_attn", {}),
    ("sol_attn tau=0.5", "sol_attn", {"tau": 0.5}),
    ("sol_attn tau=0.25", "sol_attn", {"tau": 0.25}),
    ("sol_attn tau=2", "sol_attn", {"tau": 2.0}),
    ("sol_attn tau=0.75", "sol_attn", {"tau": 0.75}),
    ("sol_attn tau=1.25", "sol_attn", {"tau": 1.25}),
    ("sol_attn thresh_type=exact", "sol_attn", {"thresh_type": "exact"}),
    ("sol_attn tau=0.8", "sol_attn", {"tau": 0.8}),
    ("sol_attn block_size=128 tau=0.5", "sol_attn", {"block_size": 128, "tau": 0.5}),
    ("sol_attn block_size=128 tau=0.6", "sol_attn", {"block_size": 128, "tau": 0.6}),
    (
        "sol_attn upstream predictor=pooled centroid_variance=false",
        "sol_attn",
        {"predictor": "pooled", "centroid_variance": False},
    ),
    ("vmoba_attn (defaults)", "vmoba_attn", {}),
    ("vmoba_attn threshold=0.5", "vmoba_attn", {"moba_threshold": 0.5}),
    ("vmoba_attn upstream gate=mean", "vmoba_attn", {"gate": "mean"}),
    ("video_sparse_attn (defaults)", "video_sparse_attn", {}),
    ("video_sparse_attn sparsity=0.9", "video_sparse_attn", {"sparsity": 0.9}),
    ("video_sparse_attn sparsity=0.75", "video_sparse_attn", {"sparsity": 0.75}),
    (
        "video_sparse_attn sparsity=0.9 edge_tiles=padded",
        "video_sparse_attn",
        {"sparsity": 0.9, "edge_tiles": "padded"},
    ),
    ("sla_attn (defaults)", "sla_attn", {}),
    ("sla_attn edge_tiles=padded", "sla_attn", {"edge_tiles": "padded"}),
    ("sol_attn edge_tiles=padded", "sol_attn", {"edge_tiles": "padded"}),
    ("sparge_attn edge_tiles=padded", "sparge_attn", {"edge_tiles": "padded"}),
    ("STA searched (default candidates)", "sliding_tile_attn", {"search": None}),
    ("STA searched (large windows)", "sliding_tile_attn", {"search": [3, 5, 7, 5, 5, 5, 1, 9, 13, 6, 3, 5, 3, 9, 9]}),
    # the quantized dense reference: every pair computed, INT8 Q.K and fp16 / fp8 P.V
    ("sage_attn (defaults)", "sage_attn", {}),
    ("sage_attn pv_dtype=fp8", "sage_attn", {"pv_dtype": "fp8"}),
    # skip softmax (BLASST): a request option, not a backend; the CUDA kernel on the GPU, its PyTorch
    # reference of the same tile rule elsewhere; kept = the fraction of 128x128 tiles not skipped
    ("skip_softmax factor=1", SKIP_SOFTMAX, {"threshold_scale_factor": 1.0}),
    ("skip_softmax factor=4", SKIP_SOFTMAX, {"threshold_scale_factor": 4.0}),
    ("skip_softmax factor=16", SKIP_SOFTMAX, {"threshold_scale_factor": 16.0}),
    ("skip_softmax factor=64", SKIP_SOFTMAX, {"threshold_scale_factor": 64.0}),
    # the factor whose guaranteed dropped mass is the error budget (--budget; default SKIP_BUDGET)
    ("skip_softmax (budget)", SKIP_SOFTMAX, {"error_budget": None}),
]
#: the error budget of the "skip_softmax (budget)" case under ``--budget default`` (the sparse defaults' 0.005)
SKIP_BUDGET = 0.005
#: ``--preset``: ``{name: [(case label, families it runs on or None for all), ...]}``.  ``training-free``: the
#: training-free defaults (with the error budget) on every family, skip softmax at the same budget, and the
#: settings documented to reach >= 1.5x dense at <= 5 % on the original family (there only)
PRESETS = {
    "training-free": [
        ("sparge_attn (defaults)", None),
        ("sol_attn (defaults)", None),
        ("vmoba_attn (defaults)", None),
        ("sparse_video_gen_2_attn (defaults)", None),
        ("skip_softmax (budget)", None),
        ("sparge_attn exact cdf=0.93 topk=0.3 block_size=128", ("original",)),
        ("sparge_attn exact cdf=0.95 topk=0.3 block_size=128", ("original",)),
        ("sol_attn block_size=128 tau=0.5", ("original",)),
    ],
}
VMOBA_MODES = {0: "temporal", 1: "spatial", 2: "st"}
#: backends with an ``error_budget`` key (``--budget``; skip softmax: its threshold factor from the budget)
BUDGETED = ("sparge_attn", "sol_attn", "vmoba_attn", "sparse_video_gen_2_attn", SKIP_SOFTMAX)
#: --loop: the first step of a denoising loop past every backend's dense steps (V-MoBA 12, Sol 10)
LOOP_STEP0 = 20


def device_sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def errors(out, exact, rows):
    o = out[:, rows].double().flatten()
    e = exact.double().flatten()
    rel = float((o - e).norm() / e.norm())
    cos = float(torch.dot(o, e) / (o.norm() * e.norm()))
    return rel, cos


def kept_of(last_stats):
    """Mean kept fraction over the sparse engine's statistics entries (None: no sparse call)."""
    vals = [s["kept_fraction"] for s in last_stats.values()]
    return sum(vals) / len(vals) if vals else None


def budget_of(last_stats) -> dict:
    """``dense`` (some call ran dense), ``dense_heads`` (heads the error budget ran dense) and ``est_err``
    (the budget's largest error estimate) over the statistics entries; {} without entries."""
    entries = list(last_stats.values())
    if not entries:
        return {}
    heads = [s.get("dense_heads") for s in entries if s.get("dense_heads") is not None]
    est = [s.get("est_rel_err") for s in entries if s.get("est_rel_err") is not None]
    return {
        "dense": any(bool(s.get("dense")) for s in entries),
        "dense_heads": int(sum(heads)) if heads else None,
        "est_err": max(est) if est else None,
    }


def budget_config(backend, cfg, budget: str) -> dict:
    """``cfg`` with ``--budget`` applied (``default``: unchanged; ``off``: 0; a number).  Skip softmax:
    ``threshold_scale_factor`` from the budget (``factor_for_budget``; default :data:`SKIP_BUDGET`, off: 0)."""
    if backend == SKIP_SOFTMAX and "error_budget" in cfg:
        from ditattn.attention.kernels.skip_softmax_rules import factor_for_budget

        b = SKIP_BUDGET if budget == "default" else 0.0 if budget == "off" else float(budget)
        return {"threshold_scale_factor": factor_for_budget(b) if b > 0 else None}
    if backend in BUDGETED and backend != SKIP_SOFTMAX and DENSE_ABOVE_OVERRIDE is not None:
        cfg = dict(cfg, dense_above=DENSE_ABOVE_OVERRIDE)
    if budget == "default" or backend not in BUDGETED or backend == SKIP_SOFTMAX:
        return cfg
    return dict(cfg, error_budget=0.0 if budget == "off" else float(budget))


#: ``--dense-above``: the ``dense_above`` config key of every budgeted case (None: the backends' defaults)
DENSE_ABOVE_OVERRIDE = None


def budgets_for(spec: str, backend: str) -> list[str]:
    """The ``--budget`` values of ``backend``: the plain entries of ``spec`` (a comma list of ``default``,
    ``off``, numbers) and those written ``backend:value`` for this backend, in order (``["default"]`` for a
    backend without a budget)."""
    if backend not in BUDGETED:
        return ["default"]
    out = []
    for entry in spec.split(","):
        name, _, value = entry.rpartition(":")
        if not name or name == backend:
            out.append(value)
    return out or ["default"]


def check_budget_spec(spec: str) -> Optional[str]:
    """The first bad entry of a ``--budget`` list (None: every entry is ``[backend:]default|off|number in
    [0, 1)`` with a backend of :data:`BUDGETED`)."""
    for entry in spec.split(","):
        name, _, value = entry.rpartition(":")
        try:
            if (name and name not in BUDGETED) or (value not in ("default", "off") and not 0 <= float(value) < 1):
                return entry
        except ValueError:
            return entry
    return None


#: --error-only: no timing; one call per case (stateful backends: three steps, the last measured)
ERROR_ONLY = False
#: --loop: every sparse call gets a fresh step (a denoising loop past the dense steps), timed as the mean
LOOP = False
#: --warmup-ms / --rep-ms of the timing (common.bench_ms)
TIMING = {"warmup_ms": 100.0, "rep_ms": 400.0}
#: --paired N: each case's speed-up from N pairs of calls alternating with the dense kernel (0: the case and
#: the dense kernel timed apart, the dense kernel once per input)
PAIRED = 0


def paired_ms(case, dense, pairs: int) -> tuple[float, float]:
    """``(case ms, dense ms)``: the means over ``pairs`` rounds of one ``case()`` call then one ``dense()``
    call, each timed alone (device synchronised before and after, host clock).  Adjacent calls see the same
    clocks and temperature, so the ratio of the two means is the case's speed-up with the drift between
    separately timed runs cancelled; the mean counts a loop step that decides at its share."""

    def one(fn) -> float:
        device_sync()
        t0 = time.perf_counter()
        fn()
        device_sync()
        return time.perf_counter() - t0

    for _ in range(2):  # warm-up: both paths compiled and their caches hot
        case()
        dense()
    c = d = 0.0
    for _ in range(pairs):
        c += one(case)
        d += one(dense)
    return c / pairs * 1e3, d / pairs * 1e3


def timed_ms(fn, mean: bool = False) -> float:
    """Milliseconds of ``fn()`` by common.bench_ms with ``TIMING`` (the median; ``mean`` on CUDA: the mean,
    which counts a loop step that re-checks a reused decision at its share)."""
    if mean and DEVICE == "cuda":
        import triton.testing

        fn()
        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=TIMING["warmup_ms"], rep=TIMING["rep_ms"], return_mode="mean"))
    return bench_ms(fn, warmup_ms=TIMING["warmup_ms"], rep_ms=TIMING["rep_ms"])


def run_case(attention, q, k, v, grid, backend, cfg, *, layer=LAYER, stateful=False, mean=None, pair_with=None):
    """``(ms, out)`` of one backend call pattern (a fresh step per call when ``stateful`` or under
    ``--loop``, from :data:`LOOP_STEP0`); ``ms`` None under ``--error-only``; ``mean``: time by the mean
    (None: under ``--loop``), else the median.  ``pair_with`` (the dense call) under ``--paired``: ``ms`` is
    ``(case ms, dense ms)`` from :func:`paired_ms`."""
    stateful = stateful or (LOOP and backend not in (None, SKIP_SOFTMAX, "fa", "torch_sdpa"))
    state = {"step": LOOP_STEP0 if LOOP else 0}
    if stateful:
        from ditattn.attention.sparse.budget import clear_memory

        clear_memory()  # a fresh run: no decision of an earlier case is reused

    def call():
        out = attention(
            q,
            k,
            v,
            backend=backend,
            config=cfg,
            video_shape=grid,
            step=state["step"] if stateful else None,
            layer_idx=layer,
        )
        if stateful:
            state["step"] += 1
        return out

    if ERROR_ONLY:
        for _ in range(2 if stateful else 0):
            call()
        return None, call()
    call()  # cold start (compilation, the first k-means)
    if pair_with is not None and PAIRED > 0:
        return paired_ms(call, pair_with, PAIRED), call()
    ms = timed_ms(call, mean=LOOP if mean is None else mean)  # under --loop every case (dense too) by the mean
    return ms, call()


def skip_softmax_row(q, k, v, grid, rows, exact, factor):
    """Skip softmax at ``threshold_scale_factor`` ``factor``: the kernel on CUDA, the reference elsewhere;
    ``kept`` = 1 - the fraction of tiles skipped (at the first call).  Under ``--loop`` the calls go through
    the layer route a request's skip-softmax layer uses (:class:`ditattn.attention.skip_route.LayerRoute`):
    the first call runs the kernel, and where it skipped fewer tiles than the device's break-even the later
    calls run the dense kernel, whose output and time are then the case's (``dense`` True)."""
    import ditattn
    from ditattn.attention import skip_route
    from ditattn.attention.kernels import skip_softmax_rules

    frac, route = {}, (skip_route.LayerRoute() if LOOP else None)
    dense_backend = "fa" if q.is_cuda else "torch_sdpa"

    def fn(q, k, v, **_):
        if route is not None and route.dense_reason(q):
            frac["dense"] = True
            return ditattn.attention(q, k, v, backend=dense_backend)
        if q.is_cuda:
            from ditattn.attention.kernels.skip_softmax import skip_softmax_attention

            out, _, f = skip_softmax_attention(q, k, v, threshold_scale_factor=factor)
        else:
            out, _, f = skip_softmax_rules.skip_softmax_reference(q, k, v, threshold_scale_factor=factor)
        if route is not None:
            route.record(f)
        frac["skipped"] = float(f)
        return out

    ms, out = run_case(fn, q, k, v, grid, SKIP_SOFTMAX, None)
    rel, cos = errors(out, exact, rows)
    row = {"ms": ms, "rel_err": rel, "cosine": cos, "kept_fraction": 1.0 - frac["skipped"]}
    if frac.get("dense"):
        row["dense"] = True
    return row


def sta_rows(attention, q, k, v, grid, rows, exact, label, candidates, tmp):
    """The STA workflow: one searching call writes the strategy, inference reads it."""
    from ditattn.attention.sparse import clear_stats, last_stats
    from ditattn.attention.sparse.sta import flush_sta_search, reset_sta_search

    path = os.path.join(tmp, f"sta_{abs(hash((label, grid, q.shape[2])))}.json")
    reset_sta_search(path)
    search_cfg = {"mask_strategy_file_path": path, "sta_mode": "STA_searching", "skip_time_steps": 0}
    if candidates:
        search_cfg["window_candidates"] = candidates
    device_sync()
    t0 = time.perf_counter()
    attention(q, k, v, backend="sliding_tile_attn", config=search_cfg, video_shape=grid, step=0, layer_idx=LAYER)
    flush_sta_search(path)
    device_sync()
    search_s = time.perf_counter() - t0
    with open(path) as fh:
        windows = json.load(fh)
    cfg = {"mask_strategy_file_path": path, "skip_time_steps": 0}
    clear_stats()
    ms, out = run_case(attention, q, k, v, grid, "sliding_tile_attn", cfg)
    rel, cos = errors(out, exact, rows)
    return {
        "ms": ms,
        "rel_err": rel,
        "cosine": cos,
        "kept_fraction": kept_of(last_stats),
        "search_s": search_s,
        "windows": sorted({tuple(w) for w in windows.values()}),
    }


def measure_input(rec, dl, args, name, q, k, v, grid, tmp, meta=None):
    import ditattn
    from ditattn.attention.sparse import clear_stats, last_stats

    S, H = q.shape[1], q.shape[2]
    rows = sample_rows(S, args.ref_rows, device=q.device)
    exact, _ = reference_rows(q, k, v, rows)
    dense_backend = "fa" if DEVICE == "cuda" else "torch_sdpa"
    dense_ms, dense_out = run_case(ditattn.attention, q, k, v, None, dense_backend, None)
    rel, cos = errors(dense_out, exact, rows)
    base = {"input": name, "grid": list(grid), "seq": S, "heads": H, **(meta or {})}
    rec.add(
        **base,
        case=f"dense {dense_backend}",
        backend=dense_backend,
        ms=dense_ms,
        speedup=1.0 if dense_ms else None,
        rel_err=rel,
        cosine=cos,
        kept_fraction=1.0,
    )
    print(
        f"[{name}] grid {grid} S={S} heads={H}: dense {dense_backend} {dense_ms or float('nan'):.2f} ms, "
        f"err {rel:.2e}",
        flush=True,
    )
    only = set(args.backends.split(",")) if args.backends else None
    for label, backend, cfg in selected_cases(args, (meta or {}).get("family")):
        if only is not None and backend not in only:
            continue
        if dl.left() < 0:
            rec.note(f"budget exhausted before {label} at {name}")
            return

        def one(label=label, backend=backend, cfg=dict(cfg), layer=LAYER, budget="default"):  # noqa: B006 (binds a copy per case)
            clear_stats()
            if backend == "sliding_tile_attn":
                return sta_rows(ditattn.attention, q, k, v, grid, rows, exact, label, cfg["search"], tmp)
            if backend == SKIP_SOFTMAX:
                return skip_softmax_row(
                    q, k, v, grid, rows, exact, budget_config(backend, cfg, budget)["threshold_scale_factor"]
                )
            stateful = backend == "sparse_video_gen_2_attn"
            ms, out = run_case(
                ditattn.attention,
                q,
                k,
                v,
                grid,
                backend,
                budget_config(backend, cfg, budget),
                layer=layer,
                stateful=stateful,
                pair_with=lambda: ditattn.attention(q, k, v, backend=dense_backend),
            )
            rel, cos = errors(out, exact, rows)
            paired = isinstance(ms, tuple)
            return {
                "ms": ms[0] if paired else ms,
                **({"paired_dense_ms": ms[1], "pairs": PAIRED} if paired else {}),
                "rel_err": rel,
                "cosine": cos,
                "kept_fraction": kept_of(last_stats),
                **budget_of(last_stats),
            }

        layers = VMOBA_MODES if backend == "vmoba_attn" else {LAYER: None}
        budgeted = backend in BUDGETED and (backend != SKIP_SOFTMAX or "error_budget" in cfg)  # not fixed factors
        budgets = budgets_for(args.budget, backend) if budgeted else ["default"]
        tagged = budgeted and (":" in args.budget or len(args.budget.split(",")) > 1)
        for (layer, mode), budget in ((lm, b) for lm in layers.items() for b in budgets):
            lab = label + (f" [{mode}]" if mode else "") + (f" budget={budget}" if tagged else "")
            try:
                res = one(layer=layer, budget=budget)
            except Exception as exc:  # report and go on
                rec.note(
                    f"{lab} at {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                )
                continue
            row = rec.add(
                **base,
                case=lab,
                label=label,
                mode=mode,
                budget=budget if budgeted else None,
                backend=backend,
                config=cfg,
                speedup=(res.get("paired_dense_ms") or dense_ms) / res["ms"] if res["ms"] else None,
                **res,
            )
            print(
                f"  {lab:<44} {row['ms'] or float('nan'):9.2f} ms  x{row['speedup'] or float('nan'):5.2f}  kept "
                f"{row['kept_fraction'] if row['kept_fraction'] is not None else float('nan'):.3f}  "
                f"err {row['rel_err']:.3e}  cos {row['cosine']:.5f}"
                + (f"  search {row['search_s']:.2f} s" if "search_s" in row else ""),
                flush=True,
            )


def selected_cases(args, family: Optional[str]) -> list:
    """The ``(label, backend, config)`` cases of :data:`CASES` that ``--cases`` (or ``--preset``) selects for an
    input of structured ``family`` (None: an activation input)."""
    labels = {c[0] for c in CASES}
    if args.cases:
        wanted = args.cases.split(",")
        return [c for c in CASES if any(w == c[0] or (w not in labels and w in c[0]) for w in wanted)]
    if args.preset:
        fams = dict(PRESETS[args.preset])
        return [c for c in CASES if c[0] in fams and (fams[c[0]] is None or family in fams[c[0]])]
    return list(CASES)


def activation_summary(rows):
    """Per case over the activation inputs: ``n``, mean kept, mean / median / max error, min cosine, and
    the mean error per captured step and per layer index.  Returns ``(summary rows, table columns)``
    (empty when no row came from an activation file)."""
    import statistics

    act = [r for r in rows if str(r.get("input", "")).startswith("activations:") and r.get("rel_err") is not None]
    if not act:
        return [], []
    steps = sorted({r["step"] for r in act if r.get("step") is not None})
    layers = sorted({r["layer_idx"] for r in act if r.get("layer_idx") is not None})
    out = []
    for case in dict.fromkeys(r["case"] for r in act):
        sel = [r for r in act if r["case"] == case]
        errs = [r["rel_err"] for r in sel]
        kept = [r["kept_fraction"] for r in sel if r.get("kept_fraction") is not None]
        row = {
            "case": case,
            "n": len(sel),
            "kept": sum(kept) / len(kept) if kept else None,
            "err_mean": sum(errs) / len(errs),
            "err_median": statistics.median(errs),
            "err_max": max(errs),
            "cos_min": min(r["cosine"] for r in sel),
        }
        for s in steps:
            e = [r["rel_err"] for r in sel if r.get("step") == s]
            row[f"err_step{s}"] = sum(e) / len(e) if e else None
        for li in layers:
            e = [r["rel_err"] for r in sel if r.get("layer_idx") == li]
            row[f"err_layer{li}"] = sum(e) / len(e) if e else None
        out.append(row)
    cols = [
        ("case", "case", ""),
        ("n", "n", ""),
        ("kept", "kept", ".3f"),
        ("err_mean", "err mean", ".4f"),
        ("err_median", "median", ".4f"),
        ("err_max", "max", ".4f"),
        ("cos_min", "cos min", ".5f"),
    ]
    cols += [(f"err_step{s}", f"step {s}", ".4f") for s in steps]
    cols += [(f"err_layer{li}", f"layer {li}", ".4f") for li in layers]
    return out, cols


def family_of(row) -> str:
    """The family of a result row: its structured family, or ``activations``."""
    return "activations" if str(row.get("input", "")).startswith("activations:") else row.get("family") or "original"


def frontier_summary(rows, budgets: str = "default") -> list[dict]:
    """One entry per (case label, family) over every head count, V-MoBA layer mode and input of the family:
    ``worst_err`` (largest rel_err), ``min_cos``, ``kept_min`` / ``kept_max``, ``x_min`` / ``x_max`` (speed-up
    over dense; structured inputs only), ``dense`` (calls that ran dense / rows) under the first budget of
    ``budgets`` (the ``--budget`` list), ``ok`` (worst error <= 5 %, cosine >= 0.998 and, where timed, x_min >=
    1.0), and per further budget value ``b`` ``at[b] = (worst_err, x_min)``."""
    cases = [r for r in rows if r.get("label") and r.get("rel_err") is not None]
    order = list(dict.fromkeys(b.rpartition(":")[2] for b in budgets.split(",")))
    out = []
    for label, fam in dict.fromkeys((r["label"], family_of(r)) for r in cases):
        sel = [r for r in cases if r["label"] == label and family_of(r) == fam]
        by = {}
        for r in sel:
            by.setdefault(r.get("budget") or "default", []).append(r)
        first = next((b for b in order if b in by), next(iter(by)))
        main = by[first]
        xs = [r["speedup"] for r in main if r.get("speedup") and fam != "activations"]
        kept = [r["kept_fraction"] for r in main if r.get("kept_fraction") is not None]
        e = {
            "case": label,
            "family": fam,
            "budget": first,
            "n": len(main),
            "worst_err": max(r["rel_err"] for r in main),
            "min_cos": min(r["cosine"] for r in main),
            "kept_min": min(kept) if kept else None,
            "kept_max": max(kept) if kept else None,
            "x_min": min(xs) if xs else None,
            "x_max": max(xs) if xs else None,
            "dense": f"{sum(bool(r.get('dense')) for r in main)}/{len(main)}",
        }
        e["ok"] = e["worst_err"] <= 0.05 and e["min_cos"] >= 0.998 and (not xs or e["x_min"] >= 1.0)
        e["at"] = {}
        for b, rs in by.items():
            if b != first:
                bx = [r["speedup"] for r in rs if r.get("speedup") and fam != "activations"]
                e["at"][b] = (max(r["rel_err"] for r in rs), min(bx) if bx else None)
        out.append(e)
    return out


def summary_table(summary) -> str:
    """The short table of :func:`frontier_summary` (one line per case and family)."""
    extra = list(dict.fromkeys(b for e in summary for b in e["at"]))
    lines = [
        "| case | family | budget | n | worst err | min cos | kept | x FA4 min-max | dense | ok |"
        + "".join(f" b={b}: err / x min |" for b in extra),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra),
    ]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for e in summary:
        cells = [
            e["case"],
            e["family"],
            e["budget"],
            str(e["n"]),
            f(e["worst_err"] * 100, ".2f") + " %",
            f(e["min_cos"], ".5f"),
            f"{f(e['kept_min'], '.2f')}-{f(e['kept_max'], '.2f')}",
            f"{f(e['x_min'], '.2f')}-{f(e['x_max'], '.2f')}",
            e["dense"],
            "yes" if e["ok"] else "NO",
        ]
        for b in extra:
            err, x = e["at"].get(b, (None, None))
            cells.append("-" if err is None else f"{err * 100:.2f} % / {f(x, '.2f')}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["input"], r["heads"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 5), squeeze=False)
    for ax, (inp, heads) in zip(axes[0], groups):
        sel = [r for r in rows if r["input"] == inp and r["heads"] == heads and r.get("rel_err") and r.get("speedup")]
        for backend in sorted({r["backend"] for r in sel}):
            pts = [r for r in sel if r["backend"] == backend]
            ax.scatter([r["speedup"] for r in pts], [r["rel_err"] for r in pts], label=backend, s=22)
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.axvline(1.5, color="grey", lw=0.6, ls=":")
        ax.axhline(0.05, color="grey", lw=0.6, ls=":")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="speed-up over dense (same run)",
            ylabel="relative L2 error",
            title=f"{inp}, {heads} heads",
        )
        ax.grid(alpha=0.3)
        if sel:  # --error-only rows have no speed-up to plot
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_grid_args(ap, grids="wan480", heads="12,40")
    ap.add_argument("--ref-rows", type=int, default=1024, help="query rows checked against the float32 reference")
    ap.add_argument("--backends", default=None, help="comma list: only these backends")
    ap.add_argument(
        "--activations",
        action="append",
        default=None,
        metavar="FILE",
        help="also measure on the q/k/v of an activation file (bench/capture_qkv.py); repeat for several "
        "files (inputs are then named with their prompt when the files' prompts differ)",
    )
    ap.add_argument("--no-structured", action="store_true", help="only the --activations inputs")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gen-device",
        default=None,
        choices=("cpu", "cuda"),
        help="device whose random generator draws the structured inputs' noise (default: the benchmark "
        "device); 'cpu' on the GPU measures the very inputs of a CPU --error-only run (the two "
        "generators draw different samples, whose errors differ by up to ~20 %%)",
    )
    ap.add_argument(
        "--error-only",
        action="store_true",
        help="measure errors and kept fractions only (one call per case, no timing): CPU runs at full grids",
    )
    ap.add_argument(
        "--cases",
        default=None,
        help="comma list: only these cases (an entry equal to a case label selects that case alone, "
        "any other entry every case whose label contains it)",
    )
    ap.add_argument(
        "--families",
        default="original",
        help="comma list of structured families (ditattn.evaluation.structured.FAMILIES) or 'all'",
    )
    ap.add_argument(
        "--budget",
        default="default",
        help="error_budget of the backends that have one: default (theirs), off (0) or a number in [0, 1); "
        "a comma list runs each case once per value (labels end in budget=...); an entry "
        "BACKEND:VALUE (e.g. sol_attn:0.02) applies to that backend only",
    )
    ap.add_argument(
        "--preset",
        default=None,
        choices=sorted(PRESETS),
        help="the cases of a preset (training-free: the training-free defaults on every family, skip "
        "softmax at the budget, Sparge's fast settings on the original family); --cases overrides",
    )
    ap.add_argument(
        "--loop",
        action="store_true",
        help=f"call the sparse backends as a denoising loop does (a fresh step per call from step "
        f"{LOOP_STEP0}; a layer the budget sent dense reuses that decision), timed as the mean",
    )
    ap.add_argument(
        "--activations-error-only",
        action="store_true",
        help="time the structured inputs only (the activation inputs: errors and kept fractions)",
    )
    ap.add_argument(
        "--overhead",
        action="store_true",
        help="on the original family, per head count: the cost of a dense fallback forced by the budget "
        "(per call and in a loop) and of the budget's pieces, against the dense kernel",
    )
    ap.add_argument(
        "--dense-above",
        type=float,
        default=None,
        help="predicted kept fraction of a call above which the budgeted backends run the dense kernel "
        "(default: the library's, ditattn.attention.sparse.budget.DENSE_CALL_ABOVE; the backends' "
        "dense_above config key)",
    )
    ap.add_argument("--warmup-ms", type=float, default=TIMING["warmup_ms"], help="timing warm-up per case")
    ap.add_argument("--rep-ms", type=float, default=TIMING["rep_ms"], help="timing repetitions per case (ms)")
    ap.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="N",
        help="time each case in N rounds alternating with the dense kernel (one call each, device synchronised "
        "around each call) and take its speed-up from the two means: drift between separately timed runs "
        "cancels (0, the default: case and dense kernel timed apart, by --warmup-ms / --rep-ms)",
    )
    ap.add_argument("--no-chart", action="store_true", help="no fidelity.png")
    ap.add_argument(
        "--summary",
        action="store_true",
        help="end with a short table: per case and family the worst error, lowest cosine, kept range, "
        "speed-up range and dense calls under the first --budget value (others: error / slowest)",
    )
    ap.add_argument("--out", default="fidelity_out", help="output directory")
    args = ap.parse_args()
    grids, heads_list = common.grid_args(ap, args)
    global ERROR_ONLY, LOOP, DENSE_ABOVE_OVERRIDE, PAIRED
    ERROR_ONLY, LOOP, PAIRED = args.error_only, args.loop, max(0, args.paired)
    TIMING.update(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    if args.dense_above is not None:
        if not 0 < args.dense_above <= 1:
            ap.error(f"--dense-above takes a fraction in (0, 1], got {args.dense_above}")
        DENSE_ABOVE_OVERRIDE = args.dense_above

    from ditattn.evaluation.structured import FAMILIES, family_spec, structured_qkv

    families = list(FAMILIES) if args.families == "all" else args.families.split(",")
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        ap.error(f"--families takes names from {', '.join(FAMILIES)} or 'all', got {', '.join(bad)}")
    bad_budget = check_budget_spec(args.budget)
    if bad_budget is not None:
        ap.error(
            f"--budget takes a comma list of default, off or numbers in [0, 1), each optionally after "
            f"BACKEND: ({', '.join(BUDGETED)}); got {bad_budget!r} in {args.budget!r}"
        )

    dl = Deadline(args.budget_s)
    rec = Recorder(args.out, "fidelity", {"env": env_info(), "argv": sys.argv[1:], "device": DEVICE})
    tmp = tempfile.mkdtemp()
    inputs = []
    if not args.no_structured:
        for _, grid in grids:  # family by family, both head counts each (a time limit then cuts whole families)
            for fam in families:
                for heads in heads_list:
                    name = "structured" if fam == "original" else f"structured:{fam}"
                    if args.gen_device not in (None, DEVICE):
                        name += f" ({args.gen_device} noise)"
                    inputs.append((name, grid, heads, None, {"family": fam}))
    if args.activations:
        from ditattn.evaluation.capture import load_qkv

        loaded = [x for path in args.activations for x in load_qkv(path)]
        several = len({e.get("prompt") for e, *_ in loaded}) > 1
        for entry, q, k, v in loaded:
            name = f"activations:{entry['name']}" + (f" ({entry.get('prompt')})" if several else "")
            meta = {
                "step": entry.get("step"),
                "layer_idx": entry.get("layer_idx"),
                "prompt": entry.get("prompt"),
                "model": entry.get("model"),
            }
            inputs.append((name, tuple(entry["video_shape"]), q.shape[2], (q, k, v), meta))
    if args.activations_error_only:  # the cheap inputs first: a time limit then cuts structured ones
        inputs.sort(key=lambda x: x[3] is None)
    for name, grid, heads, qkv, *meta in inputs:
        if qkv is None:
            q, k, v, _ = structured_qkv(
                family_spec(meta[0]["family"], grid, heads, seed=args.seed), device=args.gen_device or DEVICE
            )
            q, k, v = (t.to(DEVICE) for t in (q, k, v))
        else:
            q, k, v = (t.to(DEVICE, torch.bfloat16) for t in qkv)
        ERROR_ONLY = args.error_only or (qkv is not None and args.activations_error_only)
        measure_input(rec, dl, args, name, q, k, v, grid, tmp, meta[0] if meta else None)
        if args.overhead and not ERROR_ONLY and qkv is None and meta[0]["family"] == "original" and dl.left() > 0:
            measure_overhead(rec, q, k, v, grid, args)
        del q, k, v
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    rows = [r for r in rec.data["rows"] if "section" not in r]
    try:
        if not args.no_chart:
            chart(rows, os.path.join(args.out, "fidelity.png"))
    except Exception as exc:  # the table and JSON still stand
        rec.note(f"chart not written: {type(exc).__name__}: {exc}")
    print("\n## Quality-vs-speed frontier (structured inputs unless named; rel_err vs float32 exact)\n")
    cols = [
        ("input", "input", ""),
        ("heads", "H", ""),
        ("case", "case", ""),
        ("ms", "ms", ".2f"),
        ("speedup", "x dense", ".2f"),
        ("kept_fraction", "kept", ".3f"),
        ("rel_err", "rel err", ".3e"),
        ("cosine", "cosine", ".5f"),
        ("dense", "dense", ""),
        ("dense_heads", "dense heads", ""),
        ("est_err", "est err", ".3f"),
        ("search_s", "search s", ".2f"),
    ]
    print(fmt_table(rows, cols))
    summary, scols = activation_summary(rows)
    if summary:
        rec.data["activation_summary"] = summary
        rec.flush()
        print(
            f"\n## Over the activation inputs (per case: {summary[0]['n']} inputs unless n says otherwise; "
            "err = rel_err vs float32 exact)\n"
        )
        print(fmt_table(summary, scols))
    over = [r for r in rec.data["rows"] if r.get("section") == "overhead"]
    if over:
        print("\n## Cost of the error budget against the dense kernel (original family; x dense = dense / this)\n")
        print(
            fmt_table(
                over,
                [
                    ("heads", "H", ""),
                    ("case", "what", ""),
                    ("ms", "ms", ".3f"),
                    ("speedup", "x dense", ".3f"),
                    ("dense", "ran dense", ""),
                ],
            )
        )
    for n in rec.data["notes"]:
        print("NOTE:", n)
    if args.summary:
        summary = frontier_summary(rows, args.budget)
        rec.data["summary"] = summary
        rec.flush()
        print(
            f"\n## Summary per case and family (budget {args.budget.split(',')[0]}; worst over heads, modes and "
            "inputs; x = speed-up over dense, structured inputs; ok: <= 5 %, cos >= 0.998, x >= 1)\n"
        )
        print(summary_table(summary))


#: steps of the request whose mean call time is a loop's fallback cost (a 50-step video past the dense steps)
REQUEST_STEPS = 40


def _loop_step(q, k, v, grid, backend, cfg):
    """``fn(step)``: one call of ``backend`` as a DiT layer of the denoising loop makes it at ``step``."""
    import ditattn

    def call(step):
        ditattn.attention(q, k, v, backend=backend, config=cfg, video_shape=grid, step=step, layer_idx=LAYER)

    return call


def _synced_ms(fn, steps: int = 1) -> float:
    """Mean milliseconds per call of ``fn(step)`` over steps :data:`LOOP_STEP0` .. + ``steps`` - 1, between device
    syncs."""
    device_sync()
    t0 = time.perf_counter()
    for step in range(LOOP_STEP0, LOOP_STEP0 + steps):
        fn(step)
    device_sync()
    return (time.perf_counter() - t0) / steps * 1e3


def request_ms(q, k, v, grid, backend, cfg, dense, *, fresh: bool = True, requests: int = 3) -> tuple[float, float]:
    """``(case ms, dense ms)``: mean milliseconds per call over whole requests of :data:`REQUEST_STEPS` steps
    (each starting over from :data:`LOOP_STEP0`, so its first step decides and the rest reuse the decision), each
    request followed by one of as many ``dense()`` calls, timed alike: adjacent requests see the same clocks, so
    the ratio of the two means is the fallback's cost with the drift between separately timed runs cancelled.
    ``fresh``: every request starts with no memory of earlier ones (``requests`` of them after a warm-up), the
    cost of a layer's first request; else one warm-up request and then one whole cycle of the error check's
    memory (``check.RETRY_EVERY`` requests: the later ones start where the earlier ended, one runs the whole
    ladder again): the cost per request of a server that keeps serving the same layer."""
    from ditattn.attention.sparse import check
    from ditattn.attention.sparse.budget import clear_memory

    case = _loop_step(q, k, v, grid, backend, cfg)

    def pair() -> tuple[float, float]:
        if fresh:
            clear_memory()
        return _synced_ms(case, REQUEST_STEPS), _synced_ms(lambda _: dense(), REQUEST_STEPS)

    clear_memory()
    pair()
    rounds = [pair() for _ in range(requests if fresh else check.RETRY_EVERY)]
    return sum(c for c, _ in rounds) / len(rounds), sum(d for _, d in rounds) / len(rounds)


def deciding_step_ms(q, k, v, grid, backend, cfg, dense, *, repeats: int = 3) -> tuple[float, float]:
    """``(case ms, dense ms)``: the median time of a fresh request's first step alone (the call that runs the error
    check's decision ladder) and of one ``dense()`` call timed alike right after it, each between device syncs:
    where a layer's first request spends its extra time."""
    from ditattn.attention.sparse.budget import clear_memory

    case = _loop_step(q, k, v, grid, backend, cfg)
    clear_memory()
    case(LOOP_STEP0)  # warm-up
    rounds = []
    for _ in range(repeats):
        clear_memory()
        rounds.append((_synced_ms(case), _synced_ms(lambda _: dense())))
    return statistics.median(c for c, _ in rounds), statistics.median(d for _, d in rounds)


def measure_overhead(rec, q, k, v, grid, args):
    """Rows (``section="overhead"``) of what the error budget costs on this input: every budgeted backend with a
    budget and error check so tight that every call runs dense (per call: the whole decision each time; deciding
    step: a fresh request's first step alone, :func:`deciding_step_ms`; loop: the
    mean call of whole :data:`REQUEST_STEPS`-step requests, :func:`request_ms`, a layer's first request and the
    later requests that start from the earlier ones' end, each against dense requests timed next to it), then the
    budget's pieces alone (tiling q and k, the centre-row check, the full probes and the widening), each against the
    dense kernel of the same run."""
    import ditattn
    from ditattn.attention.functional import auto_dense_backend
    from ditattn.attention.sparse import budget as eb
    from ditattn.attention.sparse import clear_stats, last_stats
    from ditattn.attention.sparse.tiling import make_tile_layout, tile

    global LOOP
    H = q.shape[2]
    dense_backend = "fa" if DEVICE == "cuda" else "torch_sdpa"
    fallback_kernel = auto_dense_backend(q, k)  # what a sparse backend's dense fallback runs here

    def add(what, ms, dense_ms, **extra):
        row = rec.add(
            section="overhead",
            input="structured",
            grid=list(grid),
            heads=H,
            case=what,
            ms=ms,
            speedup=dense_ms / ms if ms and dense_ms else None,
            **extra,
        )
        print(f"  overhead {what:<48} {ms:9.3f} ms  x{row['speedup'] or float('nan'):6.3f}", flush=True)

    def dense_call():
        return ditattn.attention(q, k, v, backend=dense_backend)

    dense_ms = timed_ms(dense_call, mean=True)
    add(f"dense {dense_backend}", dense_ms, dense_ms)
    only = set(args.backends.split(",")) if args.backends else None
    loop0 = LOOP
    try:
        for backend in BUDGETED:
            if backend == SKIP_SOFTMAX or (only is not None and backend not in only):
                continue
            for mode in ("per call", "deciding step", "loop (mean)", "later requests"):
                LOOP = mode not in ("per call", "deciding step")
                clear_stats()
                # a budget and an error check so tight that every rung fails: the sparse call, its check, the
                # budget's early probe, then the dense kernel
                forced = {"error_budget": 1e-6, "max_rel_err": 1e-6}
                try:
                    if LOOP:  # whole requests of REQUEST_STEPS steps, each against a dense request run next to it
                        ms, paired = request_ms(
                            q, k, v, grid, backend, forced, dense_call, fresh=mode == "loop (mean)"
                        )
                    elif mode == "deciding step":  # a fresh request's first step alone, against one dense call
                        ms, paired = deciding_step_ms(q, k, v, grid, backend, forced, dense_call)
                    else:  # per call: no step (every call decides)
                        ms, _ = run_case(ditattn.attention, q, k, v, grid, backend, forced, mean=True)
                        paired = None  # against the dense kernel timed once above
                except Exception as exc:  # report and go on
                    rec.note(f"overhead {backend}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    continue
                dense = all(bool(s.get("dense")) for s in last_stats.values())
                add(
                    f"{backend} forced dense, {mode}",
                    ms,
                    paired or dense_ms,
                    dense=dense,
                    kernel=fallback_kernel,
                    **({} if paired is None else {"paired_dense_ms": paired}),
                )
    finally:
        LOOP = loop0
    layout = make_tile_layout(tuple(grid), (4, 4, 4), 0)
    scale = q.shape[-1] ** -0.5
    qt, kt = tile(q, layout), tile(k, layout)
    nv = layout.n_video_blocks
    lm = eb.probe_log_mass(qt, kt, layout, scale)
    none = torch.zeros(*lm.shape[:3], nv, dtype=torch.bool, device=lm.device)
    pieces = {
        "tile q and k (64-token tiles)": lambda: (tile(q, layout), tile(k, layout)),
        "early check (sampled probe rows, one sync)": lambda: eb.early_dense(q, k, layout, 0.005, scale=scale),
        "probe masses (9 rows per block)": lambda: eb.probe_log_mass(qt, kt, layout, scale),
        "widening to the budget (9 rows per block)": lambda: eb.enforce_budget(lm, none, 0.005),
        "widening, PyTorch path (sorted rows)": lambda: eb.enforce_budget(lm, none, 0.005, impl="reference"),
    }
    for what, fn in pieces.items():
        add(what, timed_ms(fn, mean=True), dense_ms)


if __name__ == "__main__":
    main()
