"""``ditattn serve`` end to end: the real CLI in a subprocess, the default built-in model (ditattn:shapes) on the CPU,
driven by the official ``openai`` client (images, video jobs, refusals, a concurrent mixed load,
429, 401, /metrics)."""

import base64
import importlib.util
import io
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from ditattn.server.metrics import parse_text, samples
from serving import serve_flags, serve_process, wait_for, wait_video

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the videos API deprecated

KEY = "test-key-123"
# sage_attn runs on the CPU through its in-tree reference once that backend module exists
SAGE_BUILT = importlib.util.find_spec("ditattn.attention.backends.sage") is not None


ARGS = serve_flags(
    api_key=KEY,
    max_batch_size=8,
    max_queue=8,
    height=16,
    width=16,
    num_inference_steps=2,
    guidance_scale=1.0,
    num_frames=5,
)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with serve_process(ARGS, log) as base:
        yield base, log


@pytest.fixture(scope="module", params=["one process", pytest.param("two Ray replicas", marks=pytest.mark.ray)])
def server(request, tmp_path_factory):
    """The same requests against ``ditattn serve`` and against two CPU replicas on Ray Serve behind one endpoint
    (a PostgreSQL job store and a shared output folder)."""
    if request.param == "one process":
        yield request.getfixturevalue("plain_server")
        return
    pytest.importorskip("ray", reason="ray is not installed (pip install 'ditattn[scale]')")
    pg = request.getfixturevalue("pg_server")
    url = pg.fresh_db("e2e" + uuid.uuid4().hex[:10])
    out = tmp_path_factory.mktemp("ray-out")
    log = tmp_path_factory.mktemp("ray-serve") / "server.log"
    args = [*ARGS, *serve_flags(replicas=2, job_store=url, output_dir=out, ray_address="local")]
    with serve_process(args, log, startup_s=400) as base:
        yield base, log


