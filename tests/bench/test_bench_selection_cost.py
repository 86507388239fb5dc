"""bench/selection_cost.py runs end to end on CPU (tiny grid, BENCH_DEVICE=cpu) and writes its table and JSON."""

import json


def test_selection_cost_smoke_on_cpu(tmp_path, run_bench):
    stdout = run_bench(
        "selection_cost.py", "--grid", "4,8,8", "--heads", "2", "--out", str(tmp_path), env={"BENCH_DEVICE": "cpu"}
    )
    table = stdout[stdout.index("## Predictor cost") :]
    assert "| 2 | pooled_query |" in table
    data = json.loads((tmp_path / "selection_cost.json").read_text())
    assert not data["notes"], data["notes"]
    shares = {r["predictor"]: r["flops_of_dense"] for r in data["summary"]}
    assert shares["pooled_query_var"] == 2 * shares["pooled_query"] > shares["pooled"] > 0
    assert all(r["ms"] > 0 for r in data["rows"])


def test_selection_cost_cdf_smoke_on_cpu(tmp_path, run_bench):
    """--cdf: the cdfthreshd list builder against the mask path (identical lists, no NOTE), the top-k lists and
    the whole calls each way, in one table."""
    stdout = run_bench(
        "selection_cost.py",
        "--cdf",
        "--grid",
        "4,8,12",
        "--heads",
        "2",
        "--out",
        str(tmp_path),
        env={"BENCH_DEVICE": "cpu"},
    )
    table = stdout[stdout.index("## cdfthreshd selection") :]
    for case in (
        "select cdf mask path",
        "select cdf lists",
        "select cdf lists torch",
        "select topk 0.4",
        "sparge cdf mask path",
        "sparge cdf lists",
        "sparge topk 0.4",
        "dense_fa",
    ):
        assert f"| {case} |" in table, case
    data = json.loads((tmp_path / "selection_cost.json").read_text())
    assert not data["notes"], data["notes"]
    rows = {r["case"]: r for r in data["summary"]}
    assert rows["select cdf lists"]["kept"] == rows["select cdf mask path"]["kept"] == rows["sparge cdf lists"]["kept"]
    assert all(r["ms"] > 0 for r in data["rows"]) and rows["sparge cdf lists"]["x_dense"] > 0
