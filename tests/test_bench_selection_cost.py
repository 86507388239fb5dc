"""bench/selection_cost.py runs end to end on CPU (tiny grid, BENCH_DEVICE=cpu) and writes its table and JSON."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_selection_cost_smoke_on_cpu(tmp_path):
    env = dict(os.environ, BENCH_DEVICE="cpu", PYTHONPATH=os.path.join(ROOT, "src"))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "selection_cost.py"), "--grid", "4,8,8",
                          "--heads", "2", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    table = res.stdout[res.stdout.index("## Predictor cost"):]
    assert "| 2 | pooled_query |" in table
    data = json.loads((tmp_path / "selection_cost.json").read_text())
    assert not data["notes"], data["notes"]
    shares = {r["predictor"]: r["flops_of_dense"] for r in data["summary"]}
    assert shares["pooled_query_var"] == 2 * shares["pooled_query"] > shares["pooled"] > 0
    assert all(r["ms"] > 0 for r in data["rows"])


def test_selection_explore_smoke_on_cpu():
    """bench/selection_explore.py (how the predictor defaults were chosen) runs: the oracle mask is at
    least as accurate as upstream's pooled one on a tiny structured grid."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "selection_explore.py"), "--grid", "4,8,12",
                          "--rows", "64", "--preds", "pooled,oracle,hp", "--kept", "0.5"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    err = {ln.split()[0]: float(ln.split()[-1]) for ln in res.stdout.splitlines()
           if ln.split() and ln.split()[0] in ("pooled", "oracle", "hp")}
    assert set(err) == {"pooled", "oracle", "hp"} and err["oracle"] <= err["pooled"], res.stdout