def client(base, key=KEY):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def png(b64):
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def test_images_and_video_end_to_end(server):
    base, _ = server
    c = client(base)
    assert [m.id for m in c.models.list()] == ["ditattn:shapes"]
    raw = c.images.with_raw_response.generate(
        model="ditattn:shapes",
        prompt="a red fox in the snow",
        n=2,
        size="32x16",
        extra_body={"seed": 7, "attention_backend_override": "torch_sdpa", "negative_prompt": "blurry"},
    )
    r = raw.parse()
    assert raw.headers["x-ditattn-attention-backend"] == "torch_sdpa"
    assert r.attention_backends == ["torch_sdpa"] and r.size == "32x16" and len(r.data) == 2
    a, b = png(r.data[0].b64_json), png(r.data[1].b64_json)
    assert a.shape == b.shape == (16, 32, 3) and a.dtype == np.uint8
    assert not np.array_equal(a, b)  # seeds 7 and 8
    again = c.images.generate(
        prompt="a red fox in the snow", size="32x16", extra_body={"seed": 7, "negative_prompt": "blurry"}
    )
    assert again.attention_backends == ["torch_sdpa"]  # the server default on this CPU

    v = c.videos.create(
        model="ditattn:shapes",
        prompt="waves at dusk",
        size="32x32",
        extra_body={"num_frames": 5, "fps": 8, "seed": 1, "attention_backend_override": "torch_sdpa"},
    )
    assert v.status in ("queued", "in_progress") and v.seconds == "0.625"
    v = wait_video(c, v.id)
    assert v.status == "completed" and v.progress == 100 and v.attention_backends == ["torch_sdpa"]
    content = c.videos.download_content(v.id)
    assert content.response.headers["x-ditattn-attention-backend"] == "torch_sdpa"
    import imageio.v3 as iio

    frames = iio.imread(content.content, extension=".mp4")
    assert frames.shape == (5, 32, 32, 3)
    assert v.id in [x.id for x in c.videos.list()]


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"attention_backend_override": "no_such_kernel"}, "unknown attention backend 'no_such_kernel'"),
        ({"attention_backend_override": "sliding_tile_attn"}, "not a per-request drop-in"),
        ({"attention_backend_override": "video_sparse_attn"}, "not a per-request drop-in"),
        ({"attention_backend_override": "fa"}, "would run torch_sdpa instead"),
        (
            {"skip_softmax_params": {"threshold_scale_factor": 500.0, "start_step": 1}},
            "skip_softmax_params is refused",
        ),
        ({"num_inference_steps": 10_000}, "num_inference_steps must be between"),
    ],
)
def test_refusals(server, extra, match):
    base, log = server
    c = client(base)
    for call in (
        lambda: c.images.generate(prompt="x", extra_body=extra),
        lambda: c.videos.create(prompt="x", extra_body=extra),
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            call()
        assert match in ei.value.body["message"] and ei.value.status_code == 400
    # the server logs the same reason (Ray forwards a replica's lines to its driver within ~1 s)
    wait_for(lambda: match in log.read_text(), timeout=20, what=f"{match!r} in the server log", poll=0.2)


def test_bad_sizes(server):
    base, _ = server
    c = client(base)
    for size, match in (
        ("20x16", "multiples of 16"),
        ("big", "WIDTHxHEIGHT"),
        ("16x4096", "at most 2048 pixels per side"),
    ):
        with pytest.raises(openai.BadRequestError, match=match):
            c.images.generate(prompt="x", size=size)
        with pytest.raises(openai.BadRequestError, match=match):
            c.videos.create(prompt="x", size=size)
    with pytest.raises(openai.BadRequestError, match="1 \\+ 4\\*k"):
        c.videos.create(prompt="x", extra_body={"num_frames": 6})


def test_concurrent_mixed_load(server, request):
    """64 requests, 8 at a time, random valid and invalid overrides: no crash, each valid response
    reports exactly the backend it asked for, each invalid one is a 400 naming the reason; on Ray both
    replicas ran some of them."""
    base, _ = server
    c = client(base)
    on_ray = request.node.callspec.params["server"] == "two Ray replicas"
    if on_ray:
        time.sleep(1.5)  # replicas publish their metrics at each heartbeat (at most 1 s apart): earlier tests' too
    before = samples(httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)
    rng = np.random.default_rng(1234)
    choices = [None, "torch_sdpa", "sage_attn", "TORCH_SDPA", "fa", "sliding_tile_attn", "bogus", "sage_attn_3"]
    picks = [choices[i] for i in rng.integers(0, len(choices), 64)]

    def expected(name):
        if name is None:
            return ["torch_sdpa"]
        if name.lower() == "torch_sdpa":
            return ["torch_sdpa"]
        if name == "sage_attn" and SAGE_BUILT:
            return ["sage_attn"]
        return None

    reasons = {
        "fa": "would run torch_sdpa instead",
        "sliding_tile_attn": "not a per-request drop-in",
        "bogus": "unknown attention backend",
        "sage_attn_3": "cannot serve",
        "sage_attn": "no implementation of attention backend 'sage_attn'",
    }

    def one(i):
        name = picks[i]
        extra = {"seed": i}
        if name is not None:
            extra["attention_backend_override"] = name
        try:
            if i % 8 == 7:  # some video jobs in the mix
                v = c.videos.create(prompt=f"clip {i}", extra_body=extra)
                v = wait_video(c, v.id)
                assert v.status == "completed", v
                return ("ok", v.attention_backends)
            raw = c.images.with_raw_response.generate(prompt=f"image {i}", extra_body=extra)
            r = raw.parse()
            assert raw.headers["x-ditattn-attention-backend"] == ",".join(r.attention_backends)
            assert png(r.data[0].b64_json).shape == (16, 16, 3)
            return ("ok", r.attention_backends)
        except openai.BadRequestError as e:
            return ("400", e.body["message"])

    t0 = time.time()
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(64)))
    elapsed = time.time() - t0
    n_ok = n_bad = 0
    for name, (kind, detail) in zip(picks, outs):
        want = expected(name)
        if want is None:
            assert kind == "400", (name, detail)
            assert reasons[name] in detail, (name, detail)
            n_bad += 1
        else:
            assert kind == "ok" and detail == want, (name, kind, detail)
            n_ok += 1
    assert n_ok > 10 and n_bad > 10

    def delta(name, **labels):
        def total(rows):
            return sum(v for n, lab, v in rows if n == name and all(lab.get(k) == x for k, x in labels.items()))

        return total(after) - total(before)

    def published() -> bool:  # Ray replicas publish their metrics at each heartbeat: wait for the last ones
        nonlocal after
        after = samples(httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)
        ok = delta("ditattn_generations_total", kind="image", outcome="ok")
        return ok + delta("ditattn_generations_total", kind="video", outcome="ok") >= n_ok

    after: list = []
    wait_for(published, timeout=15, what="the generations in /metrics", poll=0.5)

    assert delta("ditattn_attention_refusals_total") == n_bad
    assert (
        delta("ditattn_generations_total", kind="image", outcome="ok")
        + delta("ditattn_generations_total", kind="video", outcome="ok")
        == n_ok
    )
    assert delta("ditattn_generations_total", kind="image", outcome="error") == 0
    assert delta("ditattn_batch_size_sum") == n_ok  # every valid request ran in exactly one batch
    assert delta("ditattn_batch_size_count") <= n_ok
    if on_ray:
        ran = {lab.get("replica") for n, lab, v in after if n == "ditattn_generations_total" and v > 0}
        assert len(ran) == 2 and None not in ran, ran
    print(f"mixed load: {n_ok} ok, {n_bad} refused in {elapsed:.1f}s, {delta('ditattn_batch_size_count'):.0f} batches")


def test_queue_full_429_and_auth_401(plain_server):
    """The single process's queue (the deployment's, at Ray's proxy: test_server_ray.py)."""
    base, _ = plain_server
    c = client(base)
    auth = {"Authorization": f"Bearer {KEY}"}
    # a slow job occupies the worker, so the burst below meets a full queue (8 waiting)
    blocker = c.videos.create(
        prompt="slow", size="32x32", extra_body={"num_frames": 9, "num_inference_steps": 4, "guidance_scale": 5.0}
    )
    t0 = time.time()
    while parse_text(httpx.get(base + "/metrics", headers=auth).text)["ditattn_running_samples"] == 0:
        assert time.time() - t0 < 60
        time.sleep(0.02)
    with ThreadPoolExecutor(24) as ex:
        futs = [ex.submit(c.images.generate, prompt=f"burst {i}", extra_body={"seed": i}) for i in range(24)]
        outcomes = []
        for f in futs:
            try:
                f.result()
                outcomes.append(200)
            except openai.RateLimitError as e:
                assert "queue is full" in e.body["message"]
                outcomes.append(429)
    print("burst:", outcomes.count(200), "ok,", outcomes.count(429), "x 429")
    assert outcomes.count(429) >= 1 and outcomes.count(200) >= 8 and set(outcomes) == {200, 429}
    assert wait_video(c, blocker.id).status == "completed"
    assert c.images.generate(prompt="after the burst").data  # still serving
    with pytest.raises(openai.AuthenticationError):
        client(base, key="wrong").images.generate(prompt="x")
    r = httpx.post(base + "/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    m = parse_text(httpx.get(base + "/metrics", headers=auth).text)
    assert m["ditattn_queue_full_total"] == outcomes.count(429)
    assert m['ditattn_http_requests_total{endpoint="/v1/images/generations",status="401"}'] >= 2
