"""The server against hostile or unlucky clients, on a real uvicorn with the toy runner of
``test_server_app``: disconnected clients are cancelled and not computed, DELETE stops a running
video job, limits are 400s naming the flag, no input yields a 5xx, internal errors are fixed text
counted and logged once, /health reports a stuck worker, 429 carries Retry-After, image URLs come
from --public-url, and a drain keeps queued video jobs for the next start with the same
--output-dir."""

import json
import logging
import os
import socket
import threading
import time

import httpx
import openai
import pytest
from test_server_app import ToyRunner, client, serve, wait_video

import serving
from ditattn.errors import AttentionConfigError
from ditattn.runconfig import ServerConfig
from ditattn.server.app import create_app
from ditattn.server.metrics import parse_text

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


_wait = serving.wait_for


def _metrics(base, **headers):
    return parse_text(httpx.get(base + "/metrics", headers=headers).text)


def _raw_post(base, path, body: dict) -> socket.socket:
    """Send a JSON POST on a raw socket and return it without reading the answer (the caller closes
    it to play a client that went away)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def test_disconnected_clients_are_cancelled_and_not_computed():
    runner = ToyRunner(steps=300, step_s=0.02)  # 6 s per batch unless stopped
    with serve(runner, max_batch_size=1) as (base, app):
        state = app.state.server
        running = _raw_post(base, "/v1/images/generations", {"prompt": "running-gone"})
        assert runner.stepping.wait(10)
        queued = [_raw_post(base, "/v1/images/generations", {"prompt": f"queued-gone-{i}"}) for i in range(3)]
        _wait(lambda: state.scheduler.queue_depth == 3, what="3 queued")
        for s in queued:
            s.close()
        _wait(lambda: state.scheduler.queue_depth == 0, what="queued requests removed")
        t0 = time.time()
        running.close()
        _wait(lambda: state.scheduler.running == 0, what="running request stopped")
        assert time.time() - t0 < 2
        m = _metrics(base)
        key = 'ditattn_requests_cancelled_total{kind="image",reason="client_disconnected",stage="%s"}'
        assert m[key % "queued"] == 3 and m[key % "running"] == 1
        _wait(
            lambda: (
                _metrics(base).get('ditattn_http_requests_total{endpoint="/v1/images/generations",status="499"}') == 4
            ),
            what="499s counted",
        )
        prompts = [p for batch, _ in runner.steps_run for p in batch]
        assert prompts == ["running-gone"] and runner.steps_run[0][1] < 100  # the queued ones never ran
        runner.steps = 0
        assert client(base).images.generate(prompt="still serving").data


def test_delete_cancels_a_queued_and_a_running_video_job(tmp_path):
    runner = ToyRunner(steps=500, step_s=0.02)
    with serve(runner, max_batch_size=1, output_dir=str(tmp_path)) as (base, app):
        c = client(base)
        a = c.videos.create(prompt="running", extra_body={"num_frames": 1})
        assert runner.stepping.wait(10)
        b = c.videos.create(prompt="queued", extra_body={"num_frames": 1})
        assert c.videos.retrieve(a.id).status == "in_progress" and c.videos.retrieve(b.id).status == "queued"
        assert c.videos.delete(b.id).deleted
        t0 = time.time()
        assert c.videos.delete(a.id).deleted
        _wait(lambda: app.state.server.scheduler.running == 0, what="the deleted job to stop")
        assert time.time() - t0 < 2
        assert runner.steps_run == [(["running"], runner.steps_run[0][1])] and runner.steps_run[0][1] < 100
        for vid in (a.id, b.id):
            with pytest.raises(openai.NotFoundError):
                c.videos.retrieve(vid)
        m = _metrics(base)
        for stage in ("queued", "running"):
            assert m[f'ditattn_requests_cancelled_total{{kind="video",reason="deleted",stage="{stage}"}}'] == 1
        assert app.state.server.videos.jobs.load() == []  # gone from the job store too


def test_limits_and_hostile_numbers_are_400s_naming_the_limit(caplog):
    runner = ToyRunner()
    with serve(runner, max_output_pixels=32 * 16 * 4, max_steps=4, max_n=2, max_frames=17) as (base, app):
        img, vid = base + "/v1/images/generations", base + "/v1/videos"
        cases = [
            (img, {"prompt": "x", "n": 3}, "--max-n"),
            (img, {"prompt": "x", "num_inference_steps": 5}, "--max-steps"),
            (img, {"prompt": "x", "num_inference_steps": 10**30}, "--max-steps"),
            (vid, {"prompt": "x", "num_frames": 9}, "--max-output-pixels"),
            (vid, {"prompt": "x", "num_frames": 10**30}, "--max-frames"),
            (vid, {"prompt": "x", "fps": 10**30}, "--max-fps"),
            (vid, {"prompt": "x", "seconds": 1e308}, "at most 3600"),
            (vid, {"prompt": "x", "seconds": "1e999"}, "at most 3600"),
            (vid, {"prompt": "x", "seconds": "nan"}, "at most 3600"),
            (vid, {"prompt": "x", "seconds": 3000}, "--max-frames"),
            (img, {"prompt": "x", "guidance_scale": 1e300}, "guidance_scale must be a number from 0 to 100"),
            (img, {"prompt": "x", "guidance_scale": -1}, "guidance_scale must be a number from 0 to 100"),
            (img, {"prompt": "x", "seed": -1}, "seed must be an integer from 0 to"),
            (img, {"prompt": "x", "seed": 2**63}, "seed must be an integer from 0 to"),
            (img, {"prompt": "x", "seed": 2**63 - 1, "n": 2}, "image i of n=2 uses seed + i"),
            (img, {"prompt": "x", "skip_softmax_params": {"threshold_scale_factor": 1e308}}, "less than or equal"),
            (
                img,
                {"prompt": "x", "skip_softmax_params": {"threshold_scale_factor": 1, "start_step": 10**20}},
                "less than or equal",
            ),
            (img, {"prompt": "x", "output_compression": 1000}, "less than or equal to 100"),
            (img, {"prompt": "x", "size": "99999x99999"}, "--max-side"),
            (img, {"prompt": "x", "model": "m" * 100000}, "at most 512 characters"),
            (img, {"prompt": "x", "model": "m" * 500}, "does not exist"),
        ]
        for url, body, words in cases:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="ditattn.server"):
                r = httpx.post(url, json=body)
            assert r.status_code in (400, 404), (body, r.status_code, r.text[:300])
            assert words in r.json()["error"]["message"], (body, r.json())
            lines = [rec for rec in caplog.records if rec.name == "ditattn.server"]
            assert len(lines) == (r.status_code == 400), (body, [rec.getMessage() for rec in lines])  # one per refusal
        for raw in (
            b'{"prompt": "x", "guidance_scale": NaN}',
            b'{"prompt": "x", "guidance_scale": Infinity}',
            b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}",
            b'{"prompt": "x", "seed": 1e999}',
        ):
            r = httpx.post(img, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw[:60], r.text[:300])
        m = _metrics(base)
        assert not any(k.startswith("ditattn_http_requests_total") and 'status="5' in k for k in m)
        assert runner.batches == []  # nothing ran


def test_bodies_are_bounded_before_parsing(caplog):
    with serve(ToyRunner(), max_body_bytes=4096, max_json_depth=8) as (base, app):
        img = base + "/v1/images/generations"
        r = httpx.post(img, content=b"[" * 4000, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "deeper than 8 levels" in r.json()["error"]["message"]
        deep = {"prompt": "x", "user": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}  # in a string
        assert httpx.post(img, json=deep).status_code == 200
        r = httpx.post(img, content=b"x" * 5000, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
        r = httpx.post(img, content=b"\xff\xfe{}", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        key = "p" + "[a]" * 20
        r = httpx.post(base + "/v1/videos", data={"prompt": "x", key: "1"})
        assert r.status_code == 400 and "deeper than 8 levels" in r.json()["error"]["message"]
        r = httpx.post(
            base + "/v1/videos",
            content=b"prompt=%ff%fe&x=1",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 400
        m = _metrics(base)
        assert not any('status="5' in k for k in m if k.startswith("ditattn_http_requests_total"))
    assert "Traceback" not in caplog.text


def test_internal_error_is_fixed_text_counted_and_logged_once(caplog):
    with serve(ToyRunner()) as (base, app):
        state = app.state.server

        def explode(model):
            raise RuntimeError("/secret/install/path/x.py blew up")

        state.check_model = explode
        with caplog.at_level(logging.ERROR, logger="ditattn.server"):
            r = httpx.post(base + "/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 500
        msg = r.json()["error"]["message"]
        assert msg.startswith("internal server error (reference ") and "secret" not in r.text
        ref = msg.split("reference ")[1].split(";")[0]
        records = [rec for rec in caplog.records if "internal error on POST" in rec.getMessage()]
        assert len(records) == 1 and ref in records[0].getMessage() and records[0].exc_info is not None
        assert _metrics(base)['ditattn_http_requests_total{endpoint="/v1/images/generations",status="500"}'] == 1


def test_health_reports_busy_then_degraded_past_the_timeout():
    gate = threading.Event()
    runner = ToyRunner(gate=gate)  # stuck inside one "step" until the gate opens
    with serve(runner, request_timeout_s=0.5) as (base, app):
        assert httpx.get(base + "/health").json()["status"] == "ok"
        c = client(base)
        c.videos.create(prompt="stuck", extra_body={"num_frames": 1})
        _wait(lambda: app.state.server.scheduler.running == 1, what="the job to start")
        h = httpx.get(base + "/health")
        assert h.status_code == 200 and h.json()["status"] == "busy" and h.json()["running_job_age_s"] >= 0
        time.sleep(0.7)
        h = httpx.get(base + "/health")
        body = h.json()
        assert h.status_code == 503 and body["status"] == "degraded" and body["running_job_overdue_s"] > 0
        assert body["running_job_age_s"] >= 0.5
        gate.set()
        _wait(lambda: httpx.get(base + "/health").json()["status"] == "ok", what="ok again")


def test_429_carries_retry_after_and_image_urls_use_the_public_url():
    gate = threading.Event()
    with serve(
        ToyRunner(gate=gate),
        max_batch_size=1,
        max_queue=1,
        public_url="https://img.example.com/ditattn",
        allowed_hosts=("*",),
    ) as (base, app):
        c = client(base)
        c.videos.create(prompt="running")
        _wait(lambda: app.state.server.scheduler.running == 1)
        c.videos.create(prompt="queued")
        r = httpx.post(base + "/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 600
        gate.set()
        _wait(lambda: app.state.server.scheduler.queue_depth == 0 and app.state.server.scheduler.running == 0)
        r = httpx.post(
            base + "/v1/images/generations",
            json={"prompt": "x", "response_format": "url"},
            headers={"Host": "evil.example.org"},
        )
        url = r.json()["data"][0]["url"]
        assert url.startswith("https://img.example.com/ditattn/v1/images/img_") and "evil" not in url
        assert httpx.get(base + url.removeprefix("https://img.example.com/ditattn")).status_code == 200


def test_drain_keeps_queued_video_jobs_and_a_restart_finishes_them(tmp_path, caplog):
    out = str(tmp_path / "serve")
    runner = ToyRunner(steps=40, step_s=0.02)  # 0.8 s per job
    with serve(runner, max_batch_size=1, output_dir=out) as (base, app):
        c = client(base)
        first = c.videos.create(prompt="first", extra_body={"num_frames": 1, "seed": 1})
        assert wait_video(c, first.id).status == "completed"
        first_bytes = c.videos.download_content(first.id).content
        runner.stepping.clear()
        running = c.videos.create(prompt="running", extra_body={"num_frames": 1, "seed": 2})
        assert runner.stepping.wait(10)
        queued = [
            c.videos.create(prompt=f"queued {i}", extra_body={"num_frames": 1, "seed": 10 + i}) for i in range(3)
        ]
        state = app.state.server
        drain = threading.Thread(target=state.drain, args=(10.0,))
        drain.start()
        _wait(lambda: state.draining)
        r = httpx.post(base + "/v1/videos", json={"prompt": "late"})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "shutting_down"
        assert httpx.post(base + "/v1/images/generations", json={"prompt": "late"}).status_code == 503
        assert httpx.get(base + "/v1/videos").status_code == 200  # reads keep working
        h = httpx.get(base + "/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        drain.join(30)
        assert c.videos.retrieve(running.id).status == "completed"  # finished within the drain time
        assert [c.videos.retrieve(v.id).status for v in queued] == ["queued"] * 3
    files_before = sorted(os.listdir(os.path.join(out, "videos")))
    runner2 = ToyRunner()
    with serve(runner2, output_dir=out) as (base, app):
        c = client(base)
        listed = {v.id: v for v in c.videos.list(limit=100)}
        assert set(listed) == {first.id, running.id, *(v.id for v in queued)}
        assert c.videos.download_content(first.id).content == first_bytes
        for v in queued:
            assert wait_video(c, v.id).status == "completed"
        assert sorted(p for batch in runner2.batches for p, _ in batch) == ["queued 0", "queued 1", "queued 2"]
        assert set(files_before) <= set(os.listdir(os.path.join(out, "videos")))  # nothing removed


def test_drain_timeout_stops_the_running_job_and_keeps_it_queued(tmp_path):
    out = str(tmp_path / "serve")
    runner = ToyRunner(steps=1000, step_s=0.02)  # 20 s: longer than the drain time
    with serve(runner, max_batch_size=1, output_dir=out) as (base, app):
        c = client(base)
        v = c.videos.create(prompt="long", extra_body={"num_frames": 1})
        assert runner.stepping.wait(10)
        t0 = time.time()
        app.state.server.drain(0.3)
        assert time.time() - t0 < 3
        assert c.videos.retrieve(v.id).status == "queued" and runner.steps_run[0][1] < 200
    runner2 = ToyRunner()
    with serve(runner2, output_dir=out) as (base, app):
        assert wait_video(client(base), v.id).status == "completed"


def test_output_dir_in_use_or_foreign_is_refused(tmp_path):
    out = tmp_path / "serve"
    with serve(ToyRunner(), output_dir=str(out)):
        with pytest.raises(AttentionConfigError, match="in use by another ditattn serve"):
            create_app(ToyRunner(), ServerConfig(output_dir=str(out)))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "jobs.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(AttentionConfigError, match="is not a ditattn job store"):
        create_app(ToyRunner(), ServerConfig(output_dir=str(bad)))
    assert (bad / "jobs.sqlite").read_bytes().startswith(b"this is not")  # left alone


def test_job_store_round_trip_order_and_refusals(tmp_path):
    import sqlite3

    from ditattn.server.jobstore import JobStore

    store = JobStore(str(tmp_path))
    for i in range(3):
        store.save({"id": f"v{i}", "status": "queued", "n": i})
    store.save({"id": "v0", "status": "completed", "n": 0})  # an update keeps its place
    store.delete("v1")
    assert [(r["id"], r["status"]) for r in store.load()] == [("v0", "completed"), ("v2", "queued")]
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.save({"id": "v3", "status": "queued"})
    db = sqlite3.connect(str(tmp_path / "jobs.sqlite"))
    db.execute("INSERT INTO videos (id, status, record) VALUES ('bad', 'queued', '{not json')")
    db.commit()
    db.close()
    store = JobStore(str(tmp_path))  # the lock was released by close()
    assert [r["id"] for r in store.load()] == ["v0", "v2"] and store.bad_rows == ["bad"]
    store.close()
    db = sqlite3.connect(str(tmp_path / "jobs.sqlite"))
    db.execute("PRAGMA user_version = 7")
    db.close()
    with pytest.raises(AttentionConfigError, match="job store version 7"):
        JobStore(str(tmp_path))
