"""``ditattn generate`` end to end: MP4 / PNG output, the timing line, errors, the diffusers passthrough."""

import os
import sys

import numpy as np
import pytest

import serving
from conftest import OMP_THREADS_SET_HERE
from ditattn.cli import main

SMALL = ["--height", "32", "--width", "48", "--num-inference-steps", "2"]


def run(capsys, *argv):
    capsys.readouterr()
    rc = main(["generate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _env():
    return serving.subprocess_env()


def read_mp4(path):
    import imageio.v2 as imageio

    reader = imageio.get_reader(path, format="FFMPEG")
    try:
        meta = reader.get_meta_data()
        frames = np.stack(list(reader.iter_data()))
    finally:
        reader.close()
    return frames, meta


def test_generate_writes_a_playable_mp4(capsys, tmp_path):
    rc, out, err = run(
        capsys,
        "--prompt",
        "a red fox in the snow",
        "--num-frames",
        "5",
        "--seed",
        "4",
        "--output-path",
        str(tmp_path),
        *SMALL,
    )
    assert rc == 0, err
    lines = out.strip().splitlines()
    path = str(tmp_path / "a_red_fox_in_the_snow_s4.mp4")
    assert lines[0] == f"saved: {path}"
    assert lines[-1].startswith("done in ") and "48x32, 5 frames, 2 steps" in lines[-1]
    assert "denoise" in lines[-1] and "DiT attention: torch_sdpa" in lines[-1]
    assert "denoising" in err and "2/2" in err  # the progress bar (stderr)
    frames, meta = read_mp4(path)
    assert frames.shape == (5, 32, 48, 3) and frames.dtype == np.uint8
    assert meta["codec"] == "h264" and meta["fps"] == 16 and meta["pix_fmt"].startswith("yuv420p")
    assert frames.std() > 1  # not a blank clip


def test_generate_single_frame_writes_png(capsys, tmp_path):
    from PIL import Image

    rc, out, err = run(
        capsys,
        "--prompt",
        "sunset",
        "--num-frames",
        "1",
        "--output-path",
        str(tmp_path),
        "--output-file",
        "still",
        *SMALL,
    )
    assert rc == 0, err
    path = tmp_path / "still.png"
    assert out.strip().splitlines()[0] == f"saved: {path}"
    img = Image.open(path)
    assert img.size == (48, 32) and img.mode == "RGB"


def test_generate_request_override_and_no_save(capsys, tmp_path):
    rc, out, err = run(
        capsys,
        "--prompt",
        "x",
        "--num-frames",
        "1",
        "--attention-backend-override",
        "torch_sdpa",
        "--no-save-output",
        "--output-path",
        str(tmp_path),
        *SMALL,
    )
    assert rc == 0, err
    assert os.listdir(tmp_path) == []
    last = out.strip().splitlines()[-1]
    assert "(not saved)" in last and "DiT attention: torch_sdpa" in last


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--output-file", "clip.png", "--num-frames", "5"], "cannot be a .png"),
        (["--output-file", "clip.gif"], "unsupported extension"),
        (["--height", "40"], "multiples of 16"),
        (["--num-frames", "6"], "1 + 4k"),
        (["--attention-backend-override", "video_sparse_attn"], "not a per-request drop-in"),
        (["--component-attention-backends", "vae=torch_sdpa"], "fixed attention"),
        (["--model-path", "/nonexistent/wan"], "not a local directory"),
        (["--num-gpus", "2", "--ulysses-degree", "4"], "does not divide --num-gpus 2"),
        (
            ["--num-gpus", "2", "--ulysses-degree", "1", "--ring-degree", "1"],
            "1 × --ring-degree 1 = 1 does not equal --num-gpus 2",
        ),
        (["--num-gpus", "3", "--model-path", "ditattn:tiny-wan"], "accepted Ulysses degrees for this model: 1, 2, 4"),
        (["--num-gpus", "3"], "accepted Ulysses degrees for this model: 1, 2 "),  # ditattn:shapes has 2 heads
        (["--skip-softmax-start-step", "2"], "needs --skip-softmax-threshold-scale-factor"),
        (["--enable-cuda-graph"], "--enable-cuda-graph needs a CUDA device"),
        (["--num-frames", "1", "--fps", "8"], "--fps applies to videos only"),
        (["--enable-torch-compile", "--attention-backend-override", "torch_sdpa"], "torch.compile"),
        (["--attention-backend", "sol_attn"], "accepts bfloat16) (the compute dtype is chosen with --dtype)"),
    ],
)
def test_generate_user_errors(capsys, tmp_path, argv, message):
    rc, out, err = run(capsys, "--prompt", "x", "--output-path", str(tmp_path), *argv)
    assert rc == 2
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_diffusers_passthrough_matches_native(capsys, tmp_path):
    from PIL import Image

    common = ["--prompt", "a lighthouse", "--num-frames", "1", "--seed", "2", "--output-path", str(tmp_path), *SMALL]
    rc, out, err = run(capsys, *common, "--output-file", "native.png")
    assert rc == 0, err
    rc, out, err = run(
        capsys, *common, "--output-file", "stock.png", "--backend", "diffusers", "--attention-backend", "native"
    )
    assert rc == 0, err
    assert out.strip().splitlines()[-1].endswith("DiT attention: diffusers:native")
    a = np.asarray(Image.open(tmp_path / "native.png"), dtype=np.int16)
    b = np.asarray(Image.open(tmp_path / "stock.png"), dtype=np.int16)
    assert np.abs(a - b).max() <= 1


