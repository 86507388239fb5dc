"""Dynamic batching scheduler, request parsing and metrics of the server (no HTTP, no model)."""

import threading
import time

import numpy as np
import pytest

import serving
from ditattn.attention.context import RequestState, SkipSoftmaxParams, current_request
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.errors import GenerationCancelled
from ditattn.server.metrics import Metrics, parse_text
from ditattn.server.protocol import (
    ImageGenerationRequest,
    RequestError,
    VideoCreateRequest,
    parse_size,
    unflatten_form,
    validation_error_to_request_error,
)
from ditattn.server.scheduler import (
    GenerationJob,
    GenerationResult,
    JobCancelled,
    JobTimeout,
    QueueFull,
    Scheduler,
    SchedulerStopped,
    batch_stop_reason,
)


class RecordingRunner:
    """Records each batch (job ids and the request state seen inside the scope); can be gated."""

    def __init__(self, gate=None, fail_prompt=None, delay=0.0):
        self.batches = []
        self.states = []
        self.gate = gate
        self.fail_prompt = fail_prompt
        self.delay = delay
        self.calls = 0

    def run_batch(self, jobs):
        self.calls += 1
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        self.batches.append([j.id for j in jobs])
        self.states.append(current_request())
        if self.fail_prompt is not None and any(j.prompt == self.fail_prompt for j in jobs):
            raise RuntimeError(f"cannot generate {self.fail_prompt!r}")
        req = current_request()
        backend = req.override.value if req is not None and req.override is not None else "default"
        return [GenerationResult(np.full((j.n, 1, 2, 2, 3), j.seed % 256, np.uint8), [backend]) for j in jobs]


def job(i, override=None, size=16, steps=2, ss=None, prompt=None, **kw):
    state = RequestState(override=B.from_name(override) if override else None, skip_softmax=ss)
    return GenerationJob(
        kind="image",
        prompt=prompt or f"p{i}",
        width=size,
        height=size,
        num_frames=1,
        num_inference_steps=steps,
        guidance_scale=5.0,
        seed=i,
        id=f"j{i}",
        override=override,
        skip_softmax=ss,
        state=state,
        **kw,
    )


def test_batches_group_by_signature_up_to_max_batch_size():
    gate = threading.Event()
    runner = RecordingRunner(gate=gate)
    sch = Scheduler(runner, max_batch_size=3, max_queue=100, batch_window_s=0.0)
    blocker = job(0)
    sch.submit(blocker)
    sch.start()
    while runner.calls == 0:  # the blocker is running; queue the rest behind it
        time.sleep(0.005)
    jobs = [
        job(1),
        job(2, "torch_sdpa"),
        job(3),
        job(4, "sage_attn"),
        job(5, "torch_sdpa"),
        job(6),
        job(7),
        job(8, size=32),
        job(9, steps=3),
        job(10, ss=SkipSoftmaxParams(5.0, 1)),
        job(11, ss=SkipSoftmaxParams(5.0, 2)),
        job(12),
    ]
    futs = [sch.submit(j) for j in jobs]
    gate.set()
    results = [f.result(10) for f in futs]
    sch.stop()
    assert runner.batches == [
        ["j0"],
        ["j1", "j3", "j6"],  # oldest first, same signature, max 3
        ["j2", "j5"],  # torch_sdpa override never mixes with the default
        ["j4"],  # sage_attn alone, served when it is the oldest
        ["j7", "j12"],
        ["j8"],
        ["j9"],
        ["j10"],
        ["j11"],  # size / steps / skip-softmax params split batches
    ]
    by_id = {j.id: r for j, r in zip(jobs, results)}
    assert by_id["j2"].attention_backends == ["torch_sdpa"] and by_id["j4"].attention_backends == ["sage_attn"]
    assert by_id["j1"].attention_backends == ["default"]
    # each batch ran inside its head job's request scope; nothing leaks out of the worker
    for ids, st in zip(runner.batches, runner.states):
        assert st is next(j for j in [blocker] + jobs if j.id == ids[0]).state
    assert current_request() is None


