"""bench/frontier.py --smoke runs every part of the H200 error-budget call on the CPU at tiny sizes (capture from
ditattn:shapes, the training-free preset with the budget on and off, the fallback cost, sage_attn against fa), writes
few files, and ends with the short table; bench/fidelity.py's budget list and summary rules."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fidelity():
    spec = importlib.util.spec_from_file_location("fidelity_rules", os.path.join(ROOT, "bench", "fidelity.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _frontier_smoke_run(folder):
    argv = ["--smoke", "--families", "original,weak", "--out", os.path.join(folder, "front")]
    return dict(args=[sys.executable, os.path.join(ROOT, "bench", "frontier.py"), *argv])


@pytest.mark.background.with_args(_frontier_smoke_run)  # its parts are subprocesses: run meanwhile
def test_frontier_smoke_on_cpu(background_run):
    proc, tmp_path = background_run
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    stdout, out = proc.stdout, tmp_path / "front"
    data = json.loads((out / "summary.json").read_text())
    assert set(data["parts"]) == {"capture", "fidelity", "sage"}
    assert all(p["rc"] == 0 and not p["timed_out"] for p in data["parts"].values()), data["parts"]
    got = {(e["case"], e["family"]): e for e in data["summary"]}
    for case in (
        "sparge_attn (defaults)",
        "sol_attn (defaults)",
        "vmoba_attn (defaults)",
        "sparse_video_gen_2_attn (defaults)",
        "skip_softmax (budget)",
    ):
        for fam in ("original", "weak", "activations"):
            e = got[case, fam]
            assert e["budget"] == "default" and "off" in e["at"], e
            assert 0 <= e["worst_err"] < 0.05 and e["min_cos"] > 0.998, e  # the budget holds at the smoke grid
            assert (e["x_min"] is None) == (fam == "activations"), e  # activations: errors only
    assert got["sparge_attn (defaults)", "weak"]["at"]["off"][0] > 0.1  # the plain rule does not
    for fast in ("sparge_attn exact cdf=0.93 topk=0.3 block_size=128", "sol_attn block_size=128 tau=0.5"):
        assert (fast, "original") in got and (fast, "weak") not in got  # documented fast settings: original only
    assert got["vmoba_attn (defaults)", "original"]["n"] == 3  # three layer modes, one head count
    over = {r["case"]: r for r in data["overhead"]}
    assert over["sparge_attn forced dense, loop (mean)"]["dense"] is True
    assert over["sparge_attn forced dense, later requests"]["dense"] is True
    for mode in ("loop (mean)", "later requests"):  # against dense requests timed next to each request
        r = over[f"sol_attn forced dense, {mode}"]
        assert r["paired_dense_ms"] > 0 and r["speedup"] == pytest.approx(r["paired_dense_ms"] / r["ms"]), r
        assert r["kernel"] == "torch_sdpa", r  # the dense kernel the fallback ran (the CPU's automatic choice)
    assert "paired_dense_ms" not in over["sol_attn forced dense, per call"]  # timed against the one dense figure
    step = over["sparge_attn forced dense, deciding step"]  # a fresh request's first step, against one dense call
    assert step["dense"] is True and step["paired_dense_ms"] > 0 and step["ms"] > 0, step
    assert {r["shape"] for r in data["sage_vs_fa"]} == {"1,2,256,128", "1,2,128,64"}
    assert set(data["checks"]) >= {"defaults_within_5_percent", "two_backends_1_5x", "sage_at_least_fa"}
    # structured cases are timed in pairs with the dense kernel (--paired 2 in the smoke run), the speed-up from them
    rows = json.loads((out / "fidelity" / "fidelity.json").read_text())["rows"]
    sparse = {"sparge_attn", "sol_attn", "vmoba_attn", "sparse_video_gen_2_attn"}
    timed = [r for r in rows if r.get("backend") in sparse and r.get("ms")]
    assert timed and all(r.get("pairs") == 2 and r["paired_dense_ms"] > 0 for r in timed), timed[:2]
    assert all(r["speedup"] == pytest.approx(r["paired_dense_ms"] / r["ms"]) for r in timed)
    files = [os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs]
    assert len(files) <= 8 and max(f.count(os.sep) for f in files) <= 1, files
    table = stdout[stdout.rindex("| case | family | budget |") :].strip().splitlines()
    assert len(table) == 2 + len(data["summary"]) == 2 + 5 * 3 + 3, table  # the table ends the output
    assert table[-1].startswith("| skip_softmax (budget) | weak | default |"), table[-1]


def test_paired_timing_alternates_and_returns_both_means(monkeypatch):
    import time

    fid = _fidelity()
    monkeypatch.setattr(fid, "DEVICE", "cpu")  # the host clock alone (no device to synchronise)
    calls = []

    def case():
        calls.append("c")
        time.sleep(0.002)

    def dense():
        calls.append("d")
        time.sleep(0.006)

    c_ms, d_ms = fid.paired_ms(case, dense, 5)
    assert calls == ["c", "d"] * 7  # two warm-up rounds, then five timed ones, alternating
    assert c_ms >= 2.0 and d_ms >= 6.0 and d_ms - c_ms > 2.0, (c_ms, d_ms)  # sleeps only overshoot


def test_request_timing_alternates_requests_with_dense_ones(monkeypatch):
    import time

    import ditattn

    fid = _fidelity()
    monkeypatch.setattr(fid, "DEVICE", "cpu")
    monkeypatch.setattr(fid, "REQUEST_STEPS", 3)
    calls = []

    def case(q, k, v, **kw):
        calls.append(("c", kw["step"]))
        time.sleep(0.002)

    def dense():
        calls.append(("d", None))
        time.sleep(0.006)

    monkeypatch.setattr(ditattn, "attention", case)
    c_ms, d_ms = fid.request_ms(None, None, None, (1, 2, 3), "sol_attn", {}, dense, requests=2)
    one = [("c", fid.LOOP_STEP0 + i) for i in range(3)] + [("d", None)] * 3
    assert calls == one * 3  # a warm-up pair, then two timed ones: each request next to a dense one
    assert c_ms >= 2.0 and d_ms >= 6.0 and d_ms - c_ms > 2.0, (c_ms, d_ms)


def test_budget_lists_per_backend():
    fid = _fidelity()
    assert fid.budgets_for("default,off", "sol_attn") == ["default", "off"]
    assert fid.budgets_for("default,sol_attn:0.02,sparge_attn:0.01", "sol_attn") == ["default", "0.02"]
    assert fid.budgets_for("sol_attn:0.02", "sparge_attn") == ["default"]
    assert fid.budgets_for("default,off", "sage_attn") == ["default"]
    assert fid.check_budget_spec("default,off,0.03,sol_attn:0.02") is None
    assert fid.check_budget_spec("default,sage_attn:0.1") == "sage_attn:0.1"
    assert fid.check_budget_spec("default,1.5") == "1.5"
    skip = fid.budget_config("skip_softmax", {"error_budget": None}, "0.5")
    assert skip == {"threshold_scale_factor": pytest.approx(1.0)}  # dropped mass <= 1 / (1 + 1)
    assert fid.budget_config("skip_softmax", {"error_budget": None}, "off") == {"threshold_scale_factor": None}
    assert fid.budget_config("sol_attn", {"tau": 2.0}, "off") == {"tau": 2.0, "error_budget": 0.0}


def test_summary_takes_the_worst_over_heads_and_judges_speed_on_structured_inputs():
    fid = _fidelity()

    def row(fam, heads, err, x, budget="default", inp=None):
        return {
            "input": inp or f"structured:{fam}",
            "family": fam,
            "heads": heads,
            "label": "sol_attn (defaults)",
            "budget": budget,
            "rel_err": err,
            "cosine": 1 - err / 10,
            "speedup": x,
            "kept_fraction": 0.5,
            "dense": False,
        }

    rows = [
        row("mixed", 12, 0.01, 1.6),
        row("mixed", 40, 0.04, 0.98),
        row("mixed", 40, 0.2, 2.5, "off"),
        row(None, 2, 0.01, 0.1, inp="activations:x"),
    ]
    s = {e["family"]: e for e in fid.frontier_summary(rows, "default,off")}
    assert s["mixed"]["worst_err"] == 0.04 and (s["mixed"]["x_min"], s["mixed"]["x_max"]) == (0.98, 1.6)
    assert s["mixed"]["ok"] is False  # slower than dense at 40 heads
    assert s["mixed"]["at"]["off"] == (0.2, 2.5)
    assert s["activations"]["x_min"] is None and s["activations"]["ok"] is True
    table = fid.summary_table(list(s.values()))
    assert "| sol_attn (defaults) | mixed | default | 2 | 4.00 % |" in table and "20.00 % / 2.50" in table
