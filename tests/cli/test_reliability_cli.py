"""The command line's input checks: ``ditattn backends`` validates the attention flags as ``plan``
does, a bad backend config value is reported before a dtype refusal, error lines stay short
whatever the input's length, and configs that are not regular files (a FIFO, a directory) are
refused at once instead of hanging."""

import json
import os
import re
import sys
import threading

import pytest
import torch

import ditattn
import serving
from ditattn.cli import main
from ditattn.errors import AttentionConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = "A" * 100_000


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DITATTN_CACHE", str(tmp_path / "cache"))


def _error(capsys, argv, rc_expected=2) -> str:
    """The one ``error:`` line of ``ditattn ARGV`` (exit status ``rc_expected``, no traceback)."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse-level errors
        rc = exc.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == rc_expected and len(lines) == 1 and "Traceback" not in err, (argv[:4], rc, err[-500:])
    return lines[0]


# ------------------------------------------------------------------------------------------------
# backends validates exactly as plan does


@pytest.mark.parametrize(
    "backend, config, expect",
    [
        ("sage_attn", "sparsity=1.5", "config key(s) 'sparsity' belong to no backend in use"),
        (
            "sparge_attn",
            "topk=2",
            "sparge_attn: invalid value 2.0 for 'topk' (out of range); accepted: a number in (0, 1]",
        ),
        ("sparge_attn", "topk=1.5", "sparge_attn: invalid value 1.5 for 'topk' (out of range)"),
        ("video_sparse_attn", "sparsity=-0.5", "video_sparse_attn: invalid value -0.5 for 'sparsity'"),
    ],
)
def test_backends_refuses_what_plan_refuses_with_the_same_reason(capsys, backend, config, expect):
    argv = ["--attention-backend", backend, "--attention-backend-config", config]
    from_backends = _error(capsys, ["backends", *argv])
    from_plan = _error(capsys, ["plan", *argv])  # on this CPU machine: float32, which sparge cannot run
    assert expect in from_backends and expect in from_plan
    assert "float32" not in from_plan  # the config is checked before the dtype
    if "invalid value" in expect:
        assert from_backends == from_plan


def test_backends_accepts_what_plan_accepts(capsys):
    argv = ["--attention-backend", "video_sparse_attn", "--attention-backend-config", "sparsity=0.5"]
    assert main(["backends", *argv]) == 0
    assert main(["plan", *argv]) == 0


def test_the_config_is_validated_before_the_dtype(capsys):
    """On the CPU (float32 by default) a bad sparge value names the value, not the dtype; a good one
    then reaches the dtype refusal."""
    bad = _error(capsys, ["plan", "--attention-backend", "sparge_attn", "--attention-backend-config", "topk=1.5"])
    assert "topk" in bad and "float32" not in bad
    good = _error(capsys, ["plan", "--attention-backend", "sparge_attn", "--attention-backend-config", "topk=0.5"])
    assert "float32" in good


# ------------------------------------------------------------------------------------------------
# error lines echo a bounded part of the input


@pytest.mark.parametrize(
    "argv",
    [
        ["backends", "--attention-backend-config", LONG],
        ["backends", "--attention-backend", "sparge_attn", "--attention-backend-config", LONG],
        ["backends", "--attention-backend", "sparge_attn", "--attention-backend-config", "topk=" + LONG],
        ["backends", "--attention-backend", "sparge_attn", "--attention-backend-config", LONG + "=1"],
        [
            "backends",
            "--attention-backend",
            "sparge_attn",
            "--attention-backend-config",
            "a=1," + "b" * 100_000 + "=2",
        ],
        ["backends", "--attention-backend-config", LONG + ".json"],
        ["plan", "--attention-backend", "sparge_attn", "--attention-backend-config", LONG],
        ["plan", "--component-attention-backends", LONG],
        ["plan", "--component-attention-backends", LONG + "=fa"],
        ["plan", "--config", LONG + ".yaml"],
        ["plan", "--platform", LONG],
        ["plan", "--dtype", LONG],
        ["plan", "--dtype", "a'" * 50_000],  # argparse quotes a value holding ' with "
    ],
)
def test_an_error_line_stays_short_for_a_100000_character_value(capsys, argv):
    line = _error(capsys, argv)
    # the line may list the accepted keys in full (they are short); the 100,000 characters never come back
    listed = line.split("their keys: ")[-1] if "their keys: " in line else ""
    assert len(line) - len(listed) < 300 and len(line) < 400, line[:500]


@pytest.mark.parametrize(
    "body",
    [
        f"attention-backend-config: {LONG}\n",
        f"{LONG}: 1\n",
        f"attention-backend-config: 'topk={LONG}'\n",
        f"seed: {LONG}\n",
    ],
)
def test_a_config_file_with_a_100000_character_value_gives_a_short_error(capsys, tmp_path, body):
    path = tmp_path / "run.yaml"
    path.write_text(body)
    line = _error(capsys, ["plan", "--config", str(path)])
    assert len(line) < 300, line[:400]


@pytest.mark.parametrize(
    "call",
    [
        lambda: ditattn.attention(*[torch.randn(1, 4, 1, 8)] * 3, backend="sparge_attn", config=LONG),
        lambda: ditattn.attention(*[torch.randn(1, 4, 1, 8)] * 3, backend="torch_sdpa", config={LONG: 1}),
        lambda: ditattn.attention(*[torch.randn(1, 4, 1, 8)] * 3, backend="sparge_attn", config={"topk": LONG}),
        lambda: ditattn.attention(*[torch.randn(1, 4, 1, 8)] * 3, config=LONG + ".yaml"),
        lambda: __import__("ditattn.runconfig", fromlist=["RunConfig"]).RunConfig.from_mapping({LONG: 1}),
        lambda: __import__("ditattn.runconfig", fromlist=["RunConfig"]).RunConfig.from_mapping({"lora": [[LONG]]}),
    ],
)
def test_python_api_errors_stay_short_for_a_100000_character_value(call):
    with pytest.raises(AttentionConfigError) as info:
        call()
    assert len(str(info.value)) < 1200  # the accepted keys may be listed; the echo is cut


# ------------------------------------------------------------------------------------------------
# config files that are not regular files

_CHILD = r"""
import contextlib, io, json, sys
from ditattn.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    results.append([rc, err.getvalue()])
print(json.dumps(results))
"""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def _fifo_runs(folder) -> list:
    return [
        ["backends", "--config", os.path.join(folder, "run.yaml")],
        ["backends", "--config", os.path.join(folder, "plain")],
        ["backends", "--attention-backend-config", os.path.join(folder, "backend.json")],
        ["backends", "--attention-backend-config", os.path.join(folder, "plain")],
        ["backends", "--config", folder],
        ["backends", "--attention-backend-config", folder],
    ]


def _fifo_child(folder):
    for name in ("run.yaml", "plain", "backend.json"):
        os.mkfifo(os.path.join(folder, name))
    env = serving.subprocess_env(DITATTN_CACHE=os.path.join(folder, "cache"))
    return dict(args=[sys.executable, "-c", _CHILD, json.dumps(_fifo_runs(folder))], env=env, timeout=180)


@pytest.mark.background.with_args(_fifo_child)
def test_a_fifo_or_a_directory_as_a_config_is_refused_at_once(background_run):
    """Each config flag given a FIFO (with and without a config suffix) or a directory: exit 2 with
    'is not a regular file' -- in a child process under a timeout, so a blocking open fails the test."""
    proc, tmp_path = background_run
    runs = _fifo_runs(str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for argv, (rc, err) in zip(runs, json.loads(proc.stdout.strip().splitlines()[-1])):
        kind = "a directory" if argv[-1] == str(tmp_path) else "a FIFO"
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (argv, rc, err)
        assert f"is not a regular file (it is {kind})" in err, (argv, err)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_fifo_as_a_mask_strategy_is_refused_at_once(tmp_path):
    from ditattn.attention.sparse.sta import load_mask_strategy

    fifo = str(tmp_path / "mask.json")
    os.mkfifo(fifo)
    outcome = []

    def load():
        try:
            load_mask_strategy(fifo)
        except Exception as exc:  # noqa: BLE001  (the outcome is checked below)
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=30)
    hung = reader.is_alive()
    if hung:  # release a reader blocked in open()/read() by opening and closing the write end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=30)
    assert not hung, "reading a FIFO as the mask strategy blocked"
    assert len(outcome) == 1 and isinstance(outcome[0], AttentionConfigError)
    assert re.search(r"mask strategy .* is not a regular file \(it is a FIFO\)", str(outcome[0])), outcome