def test_signature_covers_every_batching_field():
    base = job(1)
    assert base.signature() == job(2).signature()  # prompt and seed may differ within a batch
    variants = [
        job(1, size=32),
        job(1, steps=3),
        job(1, "torch_sdpa"),
        job(1, ss=SkipSoftmaxParams(1.0, 0)),
        job(1, model="other"),
    ]
    other_guidance = job(1)
    other_guidance.guidance_scale = 1.0
    other_frames = job(1)
    other_frames.num_frames = 5
    other_neg = job(1, negative_prompt="blurry")
    for v in variants + [other_guidance, other_frames, other_neg]:
        assert v.signature() != base.signature()


def test_cached_jobs_never_share_a_batch():
    """A step cache decides each step on the whole batch's change, so two requests with the same cache
    settings batched together got each other's decisions (and one trace for both): a cached job runs alone."""
    from ditattn.cache.config import resolve_cache

    setting = resolve_cache("first_block_cache", "threshold=0.5", model="ditattn:shapes", num_blocks=6)
    a, b = job(1, cache=setting), job(2, cache=setting)
    assert a.signature() != b.signature()
    assert a.signature() != job(1).signature()
    assert job(1).signature() == job(2).signature()  # without a cache they still batch

    gate = threading.Event()
    runner = RecordingRunner(gate=gate)
    sch = Scheduler(runner, max_batch_size=4, max_queue=8, batch_window_s=0.0).start()
    try:
        futs = [sch.submit(job(0))]  # holds the worker while the others queue up
        while runner.calls == 0:
            time.sleep(0.01)
        futs += [sch.submit(j) for j in (job(3, cache=setting), job(4, cache=setting), job(5), job(6))]
        gate.set()
        for f in futs:
            f.result(timeout=30)
    finally:
        sch.stop()
    assert sorted(map(sorted, runner.batches)) == [["j0"], ["j3"], ["j4"], ["j5", "j6"]]


def test_queue_full_raises_and_recovers():
    gate = threading.Event()
    runner = RecordingRunner(gate=gate)
    sch = Scheduler(runner, max_batch_size=1, max_queue=2, batch_window_s=0.0).start()
    first = sch.submit(job(0))
    while runner.calls == 0:
        time.sleep(0.005)
    a, b = sch.submit(job(1)), sch.submit(job(2))
    with pytest.raises(QueueFull, match="queue is full"):
        sch.submit(job(3))
    gate.set()
    for f in (first, a, b):
        f.result(10)
    sch.submit(job(4)).result(10)  # room again
    sch.stop()


def test_failing_request_fails_alone():
    runner = RecordingRunner(fail_prompt="boom")
    gate = threading.Event()
    runner.gate = gate
    sch = Scheduler(runner, max_batch_size=4, max_queue=10, batch_window_s=0.0)
    jobs = [job(1), job(2, prompt="boom"), job(3)]
    futs = [sch.submit(j) for j in jobs]
    gate.set()
    sch.start()
    assert futs[0].result(10).frames.shape == (1, 1, 2, 2, 3)
    assert futs[2].result(10).frames[0, 0, 0, 0, 0] == 3
    with pytest.raises(RuntimeError, match="cannot generate 'boom'"):
        futs[1].result(10)
    # the batch failed once, then each request ran alone
    assert runner.batches == [["j1", "j2", "j3"], ["j1"], ["j2"], ["j3"]]
    sch.submit(job(4)).result(10)  # still serving
    sch.stop()


