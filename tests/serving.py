"""Test helpers: the environment of a ``python -m ditattn`` child process, ``ditattn serve`` in a subprocess (the
real CLI, the tiny models on the CPU), an app on uvicorn in a thread, waiting for a condition, and polling a video
job until it ends."""

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's ephemeral range (and above Ray's worker ports,
    10002-19999), so that a server started on it cannot lose it to a process that binds port 0 meanwhile
    (Ray's own services do, between the test's choice and Ray Serve's proxy binding it)."""
    lo, hi = 20000, 32767
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            hi = min(hi, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    for port in random.sample(range(lo, hi + 1), min(200, max(hi - lo + 1, 0))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no such range here: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_flags(**flags) -> list:
    """``ditattn serve`` arguments from keywords: ``max_batch_size=8`` -> ``["--max-batch-size", "8"]``."""
    return [x for name, value in flags.items() for x in (f"--{name.replace('_', '-')}", str(value))]


def wait_for(cond, timeout: float = 15, what: str = "condition", poll: float = 0.01) -> None:
    """Return once ``cond()`` is true; fail the test after ``timeout`` seconds naming ``what``."""
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(poll)


@contextlib.contextmanager
def serve_app(app, config):
    """Run ``app`` on uvicorn in a thread on 127.0.0.1 and a free port, set up as ``ditattn serve`` sets it
    up (``uvicorn_config``: its read timeouts and protocol); yields the base URL, stops it on exit."""
    import dataclasses

    import uvicorn

    from ditattn.server.connection import uvicorn_config

    port = free_port()
    config = dataclasses.replace(config, port=port)
    server = uvicorn.Server(uvicorn_config(app, config, log_level="error", lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    wait_for(lambda: server.started or not th.is_alive(), timeout=20, what="the server to start")
    assert th.is_alive(), "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(20)


def subprocess_env(**extra) -> dict:
    """This environment for a ``python -m ditattn`` child: the checkout's ``src`` first on ``PYTHONPATH``, the
    caller's entries kept (a machine whose packages come from ``PYTHONPATH`` still finds them), plus ``extra``."""
    path = os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=path, **extra)


@contextlib.contextmanager
def serve_process(args, log_path, *, startup_s: float = 180):
    """Run ``python -m ditattn serve --port P *args`` (output to ``log_path``) until it answers
    ``/health``; yields its base URL and sends it SIGTERM on exit (its shutdown is waited for at the end of
    the session: :func:`wait_stopped`)."""
    with serve_subprocess(args, log_path, startup_s=startup_s) as (base, _proc):
        yield base


@contextlib.contextmanager
def serve_subprocess(args, log_path, *, startup_s: float = 180):
    """:func:`serve_process` yielding ``(base URL, the subprocess.Popen)``: a test may signal the server
    itself (on exit it is sent SIGTERM unless it has exited)."""
    port = free_port()
    env = subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "ditattn", "serve", "--port", str(port), *args]
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ditattn serve exited with {proc.returncode}:\n{open(log_path).read()}")
            try:  # ditattn's own answer (a model and a queue), not another program's on the port
                r = httpx.get(base + "/health", timeout=1)
                if r.status_code == 200 and "queue_depth" in r.json():
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.time() - t0 > startup_s:
                pytest.fail(f"ditattn serve did not come up:\n{open(log_path).read()}")
            time.sleep(0.2)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            STOPPING.append(proc)  # it shuts down (a Ray instance: seconds) while the next tests run


#: servers sent SIGTERM and not yet waited for: :func:`wait_stopped` (at the end of the session) waits
STOPPING: list = []


def wait_stopped(timeout: float = 20) -> None:
    """Wait for every server of :data:`STOPPING` to exit, killing one that takes more than ``timeout`` s."""
    while STOPPING:
        proc = STOPPING.pop()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_video(c, vid, timeout=120, poll=0.1):
    """Poll job ``vid`` with the openai client ``c`` every ``poll`` seconds until it is no longer
    queued or in progress."""
    t0 = time.time()
    v = c.videos.retrieve(vid)
    while v.status in ("queued", "in_progress"):
        assert time.time() - t0 < timeout, v
        time.sleep(poll)
        v = c.videos.retrieve(vid)
    return v
