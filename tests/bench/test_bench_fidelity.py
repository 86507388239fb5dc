"""bench/fidelity.py runs end to end on CPU (tiny grid, BENCH_DEVICE=cpu): structured inputs and an
activation file, the STA search workflow, the table printed last, JSON and chart written."""

import json

import torch


def _write_activations(path, grid=(2, 8, 8), heads=2):
    from safetensors.torch import save_file

    from ditattn.evaluation.capture import QKV_FORMAT

    g = torch.Generator().manual_seed(0)
    S = grid[0] * grid[1] * grid[2]
    name = "transformer.blocks.3.attn1@step7"
    tensors = {f"{name}.{t}": torch.randn(1, S, heads, 128, generator=g).to(torch.bfloat16) for t in "qkv"}
    entries = [
        {
            "name": name,
            "layer": "transformer.blocks.3.attn1",
            "layer_idx": 3,
            "step": 7,
            "video_shape": list(grid),
            "text_len": 0,
            "scale": None,
            "prompt": "p",
            "seed": 0,
            "model": "m",
        }
    ]
    save_file(tensors, path, metadata={"format": QKV_FORMAT, "entries": json.dumps(entries)})


def test_fidelity_smoke_on_cpu(tmp_path, run_bench):
    act = str(tmp_path / "act.safetensors")
    _write_activations(act)
    out = tmp_path / "fid"
    stdout = run_bench(
        "fidelity.py",
        "--grid",
        "4,8,8",
        "--heads",
        "2",
        "--cases",
        "sparge_attn (defaults),sparse_video_gen_2_attn (defaults),STA searched (default",
        "--activations",
        act,
        "--ref-rows",
        "64",
        "--out",
        str(out),
        env={"BENCH_DEVICE": "cpu"},
    )
    table = stdout[stdout.index("## Quality-vs-speed frontier") :]
    assert "| structured | 2 | sparge_attn (defaults) |" in table
    assert "activations:transformer.blocks.3.attn1@step7" in table
    data = json.loads((out / "fidelity.json").read_text())
    rows = data["rows"]
    cases = {(r["input"], r["case"]) for r in rows}
    assert ("structured", "STA searched (default candidates)") in cases
    for r in rows:
        assert 0 <= r["rel_err"] < 2 and -1 <= r["cosine"] <= 1 and r["ms"] > 0, r
        assert r["kept_fraction"] is None or 0 < r["kept_fraction"] <= 1
    sta = next(r for r in rows if r["case"].startswith("STA"))
    assert sta["search_s"] > 0 and sta["windows"]
    svg = next(r for r in rows if r["backend"] == "sparse_video_gen_2_attn")
    assert 0 < svg["kept_fraction"] <= 1
    assert (out / "fidelity.png").stat().st_size > 1000
    assert not data["notes"], data["notes"]


def test_case_lists_in_the_docs_name_existing_cases():
    """Every --cases entry of a bench/fidelity.py command in docs/*.md selects at least one case of
    bench/fidelity.py (an exact label selects that case alone)."""
    import importlib.util
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("fidelity_cases", os.path.join(root, "bench", "fidelity.py"))
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)

    labels = [c[0] for c in fidelity.CASES]
    assert len(set(labels)) == len(labels)
    found = 0
    docs = os.path.join(root, "docs")
    for name in sorted(os.listdir(docs)):
        if not name.endswith(".md"):
            continue
        text = open(os.path.join(docs, name), encoding="utf-8").read()
        for m in re.finditer(r'fidelity\.py[^`\n]*?--cases "([^"]+)"', text):
            for entry in m.group(1).split(","):
                found += 1
                assert entry in labels or any(entry in lab for lab in labels), (name, entry)
    assert found >= 10