def test_deadline_in_queue_and_cancel():
    gate = threading.Event()
    runner = RecordingRunner(gate=gate)
    sch = Scheduler(runner, max_batch_size=1, max_queue=10, batch_window_s=0.0).start()
    sch.submit(job(0))
    while runner.calls == 0:
        time.sleep(0.005)
    late = job(1, deadline=time.monotonic() + 0.05)
    gone = job(2)
    f_late, f_gone = sch.submit(late), sch.submit(gone)
    assert sch.cancel(gone, "client_disconnected") == "queued"
    with pytest.raises(JobCancelled, match="client disconnected"):
        f_gone.result(0)
    assert sch.cancel(gone, "client_disconnected") is None  # already ended
    time.sleep(0.1)
    gate.set()
    with pytest.raises(JobTimeout):
        f_late.result(10)
    sch.submit(job(3)).result(10)
    assert ["j1"] not in runner.batches and ["j2"] not in runner.batches
    sch.stop()


class SteppingRunner:
    """Runs ``steps`` steps of ``step_s`` seconds per batch, asking ``batch_stop_reason`` before each
    one (what PipelineRunner hands the pipeline as ``should_stop``); records the steps it ran."""

    def __init__(self, steps=50, step_s=0.02):
        self.steps, self.step_s = steps, step_s
        self.ran = []  # (job ids, steps run)
        self.started = threading.Event()

    def run_batch(self, jobs):
        denoise_steps(
            jobs, self.steps, self.step_s, self.started, lambda done: self.ran.append(([j.id for j in jobs], done))
        )
        return [GenerationResult(np.zeros((j.n, 1, 2, 2, 3), np.uint8), ["x"]) for j in jobs]


def denoise_steps(jobs, steps, step_s, stepping: threading.Event, record) -> None:
    """``steps`` sleeps of ``step_s`` seconds, asking ``batch_stop_reason(jobs)`` before each one as
    the pipeline asks its ``should_stop`` (GenerationCancelled with the reason); ``stepping`` is set
    once a step runs; ``record(steps_done)`` is called however it ends."""
    done = 0
    try:
        for _ in range(steps):
            reason = batch_stop_reason(jobs)
            if reason:
                raise GenerationCancelled(reason)
            stepping.set()
            time.sleep(step_s)
            done += 1
    finally:
        record(done)


def _wait(cond, timeout=10):
    serving.wait_for(cond, timeout, poll=0.005)


def test_cancel_running_job_stops_at_next_step_and_reports_it():
    runner = SteppingRunner()
    cancels = []
    sch = Scheduler(
        runner,
        max_batch_size=2,
        batch_window_s=0.0,
        on_cancel=lambda job, reason, stage: cancels.append((job.id, reason, stage)),
    ).start()
    a = job(1)
    fa = sch.submit(a)
    assert runner.started.wait(10)
    t0 = time.time()
    assert sch.cancel(a, "deleted") == "running"
    with pytest.raises(JobCancelled, match="deleted"):
        fa.result(10)
    assert time.time() - t0 < 1.0
    assert runner.ran[0][1] < 10 and cancels == [("j1", "deleted", "running")]
    # a batch of two: cancelling one lets the other finish; the cancelled one loses its result
    runner.started.clear()
    b, c = job(2), job(3)
    fb, fc = sch.submit(b), sch.submit(c)
    assert runner.started.wait(10)
    _wait(lambda: sch.running == 2)
    assert sch.cancel(b, "client_disconnected") == "running"
    assert fc.result(10).frames.shape == (1, 1, 2, 2, 3)
    with pytest.raises(JobCancelled):
        fb.result(0)
    assert runner.ran[1] == (["j2", "j3"], 50)
    assert cancels[-1] == ("j2", "client_disconnected", "running")
    sch.stop()


