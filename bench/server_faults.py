"""Load and fault run against a real ``ditattn serve`` process (the built-in tiny model on the CPU).

    PYTHONPATH=src python bench/server_faults.py --out OUTDIR [--quick]

Stages, each with assertions (the run stops at the first failed one, exit status 1):

1. **bad input storm** — hostile requests, many at once: deep JSON, 5000-digit numbers, NaN / inf,
   1e308 seconds, huge sizes / n / steps / fps / seeds, wrong types, oversized and non-UTF-8 bodies,
   deep form keys, bad query parameters, path tricks, wrong methods and keys.  Asserts: no 5xx,
   every answer an OpenAI error body, no traceback in the server log, the server still serves.
1b. **connections** — stalled connections (nothing sent, headers cut short, a body shorter than its
   Content-Length) are closed within the read timeouts; a client that half-closes its socket after
   a complete request gets its answer.
2. **mixed storm** — valid image and video requests with and without overrides plus refusals, all
   at once against a small queue.  Asserts: no 5xx, every 429 carries Retry-After, every video job
   completes with a playable MP4.
3. **disconnects** — a running image request whose client goes away, then queued requests whose
   clients go away behind a long video job, which is then DELETEd.  Asserts: the running one stops
   within a few steps, the queued ones are never computed (no batch, no image), each is counted as
   cancelled and as a 499, the deleted job stops at its next step.
4. **request timeout** (not with --quick; on the restarted server, ``--request-timeout-s 8``) — a
   request longer than the timeout: 504, and the worker is free right after.
5. **SIGTERM with queued video jobs** — a long running and four queued video jobs, then SIGTERM:
   new work gets 503 with Retry-After while draining, the process exits 0 within the drain bound
   (the running job stopped and kept queued); a restart with the same ``--output-dir`` finds every
   job (finished ones downloadable with the same bytes; the long one re-queued, then deleted; the
   four queued ones completed).
6. **second SIGTERM** — a long job, SIGTERM twice: the process exits at once (status 143); the next
   start finds the job again.
7. **files** — every output file that disappeared during the whole run is named in a server log
   line.

Writes ``server_faults.json`` (every figure) and the server logs under OUTDIR and prints a table.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Optional

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "faults-key"
SERVE_FLAGS = [
    "--api-key",
    KEY,
    "--max-batch-size",
    "4",
    "--max-queue",
    "12",
    "--height",
    "32",
    "--width",
    "32",
    "--num-frames",
    "5",
    "--num-inference-steps",
    "2",
    "--guidance-scale",
    "1.0",
    "--max-steps",
    "400",
    "--drain-timeout-s",
    "1",
    "--request-timeout-s",
    "60",
    "--max-body-bytes",
    "65536",
    "--header-timeout-s",
    str(2.0),
    "--body-timeout-s",
    str(2.0),
]
READ_TIMEOUT_S = 2.0  # the servers' --header-timeout-s and --body-timeout-s (the connections stage)
RESTART_TIMEOUT_S = 8.0  # the restarted server's --request-timeout-s (the timeout stage runs there)
AUTH = {"Authorization": f"Bearer {KEY}"}


def _without(flags: list, extra) -> list:
    """``flags`` less the ``--flag VALUE`` pairs that ``extra`` sets again (ditattn refuses a flag given twice)."""
    again = {x for x in extra if str(x).startswith("--")}
    out, skip = [], False
    for i, x in enumerate(flags):
        if skip:
            skip = False
            continue
        if x in again:
            skip = i + 1 < len(flags) and not str(flags[i + 1]).startswith("--")
            continue
        out.append(x)
    return out


class Failed(AssertionError):
    pass


def check(cond, what: str) -> None:
    if not cond:
        raise Failed(what)


# ------------------------------------------------------------------------------------------------
# the server process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``ditattn serve`` subprocess on a free port, its log in ``log_path``."""

    def __init__(self, out_dir: str, log_path: str, extra=()):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        cmd = [
            sys.executable,
            "-m",
            "ditattn",
            "serve",
            "--port",
            str(self.port),
            "--output-dir",
            out_dir,
            *_without(SERVE_FLAGS, extra),
            *extra,
        ]
        self._log = open(log_path, "w")
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        while True:
            if self.proc.poll() is not None:
                raise Failed(f"ditattn serve exited with {self.proc.returncode} at start:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 300:
                raise Failed("ditattn serve did not come up in 300 s")
            time.sleep(0.2)
        self.start_s = time.time() - t0

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()

    def metrics(self) -> dict:
        from ditattn.server.metrics import parse_text

        return parse_text(httpx.get(self.base + "/metrics", headers=AUTH, timeout=10).text)

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        t0 = time.time()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise Failed(f"the server did not exit within {timeout} s") from None
        finally:
            self._log.close()
        return rc, time.time() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def wait_for(cond, timeout: float, what: str, poll: float = 0.05):
    t0 = time.time()
    while True:
        value = cond()
        if value:
            return value
        if time.time() - t0 > timeout:
            raise Failed(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def video(srv: Server, vid: str) -> dict:
    return httpx.get(f"{srv.base}/v1/videos/{vid}", headers=AUTH, timeout=30).json()


def wait_video(srv: Server, vid: str, timeout: float = 300) -> dict:
    return wait_for(
        lambda: (lambda v: v if v.get("status") in ("completed", "failed") else None)(video(srv, vid)),
        timeout,
        f"video {vid} to finish",
        poll=0.2,
    )


def create_video(srv: Server, **body) -> dict:
    r = httpx.post(
        srv.base + "/v1/videos", json={"prompt": "a red circle moving right", **body}, headers=AUTH, timeout=60
    )
    check(r.status_code == 200, f"video create: {r.status_code} {r.text[:300]}")
    return r.json()


def raw_post(srv: Server, path: str, body: dict) -> socket.socket:
    """A JSON POST on a raw socket, left unread (close it to play a client that went away)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def files(out_dir: str) -> set:
    found = set()
    for sub in ("videos", "images"):
        try:
            found |= {f"{sub}/{n}" for n in os.listdir(os.path.join(out_dir, sub))}
        except OSError:
            pass
    return found


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------
# stage 1: bad input


def _png_header(w: int, h: int) -> bytes:
    """A PNG whose header claims ``w`` x ``h`` pixels (a decompression bomb when large)."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def bad_requests() -> list[tuple[str, str, dict]]:
    """(method, path, httpx keyword arguments) of hostile requests; none may get a 5xx."""
    img, vid = "/v1/images/generations", "/v1/videos"

    def js(body):
        return {"json": body, "headers": AUTH}

    def raw(data: bytes, ctype="application/json"):
        return {"content": data, "headers": {**AUTH, "content-type": ctype}}

    deep = b"[" * 50000 + b"]" * 50000
    reqs = [
        ("POST", img, raw(deep)),
        ("POST", img, raw(b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}")),
        ("POST", img, raw(b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}")),
        ("POST", img, raw(b'{"prompt": "x", "seed": ' + b"9" * 400 + b"}")),
        ("POST", img, raw(b'{"prompt": "x", "guidance_scale": NaN}')),
        ("POST", img, raw(b'{"prompt": "x", "guidance_scale": -Infinity}')),
        ("POST", img, raw(b'{"prompt": "x", "guidance_scale": 1e999}')),
        ("POST", img, js({"prompt": "x", "guidance_scale": 1e300})),
        ("POST", vid, js({"prompt": "x", "seconds": 1e308})),
        ("POST", vid, js({"prompt": "x", "seconds": "1e308"})),
        ("POST", vid, js({"prompt": "x", "seconds": "-3"})),
        ("POST", vid, js({"prompt": "x", "seconds": [1]})),
        ("POST", vid, js({"prompt": "x", "seconds": "inf"})),
        ("POST", img, js({"prompt": "x", "size": "99999x99999"})),
        ("POST", img, js({"prompt": "x", "size": "0x0"})),
        ("POST", img, js({"prompt": "x", "size": "-16x16"})),
        ("POST", img, js({"prompt": "x", "size": 1e9})),
        ("POST", img, js({"prompt": "x", "size": "2048x1008", "n": 10})),
        ("POST", img, js({"prompt": "x", "n": -1})),
        ("POST", img, js({"prompt": "x", "n": "abc"})),
        ("POST", img, js({"prompt": "x", "n": 2.5})),
        ("POST", img, js({"prompt": "x", "n": True})),
        ("POST", img, js({"prompt": "x", "n": 10**30})),
        ("POST", img, js({"prompt": 123})),
        ("POST", img, js({"prompt": ""})),
        ("POST", img, js({"prompt": "x" * 30000})),
        ("POST", img, js({"prompt": "x", "seed": -5})),
        ("POST", img, js({"prompt": "x", "seed": 2**64})),
        ("POST", img, js({"prompt": "x", "num_inference_steps": 0})),
        ("POST", img, js({"prompt": "x", "num_inference_steps": 10**20})),
        ("POST", vid, js({"prompt": "x", "fps": 0})),
        ("POST", vid, js({"prompt": "x", "fps": 10**9})),
        ("POST", vid, js({"prompt": "x", "num_frames": 4})),
        ("POST", vid, js({"prompt": "x", "num_frames": 10**12})),
        ("POST", img, js({"prompt": "x", "skip_softmax_params": {"threshold_scale_factor": "nan"}})),
        ("POST", img, js({"prompt": "x", "skip_softmax_params": {"threshold_scale_factor": 1e308}})),
        ("POST", img, js({"prompt": "x", "skip_softmax_params": [1, 2]})),
        ("POST", img, js({"prompt": "x", "attention_backend_override": "../../etc/passwd"})),
        ("POST", img, js({"prompt": "x", "attention_backend_override": "a" * 500})),
        ("POST", img, js({"prompt": "x", "attention_backend_override": "sliding_tile_attn"})),
        ("POST", img, js({"prompt": "x", "attention_backend_overide": "fa"})),
        ("POST", img, js({"prompt": "x", "output_compression": 10**6})),
        ("POST", img, js({"prompt": "x", "stream": True})),
        ("POST", img, js({"prompt": "x", "model": "sora-2"})),
        ("POST", img, js(["x"])),
        ("POST", img, js("x")),
        ("POST", img, js(None)),
        ("POST", img, raw(b"")),
        ("POST", img, raw(b"{not json")),
        ("POST", img, raw(b"\xff\xfe\x00{}")),
        ("POST", img, raw(b"x" * 70000)),
        ("POST", img, raw(b"prompt=x", "text/plain")),
        ("POST", vid, raw(b"--zz\r\nbroken", "multipart/form-data; boundary=zz")),
        ("POST", vid, raw(b"prompt=%ff%fe&n=%zz", "application/x-www-form-urlencoded")),
        ("POST", vid, {"data": {"prompt": "x", "p" + "[a]" * 40: "1"}, "headers": AUTH}),
        ("POST", vid, {"data": {f"f{i}": "1" for i in range(300)} | {"prompt": "x"}, "headers": AUTH}),
        ("GET", "/v1/videos?limit=-1", {"headers": AUTH}),
        ("GET", "/v1/videos?limit=abc", {"headers": AUTH}),
        ("GET", "/v1/videos?limit=" + "9" * 5000, {"headers": AUTH}),
        ("GET", "/v1/videos?order=up", {"headers": AUTH}),
        ("GET", "/v1/videos?after=video_zz", {"headers": AUTH}),
        ("GET", "/v1/videos/../../etc/passwd", {"headers": AUTH}),
        ("GET", "/v1/videos/video_" + "0" * 10000, {"headers": AUTH}),
        ("GET", "/v1/videos/video_" + "0" * 32 + "/content?variant=zzz", {"headers": AUTH}),
        ("GET", "/v1/images/img_x/content", {"headers": AUTH}),
        ("DELETE", "/v1/videos/nope", {"headers": AUTH}),
        ("PUT", vid, {"headers": AUTH}),
        ("DELETE", img, {"headers": AUTH}),
        ("GET", "/nothing", {"headers": AUTH}),
        ("POST", img, {"json": {"prompt": "x"}}),
        ("POST", img, {"json": {"prompt": "x"}, "headers": {"Authorization": "Bearer wrong"}}),
        ("GET", "/metrics", {"headers": {"Authorization": "Basic xyz"}}),
        ("POST", vid, js({"prompt": "x", "input_reference": base64.b64encode(_png_header(60000, 60000)).decode()})),
        ("POST", vid, js({"prompt": "x", "input_reference": base64.b64encode(_png_header(0, 0)).decode()})),
    ]
    return reqs


def stage_bad_input(srv: Server, repeat: int, workers: int) -> dict:
    reqs = bad_requests() * repeat
    random.Random(0).shuffle(reqs)
    before = srv.metrics()

    def send(item):
        method, path, kw = item
        r = httpx.request(method, srv.base + path, timeout=120, **kw)
        body_ok = True
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                body_ok = isinstance(err.get("message"), str) and "Traceback" not in err["message"]
            except (ValueError, KeyError, TypeError):
                body_ok = False
        return r.status_code, body_ok, path

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(send, reqs))
    dt = time.time() - t0
    statuses: dict = {}
    for code, _, _ in results:
        statuses[code] = statuses.get(code, 0) + 1
    five = [(c, p) for c, _, p in results if c >= 500]
    check(not five, f"bad input got 5xx: {five[:5]}")
    check(all(ok for _, ok, _ in results), "an error answer without an OpenAI error body")
    check(all(400 <= c < 500 for c, _, _ in results), f"bad input not refused: {statuses}")
    log = srv.log()
    check("Traceback" not in log, "a traceback in the server log:\n" + log[log.find("Traceback") :][:2000])
    r = httpx.post(srv.base + "/v1/images/generations", json={"prompt": "still alive"}, headers=AUTH, timeout=120)
    check(r.status_code == 200, f"the server stopped serving after the storm: {r.status_code}")
    after = srv.metrics()
    counted = sum(v for k, v in after.items() if k.startswith("ditattn_http_requests_total")) - sum(
        v for k, v in before.items() if k.startswith("ditattn_http_requests_total")
    )
    check(counted >= len(reqs) + 1, f"metrics counted {counted} requests of {len(reqs) + 1}")
    return {
        "requests": len(reqs),
        "kinds": len(bad_requests()),
        "statuses": statuses,
        "seconds": round(dt, 2),
        "n_5xx": len(five),
        "tracebacks_in_log": 0,
        "metrics_counted": int(counted),
    }


# ------------------------------------------------------------------------------------------------
# stage 1b: stalled and half-closed connections


def _closed_after(sock: socket.socket, limit: float) -> Optional[float]:
    """Seconds until the server closed ``sock`` (None: still open after ``limit``)."""
    t0 = time.time()
    sock.settimeout(limit)
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        return None
    except OSError:
        pass
    return time.time() - t0


def stage_connections(srv: Server, n: int) -> dict:
    """``n`` stalled connections of each kind (nothing sent, headers cut short, a body shorter than its
    Content-Length): each closed within the read timeout (+ 2 s); then a client that half-closes its
    socket after a complete image request gets its 200."""
    head = f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    kinds = {
        "idle": b"",
        "headers": (head + "Content-Ty").encode(),
        "body": (head + 'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"prompt": ').encode(),
    }
    socks = []
    for kind, data in kinds.items():
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", srv.port))
            if data:
                s.sendall(data)
            socks.append((kind, s))
    closed: dict = {k: [] for k in kinds}
    with concurrent.futures.ThreadPoolExecutor(len(socks)) as ex:
        for (kind, s), dt in zip(socks, ex.map(lambda ks: _closed_after(ks[1], READ_TIMEOUT_S + 10), socks)):
            closed[kind].append(dt)
            s.close()
    for kind, times in closed.items():
        check(
            all(t is not None and t < READ_TIMEOUT_S + 2 for t in times),
            f"stalled connections ({kind}) not closed within {READ_TIMEOUT_S + 2} s: {times}",
        )
    body = json.dumps({"prompt": "half-closed"}).encode()
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall((head + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    s.shutdown(socket.SHUT_WR)
    s.settimeout(120)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    final = data[data.rfind(b"HTTP/1.1 ") :]
    check(final.startswith(b"HTTP/1.1 200"), f"a half-closed client got {data[:200]!r}")
    check("Traceback" not in srv.log(), "a traceback in the server log after the connections stage")
    return {
        "stalled": len(socks),
        "max_close_s": {k: round(max(v), 2) for k, v in closed.items()},
        "read_timeout_s": READ_TIMEOUT_S,
        "half_closed_status": 200,
    }


# ------------------------------------------------------------------------------------------------
# stage 2: mixed valid storm


def stage_mixed_storm(srv: Server, n: int, workers: int) -> dict:
    rng = random.Random(1)
    plan = []
    for i in range(n):
        x = rng.random()
        if x < 0.55:
            body = {
                "prompt": f"a blue square {i}",
                "n": rng.choice([1, 1, 2, 3]),
                "size": rng.choice(["16x16", "32x32"]),
                "seed": i,
                "response_format": rng.choice(["b64_json", "url"]),
            }
            if rng.random() < 0.5:
                body["attention_backend_override"] = "torch_sdpa"
            plan.append(("/v1/images/generations", body, False))
        elif x < 0.8:
            plan.append(("/v1/videos", {"prompt": f"a green triangle {i}", "num_frames": 5, "seed": i}, False))
        else:
            plan.append(("/v1/images/generations", {"prompt": "x", "attention_backend_override": "nope"}, True))

    def send(item):
        path, body, refusal = item
        t0 = time.time()
        r = httpx.post(srv.base + path, json=body, headers=AUTH, timeout=300)
        return (
            path,
            refusal,
            r.status_code,
            r.headers.get("retry-after"),
            time.time() - t0,
            (r.json().get("id") if path == "/v1/videos" and r.status_code == 200 else None),
        )

    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(send, plan))
    statuses: dict = {}
    for _, _, code, _, _, _ in results:
        statuses[code] = statuses.get(code, 0) + 1
    check(not any(code >= 500 for _, _, code, _, _, _ in results), f"mixed storm got 5xx: {statuses}")
    for path, refusal, code, retry, _, _ in results:
        check(code in ((400,) if refusal else (200, 429)), f"{path}: unexpected {code} (refusal={refusal})")
        check(code != 429 or (retry is not None and int(retry) >= 1), "a 429 without Retry-After")
    vids = [vid for *_, vid in results if vid]
    digests = {}
    for vid in vids:
        v = wait_video(srv, vid)
        check(v["status"] == "completed", f"video {vid} ended {v['status']}: {v.get('error')}")
        data = httpx.get(f"{srv.base}/v1/videos/{vid}/content", headers=AUTH, timeout=60).content
        check(data[4:8] == b"ftyp", f"video {vid} is not an MP4")
        digests[vid] = sha(data)
    lat = sorted(t for path, _, code, _, t, _ in results if code == 200 and path.endswith("generations"))
    return {
        "requests": n,
        "statuses": statuses,
        "videos": len(vids),
        "seconds": round(time.time() - t0, 2),
        "image_p50_s": round(lat[len(lat) // 2], 2) if lat else None,
        "image_p95_s": round(lat[int(len(lat) * 0.95) - 1], 2) if lat else None,
        "digests": digests,
    }


# ------------------------------------------------------------------------------------------------
# stage 3: disconnects

LONG_IMAGE = {"prompt": "a long one", "size": "256x256", "num_inference_steps": 400}


def stage_disconnects(srv: Server, queued: int) -> dict:
    m0 = srv.metrics()
    # a running request whose client goes away
    s = raw_post(srv, "/v1/images/generations", LONG_IMAGE)
    wait_for(lambda: srv.health().get("running") == 1, 60, "the long image request to run")
    time.sleep(0.5)
    t0 = time.time()
    s.close()
    wait_for(lambda: srv.health()["status"] == "ok", 60, "the abandoned request to stop")
    running_stop_s = time.time() - t0
    # queued requests whose clients go away, behind a long video job (deleted afterwards)
    blocker = create_video(srv, prompt="blocker", size="256x256", num_frames=1, num_inference_steps=400)
    wait_for(lambda: video(srv, blocker["id"])["status"] == "in_progress", 60, "the blocker to run")
    socks = [raw_post(srv, "/v1/images/generations", {"prompt": f"gone {i}", "seed": i}) for i in range(queued)]
    wait_for(lambda: srv.health()["queue_depth"] == queued, 60, f"{queued} queued requests")
    m1 = srv.metrics()
    for s in socks:
        s.close()
    wait_for(lambda: srv.health()["queue_depth"] == 0, 60, "the abandoned queued requests to leave the queue")
    t0 = time.time()
    r = httpx.delete(f"{srv.base}/v1/videos/{blocker['id']}", headers=AUTH, timeout=30)
    check(r.status_code == 200 and r.json()["deleted"], f"DELETE of the running job: {r.status_code}")
    wait_for(lambda: srv.health()["status"] == "ok", 60, "the deleted job to stop")
    delete_stop_s = time.time() - t0
    wait_for(
        lambda: (
            srv.metrics().get('ditattn_http_requests_total{endpoint="/v1/images/generations",status="499"}', 0)
            - m0.get('ditattn_http_requests_total{endpoint="/v1/images/generations",status="499"}', 0)
            == queued + 1
        ),
        30,
        "the 499s to be counted",
    )
    m2 = srv.metrics()

    def delta(key, a=m0, b=m2):
        return b.get(key, 0) - a.get(key, 0)

    c = 'ditattn_requests_cancelled_total{kind="%s",reason="%s",stage="%s"}'
    check(delta(c % ("image", "client_disconnected", "running")) == 1, "the running disconnect was not counted")
    check(delta(c % ("image", "client_disconnected", "queued")) == queued, "queued disconnects not counted")
    check(delta(c % ("video", "deleted", "running")) == 1, "the deleted running job was not counted")
    check(delta("ditattn_images_generated_total") == 0, "an abandoned request produced images")
    check(delta('ditattn_batches_total{outcome="ok"}', m1, m2) == 0, "a batch ran for abandoned queued requests")
    check(delta('ditattn_batches_total{outcome="cancelled"}') == 2, "the two stopped batches are not counted")
    check(running_stop_s < 30 and delete_stop_s < 30, "a cancelled job did not stop at its next step")
    return {
        "running_disconnect_stop_s": round(running_stop_s, 2),
        "queued_disconnects": queued,
        "queued_computed": 0,
        "delete_running_stop_s": round(delete_stop_s, 2),
        "counted_499": queued + 1,
    }


# ------------------------------------------------------------------------------------------------
# stage 4: request timeout


def stage_timeout(srv: Server, timeout_s: float) -> dict:
    t0 = time.time()
    r = httpx.post(srv.base + "/v1/images/generations", json=LONG_IMAGE, headers=AUTH, timeout=300)
    answered = time.time() - t0
    check(r.status_code == 504, f"a request past the timeout got {r.status_code}")
    wait_for(lambda: srv.health()["status"] == "ok", 60, "the timed-out job to stop")
    freed = time.time() - t0
    check(
        answered < timeout_s + 10 and freed < timeout_s + 30, f"504 after {answered:.1f} s, free after {freed:.1f} s"
    )
    return {"timeout_s": timeout_s, "answered_504_s": round(answered, 2), "worker_free_s": round(freed, 2)}


# ------------------------------------------------------------------------------------------------
# stage 5 / 6: shutdown


def stage_sigterm(srv: Server, out_dir: str, log_dir: str, storm_digests: dict) -> tuple[dict, Server]:
    # long enough never to finish before the signal, on any machine; after the restart it is deleted
    running = create_video(
        srv, prompt="running at shutdown", size="256x256", num_frames=1, num_inference_steps=400, seed=7
    )
    wait_for(lambda: video(srv, running["id"])["status"] == "in_progress", 60, "the job to run")
    queued = [create_video(srv, prompt=f"queued at shutdown {i}", num_frames=5, seed=20 + i)["id"] for i in range(4)]
    check(all(video(srv, v)["status"] == "queued" for v in queued), "jobs not queued behind the running one")
    t0 = time.time()
    srv.signal(signal.SIGTERM)
    refused = None
    while srv.proc.poll() is None and refused is None:
        try:
            r = httpx.post(srv.base + "/v1/videos", json={"prompt": "too late"}, headers=AUTH, timeout=5)
            if r.status_code == 503:
                refused = (r.status_code, r.headers.get("retry-after"), r.json()["error"]["code"])
            else:
                check(r.status_code == 200, f"a POST while draining got {r.status_code}")
        except httpx.HTTPError:
            break
        time.sleep(0.05)
    rc, _ = srv.wait_exit(120)
    exit_s = time.time() - t0
    check(rc == 0, f"graceful exit status {rc}")
    check(refused is not None and refused[1], "no 503 with Retry-After while draining")
    log = srv.log()
    check("draining" in log, "no drain line in the log")
    restart = Server(
        out_dir, os.path.join(log_dir, "serve_restart.log"), extra=["--request-timeout-s", f"{RESTART_TIMEOUT_S:g}"]
    )
    ids = {v["id"] for v in httpx.get(restart.base + "/v1/videos?limit=100", headers=AUTH).json()["data"]}
    check(set(storm_digests) | {running["id"], *queued} <= ids, "a job is missing after the restart")
    found = {vid: video(restart, vid)["status"] for vid in [running["id"], *queued]}
    check(all(s in ("queued", "in_progress", "completed") for s in found.values()), f"restart statuses: {found}")
    same = all(
        sha(httpx.get(f"{restart.base}/v1/videos/{vid}/content", headers=AUTH).content) == d
        for vid, d in storm_digests.items()
    )
    check(same, "a finished video changed or vanished across the restart")
    r = httpx.delete(f"{restart.base}/v1/videos/{running['id']}", headers=AUTH, timeout=30)  # the long one: enough
    check(r.status_code == 200, f"DELETE after the restart: {r.status_code}")
    for vid in queued:
        v = wait_video(restart, vid)
        check(v["status"] == "completed", f"re-queued video {vid} ended {v['status']}: {v.get('error')}")
    return (
        {
            "drain_timeout_s": 1.0,
            "exit_s": round(exit_s, 2),
            "exit_status": rc,
            "refused_while_draining": refused,
            "jobs_kept": 1 + len(queued),
            "statuses_after_restart": sorted(found.values()),
            "finished_videos_kept": len(storm_digests),
            "restart_start_s": round(restart.start_s, 1),
        },
        restart,
    )


def stage_second_sigterm(srv: Server, out_dir: str, log_dir: str) -> dict:
    job = create_video(srv, prompt="long at a hard exit", size="256x256", num_frames=1, num_inference_steps=400)
    wait_for(lambda: video(srv, job["id"])["status"] == "in_progress", 60, "the job to run")
    srv.signal(signal.SIGTERM)
    time.sleep(0.3)
    t0 = time.time()
    srv.signal(signal.SIGTERM)
    rc, _ = srv.wait_exit(60)
    exit_s = time.time() - t0
    check(rc in (143, -15), f"second SIGTERM exit status {rc}")
    check(exit_s < 5, f"second SIGTERM took {exit_s:.1f} s")
    again = Server(out_dir, os.path.join(log_dir, "serve_third.log"))
    status = video(again, job["id"])["status"]
    check(status in ("queued", "in_progress"), f"the job after a hard exit: {status}")
    httpx.delete(f"{again.base}/v1/videos/{job['id']}", headers=AUTH, timeout=30)
    wait_for(lambda: again.health()["status"] == "ok", 60, "the deleted job to stop")
    t0 = time.time()
    again.signal(signal.SIGTERM)
    rc2, _ = again.wait_exit(60)
    return {
        "second_signal_exit_s": round(exit_s, 2),
        "exit_status": rc,
        "job_after_restart": status,
        "idle_sigterm_exit_s": round(time.time() - t0, 2),
        "idle_exit_status": rc2,
    }


def stage_files(seen: set, out_dir: str, logs: list[str]) -> dict:
    now = files(out_dir)
    gone = sorted(seen - now)
    text = "\n".join(logs)
    silent = [f for f in gone if os.path.basename(f) not in text]
    check(not silent, f"files removed without a log line: {silent[:10]}")
    return {"files_seen": len(seen), "removed": len(gone), "removed_without_log_line": len(silent)}


# ------------------------------------------------------------------------------------------------


def run(out: str, quick: bool) -> dict:
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ditattn-faults-")
    serve_dir = os.path.join(work, "serve")
    results: dict = {"quick": quick}
    seen: set = set()
    servers = []
    srv = Server(serve_dir, os.path.join(out, "serve_first.log"))
    servers.append(srv)
    try:
        results["start_s"] = round(srv.start_s, 1)
        results["bad_input"] = stage_bad_input(srv, repeat=1 if quick else 4, workers=16 if quick else 32)
        results["connections"] = stage_connections(srv, n=5 if quick else 50)
        results["mixed_storm"] = stage_mixed_storm(srv, n=24 if quick else 64, workers=24 if quick else 64)
        seen |= files(serve_dir)
        results["disconnects"] = stage_disconnects(srv, queued=4 if quick else 8)
        seen |= files(serve_dir)
        digests = results["mixed_storm"].pop("digests")
        results["sigterm"], srv = stage_sigterm(srv, serve_dir, out, digests)
        servers.append(srv)
        if not quick:
            results["timeout"] = stage_timeout(srv, RESTART_TIMEOUT_S)
        seen |= files(serve_dir)
        results["second_sigterm"] = stage_second_sigterm(srv, serve_dir, out)
        seen |= files(serve_dir)
        logs = [
            open(os.path.join(out, n), errors="replace").read() for n in sorted(os.listdir(out)) if n.endswith(".log")
        ]
        results["files"] = stage_files(seen, serve_dir, logs)
        results["ok"] = True
    except Failed as exc:
        results["ok"], results["failed"] = False, str(exc)
    finally:
        for s in servers:
            s.kill()
    if results["ok"]:
        shutil.rmtree(work, ignore_errors=True)
    else:
        results["kept_output_dir"] = serve_dir  # for a look at what the servers left
    with open(os.path.join(out, "server_faults.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    return results


ROWS = [  # (result key, table label, line: str.format over that stage's figures)
    (
        "bad_input",
        "bad input storm",
        "{requests} requests ({kinds} kinds) in {seconds} s: statuses {statuses}, "
        "5xx {n_5xx}, tracebacks {tracebacks_in_log}",
    ),
    (
        "connections",
        "connections",
        "{stalled} stalled connections closed after at most {max_close_s} s (read "
        "timeouts {read_timeout_s} s); a half-closed client got {half_closed_status}",
    ),
    (
        "mixed_storm",
        "mixed storm",
        "{requests} requests: {statuses}, {videos} videos completed, image p50 {image_p50_s} s / p95 {image_p95_s} s",
    ),
    (
        "disconnects",
        "disconnects",
        "running one stopped {running_disconnect_stop_s} s after the client left; "
        "{queued_disconnects} queued, {queued_computed} computed; DELETE of a running job "
        "stopped in {delete_running_stop_s} s; 499s {counted_499}",
    ),
    (
        "sigterm",
        "SIGTERM",
        "exit {exit_status} in {exit_s} s (drain {drain_timeout_s} s), 503 while draining "
        "{refused_while_draining}, {jobs_kept} jobs kept -> {statuses_after_restart}, "
        "{finished_videos_kept} finished videos identical",
    ),
    (
        "timeout",
        "request timeout",
        "504 after {answered_504_s} s (limit {timeout_s} s), worker free after {worker_free_s} s",
    ),
    (
        "second_sigterm",
        "second SIGTERM",
        "exit {exit_status} in {second_signal_exit_s} s; job after restart: "
        "{job_after_restart}; idle SIGTERM exit {idle_exit_status} in "
        "{idle_sigterm_exit_s} s",
    ),
    ("files", "files", "{files_seen} seen, {removed} removed, {removed_without_log_line} without a log line"),
]


def table(r: dict) -> str:
    rows = [("stage", "result")] + [(label, line.format(**r[key])) for key, label, line in ROWS if key in r]
    rows.append(("verdict", "PASS" if r.get("ok") else f"FAIL: {r.get('failed')}"))
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for server_faults.json and the server logs")
    p.add_argument("--quick", action="store_true", help="smaller storms, no timeout stage (the CI test)")
    a = p.parse_args(argv)
    r = run(a.out, a.quick)
    print(table(r))
    return 0 if r.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
