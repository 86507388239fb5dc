"""A replica's pipeline in a child process (ditattn.server.pipehost.HostedRunner): the same metadata, request
checks, frames, progress and stops as the in-process runner; a dead pipeline process is reported, and the
pipeline process ends with the process that started it."""

import os
import pickle
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from ditattn.errors import AttentionConfigError, GenerationCancelled
from ditattn.runconfig import RunConfig
from ditattn.server.jobs import GenerationJob, JobCancelled
from ditattn.server.pipehost import HostedRunner
from ditattn.server.runner import build_runner

CFG = {"model-path": "ditattn:tiny-wan", "device": "cpu"}


@pytest.fixture(scope="module")
def runners():
    cfg = RunConfig.from_mapping(CFG)
    hosted = HostedRunner(cfg, threads=torch.get_num_threads())  # the same threads: the same float sums
    try:
        yield hosted, build_runner(cfg)
    finally:
        hosted.close()
    assert not hosted.alive()


def _jobs(runner, n=2, **kw):
    state = runner.prepare(None, None)
    fields = dict(kind="image", model="m", prompt="a red circle", width=32, height=32, num_frames=1)
    fields.update(num_inference_steps=2, guidance_scale=3.0)
    fields.update(kw)
    return [GenerationJob(**{**fields, "seed": 7 + i}, state=state) for i in range(n)]


def test_metadata_and_request_checks_match_the_in_process_runner(runners):
    hosted, local = runners
    assert hosted.pid != os.getpid() and hosted.alive() and hosted.exit_reason() is None
    assert (hosted.model_id, hosted.aliases, hosted.defaults) == (local.model_id, local.aliases, local.defaults)
    assert hosted.default_backends() == local.default_backends() and hosted.adapters() == local.adapters()
    assert hosted.default_sampling == local.default_sampling
    assert hosted.default_negative_prompt == local.default_negative_prompt
    state = hosted.prepare("torch_sdpa", None)
    assert state.override.value == "torch_sdpa" and state.override_table is None  # the tables stay in the child
    assert hosted.backends_for(state) == local.backends_for(local.prepare("torch_sdpa", None))
    for bad in ("no_such_backend", "sage3"):  # unknown, and known but refused here: the child's message
        with pytest.raises(AttentionConfigError) as theirs:
            hosted.prepare(bad, None)
        with pytest.raises(AttentionConfigError) as ours:
            local.prepare(bad, None)
        assert str(theirs.value) == str(ours.value)
    cache = hosted.prepare_cache("teacache", {"threshold": 0.2})
    assert cache.name == "teacache" and cache.config["threshold"] == 0.2
    with pytest.raises(AttentionConfigError):
        hosted.prepare_cache("no_such_cache", None)
    for call, arg in (("check_lora", {"missing": 1.0}), ("check_sampling", {"scheduler": "no-such-scheduler"})):
        with pytest.raises(Exception) as theirs:
            getattr(hosted, call)(arg)
        with pytest.raises(Exception) as ours:
            getattr(local, call)(arg)
        assert type(theirs.value) is type(ours.value) and str(theirs.value) == str(ours.value)


def test_a_batch_gives_the_in_process_frames_and_reports_progress(runners):
    hosted, local = runners
    seen = []
    jobs = _jobs(hosted, on_progress=lambda job, f: seen.append((job.seed, f)))
    theirs = hosted.run_batch(jobs)
    ours = local.run_batch(_jobs(local))
    assert len(theirs) == 2 and all(j.denoised for j in jobs)
    for a, b in zip(theirs, ours):
        assert a.frames.dtype == np.uint8 and a.frames.shape == b.frames.shape == (1, 1, 32, 32, 3)
        assert np.array_equal(a.frames, b.frames)
        assert a.attention_backends == b.attention_backends
    assert not np.array_equal(theirs[0].frames, theirs[1].frames)  # each job its own seed
    assert [f for s, f in seen if s == 7] == [0.5, 1.0] and [f for s, f in seen if s == 8] == [0.5, 1.0]
    cached = {}
    for name, r in (("hosted", hosted), ("local", local)):  # a step cache's run and its report
        (cached[name],) = r.run_batch(_jobs(r, n=1, num_inference_steps=6, cache=r.prepare_cache("teacache", None)))
    assert np.array_equal(cached["hosted"].frames, cached["local"].frames)
    assert cached["hosted"].cache == cached["local"].cache and cached["hosted"].cache is not None


