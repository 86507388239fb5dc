"""Upstream's (SGLang) rules where ditattn used to report one backend and run another.

One block per item of the issue, each on simulated platforms (no hardware needed). Items 7 and
8e also have tests in test_pipeline_plan.py / test_selector.py, through ``ditattn plan``.
"""

import json
import logging

import pytest
import torch
from torch import nn

from ditattn import AttentionConfigError, LocalAttention
from ditattn.attention.backends.sage import SAGE_INTREE_HEAD_DIMS, sage_lacks_sm90_fix
from ditattn.attention.config import parse_attention_backend_config, parse_component_overrides
from ditattn.attention.context import (
    AttentionSettings,
    attention_settings,
    component_scope,
    forward_context,
    request_scope,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.override import prepare_request_override, request_backends
from ditattn.attention.selector import LayerSpec, select_backend
from ditattn.cli import main
from ditattn.platforms import Platform, use_platform
from ditattn.registry import list_backends

BF16 = torch.bfloat16
CPU = Platform.simulate("cpu")


def decide(platform, *, backend=None, overrides=None, comp="transformer", head_dim=128, dtype=BF16, **kw):
    layer = LayerSpec(prefix="blocks.0.attn1", role=kw.pop("role", "self"), head_dim=head_dim, dtype=dtype, **kw)
    settings = AttentionSettings(
        backend=B.from_name(backend) if backend else None, component_overrides=parse_component_overrides(overrides)
    )
    with use_platform(platform), component_scope(comp):
        return select_backend(layer, settings=settings)


class ToyDiT(nn.Module):
    """Two self-attention layers and one cross-attention layer; ``required`` pins the first."""

    def __init__(self, dim=128, dtype=BF16, required=None):
        super().__init__()
        self.attn1 = LocalAttention(
            2, dim, role="self", prefix="blocks.0.attn1", dtype=dtype, required_backend=required
        )
        self.attn2 = LocalAttention(2, dim, role="self", prefix="blocks.1.attn1", dtype=dtype)
        self.attn3 = LocalAttention(2, dim, role="cross", prefix="blocks.1.attn2", dtype=dtype)


def build(settings=None, platform=CPU, **kw):
    settings = settings if settings is not None else AttentionSettings()
    with use_platform(platform), attention_settings(settings), component_scope("transformer"):
        return ToyDiT(**kw)


def prep(model, name=None, platform=CPU, settings=None, **kw):
    settings = settings if settings is not None else AttentionSettings()
    with use_platform(platform):
        return prepare_request_override([model], name, settings, **kw)


# ---- item 1: non-CUDA accelerators ------------------------------------------------------------

NO_FA_KERNEL = {
    "xpu": Platform.simulate("xpu"),
    "npu": Platform.simulate("npu"),
    "musa": Platform.simulate("musa", None, {"flash_attn", "sageattention"}),
    "rocm-aiter-only": Platform.simulate("rocm", None, {"aiter"}),
}


@pytest.mark.parametrize("name", sorted(NO_FA_KERNEL))
def test_fa_without_a_kernel_path_is_reported_as_the_sdpa_substitution(name):
    platform = NO_FA_KERNEL[name]
    d = decide(platform, backend="fa", head_dim=64)
    assert (d.backend, d.requested, d.source) == (B.TORCH_SDPA, B.FA, "cli")
    assert "fa runs torch_sdpa" in d.fallback_reason
    if name == "rocm-aiter-only":
        assert "flash_attn" in d.fallback_reason and "--attention-backend aiter" in d.fallback_reason
    else:
        assert "no FlashAttention kernel" in d.fallback_reason
    info = {i.name: i for i in list_backends(platform)}["fa"]
    assert not info.usable_here and info.substitute_here.startswith("torch_sdpa:") and not info.runtime
    # automatic choice never names fa there either (NPU's ring-attention rule included)
    ring = LayerSpec(role="self", head_dim=64, dtype=BF16, needs_lse=True)
    assert select_backend(ring, component=None, settings=None, platform=platform).backend != B.FA


def test_rocm_with_flash_attn_runs_fa():
    d = decide(Platform.simulate("rocm", None, {"flash_attn"}), backend="fa")
    assert d.backend == B.FA and d.fallback_reason is None and "ROCm" in d.runtime


def test_per_request_fa_override_refused_where_fa_would_be_substituted():
    xpu = NO_FA_KERNEL["xpu"]
    model = build(platform=xpu, dim=64)
    with pytest.raises(AttentionConfigError, match="would run torch_sdpa"):
        prep(model, "fa", platform=xpu)


def test_served_backends_name_the_substitute(capsys):
    assert main(["plan", "--json", "--platform", "npu", "--attention-backend", "fa"]) == 0
    p = json.loads(capsys.readouterr().out)
    dit = [l for c in p["components"] if c["name"] == "transformer" for l in c["layers"]]
    assert {l["backend"] for l in dit} == {"torch_sdpa"} and all(l["requested"] == "fa" for l in dit)


def test_musa_sage_attn_runs_the_package(monkeypatch):
    from ditattn.attention.backends import sage
    from ditattn.attention.backends.base import AttnCall

    assert sage.auto_impl("musa", 64, False) == "package"  # was: the CPU reference
    calls = []

    def fake_sageattn(q, k, v, tensor_layout, is_causal, sm_scale):
        calls.append(tensor_layout)
        return q * 0

    monkeypatch.setattr(sage, "_load", lambda mod, attr: fake_sageattn if mod == "sageattention" else None)
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    out, lse = sage.SAGE_IMPLS["package"].run(q, q, q, AttnCall(), {"impl": "package", "pv_dtype": "fp16"})
    assert calls == ["NHD"] and lse is None
    musa = Platform.simulate("musa", None, {"sageattention"})
    assert decide(musa, backend="sage_attn", head_dim=64).runtime == "sageattention package"
    with pytest.raises(AttentionConfigError, match="no LSE"):  # ring needs the LSE the package lacks
        decide(musa, backend="sage_attn", head_dim=64, needs_lse=True)


# ---- item 2: skip softmax ---------------------------------------------------------------------


def _qkv(seed=0, s=256, d=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, 2, d, generator=g).to(BF16) for _ in range(3)]


