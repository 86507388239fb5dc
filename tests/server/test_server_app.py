"""The HTTP server on a real uvicorn, driven by the official ``openai`` client, with a fast in-test
runner: a toy DiT made of real ``LocalAttention`` layers, so attention validation
(``prepare_request_override``) and the request scope are the real ones; only the generation is fake.
"""

import base64
import contextlib
import dataclasses
import functools
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from test_server_scheduler import denoise_steps
from torch import nn

import serving
from ditattn.attention.context import AttentionSettings, attention_settings, component_scope, forward_context
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.runconfig import ServerConfig
from ditattn.server.app import create_app
from ditattn.server.metrics import parse_text
from ditattn.server.runner import BaseRunner, ModelDefaults
from ditattn.server.scheduler import GenerationResult
from ditattn.server.state import BACKEND_HEADER

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks the videos API deprecated


class ToyDiT(nn.Module):
    def __init__(self):
        super().__init__()
        from ditattn import LocalAttention

        self.attn1 = LocalAttention(2, 32, role="self", prefix="blocks.0.attn1", layer_idx=0, dtype=torch.float32)
        self.attn2 = LocalAttention(2, 32, role="cross", prefix="blocks.0.attn2", layer_idx=0, dtype=torch.float32)

    def forward(self, x, ctx):
        return self.attn2(self.attn1(x, x, x), ctx, ctx)


class ToyRunner(BaseRunner):
    """Runs the toy DiT once per batch under the active request scope and returns frames whose
    pixel values encode the seed; ``gate`` holds batches, ``fail_prompt`` makes one request fail,
    ``steps`` x ``step_s`` seconds of "denoising" ask ``batch_stop_reason`` before each step (as the
    pipeline asks its ``should_stop``); ``steps_run`` records how many steps each batch ran."""

    def __init__(self, settings=None, gate=None, fail_prompt=None, delay=0.0, steps=0, step_s=0.0):
        settings = settings if settings is not None else AttentionSettings()
        with attention_settings(settings), component_scope("transformer"):
            self.dit = ToyDiT()
        super().__init__(
            "toy-dit",
            [self.dit],
            defaults=ModelDefaults(width=32, height=16, num_frames=5, num_inference_steps=2),
            settings=settings,
            dtype=torch.float32,
            aliases=("toy",),
        )
        self.gate, self.fail_prompt, self.delay = gate, fail_prompt, delay
        self.steps, self.step_s = steps, step_s
        self.batches = []
        self.steps_run = []
        self.stepping = threading.Event()

    def run_batch(self, jobs):
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.delay:
            time.sleep(self.delay)
        denoise_steps(
            jobs,
            self.steps,
            self.step_s,
            self.stepping,
            lambda done: self.steps_run.append(([j.prompt for j in jobs], done)),
        )
        if self.fail_prompt and any(j.prompt == self.fail_prompt for j in jobs):
            raise RuntimeError("the toy model cannot draw that")
        self.batches.append([(j.prompt, j.override) for j in jobs])
        x = torch.randn(1, 8, 2, 32)
        with forward_context(step=0, num_steps=1, video_shape=(1, 2, 4)):
            self.dit(x, torch.randn(1, 3, 2, 32))
        backends = self.active_backends()
        out = []
        for j in jobs:
            frames = np.zeros((j.n, j.num_frames, j.height, j.width, 3), np.uint8)
            for i in range(j.n):
                frames[i] = (j.seed + i) % 256
            out.append(GenerationResult(frames, backends))
        return out


@contextlib.contextmanager
def serve(runner, **cfg):
    """Run the app on uvicorn in a thread; yield (base_url, app)."""
    app = create_app(runner, ServerConfig(**{"batch_window_s": 0.0, **cfg}))
    with serving.serve_app(app, app.state.server.config) as base:
        yield base, app


def client(base, key="none"):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


wait_video = functools.partial(serving.wait_video, timeout=20, poll=0.02)  # the in-process toy server is quick


@pytest.fixture(scope="module")
def toy():
    runner = ToyRunner()
    with serve(runner, max_batch_size=4, max_queue=64) as (base, app):
        yield base, app, runner


# ------------------------------------------------------------------------------------------------


def test_images_b64_and_url(toy):
    base, app, _ = toy
    c = client(base)
    raw = c.images.with_raw_response.generate(
        prompt="a red fox", n=2, size="32x16", extra_body={"seed": 10, "attention_backend_override": "torch_sdpa"}
    )
    assert raw.headers[BACKEND_HEADER] == "torch_sdpa"
    r = raw.parse()
    assert r.attention_backends == ["torch_sdpa"] and r.size == "32x16" and len(r.data) == 2
    from PIL import Image

    for i, d in enumerate(r.data):
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json))))
        assert img.shape == (16, 32, 3) and (img == 10 + i).all()
    r = c.images.generate(prompt="x", response_format="url", extra_body={"seed": 3})
    assert r.attention_backends == ["torch_sdpa"]  # the server default of the toy DiT
    assert r.data[0].url.startswith("/v1/images/img_")  # relative: no --public-url, and never the Host header
    got = httpx.get(base + r.data[0].url)
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    assert got.headers[BACKEND_HEADER] == "torch_sdpa"
    assert np.asarray(Image.open(io.BytesIO(got.content))).shape == (16, 32, 3)  # default size 32x16


