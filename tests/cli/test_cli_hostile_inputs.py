"""Command-line input a careless user gives, refused with one ``error:`` line before any work instead of a
traceback, a crash or being silently ignored: environment variables that name an unusable cache folder or
absurd thread counts, output paths of compare / calibrate-cache that cannot be written, a setting given twice
(flags, k=v keys, YAML keys, two spellings of one key), empty values, unknown job stores, a guidance scale
that would do nothing; and the machine's own refusals (a full disk, no memory) as one line, not a
traceback."""

import errno
import json
import os
import time

import pytest
from test_reliability_cli import _error  # the one error-line check of ditattn ARGV

from ditattn.cli import main
from ditattn.errors import AttentionConfigError

TINY = ["--model-path", "ditattn:tiny-wan", "--height", "32", "--width", "48", "--num-frames", "5"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DITATTN_CACHE", str(tmp_path / "cache"))


def test_an_unusable_cache_folder_or_thread_count_is_one_line_naming_the_variable(capsys, tmp_path, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for where in (str(afile), str(afile / "sub"), "/proc/ditattn-cache"):
        monkeypatch.setenv("DITATTN_CACHE", where)
        line = _error(capsys, ["generate", "--prompt", "x", *TINY])
        assert "DITATTN_CACHE" in line and "cannot be created" in line, line
    monkeypatch.setenv("DITATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DITATTN_NUM_THREADS", "100000")
    line = _error(capsys, ["generate", "--prompt", "x", *TINY])
    assert "DITATTN_NUM_THREADS=100000" in line and "accepted: 1 to" in line, line


def test_compare_and_calibrate_cache_check_their_outputs_before_any_run(capsys, tmp_path):
    existing = tmp_path / "a-file"
    existing.write_text("x")
    for out in (str(existing), "/proc/ditattn-compare"):
        t0 = time.perf_counter()
        line = _error(capsys, ["compare", "--prompt", "x", *TINY, "--variant", "a=torch_sdpa", "--output-path", out])
        assert "choose another --output-path" in line and time.perf_counter() - t0 < 20, line
    for out in ("/proc/cal.json", str(existing / "cal.json")):
        line = _error(capsys, ["calibrate-cache", "--prompt", "x", *TINY, "--output", out])
        assert "choose another --output" in line, line
    one_step = ["--num-inference-steps", "1", "--output", str(tmp_path / "c.json")]
    line = _error(capsys, ["calibrate-cache", "--prompt", "x", *TINY, *one_step])
    assert "at least 2 denoising steps" in line and "record" not in line, line
    line = _error(capsys, ["calibrate-cache", "--prompt", " ", *TINY, "--output", str(tmp_path / "c.json")])
    assert "a --prompt is empty" in line, line


def test_a_calibration_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch):
    from ditattn.cache.calibration import write_calibration

    path = tmp_path / "cal.json"
    path.write_text('{"old": true}')

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        write_calibration({"format": "x", "values": [1.0] * 1000}, str(path))
    assert json.loads(path.read_text()) == {"old": True} and os.listdir(tmp_path) == ["cal.json"]


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["--seed", "1", "--seed", "2"], "--seed set one setting (seed) 2 times"),
        (["--no-save-output", "--save-output", "true"], "--no-save-output and --save-output"),
        (["--height", "32", "--height=64"], "--height set one setting (height) 2 times"),
        (["--attention-backend-config", "topk=0.5,topk=0.4", "--attention-backend", "sparge_attn"], "given twice"),
        (["--cache-backend", "teacache", "--cache-backend-config", "threshold=0.1,threshold=5"], "given twice"),
        (["--attention-backend", ""], "--attention-backend: expected a non-empty value"),
        (["--model-path", " "], "--model-path: expected a non-empty value"),
        (["--output-path", ""], "--output-path: expected a non-empty value"),
        (["--output-file", ""], "--output-file: expected a non-empty value"),
    ],
)
def test_a_setting_given_twice_or_empty_is_refused_not_silently_dropped(capsys, argv, expect):
    line = _error(capsys, ["generate", "--prompt", "x", *argv])
    assert expect in line, line


