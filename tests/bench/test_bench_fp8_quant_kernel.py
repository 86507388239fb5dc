"""bench/fp8_quant_kernel.py (the FP8 activation quantizer, old kernel against new) on CPU: its code paths
through Triton's interpreter on a few rows, the JSON and the table; bad arguments and a missing GPU
are one line."""

import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU smoke run; on a GPU run the benchmark itself"
)


def test_fp8_quant_kernel_smoke(tmp_path, run_bench):
    stdout = run_bench(
        "fp8_quant_kernel.py",
        "--tokens",
        "6",
        "--check-rows",
        "4",
        "--shapes",
        "1.3b",
        "--sweep",
        "--out",
        str(tmp_path),
        env={"BENCH_DEVICE": "cpu"},
    )
    data = json.loads((tmp_path / "fp8_quant_kernel.json").read_text())
    rows = data["rows"]
    assert {(r["shape"], r["kernel"]) for r in rows} == {
        (s, k) for s in ("x1536", "ffn8960_gelu") for k in ("old", "new")
    }
    assert sum(r["kernel"] == "new" and r["shape"] == "x1536" for r in rows) > 1  # the sweep
    for r in rows:
        assert r["ms"] > 0 and r["old_vs_new_codes_differ"] == 0 and r["old_vs_new_scales_differ"] == 0
        if not r["gelu"]:  # both kernels are the float64 formula bit for bit
            assert r["codes_differ"] == 0 and r["scales_differ"] == 0
        assert r["max_e4m3_steps"] <= 1
    assert set(data["per_step_ms"]) == {"1.3b/old", "1.3b/new"} and len(data["notes"]) == 2
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("1.3b: quantizer per DiT step (6 calls x 30 blocks")
    assert any(ln.startswith("| x1536 | new | rows=4 warps=8 |") for ln in lines)


def test_fp8_quant_kernel_refusals(monkeypatch, capsys):
    monkeypatch.syspath_prepend(
        os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
    )
    for name in ("common", "fp8_quant_kernel"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("BENCH_DEVICE", raising=False)
    import fp8_quant_kernel as bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--shapes", "7b"])
    assert exc.value.code == 2 and "--shapes takes a comma list of 1.3b, 14b" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--tokens", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # no GPU here, and no BENCH_DEVICE=cpu
        bench.main([])
    assert str(exc.value.code).startswith("error: no CUDA device") and "\n" not in str(exc.value.code)