class TimedRunner(ToyRunner):
    """A toy whose batch takes ``delay`` seconds, of which its pipeline reports ``pipeline_s``."""

    def __init__(self, pipeline_s: float, **kw):
        super().__init__(**kw)
        self.pipeline_s = pipeline_s

    def run_batch(self, jobs):
        return [dataclasses.replace(r, seconds=self.pipeline_s) for r in super().run_batch(jobs)]


def _timings(header: str) -> dict:
    out = {}
    for part in header.split(","):
        name, dur = part.strip().split(";")
        assert dur.startswith("dur=")
        out[name] = float(dur[4:])
    return out


def test_image_answers_say_where_their_time_went():
    """Server-Timing (ms): the pipeline's own time, the rest of the wait for the result, the PNG encoding and
    the whole route; a client can subtract ``total`` from its latency to see what lay outside the server."""
    with serve(TimedRunner(pipeline_s=0.15, delay=0.25)) as (base, _):
        t0 = time.perf_counter()
        r = httpx.post(base + "/v1/images/generations", json={"prompt": "x", "n": 2}, timeout=30)
        latency_ms = 1e3 * (time.perf_counter() - t0)
    assert r.status_code == 200
    t = _timings(r.headers["server-timing"])
    assert list(t) == ["queue", "generate", "encode", "gc", "total"]
    assert 0.0 <= t["gc"] <= t["total"]
    assert t["generate"] == 150.0
    assert 100.0 - 10 <= t["queue"] < latency_ms  # the 0.25 s batch less the 0.15 s the pipeline reported
    assert 0.0 <= t["encode"] < t["total"] <= latency_ms
    assert t["total"] >= t["queue"] + t["generate"] + t["encode"] - 0.5  # rounding of each to 0.1 ms


def test_video_lifecycle_list_content_delete():
    gate = threading.Event()
    runner = ToyRunner(gate=gate)
    with serve(runner, max_batch_size=2) as (base, _):
        c = client(base)
        v = c.videos.create(
            prompt="a dog surfing",
            size="32x16",
            seconds="1",
            extra_body={"fps": 8, "seed": 4, "attention_backend_override": "torch_sdpa"},
        )
        assert v.status in ("queued", "in_progress") and v.object == "video"
        assert v.seconds == "1.125" and v.num_frames == 9 and v.size == "32x16"  # 1 s at 8 fps -> 1 + 4*2 frames
        with pytest.raises(openai.ConflictError, match="has no content"):
            c.videos.download_content(v.id)
        gate.set()
        v = wait_video(c, v.id)
        assert v.status == "completed" and v.progress == 100 and v.completed_at >= v.created_at
        assert v.attention_backends == ["torch_sdpa"]
        content = c.videos.download_content(v.id)
        assert content.response.headers[BACKEND_HEADER] == "torch_sdpa"
        assert content.response.headers["content-type"] == "video/mp4"
        data = content.content
        assert data[4:8] == b"ftyp"
        import imageio.v3 as iio

        frames = iio.imread(data, extension=".mp4")
        assert frames.shape == (9, 16, 32, 3)

        ids = [v.id] + [c.videos.create(prompt=f"p{i}", extra_body={"num_frames": 1}).id for i in range(4)]
        for vid in ids:
            assert wait_video(c, vid).status == "completed"
        page = c.videos.list(limit=2)
        assert [x.id for x in page.data] == ids[::-1][:2] and page.has_more
        assert [x.id for x in page.iter_pages().__next__().data] == ids[::-1][:2]
        assert [x.id for x in c.videos.list(limit=100, order="asc").data] == ids
        assert [x.id for x in c.videos.list(limit=2, after=ids[4]).data] == ids[::-1][1:3]
        assert [x.id for x in c.videos.list(limit=2)] == ids[::-1]  # auto-pagination walks every page
        d = c.videos.delete(ids[1])
        assert d.deleted and d.id == ids[1]
        with pytest.raises(openai.NotFoundError):
            c.videos.retrieve(ids[1])


