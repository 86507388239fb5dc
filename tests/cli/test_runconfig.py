"""The typed run configuration: built from a mapping / YAML / Python with the flags' checks,
``ditattn <command> --config FILE.yaml`` with command-line flags overriding the file, and the same
object driving the native pipeline from Python."""

import json
import re

import numpy as np
import pytest

from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.cli import main
from ditattn.errors import AttentionConfigError
from ditattn.runconfig import AttentionOptions, ParallelConfig, RunConfig, SamplingConfig, ServerConfig


def test_from_mapping_takes_flag_names_and_checks_values_like_the_flags():
    cfg = RunConfig.from_mapping(
        {
            "num-inference-steps": "4",
            "--seed": 3,
            "guidance_scale": 2,
            "component-attention-backends": {"transformer.cross": "torch_sdpa"},
            "attention-backend-config": {"sparsity": 0.5},
            "enable-torch-compile": "true",
            "max-queue": 9,
            "verbose": True,
        }
    )
    assert cfg.sampling.num_inference_steps == 4 and cfg.sampling.seed == 3 and cfg.sampling.guidance_scale == 2.0
    assert cfg.model.enable_torch_compile is True and cfg.server.max_queue == 9 and cfg.verbose is True
    settings = cfg.attention_settings()
    assert settings.component_overrides == {"transformer.cross": B.TORCH_SDPA}
    assert settings.config == {"sparsity": 0.5} and settings.compiled and not settings.cuda_graphs
    for values, message in (
        ({"num-frames": 0}, "src: num-frames: expected a positive integer up to 1025, got 0"),
        ({"seed": "-1"}, "src: seed: expected an integer from 0 to 9223372036854775807, got -1"),
        ({"guidance-scale": float("nan")}, "src: guidance-scale: expected a finite number from 0 to 100, got nan"),
        ({"guidance-scale": 1e300}, "src: guidance-scale: expected a finite number from 0 to 100, got 1e+300"),
        (
            {"num-inference-steps": 10**30},
            "src: num-inference-steps: expected a positive integer up to 1000, got 1000000000000000000000000000000",
        ),
        ({"seed": "9" * 5000}, "src: seed: expected an integer from 0 to 9223372036854775807, got '9999"),
        ({"request-timeout-s": 1e300}, "src: request-timeout-s: expected a positive number up to 604800"),
        ({"dtype": "fp8"}, "src: dtype: expected one of float32, bfloat16, float16, got 'fp8'"),
        ({"port": 70000}, "src: port: expected a TCP port 1-65535, got 70000"),
        ({"prompt": 12}, "src: prompt: expected a string, got 12"),
        ({"num-gpu": 2}, "src: unknown key 'num-gpu'; did you mean num-gpus? accepted: "),
    ):
        with pytest.raises(AttentionConfigError, match="^" + re.escape(message)):
            RunConfig.from_mapping(values, source="src")
    with pytest.raises(
        AttentionConfigError,
        match="key 'max-queue' does not apply here .it belongs to the server "
        "settings.; accepted: .*num-inference-steps",
    ):
        RunConfig.from_mapping({"max-queue": 3}, accept=("sampling",))


def test_sections_validate_when_built_in_python():
    with pytest.raises(AttentionConfigError, match="^num_frames: expected a positive integer up to 1025, got 0$"):
        SamplingConfig(num_frames=0)
    with pytest.raises(AttentionConfigError, match="batch_window_s: expected a finite number from 0 to 60"):
        ServerConfig(batch_window_s=-1)
    with pytest.raises(AttentionConfigError, match="RunConfig.sampling must be a SamplingConfig"):
        RunConfig(sampling={"prompt": "x"})
    with pytest.raises(AttentionConfigError, match="does not divide --num-gpus 4"):
        ParallelConfig(num_gpus=4, ulysses_degree=3).degrees()
    with pytest.raises(AttentionConfigError, match="needs --skip-softmax-threshold-scale-factor"):
        AttentionOptions(skip_softmax_start_step=2).skip_softmax()
    assert AttentionOptions(skip_softmax_threshold_scale_factor=5).skip_softmax() == {
        "threshold_scale_factor": 5.0,
        "start_step": 0,
    }


