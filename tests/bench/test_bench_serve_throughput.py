"""bench/serve_throughput.py's overhead split: two stub servers answer image requests with a ``Server-Timing``
header; the one standing for Ray waits 30 ms outside its reported route time, and the bench attributes that wait
to the time outside the route, not to the route."""

import http.server
import importlib.util
import json
import os
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "serve_throughput", os.path.join(ROOT, "bench", "serve_throughput.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stub(extra_s: float, gc_ms: float = 0.0):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(0.010 + extra_s)  # 10 ms "in the route", extra_s outside it
            body = json.dumps({"data": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            timing = f"queue;dur=1.0, generate;dur=8.0, encode;dur=0.5, gc;dur={gc_ms}, total;dur=10.0"
            self.send_header("Server-Timing", timing)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_parse_server_timing():
    parse = _bench().parse_server_timing
    assert parse('queue;dur=1.5, generate;desc="x";dur=20, total;dur=30.25') == {
        "queue": 1.5,
        "generate": 20.0,
        "total": 30.25,
    }
    assert parse("") == {} and parse("cache;desc=hit") == {}


def test_overhead_is_split_into_route_and_outside():
    bench = _bench()
    plain, ray = _stub(0.0), _stub(0.030, gc_ms=2.5)
    try:
        bases = {name: f"http://127.0.0.1:{s.server_address[1]}" for name, s in (("ray", ray), ("plain", plain))}
        o = bench.overhead(bases, k=6, warmup=1, size=16)
    finally:
        plain.shutdown(), ray.shutdown()
    assert o["plain"]["generate_ms"] == o["ray"]["generate_ms"] == 8.0
    assert o["plain"]["route_ms"] == o["ray"]["route_ms"] == 10.0
    assert o["overhead_route_ms"] == 0.0
    assert 25.0 <= o["overhead_outside_ms"] <= o["overhead_median_ms"] + 1.0 and o["overhead_median_ms"] >= 25.0
    assert o["overhead_paired_route_ms"] == 0.0 and o["overhead_paired_outside_ms"] >= 25.0
    table = bench.table({"size": 16, "overhead": {"requests": 6, "warmup": 1, **o}})
    assert "in route" in table and f"outside it {o['overhead_outside_ms']:+.1f}" in table
    assert f"outside it {o['overhead_paired_outside_ms']:+.1f} (means)" in table
    assert o["plain"]["gc_mean_ms"] == 0.0 and o["ray"]["gc_mean_ms"] == o["ray"]["gc_max_ms"] == 2.5
    assert "plain 0.00 ms mean (max 0.0), Ray 2.50 (max 2.5)" in table


def test_paired_overhead_is_the_mean_difference_of_request_pairs():
    """The paired overhead is the mean of (ray_i - plain_i) with its standard error, and it does not jump where a
    bimodal latency moves the medians: here the medians differ by 180 ms, the pairs by 10 ms each."""
    paired = _bench()._paired
    plain = [0.27] * 6 + [0.45] * 5
    ray = [0.28] * 5 + [0.46] * 6  # every request 10 ms slower, but one more request in the slow mode...
    ray[5] = 0.28 + 0.18  # ...because its plain partner (0.27) was slow on the Ray side
    o = paired({"ray": ray, "plain": plain}, {"ray": [], "plain": []})
    diffs = [1e3 * (r - p) for r, p in zip(ray, plain)]
    assert o["overhead_paired_mean_ms"] == round(sum(diffs) / len(diffs), 2)
    assert 0 < o["overhead_paired_se_ms"] < o["overhead_paired_mean_ms"]
    assert abs(o["overhead_paired_mean_pct"] - 100 * o["overhead_paired_mean_ms"] / (1e3 * sum(plain) / 11)) < 0.01
    assert "overhead_paired_route_ms" not in o  # no Server-Timing rows: no split
    assert paired({"ray": [0.3], "plain": [0.2]}, {"ray": [], "plain": []}) == {}  # one pair: no error estimate
