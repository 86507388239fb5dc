"""The server when the disk fills, a stored job is damaged, a client is hostile or unlucky: on a real
uvicorn (the connection handling of ``ditattn serve``) with the toy runner of ``test_server_app``.

* A video whose MP4 cannot be written (ENOSPC, a truncated encode) fails with the reason; the job
  store and the API agree; a job store that cannot be written makes ``/health`` degraded, loudly.
* A restart fails only the damaged job (malformed record, truncated or non-image first frame); a
  full disk at start is called a full disk; a foreign database is refused without a traceback.
* An image whose header claims too many pixels is a 400 (and one ``error:`` line from the CLI).
* Without an API key, a foreign ``Host`` or a cross-site ``Origin`` is refused (403).
* Stalled headers / bodies are closed; a half-closed client still gets its answer.
* DELETE stops an encode between frames; a shutdown keeps a batch that finished.
"""

import errno
import json
import logging
import os
import socket
import sqlite3
import struct
import threading
import time
import zlib

import httpx
import numpy as np
import pytest
from test_server_app import ToyRunner, client, serve, wait_video

import serving
from ditattn.errors import AttentionConfigError
from ditattn.pipelines import output
from ditattn.runconfig import ServerConfig
from ditattn.server.app import create_app
from ditattn.server.jobstore import JobStore
from ditattn.server.runner import ModelDefaults

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


_wait = serving.wait_for


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _stored(out, vid) -> dict:
    db = sqlite3.connect(os.path.join(out, "jobs.sqlite"))
    try:
        row = db.execute("SELECT status, record FROM videos WHERE id = ?", (vid,)).fetchone()
    finally:
        db.close()
    return {"status": row[0], **json.loads(row[1])}


# ------------------------------------------------------------------------------------------------
# outputs and the job store


def test_full_disk_while_encoding_fails_the_job_with_the_reason(tmp_path, monkeypatch):
    out = str(tmp_path / "serve")
    with serve(ToyRunner(), output_dir=out) as (base, app):
        c = client(base)
        monkeypatch.setattr(output.os, "fsync", _enospc)  # the MP4's flush meets a full disk
        v = wait_video(c, c.videos.create(prompt="full").id)
        assert v.status == "failed" and v.error.code == "output_failed" and "no space left" in v.error.message
        r = httpx.get(f"{base}/v1/videos/{v.id}/content")
        assert r.status_code == 409 and "no space left" in r.json()["error"]["message"]
        assert _stored(out, v.id)["status"] == "failed"  # the store agrees with the API
        assert not [n for n in os.listdir(os.path.join(out, "videos"))]  # no partial or temporary file
        monkeypatch.undo()
        ok = wait_video(c, c.videos.create(prompt="room again").id)
        assert ok.status == "completed" and _stored(out, ok.id)["status"] == "completed"
        assert output.mp4_video_frames(os.path.join(out, "videos", ok.id + ".mp4")) == 5


def test_truncated_encode_is_a_failed_job_not_a_download(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    real = imageio.get_writer

    def writer(path, *a, **k):
        w = real(path, *a, **k)
        close = w.close

        def cut():
            close()
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) - 7)

        w.close = cut
        return w

    monkeypatch.setattr(imageio, "get_writer", writer)
    out = str(tmp_path / "serve")
    with serve(ToyRunner(), output_dir=out) as (base, app):
        c = client(base)
        v = wait_video(c, c.videos.create(prompt="cut").id)
        assert v.status == "failed" and "truncated" in v.error.message
        assert httpx.get(f"{base}/v1/videos/{v.id}/content").status_code == 409
        assert _stored(out, v.id)["status"] == "failed"


