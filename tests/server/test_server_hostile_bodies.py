"""Request bodies a careless or hostile client sends, on a real uvicorn with the tiny model's runner:
request configs never make the server read its own files (nor quote them back), configs sent as text,
forms or objects mean the same, error messages are bounded whatever the input, bodies in other
content types or encodings are refused with the reason, HEAD works where GET does and a 405 names the
allowed methods, and Retry-After follows the work queued, not the last batch's length."""

import threading

import httpx
import pytest
from test_server_app import ToyRunner, client, serve

import serving
from ditattn.runconfig import ModelConfig, RunConfig
from ditattn.server.protocol import MAX_MESSAGE
from ditattn.server.runner import build_runner

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SMALL = {"prompt": "a fox", "size": "48x32", "num_inference_steps": 4}
IMAGES = "/v1/images/generations"


@pytest.fixture(scope="module")
def server():
    cfg = RunConfig(model=ModelConfig(model_path="ditattn:tiny-wan", device="cpu", dtype="float32"))
    with serve(build_runner(cfg), max_batch_size=2) as (base, app):
        yield base


def _post(base, body, **kw):
    return httpx.post(base + IMAGES, json=body, timeout=120, **kw)


@pytest.fixture()
def secret_files(tmp_path):
    """A YAML and a JSON file whose contents must never reach a client."""
    y = tmp_path / "secret.yaml"
    y.write_text("format: TOPSECRET-abc123\npassword: hunter2\n")
    j = tmp_path / "secret.json"
    j.write_text('{"format": "TOPSECRET-abc123", "threshold": 0.1}')
    return y, j


def test_request_configs_never_read_server_files(server, secret_files, tmp_path):
    y, j = secret_files
    for config in (str(y), str(j), str(tmp_path / "missing.yaml"), "/etc", str(tmp_path)):
        r = _post(server, {**SMALL, "cache_backend": "teacache", "cache_backend_config": config})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "not inline" in msg and "TOPSECRET" not in msg and "hunter2" not in msg, msg
        assert "No such file" not in msg and "directory" not in msg, msg  # nothing about what exists
    for cal in (str(y), str(j), "/etc/shadow", str(tmp_path / "missing.json")):
        for config in ({"calibration": cal}, f"calibration={cal}"):
            r = _post(server, {**SMALL, "cache_backend": "teacache", "cache_backend_config": config})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "cache_backend_config" and "not read from requests" in err["message"], err
            assert "TOPSECRET" not in err["message"] and "format" not in err["message"], err
    # still serving, and an inline config works
    r = _post(server, {**SMALL, "cache_backend": "teacache", "cache_backend_config": "threshold=0.1"})
    assert r.status_code == 200, r.text