def test_yaml_configs_refuse_a_key_given_twice_or_in_two_spellings(capsys, tmp_path):
    for body, expect in (
        ("height: 128\nheight: 256\n", "key 'height' appears twice"),
        ("num-inference-steps: 2\nnum_inference_steps: 3\n", "num-inference-steps is given twice"),
    ):
        path = tmp_path / "c.yaml"
        path.write_text(body)
        line = _error(capsys, ["plan", "--config", str(path)])
        assert expect in line, line


def test_server_settings_that_would_be_ignored_are_refused(capsys):
    line = _error(capsys, ["serve", "--job-store", "bogus://x"])
    assert "expected sqlite or a postgresql://" in line, line
    line = _error(capsys, ["serve", "--api-key", ""])
    assert "--api-key: expected a non-empty value" in line, line


def test_ray_address_without_a_cluster_is_one_line(monkeypatch):
    ray = pytest.importorskip("ray")
    from ditattn.runconfig import RunConfig, ServerConfig
    from ditattn.server import rayserve

    def no_cluster(*a, **k):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to")

    monkeypatch.setattr(ray, "init", no_cluster)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    cfg = RunConfig(server=ServerConfig(ray_address="auto"))
    with pytest.raises(AttentionConfigError, match="no Ray cluster answers there.*ray start --head"):
        rayserve.deploy(cfg)