def test_job_store_write_failure_is_reported_by_health_and_caught_up(tmp_path, caplog):
    out = str(tmp_path / "serve")
    with serve(ToyRunner(), output_dir=out) as (base, app):
        state = app.state.server
        c = client(base)
        assert httpx.get(base + "/health").json()["status"] == "ok"
        store = state.videos.jobs
        real_save = store.save

        def full(record):
            raise sqlite3.OperationalError("database or disk is full")

        store.save = full
        with caplog.at_level(logging.ERROR, logger="ditattn.server"):
            v = wait_video(c, c.videos.create(prompt="unsaved").id)
        assert v.status == "completed"
        h = httpx.get(base + "/health")
        assert h.status_code == 503 and h.json()["status"] == "degraded"
        assert "disk is full" in h.json()["job_store_error"]
        assert any("cannot save video" in r.message and "disk is full" in r.message for r in caplog.records)
        store.save = real_save
        h = httpx.get(base + "/health")  # the health check writes what was pending
        assert h.status_code == 200 and "job_store_error" not in h.json()
        assert _stored(out, v.id)["status"] == "completed"


def test_image_url_on_a_full_disk_is_507_with_the_reason(tmp_path, monkeypatch):
    with serve(ToyRunner()) as (base, app):
        import ditattn.files as files

        monkeypatch.setattr(files.os, "fsync", _enospc)
        r = httpx.post(base + "/v1/images/generations", json={"prompt": "x", "response_format": "url"}, timeout=30)
        assert r.status_code == 507 and "no space left" in r.json()["error"]["message"]
        assert not os.listdir(os.path.join(app.state.server.output_dir, "images"))
        monkeypatch.undo()
        r = httpx.post(base + "/v1/images/generations", json={"prompt": "x", "response_format": "url"}, timeout=30)
        assert r.status_code == 200 and httpx.get(base + r.json()["data"][0]["url"]).status_code == 200


# ------------------------------------------------------------------------------------------------
# restart


def _record(vid, **kw):
    request = dict(
        prompt=vid,
        width=32,
        height=16,
        num_frames=5,
        num_inference_steps=2,
        fps=16,
        negative_prompt=None,
        guidance_scale=5.0,
        guidance_scale_2=None,
        lora=None,
        seed=1,
        override=None,
        skip_softmax=None,
    )
    rec = dict(
        id=vid,
        model="toy-dit",
        prompt=vid,
        size="32x16",
        seconds="0.3125",
        num_frames=5,
        fps=16,
        num_inference_steps=2,
        override=None,
        skip_softmax=None,
        attention_backends=["torch_sdpa"],
        created_at=1,
        request=request,
        status="queued",
        progress=0,
    )
    rec.update(kw)
    return rec


def test_restore_fails_only_the_damaged_jobs(tmp_path, caplog):
    out = tmp_path / "serve"
    (out / "inputs").mkdir(parents=True)
    good, trunc, notimg, malformed, badtype = ("video_" + f"{i:032x}" for i in range(5))
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((24, 40, 3), 90, np.uint8)).save(buf, format="PNG")
    (out / "inputs" / f"{trunc}.png").write_bytes(buf.getvalue()[:40])
    (out / "inputs" / f"{notimg}.png").write_bytes(b"this is not an image at all")
    store = JobStore(str(out))
    store.save(_record(good))
    for vid in (trunc, notimg):
        rec = _record(vid)
        rec["request"]["input_reference_file"] = os.path.join("inputs", f"{vid}.png")
        store.save(rec)
    store.save({"id": malformed, "status": "queued", "request": "not a dict", "created_at": 5})
    store.save(_record(badtype, num_frames="many", status="in_progress"))
    store.close()
    notjson = "video_" + "e" * 32
    db = sqlite3.connect(str(out / "jobs.sqlite"))
    db.execute("INSERT INTO videos (id, status, record) VALUES (?, 'queued', '{not json')", (notjson,))
    db.commit()
    db.close()
    with caplog.at_level(logging.WARNING, logger="ditattn.server"):
        with serve(ToyRunner(), output_dir=str(out)) as (base, app):
            c = client(base)
            assert wait_video(c, good).status == "completed"
            for vid, words in [
                (trunc, "damaged"),
                (notimg, "damaged"),
                (malformed, "malformed"),
                (badtype, "malformed"),
                (notjson, "not valid JSON"),
            ]:
                v = c.videos.retrieve(vid)
                assert v.status == "failed" and words in v.error.message, (vid, v)
                assert _stored(str(out), vid)["status"] == "failed"
    assert "Traceback" not in caplog.text


