"""`ditattn backends` and the CLI's error contract (one `error:` line, exit 2, no traceback)."""
import json
import subprocess
import sys

import pytest

from ditattn.cli import main
from ditattn.attention.names import AttentionBackendEnum


def run(*args):
    return subprocess.run([sys.executable, "-m", "ditattn", *args], capture_output=True, text=True, timeout=120)


def test_backends_json_lists_every_backend_with_reasons(capsys):
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {b["name"]: b for b in data["backends"]}
    assert set(names) == {m.value for m in AttentionBackendEnum}
    assert names["fa"]["aliases"] == ["fa3", "fa4"]
    assert names["torch_cudnn_sdpa"]["aliases"] == ["cudnn_sdpa"]
    sdpa = names["torch_sdpa"]
    assert sdpa["usable_here"] and sdpa["enum"] == "TORCH_SDPA" and sdpa["kind"] == "dense"
    for n in ("laser_attn", "aiter", "sage_attn_3", "video_sparse_attn_h3"):
        assert not names[n]["usable_here"] and names[n]["reasons"], n
    sta = {p["name"]: p for p in names["sliding_tile_attn"]["params"]}
    assert sta["skip_time_steps"]["default"] == 15 and sta["mask_strategy_file_path"]["required"]


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "fa (fa3, fa4)" in out and "needs an Ascend NPU" in out and "falls back here to torch_sdpa" in out and "param topk: float = 0.5" in out


def test_cli_user_errors_are_one_line_exit_2():
    r = run("backends", "--nope")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    r = run("backends", "--enable-attention-backend-autotune", "maybe")
    assert r.returncode == 2 and "expected true or false" in r.stderr


def test_python_dash_m_and_help():
    r = run("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "backends" in r.stdout