def test_a_second_guidance_scale_that_would_do_nothing_is_refused():
    from ditattn.pipelines.generation import resolve_inputs
    from ditattn.pipelines.latents import VideoGeometry

    kw = dict(
        seed=0,
        image=None,
        height=None,
        width=None,
        num_frames=None,
        num_inference_steps=None,
        guidance_scale_2=8.0,
        output_type="uint8",
        defaults={"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 5.0},
        geometry=VideoGeometry(z_dim=16),
        mode="t2v",
        two_experts=True,
    )
    resolve_inputs("x", guidance_scale=3.0, **kw)  # CFG on: the second scale applies
    with pytest.raises(AttentionConfigError, match="guidance_scale_2 8 would have no effect"):
        resolve_inputs("x", guidance_scale=1.0, **kw)


@pytest.mark.parametrize(
    "exc, rc, expect",
    [
        (OSError(errno.ENOSPC, "No space left on device", "/out/x.mp4"), 1, "No space left on device (/out/x.mp4)"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB"), 1, "out of memory"),
        (MemoryError(), 1, "out of memory"),
    ],
)
def test_the_machines_refusals_are_one_line_not_a_traceback(capsys, monkeypatch, exc, rc, expect):
    import ditattn.entrypoints.plan as plan

    def fail(cfg):
        raise exc

    monkeypatch.setattr(plan, "run", fail)
    line = _error(capsys, ["plan"], rc_expected=rc)
    assert expect in line, line


def test_a_bug_still_shows_its_traceback(monkeypatch):
    import ditattn.entrypoints.plan as plan

    def bug(cfg):
        raise RuntimeError("an internal invariant broke")

    monkeypatch.setattr(plan, "run", bug)
    with pytest.raises(RuntimeError, match="invariant"):
        main(["plan"])


def test_settings_that_would_do_nothing_are_said_not_dropped(capsys):
    argv = ["plan", "--guidance-scale", "1", "--negative-prompt", "blurry", "--offload-group-blocks", "4"]
    argv += ["--lora-fuse", "false", "--num-inference-steps", "4", "--skip-softmax-threshold-scale-factor", "1"]
    argv += ["--skip-softmax-start-step", "9"]
    try:
        main(argv)
    except SystemExit:
        pass
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]
    joined = "\n".join(warnings)
    assert "--negative-prompt only act(s) with classifier-free guidance" in joined, joined
    assert "--offload-group-blocks 4 acts only with --offload group" in joined, joined
    assert "--lora-fuse acts only with --lora-path" in joined, joined
    assert "--skip-softmax-start-step 9 is past the last of the run's 4 steps" in joined, joined
    from ditattn.runconfig import RunConfig, ServerConfig

    assert RunConfig(server=ServerConfig(job_lease_s=5.0)).ignored_settings() == [
        "--job-lease-s acts only with a shared --job-store postgresql://..."
    ]
    assert RunConfig(server=ServerConfig(replica_process=False)).ignored_settings() == [
        "--replica-process acts only on Ray Serve (--replicas N > 1, or --ray-address)"
    ]
    assert RunConfig(server=ServerConfig(replica_process=False, ray_address="auto")).ignored_settings() == []
    assert RunConfig().ignored_settings() == []


def test_the_environment_is_checked_at_the_start_of_every_command(capsys, monkeypatch):
    monkeypatch.setenv("DITATTN_SAGE_IMPL", "triton")
    assert "DITATTN_SAGE_IMPL is no longer read" in _error(capsys, ["plan"])
    monkeypatch.delenv("DITATTN_SAGE_IMPL")
    monkeypatch.setenv("DITATTN_DIST_TIMEOUT_S", "abc")  # a one-process run would never read it
    assert "DITATTN_DIST_TIMEOUT_S must be a positive number" in _error(capsys, ["backends"])


def test_messages_name_the_setting_at_fault(capsys, tmp_path):
    line = _error(capsys, ["generate", "--prompt", "x", "--num-frames", "5", "--output-path", str(tmp_path / "x.png")])
    assert line.startswith("error: --output-path 'x.png': a 5-frame video cannot be a .png"), line
    line = _error(capsys, ["generate", "--prompt", "x", "--cfg-interval", "-1:1"])
    assert "given as --cfg-interval=VALUE" in line, line
    line = _error(capsys, ["plan", "--attention-backend", "sparge_attn", "--attention-backend-config", "topk="])
    assert "invalid value '' for 'topk'" in line and "JSON" not in line, line


def test_a_prompt_cut_by_the_text_encoder_is_said(caplog):
    import torch

    from ditattn.pipelines.text import encode_prompts

    def tokenizer(texts, max_length):
        lens = [min(max_length, len(t.split())) for t in texts]
        mask = torch.tensor([[1] * n + [0] * (max_length - n) for n in lens])
        return mask.clone(), mask

    def encoder(ids, mask):
        return torch.zeros(ids.shape[0], ids.shape[1], 4)

    with caplog.at_level("WARNING", logger="ditattn.pipelines"):
        encode_prompts(tokenizer, encoder, ["short prompt", "word " * 600], 512, torch.device("cpu"))
    cut = [r.getMessage() for r in caplog.records if "is cut" in r.getMessage()]
    assert len(cut) == 1 and "3000 characters fills the text encoder's 512 tokens" in cut[0], cut


def test_more_settings_that_would_do_nothing_or_are_malformed(capsys):
    from ditattn.pipelines.output import default_file_name
    from ditattn.runconfig import ModelConfig, OutputConfig, RunConfig, SimulationConfig

    notes = RunConfig(
        model=ModelConfig(model_path="ditattn:shapes", local_files_only=True, device="cpu"),
        output=OutputConfig(save_output=False, overwrite=True),
        simulation=SimulationConfig(platform="cuda:90"),
    ).ignored_settings()
    joined = "\n".join(notes)
    assert "--overwrite acts only when the output is saved" in joined, joined
    assert "--local-files-only acts only for Hugging Face repo ids" in joined, joined
    assert "--device cpu is not used with --platform cuda:90" in joined, joined
    line = _error(capsys, ["serve", "--allowed-origins", "notanorigin"])
    assert "--allowed-origins: expected an origin" in line, line
    assert default_file_name("日本語 🦊 café", 0, 5) == "日本語_café_s0.mp4"
