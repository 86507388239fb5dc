"""Test helpers: ``ditattn serve`` in a subprocess (the real CLI, the tiny models on the CPU) and polling
a video job until it ends."""
import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(args, log_path, *, startup_s: float = 180):
    """Run ``python -m ditattn serve --port P *args`` (output to ``log_path``) until it answers
    ``/health``; yields its base URL and stops it on exit."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "ditattn", "serve", "--port", str(port), *args]
    with open(log_path, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ditattn serve exited with {proc.returncode}:\n{open(log_path).read()}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > startup_s:
                pytest.fail(f"ditattn serve did not come up:\n{open(log_path).read()}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
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
