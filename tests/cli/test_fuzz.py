"""The fuzz harness (hypothesis, derandomized: the same cases every run): at least 500
generated cases over config strings, config / strategy files, RunConfig mappings, the command line
and ``ditattn.attention()`` arguments, with no outcome but a result or a user-input error — no
traceback, no crash.  The targets are in ``tests/fuzz_targets.py``."""

import json
import os
import sys

import pytest

import fuzz_targets as ft

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ATTENTION_CASES = 300


def test_fuzz_config_strings():
    ft.fuzz_config_strings()
    assert ft.COUNTS["config_strings"] >= 150


def test_fuzz_config_mappings():
    ft.fuzz_config_mappings()
    assert ft.COUNTS["config_mappings"] >= 150


def test_fuzz_config_and_strategy_files():
    ft.fuzz_config_files()
    assert ft.COUNTS["config_files"] >= 150


def test_fuzz_command_line():
    ft.fuzz_cli()
    assert ft.COUNTS["cli"] >= 100


def _fuzz_attention_run(folder):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(HERE), "src") + os.pathsep + HERE)
    return dict(
        args=[sys.executable, os.path.join(HERE, "fuzz_targets.py"), "attention", str(ATTENTION_CASES)],
        env=env,
        timeout=600,
    )


@pytest.mark.background.with_args(_fuzz_attention_run)
def test_fuzz_attention_arguments_in_a_child_process(background_run):
    """A crashed interpreter (signal) fails here with the child's output; so does any exception other
    than AttentionConfigError (hypothesis prints the falsifying call)."""
    proc, _ = background_run
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["attention"] >= ATTENTION_CASES