def test_numpy_integers_are_integers_and_bools_and_floats_are_not():
    """Integer fields take NumPy integers (anything ``operator.index`` takes) and store a plain int, as
    ``ditattn.attention`` does (``ditattn.errors.as_integer``); bools and floats stay refused."""
    import torch

    from ditattn.runconfig import CompareOptions

    s = SamplingConfig(
        num_frames=np.int64(17), height=np.int32(64), seed=np.uint64(3), num_inference_steps=torch.tensor(4)
    )
    assert (s.num_frames, s.height, s.seed, s.num_inference_steps) == (17, 64, 3, 4)
    assert all(type(v) is int for v in (s.num_frames, s.height, s.seed, s.num_inference_steps))
    cfg = RunConfig.from_mapping({"num-gpus": np.int8(1), "port": np.int16(8080), "seeds": [np.int64(1), 2]})
    assert cfg.parallel.num_gpus == 1 and cfg.server.port == 8080 and cfg.compare.seeds == (1, 2)
    assert type(cfg.server.port) is int and all(type(v) is int for v in cfg.compare.seeds)
    assert type(CompareOptions(seeds=(np.int64(5),)).seeds[0]) is int
    with pytest.raises(AttentionConfigError, match="^num_frames: expected a positive integer up to 1025, got 2000$"):
        SamplingConfig(num_frames=np.int64(2000))  # still bounded
    for bad in (True, np.True_, torch.tensor(True), 17.0, np.float64(17.0), np.array([17]), "17.5"):
        with pytest.raises(AttentionConfigError, match="^num_frames: expected a positive integer up to 1025, got "):
            SamplingConfig(num_frames=bad)


def test_numpy_numbers_are_numbers_and_bools_are_not():
    """Decimal fields (guidance_scale, shift, ...) take NumPy's floats and integers as Python's (np.float32
    was refused as 'expected a number'); bools and non-finite values stay refused."""
    s = SamplingConfig(guidance_scale=np.float32(5.5), flow_shift=np.int64(3))
    assert (s.guidance_scale, s.flow_shift) == (5.5, 3.0) and type(s.guidance_scale) is float
    for bad in (True, np.True_, np.float32("nan"), np.float64("inf")):
        with pytest.raises(AttentionConfigError, match="^guidance_scale: expected "):
            SamplingConfig(guidance_scale=bad)