def test_fidelity_on_activations_captured_from_the_shapes_model(tmp_path, run_bench):
    """bench/capture_qkv.py on the trained ``ditattn:shapes`` (128x128x9: a 3x8x8 grid, four 4x4x4 tiles; two
    steps) writes real q/k/v that bench/fidelity.py reads: every entry becomes an input named with its prompt,
    the dense backend's error is the bf16 rounding floor, the quantized dense reference is close, a sparse
    backend is not, and the per-case summary over the activation inputs is printed and stored."""
    act = str(tmp_path / "shapes_qkv.safetensors")
    out = run_bench(
        "capture_qkv.py",
        "--model-path",
        "ditattn:shapes",
        "--prompt",
        "a red circle moving right",
        "--steps",
        "0,-1",
        "--layers",
        "0,5",
        "--num-inference-steps",
        "2",
        "--height",
        "128",
        "--width",
        "128",
        "--num-frames",
        "9",
        "--out",
        act,
    )
    assert "wrote" in out and "(4 entries)" in out
    act2 = str(tmp_path / "shapes_qkv2.safetensors")
    run_bench(
        "capture_qkv.py",
        "--model-path",
        "ditattn:shapes",
        "--prompt",
        "a blue square moving up",
        "--steps",
        "-1",
        "--layers",
        "2",
        "--num-inference-steps",
        "2",
        "--height",
        "128",
        "--width",
        "128",
        "--num-frames",
        "9",
        "--out",
        act2,
    )
    fid = tmp_path / "fid"
    stdout = run_bench(
        "fidelity.py",
        "--no-structured",
        "--activations",
        act,
        "--activations",
        act2,
        "--error-only",
        "--ref-rows",
        "64",
        "--cases",
        "sage_attn (defaults),video_sparse_attn sparsity=0.75",
        "--out",
        str(fid),
        env={"BENCH_DEVICE": "cpu"},
    )
    data = json.loads((fid / "fidelity.json").read_text())
    rows = data["rows"]
    inputs = {r["input"] for r in rows}
    assert "activations:transformer.blocks.0.attn1@step0 (a red circle moving right)" in inputs
    assert "activations:transformer.blocks.2.attn1@step1 (a blue square moving up)" in inputs
    assert len(inputs) == 5  # 2 layers x 2 steps + 1
    assert all(r["model"] == "ditattn:shapes" and r["grid"] == [3, 8, 8] and r["heads"] == 2 for r in rows)
    dense = [r for r in rows if r["case"] == "dense torch_sdpa"]
    assert len(dense) == 5 and all(r["rel_err"] < 5e-3 and r["cosine"] > 0.9999 for r in dense), dense
    sage = [r for r in rows if r["case"] == "sage_attn (defaults)"]
    assert len(sage) == 5 and all(r["rel_err"] < 0.05 for r in sage), sage
    vsa = [r for r in rows if r["case"].startswith("video_sparse_attn")]
    assert len(vsa) == 5 and all(0 < r["kept_fraction"] < 1 and r["rel_err"] > 1e-2 for r in vsa), vsa
    summary = {s["case"]: s for s in data["activation_summary"]}
    assert summary["dense torch_sdpa"]["n"] == 5 and summary["dense torch_sdpa"]["err_max"] < 5e-3
    assert set(summary["sage_attn (defaults)"]) >= {"err_step0", "err_step1", "err_layer0", "err_layer2", "err_layer5"}
    assert "## Over the activation inputs" in stdout
    assert not data["notes"], data["notes"]


def test_skip_softmax_row_under_loop_runs_the_layer_route(monkeypatch):
    """Under --loop the skip-softmax case is timed as a request's layer runs it: after a first kernel call that
    skipped fewer tiles than the break-even, the dense kernel (its output, its error); without --loop, the kernel."""
    import importlib.util
    import os

    from ditattn.attention import skip_route
    from ditattn.attention.sparse import fallback

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("fidelity_skip", os.path.join(root, "bench", "fidelity.py"))
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)
    monkeypatch.setattr(fidelity, "DEVICE", "cpu")
    monkeypatch.setattr(fidelity.common, "DEVICE", "cpu")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 200, 2, 128, generator=g) for _ in range(3))  # i.i.d.: nothing to skip
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v)))
    exact = exact.transpose(1, 2)
    rows = torch.arange(200)

    class Hopper(skip_route.LayerRoute):  # this CPU as an SM90 device: the break-even applies
        def __init__(self):
            super().__init__(sm=90)

    monkeypatch.setattr(skip_route, "LayerRoute", Hopper)
    monkeypatch.setitem(fallback.MIN_SEQ_LEN, "cpu", 0)
    monkeypatch.setattr(fidelity, "LOOP", False)
    plain = fidelity.skip_softmax_row(q, k, v, (2, 10, 10), rows, exact, 4.0)
    assert "dense" not in plain and plain["kept_fraction"] > 0.5
    monkeypatch.setattr(fidelity, "LOOP", True)
    routed = fidelity.skip_softmax_row(q, k, v, (2, 10, 10), rows, exact, 4.0)
    assert routed["dense"] is True and routed["kept_fraction"] == plain["kept_fraction"]
    assert routed["rel_err"] < 1e-5 and routed["ms"] > 0  # the dense kernel's float32 output