def test_diffusers_passthrough_rejections(capsys, tmp_path):
    for argv, flag in (
        (["--enable-torch-compile"], "--enable-torch-compile"),
        (["--num-gpus", "2"], "sequence parallelism"),
    ):
        rc, out, err = run(capsys, "--prompt", "x", "--backend", "diffusers", *argv)
        assert rc == 2 and err.startswith(f"error: {flag}") and "native pipeline only" in err
    rc, out, err = run(
        capsys,
        "--prompt",
        "x",
        "--backend",
        "diffusers",
        "--attention-backend",
        "not_a_backend",
        "--output-path",
        str(tmp_path),
        *SMALL,
    )
    assert rc == 2 and "neither a ditattn backend nor one of diffusers'" in err and "flash" in err
    assert "torch_sdpa" in err  # ditattn's names too
    rc, out, err = run(
        capsys,
        "--prompt",
        "x",
        "--backend",
        "diffusers",
        "--attention-backend",
        "native",
        "--component-attention-backends",
        "transformer=torch_sdpa",
    )
    assert rc == 2 and "needs a ditattn --attention-backend; 'native' is diffusers' own" in err


def _plan_with_a_bad_component_backend(folder):
    return dict(
        args=[sys.executable, "-m", "ditattn", "plan", "--component-attention-backends", "text_encoder=fa"],
        env=_env(),
        timeout=300,
    )


@pytest.mark.background.with_args(_plan_with_a_bad_component_backend)
def test_cli_error_exit_code_in_a_subprocess(background_run):
    proc, _ = background_run
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "bias" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def _new_user_run(folder):
    env = _env()
    if OMP_THREADS_SET_HERE:  # not conftest's one-thread setting: a new user's run picks its CPU threads itself
        del env["OMP_NUM_THREADS"]
    return dict(
        args=[sys.executable, "-m", "ditattn", "generate", "--prompt", "a blue square moving up"],
        env=env,
        cwd=folder,
        timeout=600,
    )


@pytest.mark.background.with_args(_new_user_run)
def test_default_command_as_a_new_user(background_run):
    """The README's main command: no flags but --prompt, the default model (the trained ditattn:shapes),
    a video with a progress bar and the timing summary as the last line, showing what was asked for."""
    proc, tmp_path = background_run  # run in an empty folder of its own
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "saved: outputs/a_blue_square_moving_up_s0.mp4"
    assert lines[-1].startswith("done in ") and "128x128, 17 frames, 20 steps" in lines[-1]
    assert "20/20" in proc.stderr
    frames, _ = read_mp4(str(tmp_path / "outputs" / "a_blue_square_moving_up_s0.mp4"))
    assert frames.shape == (17, 128, 128, 3)
    from ditattn.train.judge import judge

    verdict = judge(frames, "blue", "moving up")  # through H.264, as a user sees it
    assert verdict.color_ok and verdict.motion_ok, verdict


