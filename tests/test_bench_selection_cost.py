"""bench/selection_cost.py runs end to end on CPU (tiny grid, BENCH_DEVICE=cpu) and writes its table and JSON."""
import json


def test_selection_cost_smoke_on_cpu(tmp_path, run_bench):
    stdout = run_bench("selection_cost.py", "--grid", "4,8,8", "--heads", "2", "--out", str(tmp_path),
                       env={"BENCH_DEVICE": "cpu"})
    table = stdout[stdout.index("## Predictor cost"):]
    assert "| 2 | pooled_query |" in table
    data = json.loads((tmp_path / "selection_cost.json").read_text())
    assert not data["notes"], data["notes"]
    shares = {r["predictor"]: r["flops_of_dense"] for r in data["summary"]}
    assert shares["pooled_query_var"] == 2 * shares["pooled_query"] > shares["pooled"] > 0
    assert all(r["ms"] > 0 for r in data["rows"])


def test_selection_explore_smoke_on_cpu(run_bench):
    """bench/selection_explore.py (how the predictor defaults were chosen) runs: the oracle mask is at
    least as accurate as upstream's pooled one on a tiny structured grid."""
    stdout = run_bench("selection_explore.py", "--grid", "4,8,12", "--rows", "64", "--preds", "pooled,oracle,hp",
                       "--kept", "0.5")
    err = {ln.split()[0]: float(ln.split()[-1]) for ln in stdout.splitlines()
           if ln.split() and ln.split()[0] in ("pooled", "oracle", "hp")}
    assert set(err) == {"pooled", "oracle", "hp"} and err["oracle"] <= err["pooled"], stdout
