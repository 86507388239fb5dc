"""CPU smoke runs of the image-to-video / offload benchmarks (so an H200 session does not find their
bugs): bench/e2e.py --i2v against diffusers, bench/wan_memory.py with block-streamed offload + tiling
(each variant in its own process, as on the GPU)."""

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def test_e2e_i2v_step_matches_diffusers(tmp_path, run_bench):
    out = tmp_path / "e2e.json"
    run_bench(
        "e2e.py",
        "--arch",
        "tiny",
        "--res",
        "tiny",
        "--i2v",
        "--repeats",
        "1",
        "--backends",
        "auto",
        "--diffusers-backends",
        "native",
        "--out",
        str(out),
    )
    rows = json.loads(out.read_text())["rows"]
    ours = next(r for r in rows if r["side"] == "ditattn")
    assert json.loads(out.read_text())["i2v"] and ours["rel_err_vs_diffusers"] < 1e-2


def _wan_memory_run(folder):
    argv = ["--arch", "tiny", "--res", "tiny", "--frames", "5", "--steps", "1", "--variants", "none,group+tiling"]
    return dict(
        args=[sys.executable, os.path.join(BENCH, "wan_memory.py"), *argv, "--out", os.path.join(folder, "mem.json")]
    )


@pytest.mark.background.with_args(_wan_memory_run)  # the variants' processes: run meanwhile
def test_wan_memory_runs_offload_variants(background_run):
    proc, tmp_path = background_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stdout = proc.stdout
    rows = json.loads((tmp_path / "mem.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "group+tiling"] and not any("error" in r for r in rows)
    assert rows[1]["offloaded"] == ["text_encoder", "transformer", "vae"] and rows[1]["vae_tiling"]
    assert rows[0]["frames_shape"] == [1, 5, 64, 64, 3]
    assert stdout.strip().splitlines()[-1].startswith("group+tiling")  # the table is last