def test_generate_rejects_non_finite_guidance_and_reports_refusal_once(capsys, caplog, tmp_path):
    with pytest.raises(SystemExit) as ei:  # argparse-level error
        run(capsys, "--prompt", "x", "--guidance-scale", "nan")
    assert ei.value.code == 2 and "expected a finite number" in capsys.readouterr().err
    import logging

    with caplog.at_level(logging.WARNING):
        rc, out, err = run(
            capsys, "--prompt", "x", "--output-path", str(tmp_path), *SMALL, "--attention-backend-override", "nope"
        )
    assert rc == 2 and err.startswith("error: attention_backend_override: unknown attention backend 'nope'")
    assert not any("request refused" in r.getMessage() for r in caplog.records)  # the error line says it once
    from ditattn.entrypoints.cli import _drop_refusal_log

    assert _drop_refusal_log not in logging.getLogger("ditattn.attention").filters  # not left behind


def test_generate_config_file_garbage_is_one_line(capsys, tmp_path):
    bad = tmp_path / "c.yml"
    bad.write_text("x: {\n  - ]\n")
    rc, out, err = run(capsys, "--prompt", "x", "--attention-backend-config", str(bad))
    assert rc == 2 and err.startswith("error: cannot parse attention backend config file") and err.count("\n") == 1


def test_negative_seed_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", "--seed", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "expected an integer from 0 to" in err and len(err.strip().splitlines()) == 1


def _usage(capsys, *argv):
    """``main(argv)`` as a user sees it: (exit status, stderr), whether argparse or the command refused."""
    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def test_output_path_naming_a_file_and_no_overwrite(capsys, tmp_path):
    from PIL import Image

    target = tmp_path / "sub" / "still.png"
    common = ["--prompt", "a lighthouse", "--num-frames", "1", *SMALL]
    rc, out, err = run(capsys, *common, "--output-path", str(target))
    assert rc == 0, err
    assert (
        out.splitlines()[0] == f"saved: {target}"
        and target.is_file()
        and not (tmp_path / "sub" / "still.png").is_dir()
    )
    first = target.read_bytes()
    rc, out, err = run(capsys, *common, "--output-path", str(target), "--seed", "5")  # same name: kept, suffix added
    assert rc == 0 and out.splitlines()[0] == f"saved: {tmp_path / 'sub' / 'still_1.png'}"
    assert target.read_bytes() == first
    rc, out, err = run(capsys, *common, "--output-path", str(target), "--seed", "5", "--overwrite")
    assert rc == 0 and out.splitlines()[0] == f"saved: {target}" and target.read_bytes() != first
    assert np.asarray(Image.open(target)).shape == (32, 48, 3)
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["still.png", "still_1.png"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-frames", "1", "--output-file", "x.mp4"], "one frame is written as a .png image"),
        (["--output-path", "{tmp}/clip.mp4", "--output-file", "y.mp4"], "names a file and --output-file"),
        (["--output-path", "{tmp}/afile/clip.mp4"], "is a file, not a folder"),
        (["--output-path", "{tmp}/adir.mp4"], "is an existing folder"),
        (
            ["--output-path", "{tmp}/clip.gif"],
            "unsupported extension '.gif'; accepted: .mp4 (clips), .png (one frame)",
        ),
        (["--output-path", "/proc/clip.mp4"], "does not take new files"),
        (["--output-path", "/sys/ditattn/out"], "does not take new files"),
    ],
)
def test_output_refused_before_generation(capsys, tmp_path, monkeypatch, argv, message):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir.mp4").mkdir()
    import ditattn.pipelines.wan as wan

    monkeypatch.setattr(wan.WanPipelineNative, "from_config", classmethod(lambda cls, cfg: pytest.fail("loaded")))
    rc, err = _usage(capsys, "generate", "--prompt", "x", *[a.format(tmp=tmp_path) for a in argv], *SMALL)
    assert rc == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "clip.gif").exists()  # no folder made for it