def test_skip_softmax_steps_before_start_step_run_dense_fa_not_the_layer_backend():
    model = build(AttentionSettings(backend=B.SAGE_ATTN))  # a lossy server default
    layer = model.attn2
    assert layer.backend == B.SAGE_ATTN
    q, k, v = _qkv()
    state = prep(model, skip_softmax={"threshold_scale_factor": 5.0, "start_step": 3})
    with request_scope(state), forward_context(step=0):
        early = layer(q, k, v)
    with attention_settings(AttentionSettings()), component_scope("ref"):
        dense = LocalAttention(2, 128, role="self", dtype=BF16, default_backend="fa")  # fa on CPU: torch_sdpa
    assert torch.equal(early, dense(q, k, v))
    assert not torch.equal(early, layer(q, k, v))  # the sage default differs (INT8)
    # what the request reports is what runs: the FA path (torch_sdpa here) for self, sage for cross
    assert request_backends([model.attn1, model.attn2, model.attn3], state) == ["torch_sdpa", "sage_attn"]


def test_skip_softmax_with_a_non_fa_override_is_refused():
    model = build()
    ss = {"threshold_scale_factor": 5.0}
    for name in ("sage_attn", "torch_sdpa"):
        with pytest.raises(AttentionConfigError, match="cannot be combined with attention_backend_override"):
            prep(model, name, skip_softmax=ss)
    h200 = Platform.simulate("cuda", (9, 0), {"flash_attn.cute", "triton"})
    state = prep(build(platform=h200), "fa", platform=h200, skip_softmax=ss)  # fa is the skip-softmax path itself
    assert state.skip_softmax is not None and state.override == B.FA


# ---- item 3: SM100 cuDNN first, FA per call when cuDNN has no kernel ---------------------------