def test_a_cancelled_or_timed_out_batch_stops_with_the_in_process_error(runners):
    hosted, _ = runners

    def cancel(job, fraction):  # every job of the batch cancelled after the first step
        for j in jobs:
            j.stop_reason = "deleted"

    jobs = _jobs(hosted, num_inference_steps=20, on_progress=cancel)  # stopped a step or two later
    with pytest.raises(GenerationCancelled) as exc:
        hosted.run_batch(jobs)
    assert exc.value.reason == "deleted"
    late = _jobs(hosted, n=1, deadline=time.monotonic() - 1)
    with pytest.raises(GenerationCancelled) as exc:
        hosted.run_batch(late)
    assert exc.value.reason == "timeout"
    assert hosted.run_batch(_jobs(hosted, n=1))[0].frames.shape == (1, 1, 32, 32, 3)  # and it serves on


def test_close_waits_for_a_running_batch_then_stops_the_pipeline_process():
    import threading

    cfg = RunConfig.from_mapping(CFG)
    r = HostedRunner(cfg, threads=1)
    started, results = threading.Event(), []
    jobs = _jobs(r, n=1, num_inference_steps=30, on_progress=lambda job, f: started.set())
    worker = threading.Thread(target=lambda: results.append(r.run_batch(jobs)))
    worker.start()
    assert started.wait(60)
    r.close(timeout_s=120)  # after the batch: its result arrives whole, then the process ends
    worker.join(10)
    assert len(results) == 1 and results[0][0].frames.shape == (1, 1, 32, 32, 3)
    assert not r.alive() and r.exit_reason().endswith("exited with code 0")


def test_stop_errors_keep_their_reason_through_pickle():
    for exc in (GenerationCancelled("timeout"), JobCancelled("client_disconnected")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and back.reason == exc.reason and str(back) == str(exc)


def test_a_dead_pipeline_process_is_reported_and_the_pipeline_ends_with_its_parent(tmp_path):
    """A parent process starts two hosted runners; it finds the one whose child was killed reported, then is
    itself killed: the other child exits on its own."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import signal, sys, time
            from ditattn.runconfig import RunConfig
            from ditattn.server.pipehost import HostedRunner, PipelineProcessDied
            cfg = RunConfig.from_mapping({"model-path": "ditattn:tiny-wan", "device": "cpu"})
            a, b = HostedRunner(cfg, threads=1), HostedRunner(cfg, threads=1)
            print(a.pid, b.pid, flush=True)
            sys.stdin.readline()  # the test killed a's pipeline process
            try:
                a.prepare(None, None)
                print("no error", flush=True)
            except PipelineProcessDied as exc:
                print("died:", exc, "|", a.exit_reason(), flush=True)
            time.sleep(600)
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ("src", os.environ.get("PYTHONPATH")) if p))
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        a_pid, b_pid = (int(x) for x in parent.stdout.readline().split())
        os.kill(a_pid, 9)
        time.sleep(0.5)
        parent.stdin.write("go\n")
        parent.stdin.flush()
        line = parent.stdout.readline()
        assert line.startswith("died: the pipeline process") and "exited with code -9" in line, line
        assert os.path.exists(f"/proc/{b_pid}")
        parent.kill()
        parent.wait(30)
        deadline = time.time() + 30
        while os.path.exists(f"/proc/{b_pid}") and _state(b_pid) != "Z" and time.time() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{b_pid}") or _state(b_pid) == "Z", "the pipeline outlived its parent"
    finally:
        parent.kill()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_image_to_video_with_a_lora_gives_the_in_process_frames(tmp_path):
    """The fields a batch carries to the pipeline process: a first-frame image and a LoRA's scale."""
    from PIL import Image
    from safetensors.torch import save_file

    from ditattn.runconfig import ModelConfig, SamplingConfig

    g = torch.Generator().manual_seed(0)
    lora = {
        f"transformer.blocks.{i}.attn1.{p}.lora_{ab}.weight": torch.randn(*shape, generator=g) * 0.1
        for i in range(2)
        for p in ("to_q", "to_v")
        for ab, shape in (("A", (4, 512)), ("B", (512, 4)))
    }
    save_file(lora, str(tmp_path / "style.safetensors"))
    cfg = RunConfig(
        model=ModelConfig(model_path="ditattn:tiny-wan-i2v", lora_path=(str(tmp_path / "style.safetensors"),)),
        sampling=SamplingConfig(num_inference_steps=2, num_frames=5),
    )
    hosted, local = HostedRunner(cfg, threads=torch.get_num_threads()), build_runner(cfg)
    try:
        assert hosted.adapters() == local.adapters() and len(hosted.adapters()) == 1
        name = hosted.adapters()[0]["name"]
        image = Image.new("RGB", (32, 32), (200, 30, 30))
        frames = []
        for r in (hosted, local):
            jobs = _jobs(r, n=1, kind="video", num_frames=5, image=image, lora=r.check_lora({name: 0.7}))
            frames.append(r.run_batch(jobs)[0].frames)
        assert frames[0].shape == (1, 5, 32, 32, 3) and np.array_equal(frames[0], frames[1])
    finally:
        hosted.close()