class _FullDiskDB:
    """A sqlite3 connection whose writes meet a full disk."""

    def __init__(self, db):
        self.db = db

    def execute(self, sql, *a):
        if not sql.startswith("PRAGMA user_version") and not sql.startswith("SELECT"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *a)

    def close(self):
        self.db.close()


def test_full_disk_at_start_is_called_a_full_disk(tmp_path, monkeypatch):
    import ditattn.server.jobstore as js

    JobStore(str(tmp_path)).close()  # a valid store
    real = sqlite3.connect
    monkeypatch.setattr(js.sqlite3, "connect", lambda *a, **k: _FullDiskDB(real(*a, **k)))
    with pytest.raises(AttentionConfigError) as exc:
        JobStore(str(tmp_path))
    assert "disk is full" in str(exc.value) and "not a ditattn job store" not in str(exc.value)
    assert "move it away" not in str(exc.value)


def test_foreign_databases_are_refused_without_a_traceback(tmp_path):
    for name, sql in [
        ("videos", "CREATE TABLE videos (title TEXT, year INT)"),
        ("other", "CREATE TABLE customers (id INT)"),
    ]:
        d = tmp_path / name
        d.mkdir()
        db = sqlite3.connect(str(d / "jobs.sqlite"))
        db.execute(sql)
        db.commit()
        db.close()
        with pytest.raises(AttentionConfigError, match="is not a ditattn job store .*move it away"):
            create_app(ToyRunner(), ServerConfig(output_dir=str(d)))
        db = sqlite3.connect(str(d / "jobs.sqlite"))  # left as it was
        assert db.execute("PRAGMA user_version").fetchone()[0] == 0
        db.close()


# ------------------------------------------------------------------------------------------------
# inputs