def test_config_file_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prompt: [unclosed\n")
    for path, message in (
        (tmp_path / "missing.yaml", "error: cannot read config file"),
        (bad, "error: cannot parse config file"),
    ):
        assert main(["generate", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err
    listing = tmp_path / "list.yaml"
    listing.write_text("- prompt\n")
    assert main(["plan", "--config", str(listing)]) == 2
    assert "must hold a mapping" in capsys.readouterr().err
    wrong = tmp_path / "serve.yaml"
    wrong.write_text("output-path: /tmp/x\n")
    assert main(["serve", "--config", str(wrong)]) == 2
    assert capsys.readouterr().err.startswith(
        f"error: config file {wrong}: key 'output-path' does not apply here (it belongs to the output settings)"
    )
    assert main(["generate", "--num-frames", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: --prompt is required")


def test_generate_from_yaml_with_flag_overrides_matches_the_python_pipeline(tmp_path, capsys):
    """The YAML sets the prompt, size, steps, seed and attention; the command line overrides the
    steps.  The file name carries the YAML's seed, the summary the overridden steps, and the same
    RunConfig drives ``WanPipelineNative`` from Python to the same image."""
    from PIL import Image

    from ditattn.entrypoints.cli import COMMANDS, build_config
    from ditattn.pipelines.wan import WanPipelineNative

    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(
        "prompt: a fox in the snow\n"
        "height: 32\n"
        "width: 48\n"
        "num-frames: 1\n"
        "num_inference_steps: 5\n"
        "seed: 5\n"
        "attention-backend: torch_sdpa\n"
        "component-attention-backends:\n"
        "  text_encoder: torch_sdpa\n"
        f"output-path: {tmp_path / 'out'}\n"
    )
    capsys.readouterr()
    assert main(["generate", "--config", str(run_yaml), "--num-inference-steps", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    path = tmp_path / "out" / "a_fox_in_the_snow_s5.png"
    assert out[0] == f"saved: {path}"
    assert "48x32, 1 frame, 2 steps" in out[-1] and "DiT attention: torch_sdpa" in out[-1]

    generate = next(c for c in COMMANDS if c.name == "generate")
    cfg = build_config(generate, {"config_file": str(run_yaml), "num_inference_steps": 2})
    assert (cfg.sampling.prompt, cfg.sampling.num_inference_steps, cfg.sampling.seed) == ("a fox in the snow", 2, 5)
    pipe = WanPipelineNative.from_config(cfg)
    assert pipe.plan()["components"][0]["layers"][0]["source"] == "component"
    res = pipe.generate(**cfg.generate_kwargs(), progress=False)
    assert res.frames.shape == (1, 1, 32, 48, 3) and res.num_inference_steps == 2
    written = np.asarray(Image.open(path), dtype=np.int16)
    assert np.abs(written - res.frames[0, 0].astype(np.int16)).max() <= 1


def test_plan_and_backends_take_config_files(tmp_path, capsys):
    cfg = tmp_path / "plan.yaml"
    cfg.write_text(json.dumps({"json": True, "attention-backend": "torch_sdpa"}))  # JSON is YAML too
    assert main(["plan", "--config", str(cfg)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {layer["backend"] for c in plan["components"] for layer in c["layers"]} <= {"torch_sdpa"}
    back = tmp_path / "backends.yml"
    back.write_text("attention-backend: sage_attn\nattention-backend-config:\n  impl: reference\n")
    assert main(["backends", "--config", str(back), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["backends"] and captured.err.startswith(
        "note: --attention-backend, --attention-backend-config checked"
    )
    back.write_text("attention-backend: sage_attn\nattention-backend-config:\n  impl: cuda\n")
    assert main(["backends", "--config", str(back)]) == 2  # values are checked as plan checks them
    assert "sage_attn: invalid value 'cuda' for 'impl'" in capsys.readouterr().err
    back.write_text("attention-backend-config:\n  impl: reference\n")  # no backend in use takes 'impl'
    assert main(["backends", "--config", str(back)]) == 2
    assert "config key(s) 'impl' belong to no backend in use" in capsys.readouterr().err
    back.write_text("num-frames: 5\n")
    assert main(["backends", "--config", str(back)]) == 2
    assert "key 'num-frames' does not apply here" in capsys.readouterr().err


def test_a_backend_flag_replaces_the_config_files_backend_with_its_keys(tmp_path, capsys):
    """``--cache-backend none`` (or another attention backend) over a file that sets a backend and its keys: the
    file's keys belonged to the old backend and go with it, said in a warning; the same backend again, or a
    config given on the command line too, keeps the usual override rules."""
    from ditattn.entrypoints.cli import COMMANDS, build_config

    run = tmp_path / "run.yaml"
    run.write_text(
        "cache-backend: teacache\ncache-backend-config: {threshold: 0.1}\n"
        "attention-backend: sparge_attn\nattention-backend-config: {topk: 0.3}\n"
    )
    plan = next(c for c in COMMANDS if c.name == "plan")
    notes: list = []
    cfg = build_config(plan, {"config_file": str(run), "cache_backend": "none"}, notes)
    assert cfg.cache.cache_backend == "none" and cfg.cache.cache_backend_config is None
    assert cfg.attention.attention_backend_config is not None  # not named: untouched
    assert len(notes) == 1 and "--cache-backend none replaces the config file's cache-backend teacache" in notes[0]
    notes.clear()
    cfg = build_config(plan, {"config_file": str(run), "attention_backend": "torch_sdpa"}, notes)
    assert cfg.attention.attention_backend_config is None and cfg.cache.cache_backend_config is not None
    assert "attention-backend sparge_attn and its attention-backend-config" in notes[0]
    notes.clear()
    same = build_config(plan, {"config_file": str(run), "cache_backend": "TeaCache"}, notes)
    assert same.cache.cache_backend_config is not None and not notes  # the same backend keeps its keys
    both = build_config(
        plan, {"config_file": str(run), "cache_backend": "magcache", "cache_backend_config": "threshold=0.2"}, notes
    )
    assert not notes and "0.2" in str(both.cache.cache_backend_config)
    assert main(["plan", "--config", str(run), "--cache-backend", "none", "--attention-backend", "torch_sdpa"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: ") == 2 and "error" not in err
