"""bench/cache_frontier.py: its tuning and held-out prompt sets are disjoint from each other and from the
shipped calibration's prompts, and a small run reports a threshold-0 variant as the uncached clip."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("cache_frontier", os.path.join(ROOT, "bench", "cache_frontier.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prompt_sets_are_disjoint_from_each_other_and_from_the_calibration():
    calibration = set(json.load(open(_calibration()))["prompts"])
    assert calibration
    sets = _bench().prompt_sets(calibration)
    tuning, heldout = set(sets["tuning"]), set(sets["heldout"])
    assert len(heldout) == len(sets["heldout"]) == 30 and len(tuning) == len(sets["tuning"]) >= 24
    assert not tuning & heldout
    assert not (tuning | heldout) & calibration
    # the order is fixed: the same call gives the same sets
    assert _bench().prompt_sets(calibration) == sets


def test_small_run_reports_threshold_zero_as_uncached(tmp_path, run_bench):
    out = tmp_path / "f.json"
    run_bench(
        "cache_frontier.py",
        "--prompt-set",
        "heldout",
        "--prompts",
        "1",
        "--size",
        "32x32x5",
        "--steps",
        "4",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--variant",
        "teacache:threshold=0,start_step=0",
        "--variant",
        "magcache:threshold=1,start_step=0,max_consecutive_skips=2",
        "--output",
        str(out),
    )
    rep = json.loads(out.read_text())
    mod = _bench()
    assert rep["meta"]["prompt_set"] == "heldout"
    assert rep["meta"]["prompts"] == mod.prompt_sets(set(json.load(open(_calibration()))["prompts"]))["heldout"][:1]
    rows = {r["variant"]: r for r in rep["rows"]}
    exact = rows["teacache:threshold=0,start_step=0"]
    assert exact["forward_ratio"] == 1.0 and exact["psnr_mean"] == 99.0 and exact["verdicts_lost"] == 0
    lossy = rows["magcache:threshold=1,start_step=0,max_consecutive_skips=2"]
    assert lossy["forward_ratio"] > 1.0 and lossy["psnr_mean"] < 99.0


def _calibration():
    from ditattn.cache.calibration import packaged_calibration

    return packaged_calibration("ditattn:shapes")
