"""bench/dit_quant.py on the tiny architecture (CPU smoke of the H200 benchmark's code paths): the
diffusers baseline, bf16 and INT8 rows with errors against bf16, FP8 refused with its reason here."""

import json

import pytest
import torch

pytest.importorskip("torchao")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_dit_quant_smoke(tmp_path, run_bench):
    stdout = run_bench(
        "dit_quant.py",
        "--arch",
        "tiny",
        "--res",
        "tiny",
        "--backends",
        "torch_sdpa",
        "--min-features",
        "128",
        "--repeats",
        "1",
        "--timesteps",
        "900,100",
        "--out-dir",
        str(tmp_path),
    )
    rows = {(r["side"], r["quant"]): r for r in json.load(open(tmp_path / "dit_quant_tiny.json"))["rows"]}
    assert rows[("diffusers", "none")]["ms"] > 0
    bf16, int8 = rows[("ditattn", "none")], rows[("ditattn", "int8")]
    assert bf16["max_rel_err_vs_bf16"] == 0 and bf16["per_step"][0]["rel_err_vs_diffusers"] < 2e-2
    assert int8["quantized_linears"] == 16 and [s["t"] for s in int8["per_step"]] == [900.0, 100.0]
    assert 1e-5 < int8["max_rel_err_vs_bf16"] < 3e-2 and int8["min_cos_vs_bf16"] > 0.999
    assert "compute capability >= 8.9" in rows[("ditattn", "fp8")]["error"]
    assert stdout.strip().splitlines()[-1].startswith("ditattn   torch_sdpa   int8")  # the table comes last