def test_refusals_are_400_with_reason(toy):
    base, app, _ = toy
    c = client(base)
    cases = [
        ({"attention_backend_override": "nope"}, "unknown attention backend 'nope'"),
        ({"attention_backend_override": "sliding_tile_attn"}, "not a per-request drop-in"),
        ({"attention_backend_override": "fa"}, "would run torch_sdpa instead"),
        ({"attention_backend_override": "sage_attn_3"}, "cannot serve"),
        (
            {"skip_softmax_params": {"threshold_scale_factor": 500.0, "start_step": 2}},
            "skip_softmax_params is refused",
        ),
        ({"skip_softmax_params": {"start_step": 2}}, "threshold_scale_factor is required"),
        ({"skip_softmax_params": {"threshold_scale_factor": -1}}, "positive number"),
        ({"num_inference_steps": 0}, "num_inference_steps must be between 1 and"),
        ({"attention_backend_overide": "torch_sdpa"}, "unknown field 'attention_backend_overide'"),
    ]
    for extra, match in cases:
        for call in (
            lambda: c.images.generate(prompt="x", extra_body=extra),
            lambda: c.videos.create(prompt="x", extra_body=extra),
        ):
            with pytest.raises(openai.BadRequestError) as ei:
                call()
            assert ei.value.status_code == 400
            err = ei.value.body
            assert match in err["message"], (extra, err)
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    for kw, match in [
        (dict(size="33x16"), "multiples of 16"),
        (dict(size="16"), "WIDTHxHEIGHT"),
        (dict(size="4096x16"), "at most"),
        (dict(n=0), "n must be between 1 and 10"),
        (dict(n=11), "n must be between"),
        (dict(output_format="jpeg"), "accepted: png"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            c.images.generate(prompt="x", **kw)
    for extra, match in [
        ({"num_frames": 4}, "1 \\+ 4\\*k"),
        ({"num_frames": 1000}, "between 1 and"),
        ({"fps": 0}, "fps must be between"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            c.videos.create(prompt="x", extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="input_reference"):
        c.videos.create(prompt="x", input_reference=("ref.png", b"\x89PNG....", "image/png"))
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.images.generate(prompt="x", model="sora-2")
    # raw HTTP: malformed bodies are 400s too, and the server keeps serving
    r = httpx.post(base + "/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/images/generations", json=["x"])
    assert r.status_code == 400
    r = httpx.post(base + "/v1/images/generations", json={"prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert c.images.generate(prompt="still serving").attention_backends == ["torch_sdpa"]


@pytest.mark.parametrize(
    "settings,override,match",
    [
        (AttentionSettings(compiled=True), "torch_sdpa", "torch.compile"),
        (AttentionSettings(cuda_graphs=True), "torch_sdpa", "captured CUDA graphs"),
        (AttentionSettings(backend=B.VIDEO_SPARSE_ATTN), "torch_sdpa", "sparse backend video_sparse_attn"),
        (AttentionSettings(ring_degree=2), "sage_attn_3", "ring parallelism"),
    ],
)
def test_server_setting_refusals(settings, override, match):
    runner = ToyRunner(settings)
    with serve(runner) as (base, _):
        c = client(base)
        with pytest.raises(openai.BadRequestError, match=match):
            c.images.generate(prompt="x", extra_body={"attention_backend_override": override})
        with pytest.raises(openai.BadRequestError, match=match):
            c.videos.create(prompt="x", extra_body={"attention_backend_override": override})
        # the server default still serves
        r = c.images.generate(prompt="x")
        assert r.attention_backends == runner.default_backends()


def test_queue_full_429_then_recovers():
    gate = threading.Event()
    runner = ToyRunner(gate=gate)
    with serve(runner, max_batch_size=1, max_queue=2) as (base, app):
        c = client(base)
        first = c.videos.create(prompt="running")
        t0 = time.time()
        while app.state.server.scheduler.running == 0:
            assert time.time() - t0 < 10
            time.sleep(0.01)
        queued = [c.videos.create(prompt=f"q{i}") for i in range(2)]
        with pytest.raises(openai.RateLimitError) as ei:
            c.videos.create(prompt="one too many")
        assert ei.value.status_code == 429 and "queue is full" in ei.value.body["message"]
        with pytest.raises(openai.RateLimitError):
            c.images.generate(prompt="one too many")
        assert c.videos.retrieve(queued[0].id).status == "queued"
        gate.set()
        for v in [first] + queued:
            assert wait_video(c, v.id).status == "completed"
        assert c.images.generate(prompt="room again").data
        text = httpx.get(base + "/metrics").text
        assert parse_text(text)["ditattn_queue_full_total"] == 2


def test_auth_401():
    with serve(ToyRunner(), api_key="s3cret") as (base, _):
        with pytest.raises(openai.AuthenticationError) as ei:
            client(base, "wrong").images.generate(prompt="x")
        assert ei.value.status_code == 401 and ei.value.body["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            client(base, "wrong").models.list()
        r = httpx.get(base + "/v1/models")
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        assert httpx.get(base + "/metrics").status_code == 401
        assert httpx.get(base + "/health").status_code == 200  # liveness stays open
        ok = client(base, "s3cret")
        assert [m.id for m in ok.models.list()] == ["toy-dit"]
        assert ok.images.generate(prompt="x").attention_backends == ["torch_sdpa"]
        assert httpx.get(base + "/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_failing_request_fails_alone_and_timeouts():
    runner = ToyRunner(fail_prompt="boom")
    with serve(runner, max_batch_size=4, batch_window_s=0.2) as (base, _):
        c = client(base)
        with ThreadPoolExecutor(4) as ex:
            futs = {p: ex.submit(c.images.generate, prompt=p) for p in ("ok1", "boom", "ok2")}
            assert futs["ok1"].result().data and futs["ok2"].result().data
            with pytest.raises(openai.InternalServerError) as ei:
                futs["boom"].result()
            msg = ei.value.body["message"]  # fixed text and a reference: no exception text, no path
            assert msg.startswith("internal server error (reference ") and "cannot draw" not in msg
        v = c.videos.create(prompt="boom")
        v = wait_video(c, v.id)
        assert v.status == "failed" and v.error.code == "generation_failed"
        assert v.error.message == f"internal server error (reference {v.id[:12]}; the server log has the details)"
        with pytest.raises(openai.ConflictError, match="internal server error"):
            c.videos.download_content(v.id)
        assert c.images.generate(prompt="fine").data
    gate = threading.Event()
    with serve(ToyRunner(gate=gate), request_timeout_s=0.5) as (base, _):
        c = client(base)
        with pytest.raises(openai.APIStatusError) as ei:
            c.images.generate(prompt="slow")
        assert ei.value.status_code == 504 and "did not finish" in ei.value.body["message"]
        v = c.videos.create(prompt="never starts")  # queued behind the running one past its deadline
        time.sleep(0.6)
        gate.set()
        v = wait_video(c, v.id)
        assert v.status == "failed" and v.error.code == "timeout"


def test_not_found_and_ids_are_not_paths(toy):
    base, _, _ = toy
    c = client(base)
    for vid in ("video_" + "0" * 32, "../../etc/passwd", "video_..%2F..%2Fx"):
        with pytest.raises(openai.NotFoundError):
            c.videos.retrieve(vid)
        with pytest.raises(openai.NotFoundError):
            c.videos.download_content(vid)
    r = httpx.get(base + "/v1/images/img_zzz/content")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(base + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_concurrent_overrides_never_leak(toy):
    base, _, runner = toy
    c = client(base)
    rng = np.random.default_rng(0)
    choices = [None, "torch_sdpa", "nope", "fa"]
    picks = [choices[i] for i in rng.integers(0, len(choices), 40)]

    def one(i, name):
        extra = {"seed": i}
        if name is not None:
            extra["attention_backend_override"] = name
        try:
            raw = c.images.with_raw_response.generate(prompt=f"p{i}", extra_body=extra)
        except openai.BadRequestError as e:
            return ("400", e.body["message"])
        r = raw.parse()
        from PIL import Image

        px = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))))[0, 0, 0]
        return (r.attention_backend_override, r.attention_backends, raw.headers[BACKEND_HEADER], int(px))

    runner.batches.clear()
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(one, range(len(picks)), picks))
    for i, (name, out) in enumerate(zip(picks, outs)):
        if name in ("nope", "fa"):
            assert out[0] == "400" and ("unknown" in out[1] or "would run torch_sdpa instead" in out[1])
        else:
            assert out[0] == name and out[1] == ["torch_sdpa"] and out[2] == "torch_sdpa" and out[3] == i
    for batch in runner.batches:  # requests with different attention settings never shared a batch
        assert len({o for _, o in batch}) == 1


def test_metrics_count(toy):
    base, _, _ = toy
    before = parse_text(httpx.get(base + "/metrics").text)
    c = client(base)
    c.images.generate(prompt="m1", n=3)
    with pytest.raises(openai.BadRequestError):
        c.images.generate(prompt="m2", extra_body={"attention_backend_override": "nope"})
    after = parse_text(httpx.get(base + "/metrics").text)

    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    assert delta('ditattn_http_requests_total{endpoint="/v1/images/generations",status="200"}') == 1
    assert delta('ditattn_http_requests_total{endpoint="/v1/images/generations",status="400"}') == 1
    assert delta('ditattn_generations_total{attention_backend="torch_sdpa",kind="image",outcome="ok"}') == 1
    assert delta("ditattn_images_generated_total") == 3
    assert delta('ditattn_attention_refusals_total{field="attention_backend_override"}') == 1
    assert delta('ditattn_batches_total{outcome="ok"}') == 1
    assert after["ditattn_queue_depth"] == 0
    h = httpx.get(base + "/health").json()
    assert h["status"] == "ok" and h["attention_backends"] == ["torch_sdpa"]
