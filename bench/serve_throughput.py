"""Throughput and per-request overhead of ``ditattn serve`` on Ray Serve against the plain server.

    PYTHONPATH=src python bench/serve_throughput.py --out OUTDIR [--job-store postgresql://...]
        [--replicas 1 2] [--requests 48] [--concurrency 8] [--size 16] [--steps 2] [--overhead 20]
        [-- SERVE_ARGS...]

For each replica count it starts ``ditattn serve --replicas N --ray-address local`` (a fresh local
Ray instance; N CPU replicas of the built-in tiny model, or one GPU each on a GPU machine) and sends
``--requests`` image requests from ``--concurrency`` clients at once: images per minute.  With
``--overhead K`` it also times K image requests one at a time against the plain ``ditattn serve``
and against Ray with one replica: the median latency of each and the difference (what Ray's proxy
and routing add per request).  Arguments after ``--`` go to every ``ditattn serve`` (e.g.
``-- --model-path /models/Wan2.1-T2V-1.3B --device cuda``).

Without ``--job-store`` a throwaway PostgreSQL server is started (tests/pg.py; needs ``initdb``).
Writes ``serve_throughput.json`` under OUTDIR and prints a table.
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
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list, log: str, timeout: float = 600):
    """``ditattn serve`` with ``args`` until its /health answers; (process, base URL)."""
    port = _port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(ROOT, "src"))
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per server process and per CPU replica: comparable
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ditattn", "serve", "--port", str(port), *args], stdout=f,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT)
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


def image(base: str, size: int, seed: int) -> float:
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/images/generations", json={"prompt": f"bench {seed}", "size": f"{size}x{size}",
                                                          "seed": seed}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"image request: HTTP {r.status_code}: {r.text[:200]}")
    return time.perf_counter() - t0


def throughput(base: str, n: int, conc: int, size: int) -> dict:
    for i in range(conc):  # warm every replica (first-call costs) before the clock starts
        image(base, size, 10_000 + i)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(conc) as pool:
        lat = list(pool.map(lambda i: image(base, size, i), range(n)))
    wall = time.perf_counter() - t0
    return {"images": n, "wall_s": round(wall, 2), "images_per_min": round(60 * n / wall, 1),
            "latency_median_s": round(statistics.median(lat), 3)}


def sequential(base: str, k: int, size: int) -> float:
    for i in range(3):
        image(base, size, 20_000 + i)
    return statistics.median(image(base, size, i) for i in range(k))


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
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pg = None
    if a.job_store is None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from pg import PgServer, find_bin

        if find_bin() is None:
            raise SystemExit("no --job-store and PostgreSQL is not installed (initdb not found)")
        pg = PgServer(find_bin()).start()
        a.job_store = pg.url
    common = ["--height", str(a.size), "--width", str(a.size), "--num-inference-steps", str(a.steps),
              "--guidance-scale", "1.0", "--max-batch-size", "4", "--max-queue", "256", *a.serve_args]
    res: dict = {"size": a.size, "steps": a.steps, "requests": a.requests, "concurrency": a.concurrency,
                 "serve_args": common, "cpus": os.cpu_count(), "ray": {}}
    try:
        for n in a.replicas:
            outdir = tempfile.mkdtemp(prefix="ditattn-bench-out-")
            proc, base = start(["--replicas", str(n), "--ray-address", "local", "--job-store", a.job_store,
                                "--output-dir", outdir, *common], os.path.join(a.out, f"ray{n}.log"))
            try:
                res["ray"][n] = throughput(base, a.requests, a.concurrency, a.size)
                if a.overhead and n == 1:
                    res["ray_sequential_median_s"] = sequential(base, a.overhead, a.size)
            finally:
                stop(proc)
            print(f"ray, {n} replica(s): {res['ray'][n]}", flush=True)
        if a.overhead:
            proc, base = start(common, os.path.join(a.out, "plain.log"))
            try:
                res["plain_sequential_median_s"] = sequential(base, a.overhead, a.size)
                res["plain"] = throughput(base, a.requests, a.concurrency, a.size)
            finally:
                stop(proc)
            if "ray_sequential_median_s" in res:
                d = res["ray_sequential_median_s"] - res["plain_sequential_median_s"]
                res["ray_overhead_s"] = round(d, 4)
                res["ray_overhead_pct"] = round(100 * d / res["plain_sequential_median_s"], 2)
    finally:
        if pg is not None:
            pg.stop()
    if len(res["ray"]) >= 2:
        lo, hi = min(res["ray"]), max(res["ray"])
        res["scaling"] = round(res["ray"][hi]["images_per_min"] / res["ray"][lo]["images_per_min"], 2)
    with open(os.path.join(a.out, "serve_throughput.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
