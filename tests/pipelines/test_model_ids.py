"""``--model-path org/name``: Hugging Face repo ids resolved through huggingface_hub from a locally
written cache (the layout ``hf download`` leaves: ``models--org--name/{refs,snapshots}``), never the
network — in ``generate`` (the real CLI, offline), ``plan``, ``serve`` and ``WanPipeline.from_pretrained``;
the errors when an id is neither cached nor reachable."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import serving
from ditattn.errors import AttentionConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPO = "some-org/some-wan"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMALL = ["--height", "32", "--width", "48", "--num-frames", "1", "--num-inference-steps", "2"]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """An HF_HOME whose hub cache holds the tiny Wan pipeline as ``some-org/some-wan`` (main =
    COMMIT) and, as ``some-org/some-wan`` revision ``v2``, a second snapshot."""
    from ditattn.models.tiny import tiny_model_path

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--some-org--some-wan"
    shutil.copytree(tiny_model_path("ditattn:tiny-wan"), repo / "snapshots" / COMMIT)
    shutil.copytree(tiny_model_path("ditattn:tiny-wan2.2"), repo / "snapshots" / ("f" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v2").write_text("f" * 40)
    return home


def _cli(hf_home, *argv, offline="1", **env):
    full = serving.subprocess_env(HF_HOME=str(hf_home), HF_HUB_OFFLINE=offline, **env)
    full.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "ditattn", *argv], capture_output=True, text=True, env=full, timeout=300
    )


def test_generate_from_a_cached_repo_id_offline(hf_home, tmp_path):
    proc = _cli(
        hf_home,
        "generate",
        "--model-path",
        REPO,
        "--prompt",
        "a lighthouse",
        "--output-path",
        str(tmp_path),
        "--output-file",
        "hub.png",
        *SMALL,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hub.png").is_file()
    assert proc.stdout.strip().splitlines()[-1].startswith("done in ")


@pytest.fixture
def hub_cache(hf_home, monkeypatch):
    """In this process: the hub cache of ``hf_home``, as HF_HOME would set it at import."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    return str(hf_home / "hub")


def _plan(capsys, *argv):
    from ditattn.cli import main

    capsys.readouterr()
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_revision_and_plan(hub_cache, capsys):
    rc, out, err = _plan(capsys, "--model-path", REPO, "--revision", "v2", "--json")
    assert rc == 0, err
    assert '"transformer_2"' in out  # v2 is the Wan 2.2 snapshot
    rc, out, err = _plan(capsys, "--model-path", REPO, "--revision", COMMIT, "--json")
    assert rc == 0, err
    assert '"transformer_2"' not in out


@pytest.mark.parametrize(
    "argv,words",
    [
        (
            ["--model-path", "other-org/missing"],
            ["'other-org/missing'", "not in the local Hugging Face cache", "HF_HUB_OFFLINE is set"],
        ),
        (["--model-path", REPO, "--revision", "v9"], ["(revision v9)", "not in the local Hugging Face cache"]),
        (["--model-path", "ditattn:tiny-wan", "--revision", "main"], ["--revision applies to Hugging Face"]),
        (["--model-path", "./no/such/folder"], ["is not a local directory", "Hugging Face repo id"]),
    ],
)
def test_model_id_errors(hub_cache, capsys, argv, words):
    rc, out, err = _plan(capsys, *argv)
    assert rc == 2 and err.startswith("error: ") and err.strip().count("\n") == 0
    for w in words:
        assert w in err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--local-files-only"], ["'other-org/missing'", "--local-files-only"]),
        # online, but nothing answers (a closed local port stands in for the hub): the id and the endpoint
        ([], ["'other-org/missing'", "cannot be reached", "127.0.0.1:9"]),
    ],
)
def test_model_id_errors_online(hf_home, argv, words):
    proc = _cli(
        hf_home, "plan", "--model-path", "other-org/missing", *argv, offline="0", HF_ENDPOINT="http://127.0.0.1:9"
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and err.count("\n") == 0 and "Traceback" not in err
    for w in words:
        assert w in err


def test_cache_dir_for_a_built_in_model_is_a_warning_not_silently_ignored(hub_cache, tmp_path, caplog):
    """A built-in model is built locally (under DITATTN_CACHE), so cache_dir does nothing for it: one
    warning says so, in the words ``--local-files-only`` gets on the command line; a repo id uses it quietly."""
    import ditattn
    from ditattn.pipelines.model_index import resolve_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    unused = tmp_path / "hf-cache"
    with caplog.at_level("WARNING", logger="ditattn.pipeline"):
        ditattn.WanPipeline.from_pretrained("ditattn:tiny-wan", cache_dir=str(unused), attention_backend="torch_sdpa")
    said = [r for r in caplog.records if "cache_dir" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in said] == [
        (
            "WARNING",
            "cache_dir acts only for Hugging Face repo ids; built-in ditattn: models are local (ditattn:tiny-wan "
            "is built under DITATTN_CACHE, default ~/.cache/ditattn)",
        )
    ]
    assert not unused.exists()  # and nothing went there
    caplog.clear()
    with caplog.at_level("WARNING", logger="ditattn.pipeline"):
        WanPipelineNative.from_pretrained("ditattn:tiny-wan", load_weights=False)  # no cache_dir: nothing to say
        assert resolve_model_path(REPO, cache_dir=hub_cache)[0].startswith(hub_cache)  # used: nothing to say
    assert not [r for r in caplog.records if "cache_dir" in r.getMessage()]


def test_python_pipeline_and_server_take_the_id(hf_home, hub_cache):
    from fastapi.testclient import TestClient

    import ditattn
    from ditattn.runconfig import RunConfig
    from ditattn.server.app import create_app
    from ditattn.server.runner import build_runner

    cache = hub_cache
    pipe = ditattn.WanPipeline.from_pretrained(REPO, cache_dir=cache, attention_backend="torch_sdpa")
    ref = ditattn.WanPipeline.from_pretrained("ditattn:tiny-wan", attention_backend="torch_sdpa")
    kw = dict(height=32, width=48, num_frames=1, num_inference_steps=2, seed=3, progress=False)
    assert np.array_equal(pipe("a lighthouse", **kw), ref("a lighthouse", **kw))  # the same weights
    with pytest.raises(AttentionConfigError, match="not in the local Hugging Face cache"):
        ditattn.WanPipeline.from_pretrained("other-org/missing", cache_dir=cache)

    cfg = RunConfig.from_mapping(
        {"model_path": REPO, "num_inference_steps": 2, "height": 32, "width": 32, "num_frames": 1, "batch_window_s": 0}
    )
    app = create_app(build_runner(cfg), cfg.server)
    with TestClient(app, base_url="http://localhost") as client:
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [REPO]
        r = client.post("/v1/images/generations", json={"model": REPO, "prompt": "a boat", "size": "32x32"})
        assert r.status_code == 200, r.text
        assert r.json()["attention_backends"] == ["torch_sdpa"]