def test_running_job_past_its_deadline_is_stopped():
    runner = SteppingRunner(steps=500)
    cancels = []
    sch = Scheduler(
        runner,
        max_batch_size=1,
        batch_window_s=0.0,
        on_cancel=lambda job, reason, stage: cancels.append((reason, stage)),
    ).start()
    t0 = time.time()
    with pytest.raises(JobTimeout, match="request timeout"):
        sch.submit(job(1, deadline=time.monotonic() + 0.2)).result(10)
    assert time.time() - t0 < 1.5 and runner.ran[0][1] < 100 and cancels == [("timeout", "running")]
    # run_timeout_s: the deadline restarts when the job starts (a video job's run is bounded on its own)
    v = job(2, deadline=time.monotonic() + 0.05, run_timeout_s=0.4)
    with pytest.raises(JobTimeout):
        sch.submit(v).result(10)
    assert runner.ran[-1][0] == ["j2"] and 10 <= runner.ran[-1][1] < 100 and cancels[-1] == ("timeout", "running")
    # a queued job past its deadline never runs
    runner.started.clear()
    sch.submit(job(3))
    assert runner.started.wait(10)
    late = sch.submit(job(4, deadline=time.monotonic() + 0.01, run_timeout_s=10))
    (running_job,), _ = sch.running_jobs()
    assert running_job.id == "j3" and sch.cancel(running_job, "deleted") == "running"
    with pytest.raises(JobTimeout):
        late.result(10)
    assert cancels[-1] == ("timeout", "queued")
    assert all(ids != ["j4"] for ids, _ in runner.ran)
    sch.stop()


def test_pause_keeps_chosen_queued_jobs_and_stop_running():
    runner = SteppingRunner(steps=1000)
    sch = Scheduler(runner, max_batch_size=1, batch_window_s=0.0).start()
    running = sch.submit(job(0))
    assert runner.started.wait(10)
    keep, drop = job(1), job(2, prompt="drop me")
    fk, fd = sch.submit(keep), sch.submit(drop)
    dropped = sch.pause(keep=lambda j: j.prompt != "drop me")
    assert dropped == [drop] and sch.pending() == [keep]
    with pytest.raises(SchedulerStopped):
        fd.result(0)
    with pytest.raises(SchedulerStopped):
        sch.submit(job(3))
    assert not sch.wait_idle(0.1)
    assert sch.stop_running("shutdown") == 1
    assert sch.wait_idle(5)
    with pytest.raises(SchedulerStopped):
        running.result(0)
    assert sch.pending() == [keep] and not fk.done()  # paused: nothing new starts
    sch.stop()
    with pytest.raises(SchedulerStopped):
        fk.result(0)


def test_batch_window_collects_concurrent_arrivals():
    runner = RecordingRunner()
    sch = Scheduler(runner, max_batch_size=4, max_queue=10, batch_window_s=0.3).start()
    futs = [sch.submit(job(1))]
    time.sleep(0.05)
    futs += [sch.submit(job(i)) for i in (2, 3, 4)]
    for f in futs:
        f.result(10)
    sch.stop()
    assert runner.batches == [["j1", "j2", "j3", "j4"]]


def test_wrong_result_count_is_a_failure():
    class Bad:
        def run_batch(self, jobs):
            return []

    sch = Scheduler(Bad(), max_batch_size=2, batch_window_s=0.0).start()
    with pytest.raises(RuntimeError, match="results for a batch of 1"):
        sch.submit(job(1)).result(10)
    sch.stop()


# ------------------------------------------------------------------------------------------------
# protocol


def test_parse_size():
    assert parse_size("832x480") == (832, 480)
    assert parse_size(" 64X32 ") == (64, 32)
    assert parse_size("auto") is None and parse_size(None) is None
    for bad in ("832", "axb", "0x16", "16x-16", "16*16", "1e3x16"):
        with pytest.raises(RequestError, match="expected 'WIDTHxHEIGHT'|must be positive"):
            parse_size(bad)