def _png_header(w, h) -> bytes:
    """A PNG whose header claims ``w`` x ``h`` pixels (its data is a few bytes)."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("w,h", [(20000, 20000), (12000, 9000), (5000, 5000)])
def test_image_size_is_checked_from_the_header(w, h):
    from ditattn.pipelines.conditioning import ImageInputError, decode_image_bytes

    with pytest.raises(ImageInputError, match=r"at most 1000000 pixels"):
        decode_image_bytes(_png_header(w, h), max_pixels=1000 * 1000)


def test_decompression_bomb_is_a_400_and_one_cli_error_line(tmp_path, capsys):
    import base64

    bomb = _png_header(30000, 30000)
    runner = ToyRunner()
    runner.defaults = ModelDefaults(width=32, height=16, num_frames=5, num_inference_steps=2, image_input="optional")
    with serve(runner) as (base, app):
        r = httpx.post(base + "/v1/videos", json={"prompt": "x", "input_reference": base64.b64encode(bomb).decode()})
        assert r.status_code == 400 and "pixels" in r.json()["error"]["message"], r.text
    path = tmp_path / "bomb.png"
    path.write_bytes(bomb)
    from ditattn.entrypoints.cli import main

    try:
        rc = main(["generate", "--prompt", "x", "--image", str(path), "--output-path", str(tmp_path)])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] and "pixels" in err


# ------------------------------------------------------------------------------------------------
# browsers, stalled and half-closed connections


def test_without_a_key_foreign_hosts_and_origins_are_refused(toy_open):
    base, _ = toy_open
    post = lambda **h: httpx.post(base + "/v1/images/generations", json={"prompt": "x"}, headers=h, timeout=30)  # noqa
    r = post(Origin="https://evil.example")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = post(Host="evil.example")  # DNS rebinding: the page's name, our address
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert post(Origin="null").status_code == 403
    for ok in (
        {},
        {"Origin": "http://localhost:5173"},
        {"Origin": base},
        {"Host": "localhost"},
        {"Origin": "https://app.example"},
    ):  # the last one: --allowed-origins
        assert post(**ok).status_code == 200, ok
    assert httpx.get(base + "/health", headers={"Host": "evil.example"}).status_code == 200


def test_with_a_key_the_key_decides():
    with serve(ToyRunner(), api_key="k") as (base, app):
        r = httpx.post(
            base + "/v1/images/generations",
            json={"prompt": "x"},
            timeout=30,
            headers={"Origin": "https://evil.example", "Authorization": "Bearer k"},
        )
        assert r.status_code == 200


@pytest.fixture(scope="module")
def toy_open():
    with serve(ToyRunner(), allowed_origins=("https://app.example",), header_timeout_s=0.5, body_timeout_s=0.5) as (
        base,
        app,
    ):
        yield base, app


def _connect(base):
    host, port = base.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(10)
    return s


def _closed_within(s, seconds) -> bool:
    t0 = time.time()
    try:
        while s.recv(4096):
            pass
    except (ConnectionResetError, socket.timeout):
        return False
    return time.time() - t0 < seconds


def test_stalled_headers_and_bodies_are_closed(toy_open):
    base, _ = toy_open
    idle = _connect(base)  # sends nothing
    partial = _connect(base)
    partial.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    short = _connect(base)
    short.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    for s in (idle, partial, short):
        assert _closed_within(s, 5)
        s.close()
    drip = _connect(base)  # a byte at a time: the header time counts from the first byte
    t0 = time.time()
    for b in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
        try:
            drip.sendall(bytes([b]))
        except OSError:
            break
        time.sleep(0.05)
        if time.time() - t0 > 4:
            break
    assert time.time() - t0 < 4, "a slow header drip was kept open"
    drip.close()
    assert httpx.get(base + "/health").status_code == 200


def test_half_closed_client_gets_its_answer(toy_open):
    base, _ = toy_open
    body = json.dumps({"prompt": "half-closed"}).encode()
    s = _connect(base)
    s.sendall(
        b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    s.shutdown(socket.SHUT_WR)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    final = data[data.rfind(b"HTTP/1.1 ") :]
    assert final.startswith(b"HTTP/1.1 200"), data[:300]
    assert json.loads(final.split(b"\r\n\r\n", 1)[1])["data"][0]["b64_json"]


# ------------------------------------------------------------------------------------------------
# decode / encode: interruptible, or kept


def test_delete_stops_an_encode_between_frames(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    real = imageio.get_writer
    appended = []

    def slow(*a, **k):
        w = real(*a, **k)
        append = w.append_data

        def one(frame):
            appended.append(1)
            time.sleep(0.05)
            append(frame)

        w.append_data = one
        return w

    monkeypatch.setattr(imageio, "get_writer", slow)
    runner = ToyRunner()
    with serve(runner, output_dir=str(tmp_path / "serve"), max_frames=401, max_output_pixels=10**7) as (base, app):
        state = app.state.server
        c = client(base)
        v = c.videos.create(prompt="long", extra_body={"num_frames": 401})
        _wait(lambda: len(appended) > 3, what="the encode to start")
        t0 = time.time()
        httpx.delete(f"{base}/v1/videos/{v.id}")
        _wait(lambda: not state._encodes, timeout=5, what="the encode to stop")
        assert time.time() - t0 < 2 and len(appended) < 100
        assert not [n for n in os.listdir(os.path.join(state.output_dir, "videos"))]


def test_shutdown_keeps_a_batch_that_finished():
    from ditattn.server.jobs import SHUTDOWN, GenerationJob, GenerationResult
    from ditattn.server.scheduler import Scheduler

    class Finisher:
        def run_batch(self, jobs):
            sched.stop_running(SHUTDOWN)  # SIGTERM while the decode / encode ran
            return [GenerationResult(np.zeros((1, 1, 2, 2, 3), np.uint8), ["torch_sdpa"]) for _ in jobs]

    sched = Scheduler(Finisher(), batch_window_s=0.0).start()
    try:
        job = GenerationJob(
            kind="video",
            model="m",
            prompt="p",
            width=2,
            height=2,
            num_frames=1,
            num_inference_steps=1,
            negative_prompt=None,
            guidance_scale=1.0,
            seed=0,
            fps=1,
        )
        assert sched.submit(job).result(10).frames.shape == (1, 1, 2, 2, 3)
    finally:
        sched.stop()


def test_vae_decode_stops_between_latent_frames():
    import torch

    from ditattn.errors import GenerationCancelled
    from ditattn.pipelines.latents import decode_latents

    class VAE(torch.nn.Module):
        dtype = torch.float32

        class config:
            latents_mean = [0.0, 0.0]
            latents_std = [1.0, 1.0]

        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Identity()
            self.calls = 0

        def decode(self, z, return_dict=False):  # as diffusers: one decoder call per latent frame
            frames = []
            for i in range(z.shape[2]):
                self.calls += 1
                frames.append(self.decoder(z[:, :1, i : i + 1].expand(-1, 3, -1, -1, -1)))
            return (torch.cat(frames, 2),)

    vae, asked = VAE(), []

    def check():
        asked.append(1)
        if len(asked) > 2:
            raise GenerationCancelled("deleted")

    with pytest.raises(GenerationCancelled):
        decode_latents(vae, torch.zeros(1, 2, 7, 2, 2), torch.device("cpu"), check_stop=check)
    assert vae.calls == 3 and len(vae.decoder._forward_pre_hooks) == 0
    out = decode_latents(vae, torch.zeros(1, 2, 7, 2, 2), torch.device("cpu"))
    assert out.shape == (1, 7, 2, 2, 3)


def test_drain_waits_for_the_decode_of_finished_frames(tmp_path, monkeypatch):
    import ditattn.server.state as state_mod

    monkeypatch.setattr(state_mod, "STOP_GRACE_S", 0.2)
    monkeypatch.setattr(state_mod, "DECODE_GRACE_S", 20.0)
    decoding = threading.Event()

    class Decoding(ToyRunner):
        def run_batch(self, jobs):
            for j in jobs:
                j.denoised = True  # every step ran: what the pipeline runner records from on_step
            decoding.set()
            time.sleep(1.5)  # a decode that does not stop for a shutdown
            return super().run_batch(jobs)

    out = str(tmp_path / "serve")
    with serve(Decoding(), output_dir=out) as (base, app):
        c = client(base)
        v = c.videos.create(prompt="decoding")
        assert decoding.wait(10)
        assert app.state.server.drain(0.0)  # SIGTERM while decoding: the frames are kept, not recomputed
        rec = app.state.server.videos.get(v.id)
        assert rec.status == "completed" and output.mp4_video_frames(rec.path) == 5
        assert _stored(out, v.id)["status"] == "completed"


def test_tiny_pipeline_decode_stops_between_latent_frames():
    """The real VAE of the tiny model: a stop asked once its decode has started ends it at the next
    latent frame (GenerationCancelled), not after the whole clip."""
    import torch

    from ditattn.errors import GenerationCancelled
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained("ditattn:tiny-wan")
    decoder = pipe.components["vae"].decoder
    calls = []
    hook = decoder.register_forward_hook(lambda *a: calls.append(1))
    state = {"denoised": False}

    def stop_once_decoding():
        return "deleted" if state["denoised"] and calls else None

    try:
        with pytest.raises(GenerationCancelled, match="deleted"):
            pipe.generate(
                "x",
                height=32,
                width=32,
                num_frames=13,
                num_inference_steps=1,
                progress=False,
                on_step=lambda done, total: state.update(denoised=done >= total),
                should_stop=stop_once_decoding,
            )
        stopped_after = len(calls)
        calls.clear()
        with torch.no_grad():
            pipe.generate("x", height=32, width=32, num_frames=13, num_inference_steps=1, progress=False)
    finally:
        hook.remove()
    assert stopped_after == 1 and len(calls) == 4  # 13 frames = 4 latent frames, one decoder call each


def test_damaged_job_store_file_is_refused_at_create_not_at_startup(tmp_path):
    store = JobStore(str(tmp_path))
    for i in range(300):
        store.save(_record("video_" + f"{i:032x}", prompt="x" * 200))
    store.close()
    path = tmp_path / "jobs.sqlite"
    data = bytearray(path.read_bytes())
    data[4096:] = b"\xff" * (len(data) - 4096)  # every page but the header is damaged
    path.write_bytes(bytes(data))
    with pytest.raises(AttentionConfigError, match="damaged|not a ditattn job store"):
        create_app(ToyRunner(), ServerConfig(output_dir=str(tmp_path)))
