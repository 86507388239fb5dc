"""Throughput and per-request overhead of ``ditattn serve`` on Ray Serve against the plain server.

    PYTHONPATH=src python bench/serve_throughput.py --out OUTDIR [--job-store postgresql://...]
        [--replicas 1 2] [--requests 48] [--concurrency 8] [--size 16] [--steps 2] [--overhead K]
        [--warmup 3] [-- SERVE_ARGS...]

Throughput (``--requests`` > 0): for each replica count it starts ``ditattn serve --replicas N
--ray-address local`` (a fresh local Ray instance; N CPU replicas of the built-in tiny model, or one
GPU each on a GPU machine) over a shared PostgreSQL job store and sends ``--requests`` image requests
from ``--concurrency`` clients at once: images per minute.  Without ``--job-store`` a throwaway
PostgreSQL server is started (tests/pg.py; needs ``initdb``).

Overhead (``--overhead K``): one Ray Serve replica (``--replicas 1 --ray-address local``, the
single server's SQLite store: no PostgreSQL needed) and the plain ``ditattn serve`` run side by side;
after ``--warmup`` requests each, K image requests go to each, one at a time, alternating between the
two (drift hits both alike): median and p90 latency of each and what Ray's proxy and routing add, split
by the servers' ``Server-Timing`` headers into time inside the image route (the pipeline's ``generate``
among it) and time outside it (HTTP, Ray's proxy and its call to the replica).

``--steps 0``: the model's own step count and guidance scale.  Arguments after ``--`` go to every
``ditattn serve`` (e.g. ``-- --model-path ditattn:shapes --device cuda``).  Writes
``serve_throughput.json`` under OUTDIR and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list, log: str, timeout: float = 600, threads: int = 0):
    """``ditattn serve`` with ``args`` until its /health answers; (process, base URL).  ``threads``:
    its ``OMP_NUM_THREADS`` (0: left to the server; a GPU replica on Ray gets 1 from Ray)."""
    port = _port()
    path = os.pathsep.join(p for p in (os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=path)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ditattn", "serve", "--port", str(port), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
    base, t0 = f"http://127.0.0.1:{port}", time.time()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"ditattn serve exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.time() - t0 > timeout:
            proc.kill()
            raise SystemExit(f"ditattn serve did not come up in {timeout:.0f} s; see {log}")
        time.sleep(0.5)


def stop(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def image_timed(base: str, size: int, seed: int, client: httpx.Client) -> tuple:
    """One image request through ``client`` (a kept-alive connection): ``(latency s, the answer's
    Server-Timing as {name: ms})``."""
    t0 = time.perf_counter()
    r = client.post(
        base + "/v1/images/generations",
        json={"prompt": f"bench {seed}", "size": f"{size}x{size}", "seed": seed},
        timeout=600,
    )
    lat = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"image request: HTTP {r.status_code}: {r.text[:200]}")
    return lat, parse_server_timing(r.headers.get("server-timing", ""))


def parse_server_timing(value: str) -> dict:
    """``"queue;dur=1.5, total;dur=3"`` -> ``{"queue": 1.5, "total": 3.0}`` (entries without a duration skipped)."""
    out = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, *params = (x.strip() for x in part.split(";"))
        for param in params:
            if param.startswith("dur="):
                out[name] = float(param[4:])
    return out


def throughput(base: str, n: int, conc: int, size: int) -> dict:
    """``n`` image requests from ``conc`` clients at once (each a kept-alive connection): images per minute."""
    local, clients = threading.local(), []

    def one(i: int) -> float:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=600)
            clients.append(local.client)
        return image_timed(base, size, i, local.client)[0]

    try:
        with concurrent.futures.ThreadPoolExecutor(conc) as pool:
            list(pool.map(lambda i: one(10_000 + i), range(conc)))  # warm every replica before the clock starts
            t0 = time.perf_counter()
            lat = list(pool.map(one, range(n)))
            wall = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    return {
        "images": n,
        "wall_s": round(wall, 2),
        "images_per_min": round(60 * n / wall, 1),
        "latency_median_s": round(statistics.median(lat), 3),
    }


def _stats(lat: list) -> dict:
    ms = [1000 * x for x in lat]
    return {
        "median_ms": round(statistics.median(ms), 2),
        "p90_ms": round(statistics.quantiles(ms, n=10, method="inclusive")[-1], 2),
        "latencies_ms": [round(x, 2) for x in ms],
    }


def overhead(bases: dict, k: int, warmup: int, size: int) -> dict:
    """``k`` sequential requests to each server of ``bases`` (name -> URL; ``"ray"`` and ``"plain"``),
    alternating, after ``warmup`` each; latency statistics per server, where the time went by the servers'
    ``Server-Timing`` (median ms of ``generate``, of the route's ``total`` and of the latency outside it),
    and Ray's overhead over the plain server, in all and split into inside and outside the route."""
    # one kept-alive client per server, as a real client holds (a new httpx client per request costs ~18 ms of
    # this process's CPU on the 2-core machine, which would count as time outside both servers)
    clients = {name: httpx.Client(timeout=600) for name in bases}
    try:
        for name, base in bases.items():
            for i in range(warmup):
                image_timed(base, size, 20_000 + i, clients[name])
        lat: dict = {name: [] for name in bases}
        timing: dict = {name: [] for name in bases}
        for i in range(k):
            for name in bases if i % 2 == 0 else list(bases)[::-1]:  # ABBA: neither always goes first
                latency, t = image_timed(bases[name], size, i, clients[name])
                lat[name].append(latency)
                timing[name].append({**t, "latency": 1e3 * latency})
    finally:
        for c in clients.values():
            c.close()
    out = {name: _stats(v) for name, v in lat.items()}
    for name, rows in timing.items():
        if rows and all("total" in r for r in rows):
            out[name]["generate_ms"] = round(statistics.median(r.get("generate", 0.0) for r in rows), 2)
            out[name]["route_ms"] = round(statistics.median(r["total"] for r in rows), 2)
            out[name]["outside_ms"] = round(statistics.median(r["latency"] - r["total"] for r in rows), 2)
            if all("gc" in r for r in rows):  # spikes: the mean says what they cost, the max how large one is
                out[name]["gc_mean_ms"] = round(statistics.fmean(r["gc"] for r in rows), 2)
                out[name]["gc_max_ms"] = round(max(r["gc"] for r in rows), 2)
            out[name]["server_timing_ms"] = [{key: round(val, 2) for key, val in r.items()} for r in rows]
    ray, plain = out["ray"], out["plain"]
    for q in ("median", "p90"):
        d = ray[f"{q}_ms"] - plain[f"{q}_ms"]
        out[f"overhead_{q}_ms"] = round(d, 2)
        out[f"overhead_{q}_pct"] = round(100 * d / plain[f"{q}_ms"], 2)
    for part in ("route", "outside"):
        if f"{part}_ms" in ray and f"{part}_ms" in plain:
            out[f"overhead_{part}_ms"] = round(ray[f"{part}_ms"] - plain[f"{part}_ms"], 2)
    out.update(_paired(lat, timing))
    return out


def _paired(lat: dict, timing: dict) -> dict:
    """Ray's overhead from the pairs (the i-th request to each server, sent one after the other): the mean
    difference and its standard error, in ms and % of the plain server's mean, and the mean differences inside
    and outside the route.  A GPU request's latency can be bimodal (here 270 or 450 ms), and then a difference
    of two medians jumps with where each median falls; the paired mean does not."""
    diffs = [1e3 * (r - p) for r, p in zip(lat["ray"], lat["plain"])]
    if len(diffs) < 2:
        return {}
    mean, base = statistics.fmean(diffs), 1e3 * statistics.fmean(lat["plain"])
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    out = {
        "overhead_paired_mean_ms": round(mean, 2),
        "overhead_paired_se_ms": round(se, 2),
        "overhead_paired_mean_pct": round(100 * mean / base, 2),
        "overhead_paired_se_pct": round(100 * se / base, 2),
    }
    rows = list(zip(timing["ray"], timing["plain"]))
    if rows and all("total" in r and "total" in p for r, p in rows):
        out["overhead_paired_route_ms"] = round(statistics.fmean(r["total"] - p["total"] for r, p in rows), 2)
        out["overhead_paired_outside_ms"] = round(
            statistics.fmean((r["latency"] - r["total"]) - (p["latency"] - p["total"]) for r, p in rows), 2
        )
    return out


def table(res: dict) -> str:
    o = res["overhead"]
    split = all("route_ms" in o[n] for n in ("plain", "ray"))
    lines = [
        f"per-request latency, {res['size']}x{res['size']} image, {o['requests']} sequential requests each "
        f"(alternating, after {o['warmup']} warm-up):",
        f"{'server':<26}{'median ms':>11}{'p90 ms':>10}"
        + (f"{'generate':>10}{'in route':>10}{'outside':>10}" if split else ""),
    ]
    for name, label in (("plain", "ditattn serve"), ("ray", "Ray Serve, 1 replica")):
        row = f"{label:<26}{o[name]['median_ms']:>11.1f}{o[name]['p90_ms']:>10.1f}"
        if split:
            row += f"{o[name]['generate_ms']:>10.1f}{o[name]['route_ms']:>10.1f}{o[name]['outside_ms']:>10.1f}"
        lines.append(row)
    last = (
        f"{'Ray overhead':<26}{o['overhead_median_ms']:>+11.1f}{o['overhead_p90_ms']:>+10.1f}"
        f"   ({o['overhead_median_pct']:+.1f} % median, {o['overhead_p90_pct']:+.1f} % p90)"
    )
    if split:
        last += f"; in the route {o['overhead_route_ms']:+.1f}, outside it {o['overhead_outside_ms']:+.1f} (medians)"
    lines.append(last)
    if "overhead_paired_mean_ms" in o:
        paired = (
            f"{'paired mean':<26}{o['overhead_paired_mean_ms']:>+11.1f} ms +- {o['overhead_paired_se_ms']:.1f} (s.e.)"
            f"   ({o['overhead_paired_mean_pct']:+.1f} +- {o['overhead_paired_se_pct']:.1f} % of the plain mean)"
        )
        if "overhead_paired_route_ms" in o:
            paired += (
                f"; in the route {o['overhead_paired_route_ms']:+.1f}, outside it "
                f"{o['overhead_paired_outside_ms']:+.1f} (means)"
            )
        lines.append(paired)
    if all("gc_mean_ms" in o[n] for n in ("plain", "ray")):
        lines.append(
            f"{'in the garbage collector':<26}plain {o['plain']['gc_mean_ms']:.2f} ms mean (max "
            f"{o['plain']['gc_max_ms']:.1f}), Ray {o['ray']['gc_mean_ms']:.2f} (max {o['ray']['gc_max_ms']:.1f})"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--job-store", default=None)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--overhead", type=int, default=0, metavar="K")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    common = ["--height", str(a.size), "--width", str(a.size), "--max-batch-size", "4", "--max-queue", "256"]
    if a.steps:
        common += ["--num-inference-steps", str(a.steps), "--guidance-scale", "1.0"]
    common += a.serve_args
    res: dict = {
        "size": a.size,
        "steps": a.steps or "model default",
        "requests": a.requests,
        "concurrency": a.concurrency,
        "serve_args": common,
        "cpus": os.cpu_count(),
        "ray": {},
    }
    t_start = time.perf_counter()
    pg = None
    if a.requests and a.job_store is None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from pg import PgServer, find_bin

        if find_bin() is None:
            raise SystemExit("no --job-store and PostgreSQL is not installed (initdb not found)")
        pg = PgServer(find_bin()).start()
        a.job_store = pg.url
    try:
        for n in a.replicas if a.requests else []:
            outdir = tempfile.mkdtemp(prefix="ditattn-bench-out-")
            proc, base = start(
                [
                    "--replicas",
                    str(n),
                    "--ray-address",
                    "local",
                    "--job-store",
                    a.job_store,
                    "--output-dir",
                    outdir,
                    *common,
                ],
                os.path.join(a.out, f"ray{n}.log"),
            )
            try:
                res["ray"][n] = throughput(base, a.requests, a.concurrency, a.size)
            finally:
                stop(proc)
            print(f"ray, {n} replica(s): {res['ray'][n]}", flush=True)
        if a.overhead:
            procs = []
            try:
                # the same CPU threads for both (a GPU replica on Ray runs one; on the CPU it takes its cores)
                p, ray_base = start(
                    ["--ray-address", "local", *common], os.path.join(a.out, "ray1-overhead.log"), threads=1
                )
                procs.append(p)
                p, plain_base = start(common, os.path.join(a.out, "plain.log"), threads=1)
                procs.append(p)
                res["overhead"] = {
                    "requests": a.overhead,
                    "warmup": a.warmup,
                    **overhead({"ray": ray_base, "plain": plain_base}, a.overhead, a.warmup, a.size),
                }
            finally:
                for p in procs:
                    stop(p)
    finally:
        if pg is not None:
            pg.stop()
    if len(res["ray"]) >= 2:
        lo, hi = min(res["ray"]), max(res["ray"])
        res["scaling"] = round(res["ray"][hi]["images_per_min"] / res["ray"][lo]["images_per_min"], 2)
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    with open(os.path.join(a.out, "serve_throughput.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "overhead"}, indent=1))
    if "overhead" in res:
        text = table(res)
        with open(os.path.join(a.out, "serve_overhead.txt"), "w") as f:
            f.write(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