def test_unflatten_form_matches_openai_client_encoding():
    import openai

    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:1/v1")
    body = {
        "prompt": "a fox",
        "seconds": "4",
        "skip_softmax_params": {"threshold_scale_factor": 500.0, "start_step": 14},
        "tags": [1, 2],
        "seed": 7,
        "flag": True,
    }
    items = []
    for k, v in client._serialize_multipartform(body).items():
        items += [(k, x) for x in v] if isinstance(v, list) else [(k, v)]
    out = unflatten_form(items)
    assert out == {
        "prompt": "a fox",
        "seconds": "4",
        "seed": "7",
        "flag": "true",
        "tags": ["1", "2"],
        "skip_softmax_params": {"threshold_scale_factor": "500.0", "start_step": "14"},
    }
    req = VideoCreateRequest.model_validate({k: v for k, v in out.items() if k not in ("tags", "flag")})
    assert req.skip_softmax_params.as_dict() == {"threshold_scale_factor": 500.0, "start_step": 14}
    assert req.seed == 7 and req.seconds_value() == 4.0
    for bad in ([("a[b", "1")], [("a", "1"), ("a", "2")], [("a", "1"), ("a[b]", "2")]):
        with pytest.raises(RequestError):
            unflatten_form(bad)


def test_request_models_reject_unknown_and_bad_fields():
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as ei:
        ImageGenerationRequest.model_validate({"prompt": "x", "attention_backend_overide": "fa"})
    err = validation_error_to_request_error(ei.value, ImageGenerationRequest)
    assert err.status == 400 and "unknown field 'attention_backend_overide'" in err.message
    assert "attention_backend_override" in err.message  # lists what is accepted
    with pytest.raises(ValidationError) as ei:
        ImageGenerationRequest.model_validate({"prompt": "x", "n": "two"})
    assert "'n'" in validation_error_to_request_error(ei.value, ImageGenerationRequest).message
    with pytest.raises(ValidationError) as ei:
        ImageGenerationRequest.model_validate({"n": 1})
    assert (
        "missing required field 'prompt'"
        in validation_error_to_request_error(ei.value, ImageGenerationRequest).message
    )
    with pytest.raises(ValidationError):
        ImageGenerationRequest.model_validate({"prompt": "x", "skip_softmax_params": {"threshold": 1}})
    r = ImageGenerationRequest.model_validate({"prompt": "x", "stream": True})
    with pytest.raises(RequestError, match="stream"):
        r.check_unsupported()
    r = ImageGenerationRequest.model_validate({"prompt": "x", "output_format": "jpeg"})
    with pytest.raises(RequestError, match="accepted: png"):
        r.check_unsupported()
    for s in ("0", "-1", "abc", "inf"):
        with pytest.raises(RequestError, match="seconds"):
            VideoCreateRequest.model_validate({"prompt": "x", "seconds": s}).seconds_value()


# ------------------------------------------------------------------------------------------------
# metrics


def test_metrics_exposition():
    depth = [3]
    m = Metrics(queue_depth=lambda: depth[0])
    m.requests.labels(endpoint="/v1/videos", status="200").inc()
    m.requests.labels(endpoint="/v1/videos", status="200").inc()
    m.generations.labels(kind="image", outcome="ok", attention_backend='weird"name').inc()
    m.batch_size.observe(3)
    m.batch_size.observe(9)
    text = m.render().decode()
    assert "# TYPE ditattn_http_requests_total counter" in text
    assert "# TYPE ditattn_batch_size histogram" in text
    vals = parse_text(text)
    assert vals['ditattn_http_requests_total{endpoint="/v1/videos",status="200"}'] == 2
    assert vals['ditattn_generations_total{attention_backend="weird\\"name",kind="image",outcome="ok"}'] == 1
    assert vals['ditattn_batch_size_bucket{le="4.0"}'] == 1
    assert vals['ditattn_batch_size_bucket{le="+Inf"}'] == 2
    assert vals["ditattn_batch_size_sum"] == 12 and vals["ditattn_batch_size_count"] == 2
    assert vals["ditattn_queue_depth"] == 3 and vals["ditattn_queue_full_total"] == 0
    depth[0] = 5  # gauges are read at scrape time
    assert parse_text(m.render())["ditattn_queue_depth"] == 5
    with pytest.raises(ValueError):
        m.requests.labels(endpoint="x")
