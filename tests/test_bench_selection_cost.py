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


def test_selection_explore_svg2_plans(run_bench):
    """--svg2: SVG2's plans over cold and warm steps; keeping every cluster pair (top_p 1) is exact."""
    stdout = run_bench("selection_explore.py", "--grid", "4,8,12", "--rows", "64", "--heads", "3", "--steps", "2",
                       "--svg2", '[{"num_q_clusters": 4, "num_k_clusters": 8}, '
                                 '{"num_q_clusters": 4, "num_k_clusters": 8, "top_p": 1.0}]')
    lines = [ln for ln in stdout.splitlines() if ln.startswith("svg2 ")]
    assert [ln.split(" step ")[1].split(":")[0] for ln in lines] == ["0 cold", "1 warm"] * 2
    err = [float(ln.split(" err ")[1].split()[0]) for ln in lines]
    kept = [float(ln.split(" kept ")[1].split()[0]) for ln in lines]
    assert 0 < err[0] < 1 and 0 < kept[0] < 1
    assert err[2:] == [0.0, 0.0] and kept[2:] == [1.0, 1.0]


def test_selection_explore_sparge_plans(run_bench):
    """--sparge: sparge_attn's plans (the library's selection, kernel skipped); topk 1 is exact, cdfthreshd
    with a floor keeps at least the floor and at most what cdfthreshd 1 keeps."""
    stdout = run_bench("selection_explore.py", "--grid", "4,8,12", "--rows", "64", "--heads", "3",
                       "--sparge", '[{"topk": 1.0}, {"topk": 0.25}, {"cdfthreshd": 0.9, "topk": 0.25}, '
                                   '{"cdfthreshd": 0.9, "topk": 0.001}]')
    rows = [ln.split("}")[1].split() for ln in stdout.splitlines() if ln.startswith("{")]
    kept, err = [float(r[0]) for r in rows], [float(r[1]) for r in rows]
    assert len(rows) == 4 and kept[0] == 1.0 and err[0] == 0.0
    assert kept[1] <= kept[2] <= 1 and kept[3] <= kept[2] and err[2] <= err[1]


def test_selection_cost_cdf_smoke_on_cpu(tmp_path, run_bench):
    """--cdf: the cdfthreshd list builder against the mask path (identical lists, no NOTE), the top-k lists and
    the whole calls each way, in one table."""
    stdout = run_bench("selection_cost.py", "--cdf", "--grid", "4,8,12", "--heads", "2", "--out", str(tmp_path),
                       env={"BENCH_DEVICE": "cpu"})
    table = stdout[stdout.index("## cdfthreshd selection"):]
    for case in ("select cdf mask path", "select cdf lists", "select cdf lists torch", "select topk 0.4", "sparge cdf mask path",
                 "sparge cdf lists", "sparge topk 0.4", "dense_fa"):
        assert f"| {case} |" in table, case
    data = json.loads((tmp_path / "selection_cost.json").read_text())
    assert not data["notes"], data["notes"]
    rows = {r["case"]: r for r in data["summary"]}
    assert rows["select cdf lists"]["kept"] == rows["select cdf mask path"]["kept"] == rows["sparge cdf lists"]["kept"]
    assert all(r["ms"] > 0 for r in data["rows"]) and rows["sparge cdf lists"]["x_dense"] > 0