def test_sm100_cudnn_choice_falls_back_to_fa_per_call(caplog, monkeypatch):
    from ditattn.attention import selector

    monkeypatch.setattr(selector, "_fallback_logged", set())  # logged once per process and reason
    b200 = Platform.simulate("cuda", (10, 0), {"flash_attn.cute"})
    with use_platform(b200), attention_settings(AttentionSettings()), component_scope("transformer"):
        layer = LocalAttention(2, 128, role="self", prefix="blocks.0.attn1", dtype=BF16)
    d = layer.decision
    assert (d.backend, d.source, d.runtime_fallback) == (B.TORCH_CUDNN_SDPA, "auto", B.FA)
    assert d.to_json()["runtime_fallback"] == "fa"
    q, k, v = _qkv(1)
    with caplog.at_level(logging.WARNING, logger="ditattn.attention"):
        out = layer(q, k, v)  # CPU tensors: cuDNN has no kernel, so the call runs fa (torch_sdpa on CPU)
    expect = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert torch.allclose(out.float(), expect.float(), atol=1e-2)
    assert any(
        "torch_cudnn_sdpa -> fa for this call" in r.getMessage() and r.levelno == logging.WARNING
        for r in caplog.records
    )
    assert d.runtime_fallback_used and request_backends([layer], None) == ["torch_cudnn_sdpa", "fa"]


def test_explicit_cudnn_without_a_kernel_is_a_clear_error():
    from ditattn import attention

    q, k, v = _qkv(2, s=32, d=64)
    with pytest.raises(AttentionConfigError, match="cuDNN"):
        with use_platform(Platform.simulate("cuda", (9, 0), ())):
            attention(q, k, v, backend="torch_cudnn_sdpa")


# ---- item 4: Hopper sage_attn -> fa when the package lacks the SM90 fix -------------------------


@pytest.mark.parametrize(
    "version,lacks",
    [
        ("2.2.0", True),
        ("2.1.1", True),
        ("1.0.6", False),
        ("2.2.0+git.d9704247a513", False),
        ("2.2.1", False),
        (None, False),
    ],
)
def test_sm90_fix_detection(version, lacks):
    pkgs = {"sageattention" + (f"=={version}" if version else "")}
    assert sage_lacks_sm90_fix(Platform.simulate("cuda", (9, 0), pkgs)) is lacks


def test_hopper_sage_head_dims_outside_the_in_tree_kernel_fall_back_to_fa():
    h200 = Platform.simulate("cuda", (9, 0), {"triton", "flash_attn.cute", "sageattention==2.2.0"})
    for d in SAGE_INTREE_HEAD_DIMS:  # the in-tree kernel serves these: sage_attn runs
        dec = decide(h200, backend="sage_attn", head_dim=d)
        assert dec.backend == B.SAGE_ATTN and dec.fallback_reason is None
    dec = decide(h200, backend="sage_attn", head_dim=96)  # used to reach the unfixed package
    assert (dec.backend, dec.requested) == (B.FA, B.SAGE_ATTN)
    assert "SM90 binding fix" in dec.fallback_reason and "2.2.0" in dec.fallback_reason
    fixed = Platform.simulate("cuda", (9, 0), {"triton", "flash_attn.cute", "sageattention==2.2.0+git.d9704247a513"})
    assert decide(fixed, backend="sage_attn", head_dim=96).backend == B.SAGE_ATTN
    no_triton = Platform.simulate("cuda", (9, 0), {"flash_attn.cute", "sageattention==2.2.0"})
    assert decide(no_triton, backend="sage_attn", head_dim=128).backend == B.FA
    # no FlashAttention either: the chain ends at torch_sdpa, and the reason names both hops
    bare = Platform.simulate("cuda", (9, 0), {"sageattention==2.2.0"})
    dec = decide(bare, backend="sage_attn", head_dim=128)
    assert dec.backend == B.TORCH_SDPA and "SM90" in dec.fallback_reason and "fa -> torch_sdpa" in dec.fallback_reason
    # off Hopper the package serves head dims the in-tree kernel does not
    a100 = Platform.simulate("cuda", (8, 0), {"triton", "sageattention==2.2.0"})
    assert decide(a100, backend="sage_attn", head_dim=96).backend == B.SAGE_ATTN


def test_sage_head_dim_nothing_serves_is_refused_at_selection():
    h200 = Platform.simulate("cuda", (9, 0), {"triton"})
    with pytest.raises(AttentionConfigError, match="head dims 32/64/128"):
        decide(h200, backend="sage_attn", head_dim=96)


