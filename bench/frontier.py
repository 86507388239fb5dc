"""The error-budget frontier in one call: captured activations, every training-free default against FA4, sage_attn
against fa, and the budget's GPU tests, under one time budget.

    python bench/frontier.py --out $OUT --budget-s 400

Parts, each a subprocess with its own time limit cut from ``--budget-s`` (its output goes to ``OUT/<part>.log``;
a part that fails or runs out of time is reported and the others still run):

1. ``capture``: ``bench/capture_qkv.py`` on the trained ``ditattn:shapes`` (256x256x33, a 9x16x16 latent grid;
   steps 10 and the last, blocks 0, 3, 5: six real q/k/v inputs), into a temporary file.
2. ``fidelity``: ``bench/fidelity.py --preset training-free --loop --overhead --summary`` at the Wan 480p grid
   (21x30x52) with 12 and 40 heads on every structured family and on the captured activations (errors only
   there): for each training-free default (Sparge, Sol, V-MoBA in its three layer modes, SVG2; skip softmax at the
   same budget; Sparge's fast settings on the original family) and each ``--budget`` value (default
   ``default,off``: the error budget on, and the plain rules) the relative error and cosine against float32 exact
   attention, the kept fraction, the calls that ran dense and the speed-up over FA4 dense timed in the same
   process, as a denoising loop calls them (a fresh step per call; the mean time).  ``--overhead`` adds what a
   dense fallback forced by the budget costs (per call and in the loop) and the budget's pieces.
   Writes ``OUT/fidelity/fidelity.json``.
3. ``sage``: ``bench/attention.py --sage-vs-fa``: ``sage_attn`` at its defaults (and with its own kernel at every
   length) against ``fa`` at every shape of that benchmark.  Writes ``OUT/sage/attention.json``.
4. ``tests``: ``pytest tests/attention/test_sparse_budget.py tests/attention/test_sparse_fallbacks.py`` (their
   GPU tests run on a GPU).

Then ``OUT/summary.json`` (each part's status and seconds, the fidelity summary, the sage rows, the checks below)
and, printed last, one line per case and family (worst error, lowest cosine, kept range, slowest / fastest
speed-up over FA4, dense calls, the other budgets' worst error and slowest speed-up) and the checks:
every default <= 5 % error and cosine >= 0.998 on every family, >= 1.0x FA4 on every structured family, two
backends >= 1.5x at <= 5 % on the original family, sage_attn >= 1.0x fa at every shape.

Tuning in a later call: ``--budget default,0.02,0.05`` (or ``sol_attn:0.02``: one backend), ``--parts
capture,fidelity``, ``--families``, ``--heads``, ``--backends``, ``--cases``, ``--dense-above``,
``--ref-rows`` (bench/fidelity.py's) and ``--no-overhead``.  ``--smoke`` runs every
part on the CPU at tiny sizes (``BENCH_DEVICE=cpu``; the tests part is left out unless named), as the CI does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("capture", "fidelity", "sage", "tests")
#: seconds kept for the parts after the fidelity run (sage, tests) and for the fidelity run's last case
RESERVE = {"sage": 70.0, "tests": 75.0}
TAIL_S = 40.0
#: the captured prompt and the activation file's layout
PROMPT = "a red circle moving right"
CAPTURE = {
    "gpu": ["--steps", "10,-1", "--layers", "0,3,5", "--height", "256", "--width", "256", "--num-frames", "33"],
    "smoke": [
        "--steps",
        "0,-1",
        "--layers",
        "0",
        "--num-inference-steps",
        "2",
        "--height",
        "128",
        "--width",
        "128",
        "--num-frames",
        "9",
    ],
}
TESTS = ["tests/attention/test_sparse_budget.py", "tests/attention/test_sparse_fallbacks.py"]


def run_part(name: str, argv: list, out: str, limit: float, env: dict) -> dict:
    """Run ``argv`` (a Python script and its arguments) in a fresh interpreter for at most ``limit`` seconds, its
    output in ``OUT/<name>.log``; returns ``{"rc", "seconds", "timed_out"}`` and prints one line (the log's last
    lines when it failed)."""
    log = os.path.join(out, f"{name}.log")
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc, timed_out = proc.wait(timeout=max(1.0, limit)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part's own process group (started above)
            rc, timed_out = proc.wait(), True
    res = {"rc": rc, "seconds": round(time.time() - t0, 1), "timed_out": timed_out}
    print(
        f"[{name}] rc {rc}{' (time limit)' if timed_out else ''} in {res['seconds']} s (limit {limit:.0f} s)",
        flush=True,
    )
    if rc != 0:
        with open(log) as fh:
            print("".join(fh.readlines()[-12:]), flush=True)
    return res


def checks(summary: list, sage_rows: list) -> dict:
    """The criteria over the fidelity summary (under the first ``--budget`` value) and the sage rows."""
    defaults = [e for e in summary if e["case"].endswith("(defaults)")]
    err_bad = [
        f"{e['case']} / {e['family']}: {e['worst_err'] * 100:.2f} %, cos {e['min_cos']:.5f}"
        for e in defaults
        if e["worst_err"] > 0.05 or e["min_cos"] < 0.998
    ]
    slow = [
        f"{e['case']} / {e['family']}: x {e['x_min']:.3f}"
        for e in defaults
        if e["x_min"] is not None and e["x_min"] < 1.0
    ]
    fast = sorted(
        {
            e["case"].split(" ")[0]
            for e in summary
            if e["family"] == "original" and e["x_min"] is not None and e["x_min"] >= 1.5 and e["worst_err"] <= 0.05
        }
    )
    sage_slow = [
        f"{r['shape']}: x {r['x_fa']:.3f}" for r in sage_rows if r.get("x_fa") is not None and r["x_fa"] < 1.0
    ]
    return {
        "defaults_within_5_percent": not err_bad and bool(defaults),
        "over_5_percent": err_bad,
        "defaults_at_least_dense_speed": not slow and bool(defaults),
        "slower_than_dense": slow,
        "backends_1_5x_at_5_percent_original": fast,
        "two_backends_1_5x": len(fast) >= 2,
        "sage_at_least_fa": not sage_slow and bool(sage_rows),
        "sage_slower": sage_slow,
    }


def read_json(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "frontier_out"), help="output directory")
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget of the whole call (seconds)")
    ap.add_argument(
        "--parts", default=None, help=f"comma list of {', '.join(PARTS)} (default: all; --smoke: no tests)"
    )
    ap.add_argument("--smoke", action="store_true", help="every part on the CPU at tiny sizes (CI)")
    ap.add_argument("--budget", default="default,off", help="bench/fidelity.py --budget (first: the judged one)")
    ap.add_argument("--families", default="all", help="bench/fidelity.py --families")
    ap.add_argument("--heads", default="12,40", help="bench/fidelity.py --heads")
    ap.add_argument("--backends", default=None, help="bench/fidelity.py --backends")
    ap.add_argument("--dense-above", default=None, help="bench/fidelity.py --dense-above")
    ap.add_argument("--cases", default=None, help="bench/fidelity.py --cases (instead of the training-free preset)")
    ap.add_argument(
        "--no-overhead", action="store_true", help="leave out the fallback cost (bench/fidelity.py --overhead)"
    )
    ap.add_argument("--rep-ms", default="200", help="bench/fidelity.py --rep-ms (timing per case)")
    ap.add_argument(
        "--ref-rows",
        default=None,
        help="bench/fidelity.py --ref-rows: query rows whose error is measured against float32 exact attention "
        "(default: its 1,024, sampled at random; errors near 5 %% move by tenths of a point with the sample)",
    )
    ap.add_argument(
        "--paired",
        default="10",
        help="bench/fidelity.py --paired: each case's speed-up from this many rounds alternating with FA4 "
        "(0: timed apart, FA4 once per input)",
    )
    ap.add_argument("--sage-shapes", default=None, help="bench/attention.py --shapes (default: all of its shapes)")
    args = ap.parse_args(argv)
    parts = args.parts.split(",") if args.parts else [p for p in PARTS if not (args.smoke and p == "tests")]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts takes a comma list of {', '.join(PARTS)}, got {', '.join(bad)}")
    t0 = time.time()
    left = lambda: args.budget_s - (time.time() - t0)  # noqa: E731
    os.makedirs(args.out, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")]))
    )
    if args.smoke:
        env["BENCH_DEVICE"] = "cpu"
    status = {}
    tmp = tempfile.mkdtemp(prefix="frontier_")
    act = os.path.join(tmp, "shapes_qkv.safetensors")
    if "capture" in parts:
        status["capture"] = run_part(
            "capture",
            [
                os.path.join(HERE, "capture_qkv.py"),
                "--model-path",
                "ditattn:shapes",
                "--prompt",
                PROMPT,
                *CAPTURE["smoke" if args.smoke else "gpu"],
                "--out",
                act,
            ],
            args.out,
            min(90.0, left()),
            env,
        )
    if "fidelity" in parts:
        reserve = sum(s for p, s in RESERVE.items() if p in parts) + TAIL_S
        fid = [
            os.path.join(HERE, "fidelity.py"),
            "--families",
            args.families,
            "--budget",
            args.budget,
            "--loop",
            "--summary",
            "--no-chart",
            "--activations-error-only",
            "--warmup-ms",
            "1" if args.smoke else "50",
            "--rep-ms",
            "1" if args.smoke else args.rep_ms,
            "--paired",
            "2" if args.smoke else args.paired,
            "--budget-s",
            f"{max(10.0, left() - reserve):.0f}",
            "--out",
            os.path.join(args.out, "fidelity"),
        ]
        fid += (
            ["--grid", "4,8,8", "--heads", "2", "--ref-rows", "32"]
            if args.smoke
            else ["--grids", "wan480", "--heads", args.heads]
        )
        fid += ["--ref-rows", args.ref_rows] if args.ref_rows and not args.smoke else []
        fid += ["--cases", args.cases] if args.cases else ["--preset", "training-free"]
        fid += [] if args.no_overhead else ["--overhead"]
        fid += ["--backends", args.backends] if args.backends else []
        fid += ["--dense-above", args.dense_above] if args.dense_above else []
        fid += ["--activations", act] if os.path.exists(act) else []
        status["fidelity"] = run_part("fidelity", fid, args.out, max(20.0, left() - reserve + TAIL_S), env)
    if "sage" in parts:
        shapes = "1,2,256,128;1,2,128,64" if args.smoke and not args.sage_shapes else args.sage_shapes
        limit = max(15.0, left() - (RESERVE["tests"] if "tests" in parts else 0.0))
        status["sage"] = run_part(
            "sage",
            [
                os.path.join(HERE, "attention.py"),
                "--sage-vs-fa",
                "--budget-s",
                f"{max(5.0, limit - 15):.0f}",
                "--out",
                os.path.join(args.out, "sage"),
            ]
            + (["--shapes", shapes] if shapes else []),
            args.out,
            limit,
            env,
        )
    if "tests" in parts:
        status["tests"] = run_part(
            "tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], args.out, max(15.0, left()), env
        )
        with open(os.path.join(args.out, "tests.log")) as fh:
            tail = [ln.strip() for ln in fh.read().splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
        status["tests"]["result"] = tail[-1] if tail else None

    import fidelity  # the summary table's format (bench/fidelity.py)

    fdata = read_json(os.path.join(args.out, "fidelity", "fidelity.json"))
    # from the rows (a fidelity run stopped by its time limit wrote them, not its summary)
    summary = fidelity.frontier_summary([r for r in fdata.get("rows", []) if "section" not in r], args.budget)
    sage_rows = [
        r
        for r in read_json(os.path.join(args.out, "sage", "attention.json")).get("rows", [])
        if r.get("section") == "sage_vs_fa"
    ]
    for r in sage_rows:
        r["shape"] = ",".join(map(str, r["shape"]))
    overhead = [r for r in fdata.get("rows", []) if r.get("section") == "overhead"]
    result = {
        "argv": sys.argv[1:],
        "seconds": round(time.time() - t0, 1),
        "parts": status,
        "checks": checks(summary, sage_rows),
        "summary": summary,
        "sage_vs_fa": sage_rows,
        "overhead": overhead,
        "notes": fdata.get("notes", []),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=str)

    print(f"\n## Error budget frontier ({result['seconds']} s; files in {args.out})\n")
    if overhead:
        print(
            "fallback cost (x dense): "
            + "; ".join(
                f"H{r['heads']} {r['case']} {r['speedup']:.3f}"
                for r in overhead
                if r.get("speedup") and "forced" in r["case"]
            )
        )
    if sage_rows:
        print(
            "sage_attn / fa: "
            + "; ".join(
                f"{r['shape']} {r['x_fa'] or float('nan'):.3f} (own {r.get('x_fa_own_kernel') or float('nan'):.3f})"
                for r in sage_rows
            )
        )
    for name, st in status.items():
        print(
            f"part {name}: rc {st['rc']}{' TIME LIMIT' if st['timed_out'] else ''} {st['seconds']} s"
            + (f" ({st['result']})" if st.get("result") else "")
        )
    c = result["checks"]
    print(
        f"checks: defaults <= 5 %: {c['defaults_within_5_percent']}; >= 1.0x FA4: "
        f"{c['defaults_at_least_dense_speed']}; >= 1.5x at <= 5 % (original): "
        f"{','.join(c['backends_1_5x_at_5_percent_original']) or '-'}; sage >= fa: {c['sage_at_least_fa']}"
    )
    if summary:
        print()
        print(fidelity.summary_table(summary))
    return 0 if all(st["rc"] == 0 for st in status.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    raise SystemExit(main())