def test_a_cache_config_means_the_same_as_text_an_object_or_a_form(server):
    text = "threshold=1e6,start_step=1,end_step=-1,max_consecutive_skips=2,taylorseer=false"  # > 64 characters
    assert len(text) > 64
    obj = {"threshold": "1e6", "start_step": "1", "end_step": -1, "max_consecutive_skips": "2", "taylorseer": "false"}
    traces = []
    for config in (text, obj):
        r = _post(server, {**SMALL, "cache_backend": "teacache", "cache_backend_config": config, "seed": 3})
        assert r.status_code == 200, r.text
        traces.append(r.json()["cache"]["trace"])
    form = {"prompt": "a fox", "size": "48x32", "num_inference_steps": "4", "seed": "3", "cache_backend": "teacache"}
    form.update({f"cache_backend_config[{k}]": str(v) for k, v in obj.items()})
    r = httpx.post(server + IMAGES, data=form, timeout=120)
    assert r.status_code == 200, r.text
    traces.append(r.json()["cache"]["trace"])
    assert traces[0] == traces[1] == traces[2] and "R" in traces[0], traces
    # limits are stated in the unit that applies
    r = _post(server, {**SMALL, "cache_backend": "teacache", "cache_backend_config": "threshold=0.1," * 200})
    assert r.status_code == 400 and "at most 2000 characters" in r.json()["error"]["message"], r.text
    # a start_step past the request's steps would silently cache nothing
    r = _post(server, {**SMALL, "cache_backend": "teacache", "cache_backend_config": {"start_step": 10**12}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "cache_backend_config" and "no step" in err["message"], err


def test_error_messages_are_bounded_whatever_the_input(server):
    huge_key = "k" * 200_000
    for body in (
        {**SMALL, "cache_backend": "teacache", "cache_backend_config": {huge_key: 1}},
        {**SMALL, "cache_backend": "teacache", "cache_backend_config": f"{huge_key}=1"[:1999]},
        {**SMALL, "seed": int("9" * 4000)},
        {**SMALL, "n": int("9" * 4000)},
    ):
        r = _post(server, body)
        assert r.status_code == 400, r.text[:300]
        assert len(r.json()["error"]["message"]) <= MAX_MESSAGE and len(r.content) < 4 * MAX_MESSAGE, len(r.content)
    r = httpx.get(server + "/v1/models/" + "b" * 60_000)
    assert r.status_code in (404, 414) and len(r.content) < 4 * MAX_MESSAGE
    r = _post(server, {**SMALL, "prompt": "x" * 20_001})
    assert r.status_code == 400 and "20001 characters" in r.json()["error"]["message"], r.text[:300]


def test_a_field_of_several_types_names_the_field_and_every_accepted_type(server):
    r = _post(server, {**SMALL, "timesteps": {"a": 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "timesteps", err
    assert "expected a list or a string" in err["message"], err


def test_bodies_in_other_types_or_encodings_are_refused_with_the_reason(server):
    js = b'{"prompt": "a fox", "size": "48x32", "num_inference_steps": 2}'
    # curl -d sends form-urlencoded unless told otherwise
    r = httpx.post(server + IMAGES, content=js, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"], r.text
    for ctype in ("text/plain", "application/xml", "image/png"):
        r = httpx.post(server + IMAGES, content=js, headers={"Content-Type": ctype})
        assert r.status_code == 415 and "accepted: application/json" in r.json()["error"]["message"], (ctype, r.text)
    r = httpx.post(server + IMAGES, content=js, headers={"Content-Type": "application/json; charset=latin-1"})
    assert r.status_code == 415 and "charset" in r.json()["error"]["message"], r.text
    # form text that is not UTF-8 would be generated garbled
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(server + IMAGES, content=b"prompt=%ff&size=48x32", headers=form)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text
    boundary = "b0undary"
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n'.encode() + b"\xff\xfe h\x00"
    body = part + f"\r\n--{boundary}--\r\n".encode()
    ctype = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    r = httpx.post(server + IMAGES, content=body, headers=ctype)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"], r.text
    # a multipart body cut before its closing boundary is truncated, not a body without fields
    part = f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na fox\r\n'.encode()
    r = httpx.post(server + IMAGES, content=part, headers=ctype)
    assert r.status_code == 400 and "closing boundary" in r.json()["error"]["message"], r.text
    # JSON without a Content-Type is still read as JSON (many scripts send none)
    r = httpx.post(server + IMAGES, content=js, headers={"Content-Type": ""})
    assert r.status_code == 200, r.text


def test_head_works_where_get_does_and_405_names_the_allowed_methods(server):
    for path in ("/health", "/metrics", "/v1/models"):
        get, head = httpx.get(server + path), httpx.head(server + path)
        assert head.status_code == get.status_code == 200 and head.content == b"", (path, head.status_code)
    r = httpx.put(server + "/health")
    assert r.status_code == 405 and "GET" in r.headers.get("allow", ""), r.headers
    assert "allowed methods" in r.json()["error"]["message"]
    r = httpx.request("DELETE", server + IMAGES)
    assert r.status_code == 405 and r.headers.get("allow") == "POST", r.headers


def test_retry_after_follows_the_work_queued_not_the_last_batch():
    runner = ToyRunner(steps=10, step_s=0.03)  # about 0.3 s per job, whatever its size
    with serve(runner, max_batch_size=1, max_queue=4) as (base, app):
        c = client(base)
        for _ in range(3):  # short image batches first: the mean batch time is ~0.3 s
            assert httpx.post(base + IMAGES, json={"prompt": "warm"}, timeout=30).status_code == 200
        gate = threading.Event()
        runner.gate = gate
        c.videos.create(prompt="running", extra_body={"num_frames": 9})
        serving.wait_for(lambda: app.state.server.scheduler.running == 1, what="running")
        for i in range(4):  # each 9 frames: 9x the work of an image
            c.videos.create(prompt=f"queued {i}", extra_body={"num_frames": 9})
        r = httpx.post(base + IMAGES, json={"prompt": "refused"})
        gate.set()
        assert r.status_code == 429, r.text
        wait = int(r.headers["retry-after"])
        per_image = app.state.server._seconds_per_work * 32 * 16 * 2  # the toy default: 32x16, 2 steps
        assert wait >= 4 * 9 * per_image * 0.9, (wait, per_image)  # the queue's work, not 5 mean batches