def test_in_tree_head_dims_match_the_kernel():
    pytest.importorskip("triton")
    from ditattn.attention.kernels.int8_attention import SUPPORTED_HEAD_DIMS

    assert tuple(SUPPORTED_HEAD_DIMS) == SAGE_INTREE_HEAD_DIMS


# ---- item 5: required backends survive request-scoped switches --------------------------------


def test_required_layers_keep_their_backend_under_override_and_skip_softmax():
    model = build(required="torch_sdpa")
    assert model.attn1.decision.source == "required"
    state = prep(model, "sage_attn")
    assert id(model.attn1) not in state.override_table and id(model.attn2) in state.override_table
    assert request_backends([model.attn1, model.attn2], state) == ["torch_sdpa", "sage_attn"]
    state = prep(model, skip_softmax={"threshold_scale_factor": 5.0})
    assert id(model.attn1) not in state.override_table and id(model.attn2) in state.override_table


def test_a_required_sparse_layer_does_not_block_a_dense_override():
    model = build(required="video_sparse_attn")
    state = prep(model, "torch_sdpa")
    assert model.attn1.backend == B.VIDEO_SPARSE_ATTN and id(model.attn1) not in state.override_table


# ---- item 8 ----------------------------------------------------------------------------------


def test_fp8_fa_sm120_explicit_on_sm120_is_refused_not_swapped():
    rtx = Platform.simulate("cuda", (12, 0), {"flash_attn.cute"})
    with pytest.raises(AttentionConfigError, match="SM120 FP8 CuTe kernel is not part of this build"):
        decide(rtx, backend="fp8_fa_sm120")
    # upstream's fallbacks stay: calls the kernel does not serve, and other GPUs, use torch_cudnn_sdpa
    dec = decide(rtx, backend="fp8_fa_sm120", causal=True)
    assert dec.backend == B.TORCH_CUDNN_SDPA and "non-causal" in dec.fallback_reason
    dec = decide(Platform.simulate("cuda", (9, 0), ()), backend="fp8_fa_sm120")
    assert dec.backend == B.TORCH_CUDNN_SDPA and "SM120 only" in dec.fallback_reason


def test_pinning_component_override_substitution_is_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="ditattn.attention"):
        dec = decide(Platform.simulate("cuda", (9, 0), {"triton"}), overrides="transformer=fa")
    assert dec.backend == B.TORCH_SDPA and dec.source == "component"
    warned = [r for r in caplog.records if "fa requested, running torch_sdpa" in r.getMessage()]
    assert warned and all(r.levelno == logging.WARNING for r in warned)


def test_auxiliary_fallback_from_the_global_backend_stays_info(caplog):
    with caplog.at_level(logging.INFO, logger="ditattn.attention"):
        dec = decide(
            CPU,
            backend="sage_attn",
            comp="text_encoder",
            dtype=torch.float32,
            needs_bias=True,
            default_backend=B.TORCH_SDPA,
        )
    assert dec.backend == B.TORCH_SDPA and dec.source == "layer_default"
    assert [r.levelno for r in caplog.records] == [logging.INFO]


@pytest.mark.parametrize(
    "sm,packages,expect",
    [
        ((8, 0), {"flash_attn"}, B.FA),  # was torch_cudnn_sdpa: cuDNN-first is measured on SM90 only
        ((8, 6), (), B.TORCH_SDPA),
        ((8, 9), (), B.TORCH_SDPA),
        ((12, 0), {"flash_attn"}, B.FA),
        ((9, 0), {"flash_attn"}, B.TORCH_CUDNN_SDPA),  # measured on the H200
        ((9, 0), {"flash_attn.cute"}, B.FA),
        ((10, 0), {"flash_attn.cute"}, B.TORCH_CUDNN_SDPA),  # upstream's SM100 rule
    ],
)
def test_cudnn_first_only_where_measured_or_upstream_says(sm, packages, expect):
    assert decide(Platform.simulate("cuda", sm, packages)).backend == expect


@pytest.mark.parametrize(
    "text,expect",
    [
        ("topk=0.5,", {"topk": 0.5}),
        ("dense_layers=0,1,", {"dense_layers": "0,1"}),
        ("sparsity=0.5,,enable_x=true", {"sparsity": 0.5, "enable_x": True}),
    ],
)
def test_trailing_and_empty_commas_never_end_up_in_a_value(text, expect):
    assert parse_attention_backend_config(text) == expect


