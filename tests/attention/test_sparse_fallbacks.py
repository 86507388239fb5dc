"""Dense fallbacks made visible, and the platform rules around them: MPS runs SDPA for every explicit
backend, one rule for explicit ``fa`` on a call FlashAttention cannot serve, the unfixed sageattention
refused up front on Hopper, the sage_attn Hopper crossover, and the per-layer accounting of a run
(run summary, plan after a run, compare)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ditattn.cli import main


def _plan(capsys, *argv):
    rc = main(["plan", "--json", *argv])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


def _dit_layers(plan, role="self"):
    return [l for c in plan["components"] if c["name"] == "transformer" for l in c["layers"] if l["role"] == role]


@pytest.mark.parametrize("backend", ["sage_attn", "sparge_attn", "fa"])
def test_mps_runs_sdpa_for_an_explicit_backend_and_records_it(capsys, backend):
    rc, plan, err = _plan(capsys, "--platform", "mps", "--attention-backend", backend)
    assert rc == 0, err
    layers = _dit_layers(plan)
    assert {l["backend"] for l in layers} == {"torch_sdpa"}
    assert {l.get("requested") for l in layers} == {backend}
    assert all(
        l["fallback_reason"] and ("MPS" in l["fallback_reason"] or "mps" in l["fallback_reason"]) for l in layers
    )


@pytest.mark.parametrize(
    "platform,dtype,installed",
    [
        ("cuda:90", "float32", "flash_attn.cute"),
        ("cuda:90", "float32", ""),
        ("cuda:75", "bfloat16", "flash_attn"),
        ("cuda:75", "bfloat16", ""),
    ],
)
def test_explicit_fa_on_a_call_it_cannot_serve_is_one_rule(capsys, platform, dtype, installed):
    """float32 or below SM80: torch_sdpa with the reason, whether FlashAttention is installed or not."""
    argv = ["--platform", platform, "--dtype", dtype, "--attention-backend", "fa"]
    if installed:
        argv += ["--platform-packages", installed]
    rc, plan, err = _plan(capsys, *argv)
    assert rc == 0, err
    layers = _dit_layers(plan)
    assert {l["backend"] for l in layers} == {"torch_sdpa"} and {l["requested"] for l in layers} == {"fa"}
    why = layers[0]["fallback_reason"]
    assert "FlashAttention cannot serve this call" in why
    assert ("float32" in why) if dtype == "float32" else ("SM80" in why)


def test_unfixed_sageattention_on_hopper_is_refused_up_front(capsys):
    rc = main(
        [
            "plan",
            "--platform",
            "cuda:90",
            "--platform-packages",
            "sageattention==2.2.0,triton",
            "--attention-backend",
            "sage_attn",
            "--attention-backend-config",
            "impl=package",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "impl package cannot run here" in err and "SM90 binding fix" in err and "Traceback" not in err
    # the fixed build is accepted
    rc, _, err = _plan(
        capsys,
        "--platform",
        "cuda:90",
        "--platform-packages",
        "sageattention==2.2.0+git.d9704247a513,triton",
        "--attention-backend",
        "sage_attn",
        "--attention-backend-config",
        "impl=package",
    )
    assert rc == 0, err
    # `backends` no longer says the unfixed package runs sage_attn here (no Triton: nothing else does)
    assert main(["backends", "--json", "--platform", "cuda:90", "--platform-packages", "sageattention==2.2.0"]) == 0
    sage = next(b for b in json.loads(capsys.readouterr().out)["backends"] if b["name"] == "sage_attn")
    assert not sage["usable_here"]


def test_sage_crossover_routes_short_hopper_calls_to_fa(monkeypatch, capsys):
    from ditattn.attention.backends import sage_crossover as sc

    assert sc.DEFAULT_MIN_SEQ_LEN == 16384  # the first measured length where sage_attn beats fa
    assert all(x < 1.0 for s, _, _, x in sc.H200_SAGE_VS_FA if s < sc.DEFAULT_MIN_SEQ_LEN)

    class FakeQ:
        device = torch.device("cuda")

        def __init__(self, s):
            self.shape = (1, s, 12, 128)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    sc._is_sm90.cache_clear()  # the capability is asked once per device
    assert "4096 tokens < min_seq_len 16384" in sc.routes_to_dense(FakeQ(4096), {"impl": "auto"})
    assert sc.routes_to_dense(FakeQ(16384), {"impl": "auto"}) is None
    assert sc.routes_to_dense(FakeQ(4096), {"impl": "sm90"}) is None  # an explicit kernel runs as asked
    assert sc.routes_to_dense(FakeQ(4096), {"impl": "auto", "min_seq_len": 0}) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    sc._is_sm90.cache_clear()
    assert sc.routes_to_dense(FakeQ(4096), {"impl": "auto"}) is None  # measured on Hopper only
    monkeypatch.undo()
    sc._is_sm90.cache_clear()
    rc, plan, err = _plan(
        capsys,
        "--platform",
        "cuda:90",
        "--platform-packages",
        "triton,flash_attn.cute",
        "--attention-backend",
        "sage_attn",
    )
    assert rc == 0, err
    assert all("fa (exact dense) below 16384 tokens" in l["runtime"] for l in _dit_layers(plan))


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an SM90 GPU"
)
def test_sage_short_call_on_hopper_equals_fa():
    import ditattn

    q, k, v = (torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = ditattn.attention(q, k, v, backend="sage_attn")
    torch.testing.assert_close(out, ditattn.attention(q, k, v, backend="fa"), rtol=0, atol=0)


def test_run_summary_and_plan_after_a_run_count_dense_fallbacks(caplog):
    """tiny-wan's grid is below Sparge's 128-token floor: every call runs dense, the run summary and the
    plan after the run count the fallbacks per layer, and the log says so once."""
    from ditattn.attention.context import AttentionSettings
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.attention.sparse.fallback import clear_dense_notes
    from ditattn.pipelines.wan import WanPipelineNative

    clear_dense_notes()
    pipe = WanPipelineNative.from_pretrained(
        "ditattn:tiny-wan", AttentionSettings(backend=B.SPARGE_ATTN), device="cpu", dtype=torch.bfloat16
    )
    with caplog.at_level(logging.INFO, logger="ditattn.attention.sparse"):
        res = pipe.generate(
            "a cat", num_inference_steps=2, height=32, width=32, num_frames=1, output_type="latent", progress=False
        )
    said = [r for r in caplog.records if "runs dense attention" in r.getMessage()]
    assert len(said) == 1 and "tokens < 128" in said[0].getMessage()
    layers = res.stats["sparse_layers"]
    assert layers and all(
        e["dense_fallbacks"] == e["calls"] == 2 and e["kept_fraction"] == 1.0 for e in layers.values()
    )
    assert res.stats["sparse"]["dense_fallbacks"] == 2 * len(layers)
    plan = pipe.plan()
    rows = [f"{c['name']}.{l['prefix']}" for c in plan["components"] for l in c["layers"] if "sparse_run" in l]
    assert set(rows) == set(layers) and plan["sparse_run"]["dense_fallbacks"] == 2 * len(layers)
    assert any("tokens < 128" in r for r in plan["dense_notes"]["sparge_attn"])


def test_compare_summary_counts_dense_fallbacks():
    from ditattn.evaluation.report import format_summary, summarise

    runs = [{"dit_s": 1.0, "total_s": 2.0, "kept_fraction": 0.8, "dense_fallback_calls": n} for n in (3, 4)]
    s = summarise(runs, None)
    assert s["dense_fallback_calls"] == 7
    table = format_summary({"variants": [{"name": "sparge", "summary": s}]})
    assert "fallbk" in table.splitlines()[0] and table.splitlines()[1].split()[-1] == "7"


@pytest.mark.parametrize("backend", ["sparge_attn", "sparse_video_gen_2_attn"])
def test_plan_says_below_which_length_a_sparse_backend_runs_dense(capsys, backend):
    """On CUDA the unset min_seq_len is 16384 tokens and the plan's runtime says so; min_seq_len=0 drops it;
    on the CPU (no minimum) nothing is added."""
    gpu = ("--platform", "cuda:90", "--platform-packages", "triton,flash_attn.cute", "--dtype", "bfloat16")
    rc, plan, err = _plan(capsys, *gpu, "--attention-backend", backend)
    assert rc == 0, err
    assert all(l["runtime"].endswith("dense kernel below 16384 tokens") for l in _dit_layers(plan)), plan
    rc, plan, err = _plan(capsys, *gpu, "--attention-backend", backend, "--attention-backend-config", "min_seq_len=0")
    assert rc == 0 and not any("dense kernel below" in l["runtime"] for l in _dit_layers(plan)), err
    rc, plan, err = _plan(capsys, "--attention-backend", backend, "--dtype", "bfloat16")
    assert rc == 0 and not any("dense kernel below" in l["runtime"] for l in _dit_layers(plan)), err


def test_a_named_dense_phase_that_is_the_automatic_choice_takes_the_cached_path(monkeypatch):
    """A sparse backend's dense phase that names the backend the platform would pick anyway (Sol's
    ``dense_backend``) runs through the cached automatic decision, with the same output as the public entry;
    another named backend still goes through the public entry."""
    import ditattn
    from ditattn.attention import functional
    from ditattn.attention.sparse.block_sparse import dense_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 37, 3, 32, generator=g) for _ in range(3))
    auto = functional.auto_dense_backend(q, k)
    seen = []
    real = functional.auto_dense_attention
    monkeypatch.setattr(functional, "auto_dense_attention", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    out, lse = dense_attention(q, k, v, backend=auto, return_lse=True)
    ref, ref_lse = ditattn.attention(q, k, v, backend=auto, return_lse=True)
    assert seen == [1]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    other = "fa" if auto != "fa" else "torch_sdpa"
    out2, _ = dense_attention(q, k, v, backend=other)
    assert seen == [1]  # the public entry, not the cached automatic path
    torch.testing.assert_close(out2, ref, atol=2e-3, rtol=2e-3)