def test_output_folder_with_a_dot_in_its_name_is_still_a_folder(tmp_path):
    from ditattn.pipelines.output import split_output_target

    (tmp_path / "run.v2").mkdir()
    assert split_output_target(str(tmp_path / "run.v2"), None) == (str(tmp_path / "run.v2"), None)
    assert split_output_target(str(tmp_path / "clip.MP4"), None) == (str(tmp_path), "clip.MP4")


def test_read_only_output_folder_is_refused_by_a_write_probe(tmp_path, monkeypatch):
    """The permission bits can say yes (root) where the file system says no: a file is created and
    removed in the target folder first."""
    import tempfile

    from ditattn.errors import AttentionConfigError
    from ditattn.pipelines.output import check_output_target

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(AttentionConfigError, match="does not take new files .Read-only file system"):
        check_output_target(str(tmp_path / "clip.mp4"))
    monkeypatch.undo()
    check_output_target(str(tmp_path / "clip.mp4"))
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_missing_video_writer_is_refused_before_generation(capsys, tmp_path, monkeypatch):
    import imageio_ffmpeg

    import ditattn.pipelines.wan as wan

    def no_ffmpeg():
        raise RuntimeError("No ffmpeg exe could be found. Install ffmpeg on your system, or set IMAGEIO_FFMPEG_EXE")

    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", no_ffmpeg)
    monkeypatch.setattr(wan.WanPipelineNative, "from_config", classmethod(lambda cls, cfg: pytest.fail("loaded")))
    rc, err = _usage(capsys, "generate", "--prompt", "x", "--output-path", str(tmp_path), *SMALL)
    assert rc == 2 and err.startswith("error: cannot write MP4 video: no ffmpeg") and "imageio-ffmpeg" in err


@pytest.mark.parametrize(
    "content, message",
    [
        (b"num-inference-steps: \xff\xfe\n", "not UTF-8 text"),
        (b"num-inference-steps: " + b"9" * 5000 + b"\n", "a number has too many digits"),
        (b"guidance-scale: " + b"9" * 400 + b"\n", "guidance-scale: expected a finite number from 0 to 100"),
        (b"attention-backend-config: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested too deeply"),
        (b"seed: " + b"9" * 30 + b"\n", "seed: expected an integer from 0 to"),
        (b'attention-backend-config: \'{"sparsity": ' + b"9" * 5000 + b"}'\n", "a number has too many digits"),
    ],
)
def test_config_file_read_errors_are_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    rc, err = _usage(capsys, "generate", "--prompt", "x", "--config", str(path), "--no-save-output", *SMALL)
    assert rc == 2 and err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and len(err) < 400 and "Traceback" not in err


def test_mask_strategy_file_errors_are_one_line(capsys, tmp_path):
    for body, message in (
        (b"\xff\xfe{}", "not UTF-8 text"),
        (b"[" * 5000, "nested too deeply"),
        (b'{"0_0_0": [' + b"9" * 5000 + b", 1, 1]}", "too many digits"),
    ):
        strat = tmp_path / "mask.json"
        strat.write_bytes(body)
        rc, err = _usage(
            capsys,
            "generate",
            "--prompt",
            "x",
            "--no-save-output",
            *SMALL,
            "--num-frames",
            "5",
            "--attention-backend",
            "sliding_tile_attn",
            "--attention-backend-config",
            f"mask_strategy_file_path={strat}",
        )
        last = err.strip().splitlines()[-1]  # read at the first denoising step: after the progress bar
        assert rc == 2 and last.startswith("error: sliding_tile_attn: ") and message in last, err
        assert "Traceback" not in err


def test_png_name_for_the_models_default_video_is_refused_before_denoising(capsys, tmp_path, monkeypatch):
    import ditattn.pipelines.wan as wan

    monkeypatch.setattr(wan.WanPipelineNative, "generate", lambda *a, **k: pytest.fail("generated"))
    rc, err = _usage(capsys, "generate", "--prompt", "x", "--output-path", str(tmp_path / "still.png"), *SMALL)
    assert rc == 2 and "a 17-frame video cannot be a .png" in err