def test_a_config_of_only_commas_is_an_error():
    with pytest.raises(AttentionConfigError, match="no key=value"):
        parse_attention_backend_config(",")


def test_transformer_2_role_key_keeps_inheritance_for_the_other_role():
    ov = "transformer=torch_cudnn_sdpa,transformer_2.cross=torch_sdpa"
    h200 = Platform.simulate("cuda", (9, 0), {"flash_attn.cute"})
    assert decide(h200, overrides=ov, comp="transformer_2").backend == B.TORCH_CUDNN_SDPA
    assert decide(h200, overrides=ov, comp="transformer_2", role="cross").backend == B.TORCH_SDPA


# ---- item 9: simulate a platform from the CLI -------------------------------------------------


def test_plan_platform_flag_simulates_a_gpu(capsys):
    assert main(["plan", "--json", "--platform", "cuda:90", "--platform-packages", "flash_attn.cute,triton"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["platform"] == {
        "name": "cuda",
        "device": "cuda",
        "capability": [9, 0],
        "simulated": True,
        "packages": ["flash_attn.cute", "triton"],
    }
    dit = [l for c in p["components"] if c["name"] == "transformer" for l in c["layers"]]
    assert {l["backend"] for l in dit} == {"fa"}
    assert main(["plan", "--platform", "cuda:100"]) == 0
    out = capsys.readouterr().out
    assert "capability 10.0" in out and "simulated, packages: none" in out
    assert "torch_cudnn_sdpa has no kernel for run torch_sdpa" in out  # SM100's per-call fallback (no FA here)


def test_backends_platform_flag(capsys):
    assert main(["backends", "--json", "--platform", "xpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    fa = next(b for b in data["backends"] if b["name"] == "fa")
    assert data["platform"]["name"] == "xpu" and not fa["usable_here"] and fa["substitute_here"]
    assert main(["backends", "--platform", "cuda:120", "--platform-packages", "flash_attn.cute"]) == 0
    assert "platform: cuda SM120 [simulated" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--platform", "tpu"], "unknown platform 'tpu'"),
        (["--platform", "cuda:9x"], "bad compute capability"),
        (["--platform", "xpu:90"], "cuda only"),
        (["--platform", "cuda:90", "--platform-packages", "flash-attn"], "unknown package"),
        (["--platform-packages", "triton"], "needs --platform"),
    ],
)
def test_platform_flag_errors_are_one_line(capsys, argv, match):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def test_platform_flags_documented_in_help(capsys):
    for cmd in ("plan", "backends"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "--platform NAME[:SM]" in out and "--platform-packages" in out


def test_server_reports_what_runs_for_required_layers_and_skip_softmax():
    """The server's ``attention_backends`` come from the prepared request state (runner.backends_for),
    not from the override's name."""
    from ditattn.server.runner import BaseRunner

    model = build(AttentionSettings(backend=B.SAGE_ATTN), required="torch_sdpa")
    runner = BaseRunner("toy", [model], dtype=BF16, platform=CPU)
    assert runner.backends_for(runner.prepare(None, None)) == ["sage_attn", "torch_sdpa"]
    state = runner.prepare(None, {"threshold_scale_factor": 5.0})  # self layers: the FA path (torch_sdpa here)
    assert runner.backends_for(state) == ["sage_attn", "torch_sdpa"]
    assert id(model.attn2) in state.override_table and state.override_table[id(model.attn2)][0] == B.TORCH_SDPA
    state = runner.prepare("torch_sdpa", None)
    assert runner.backends_for(state) == ["torch_sdpa"]


@pytest.mark.parametrize(
    "sm,packages,head_dim,label",
    [
        # measured fastest on SM90 from 16k tokens; shorter calls run fa (the measured crossover)
        ((9, 0), {"triton", "sageattention"}, 128, "in-tree Gluon SM90 kernel; fa (exact dense) below 16384 tokens"),
        # a head dim the Gluon kernel lacks
        ((9, 0), {"triton", "sageattention"}, 32, "in-tree Triton INT8 kernel; fa (exact dense) below 16384 tokens"),
        ((8, 0), {"triton", "sageattention"}, 128, "sageattention package"),
        ((8, 0), {"triton"}, 64, "in-tree Triton INT8 kernel"),
        ((8, 0), {"triton", "sageattention"}, 96, "sageattention package"),
    ],
)
def test_plan_runtime_label_is_the_sage_implementation_that_runs(sm, packages, head_dim, label):
    assert decide(Platform.simulate("cuda", sm, packages), backend="sage_attn", head_dim=head_dim).runtime == label


# ---- merged with the arch branch: the sage dispatch table and the typed config ---------------


def test_sage_auto_on_cuda_is_the_plan_rule_including_the_config():
    """``impl=auto`` (backend) and the plan's runtime label (selector) use one rule, including
    ``pv_dtype=fp8``, which the package does not implement; an explicit ``impl`` is what the plan names."""
    from ditattn.attention.backends import sage

    a100 = Platform.simulate("cuda", (8, 0), {"triton", "sageattention"})
    assert sage.auto_impl("cuda", 128, False, "fp16", a100) == "package"
    assert sage.auto_impl("cuda", 128, False, "fp8", a100) == "triton"
    with pytest.raises(AttentionConfigError, match="no pv_dtype fp8"):
        sage.auto_impl("cuda", 96, False, "fp8", a100)
    layer = LayerSpec(prefix="blocks.0.attn1", role="self", head_dim=128, dtype=BF16)
    for config, label in (
        ({}, "sageattention package"),
        ({"pv_dtype": "fp8"}, "in-tree Triton INT8 kernel"),
        ({"impl": "triton"}, "in-tree Triton INT8 kernel"),
    ):
        settings = AttentionSettings(backend=B.SAGE_ATTN, config=config)
        with use_platform(a100), component_scope("transformer"):
            assert select_backend(layer, settings=settings).runtime == label


def test_explicit_package_impl_on_hopper_without_the_sm90_fix_is_refused(monkeypatch):
    from ditattn.attention.backends import sage
    from ditattn.attention.backends.base import AttnCall
    from ditattn.errors import BackendUnavailableError

    monkeypatch.setattr(sage, "_load", lambda mod, attr: (lambda *a, **k: None) if mod == "sageattention" else None)
    q = torch.randn(1, 8, 2, 64, dtype=BF16)
    with use_platform(Platform.simulate("cuda", (9, 0), {"triton", "sageattention==2.2.0"})):
        with pytest.raises(BackendUnavailableError, match="impl package: sageattention 2.2.0 lacks the upstream SM90"):
            sage.sage_impl_for(q, AttnCall(), {"impl": "package"})
    with use_platform(Platform.simulate("cuda", (9, 0), {"triton", "sageattention==2.2.0+git.d9704247a513"})):
        with pytest.raises(AttentionConfigError, match="runs on CUDA and MUSA, not cpu"):  # the fix: only the device
            sage.sage_impl_for(q, AttnCall(), {"impl": "package"})


def test_simulated_platform_is_a_typed_config_section(tmp_path, capsys):
    from ditattn.entrypoints import plan
    from ditattn.runconfig import RunConfig, SimulationConfig

    sim = SimulationConfig(platform=" CUDA:90 ", platform_packages="flash_attn.cute, triton")
    assert (sim.platform, sim.platform_packages) == ("cuda:90", ("flash_attn.cute", "triton"))
    for bad, match in (
        ({"platform": "tpu"}, "platform: unknown platform 'tpu'"),
        ({"platform_packages": ["triton"]}, "needs --platform"),
        ({"platform": "cuda", "platform_packages": 3}, "platform_packages: expected"),
    ):
        with pytest.raises(AttentionConfigError, match=match):
            SimulationConfig(**bad)
    assert plan.run(RunConfig(simulation=sim, json=True)) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["platform"]["simulated"] and p["platform"]["capability"] == [9, 0]
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("platform: xpu\njson: true\n")
    assert main(["backends", "--config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["platform"]["name"] == "xpu"
    cfg.write_text("platform: cuda:90\n")  # plan and backends only: generate runs on the machine here
    assert main(["generate", "--prompt", "x", "--config", str(cfg)]) == 2
    assert "key 'platform' does not apply here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--platform", "cuda:90"])
