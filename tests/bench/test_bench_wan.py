"""CPU smoke runs of the image-to-video / offload benchmarks (so an H200 session does not find their
bugs): bench/e2e.py --i2v against diffusers, bench/wan_memory.py with block-streamed offload + tiling
(each variant in its own process, as on the GPU)."""

import json


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


def test_wan_memory_runs_offload_variants(tmp_path, run_bench):
    out = tmp_path / "mem.json"
    stdout = run_bench(
        "wan_memory.py",
        "--arch",
        "tiny",
        "--res",
        "tiny",
        "--frames",
        "5",
        "--steps",
        "1",
        "--variants",
        "none,group+tiling",
        "--out",
        str(out),
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "group+tiling"] and not any("error" in r for r in rows)
    assert rows[1]["offloaded"] == ["text_encoder", "transformer", "vae"] and rows[1]["vae_tiling"]
    assert rows[0]["frames_shape"] == [1, 5, 64, 64, 3]
    assert stdout.strip().splitlines()[-1].startswith("group+tiling")  # the table is last
