"""CPU smoke runs of the image-to-video / offload benchmarks (so an H200 session does not find their
bugs): bench/e2e.py --i2v against diffusers, bench/wan_memory.py with block-streamed offload + tiling."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_e2e_i2v_step_matches_diffusers(tmp_path):
    out = tmp_path / "e2e.json"
    _run(["bench/e2e.py", "--arch", "tiny", "--res", "tiny", "--i2v", "--repeats", "1", "--backends", "auto",
          "--diffusers-backends", "native", "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    ours = next(r for r in rows if r["side"] == "ditattn")
    assert json.loads(out.read_text())["i2v"] and ours["rel_err_vs_diffusers"] < 1e-2


def test_wan_memory_runs_offload_variants(tmp_path):
    out = tmp_path / "mem.json"
    stdout = _run(["bench/wan_memory.py", "--arch", "tiny", "--res", "tiny", "--frames", "5", "--steps", "1",
                   "--variants", "none,group+tiling", "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "group+tiling"] and not any("error" in r for r in rows)
    assert rows[1]["offloaded"] == ["text_encoder", "transformer", "vae"] and rows[1]["vae_tiling"]
    assert rows[0]["frames_shape"] == [1, 5, 64, 64, 3]
    assert stdout.strip().splitlines()[-1].startswith("group+tiling")  # the table is last
