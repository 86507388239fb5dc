"""Every selection rule (priority, strictness, substitutions), on simulated platforms (no hardware needed)."""

import threading

import pytest
import torch

from ditattn import AttentionConfigError, LocalAttention
from ditattn.attention.config import parse_component_overrides
from ditattn.attention.context import (
    AttentionSettings,
    RequestState,
    attention_settings,
    component_scope,
    current_request,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
    request_scope,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.selector import LayerSpec, check_overrides_used, select_backend
from ditattn.platforms import Platform, use_platform

FA4 = {"flash_attn.cute", "triton"}
H200 = Platform.simulate("cuda", (9, 0), FA4)
H200_NO_FA = Platform.simulate("cuda", (9, 0), {"triton"})
CPU = Platform.simulate("cpu")
BF16 = torch.bfloat16


def sel(
    layer=None,
    *,
    comp="transformer",
    backend=None,
    overrides=None,
    platform=H200,
    ring=1,
    explicit=None,
    dtype=BF16,
    **kw,
):
    layer = layer or LayerSpec(prefix="blocks.0.attn1", role="self", head_dim=128, dtype=dtype, **kw)
    settings = AttentionSettings(
        backend=B.from_name(backend) if backend else None,
        component_overrides=parse_component_overrides(overrides),
        ring_degree=ring,
    )
    with use_platform(platform), component_scope(comp) as scope:
        d = select_backend(layer, explicit=B.from_name(explicit) if explicit else None, settings=settings)
    return d, scope


# ---- priority ---------------------------------------------------------------------------------


def test_priority_forced_beats_component_and_cli():
    with global_force_attn_backend_context_manager("torch_sdpa"):
        d, _ = sel(backend="fa", overrides="transformer=torch_cudnn_sdpa")
    assert (d.backend, d.source) == (B.TORCH_SDPA, "forced")


def test_force_function_and_clear():
    global_force_attn_backend("cudnn_sdpa")
    assert sel()[0].backend == B.TORCH_CUDNN_SDPA
    global_force_attn_backend(None)
    assert sel()[0].source == "auto"


def test_context_manager_restores_previous_force():
    global_force_attn_backend("torch_sdpa")
    with global_force_attn_backend_context_manager("fa"):
        assert sel()[0].backend == B.FA
    assert sel()[0].backend == B.TORCH_SDPA


def test_component_override_beats_cli():
    d, scope = sel(backend="fa", overrides="transformer=torch_cudnn_sdpa")
    assert (d.backend, d.source) == (B.TORCH_CUDNN_SDPA, "component")
    assert "transformer" in scope.used_override_keys


def test_role_key_beats_component_key():
    layer = LayerSpec(prefix="blocks.0.attn2", role="cross", head_dim=128, dtype=BF16)
    d, _ = sel(layer, overrides="transformer=fa,transformer.cross=torch_sdpa")
    assert (d.backend, d.source) == (B.TORCH_SDPA, "component_role")
    d, _ = sel(overrides="transformer=fa,transformer.cross=torch_sdpa")  # self layer
    assert (d.backend, d.source) == (B.FA, "component")


def test_transformer_2_inherits_unless_it_has_its_own_keys():
    d, _ = sel(comp="transformer_2", overrides="transformer=torch_cudnn_sdpa")
    assert (d.backend, d.override_key) == (B.TORCH_CUDNN_SDPA, "transformer")
    # transformer_2's own key covers only cross-attention: its self-attention still inherits
    d, _ = sel(comp="transformer_2", overrides="transformer=torch_cudnn_sdpa,transformer_2.cross=torch_sdpa")
    assert (d.backend, d.override_key) == (B.TORCH_CUDNN_SDPA, "transformer")
    d, _ = sel(comp="transformer_2", overrides="transformer=torch_cudnn_sdpa,transformer_2=torch_sdpa")
    assert (d.backend, d.override_key) == (B.TORCH_SDPA, "transformer_2")
    d, _ = sel(comp="transformer_2", overrides="transformer.self=torch_cudnn_sdpa,transformer_2=torch_sdpa")
    assert (d.backend, d.override_key) == (B.TORCH_SDPA, "transformer_2")  # own component key beats inherited role key


def test_cli_global_then_layer_default_then_auto():
    assert sel(backend="torch_cudnn_sdpa")[0].source == "cli"
    d, _ = sel(default_backend=B.TORCH_CUDNN_SDPA)
    assert (d.backend, d.source) == (B.TORCH_CUDNN_SDPA, "layer_default")
    assert sel()[0].source == "auto"


def test_explicit_argument_sits_above_force():
    with global_force_attn_backend_context_manager("torch_sdpa"):
        d, _ = sel(explicit="torch_cudnn_sdpa")
    assert (d.backend, d.source) == (B.TORCH_CUDNN_SDPA, "explicit")


# ---- strictness -------------------------------------------------------------------------------


def test_dit_global_backend_fails_closed():
    with pytest.raises(AttentionConfigError, match="sage_attn_3.*transformer.blocks.0.attn1.*SM100"):
        sel(backend="sage_attn_3")


def test_auxiliary_component_falls_back_to_default_with_reason():
    enc = LayerSpec(
        prefix="encoder.block.0.layer.0.SelfAttention",
        role="self",
        head_dim=64,
        dtype=BF16,
        needs_bias=True,
        default_backend=B.TORCH_SDPA,
    )
    d, _ = sel(enc, comp="text_encoder", backend="fa")
    assert d.backend == B.TORCH_SDPA and d.source == "layer_default"
    assert "additive attention bias" in d.fallback_reason


def test_auxiliary_without_default_falls_back_to_platform_choice():
    enc = LayerSpec(prefix="attn", role="self", head_dim=64, dtype=torch.float32)
    d, _ = sel(enc, comp="text_encoder", backend="fa", platform=H200)  # fa needs fp16/bf16
    # fa on a call it cannot serve is the platform's torch_sdpa substitution, installed or not
    assert d.backend == B.TORCH_SDPA and d.source == "cli" and "dtype float32" in d.fallback_reason


def test_explicit_component_override_is_strict():
    enc = LayerSpec(prefix="attn", role="self", head_dim=64, dtype=BF16, needs_bias=True, default_backend=B.TORCH_SDPA)
    with pytest.raises(AttentionConfigError, match="fa.*additive attention bias"):
        sel(enc, comp="text_encoder", overrides="text_encoder=fa")


@pytest.mark.parametrize("how", ["cli", "component", "forced"])
def test_sparse_self_backend_serves_cross_attention_through_dense(how):
    cross = LayerSpec(prefix="blocks.0.attn2", role="cross", head_dim=128, dtype=BF16)
    kw = {
        "cli": dict(backend="video_sparse_attn"),
        "component": dict(overrides="transformer=video_sparse_attn"),
        "forced": {},
    }[how]
    if how == "forced":
        with global_force_attn_backend_context_manager("video_sparse_attn"):
            d, _ = sel(cross)
    else:
        d, _ = sel(cross, **kw)
    assert d.backend == B.FA and d.requested == B.VIDEO_SPARSE_ATTN
    assert "cannot serve cross-attention" in d.fallback_reason
    self_d, _ = sel(**kw) if how != "forced" else (None, None)
    if self_d is not None:
        assert self_d.backend == B.VIDEO_SPARSE_ATTN


def test_sparse_cross_fallback_prefers_dense_cli_backend():
    cross = LayerSpec(prefix="blocks.0.attn2", role="cross", head_dim=128, dtype=BF16)
    d, _ = sel(cross, backend="torch_cudnn_sdpa", overrides="transformer=sliding_tile_attn")
    assert d.backend == B.TORCH_CUDNN_SDPA


def test_sparse_role_override_on_cross_runs_a_dense_backend():
    cross = LayerSpec(prefix="blocks.0.attn2", role="cross", head_dim=128, dtype=BF16)
    d, scope = sel(cross, overrides="transformer.cross=video_sparse_attn")
    assert (d.backend, d.source, d.requested) == (B.FA, "component_role", B.VIDEO_SPARSE_ATTN)
    assert "cannot serve cross-attention" in d.fallback_reason
    assert "transformer.cross" in scope.used_override_keys


def test_backend_sets_are_hints_not_allowlists():
    d, _ = sel(backend="torch_cudnn_sdpa", supported_backends=(B.TORCH_SDPA,))
    assert d.backend == B.TORCH_CUDNN_SDPA
    d, _ = sel(supported_backends=(B.TORCH_SDPA,))  # auto follows the hint
    assert d.backend == B.TORCH_SDPA


def test_required_backend_survives_overrides():
    d, _ = sel(backend="fa", overrides="transformer=torch_cudnn_sdpa", required_backend=B.TORCH_SDPA)
    assert (d.backend, d.source) == (B.TORCH_SDPA, "required")


def test_ring_needs_lse_fail_closed():
    with pytest.raises(AttentionConfigError, match="LSE"):
        sel(backend="video_sparse_attn", ring=2)
    assert sel(backend="fa", ring=2)[0].backend == B.FA


def test_fail_closed_on_missing_operations():
    layer = LayerSpec(prefix="p", role="self", head_dim=128, dtype=BF16, varlen=True)
    with pytest.raises(AttentionConfigError, match="variable-length"):
        sel(layer, explicit="torch_cudnn_sdpa")
    cross = LayerSpec(prefix="p", role="cross", head_dim=128, dtype=BF16)
    with pytest.raises(AttentionConfigError, match="cross-attention"):
        sel(cross, explicit="sliding_tile_attn")


# ---- platform substitutions ---------------------------------------------------------------------


def test_fa_without_runtime_substitutes_sdpa_and_records_it():
    d, _ = sel(backend="fa", platform=H200_NO_FA)
    assert d.backend == B.TORCH_SDPA and d.requested == B.FA and d.source == "cli"
    assert "no FlashAttention runtime installed" in d.fallback_reason
    d, _ = sel(backend="fa", platform=CPU, dtype=torch.float32)
    assert d.backend == B.TORCH_SDPA and "cpu" in d.fallback_reason


def test_fp8_sm120_falls_back_to_cudnn_off_sm120_and_for_unsupported_calls():
    d, _ = sel(backend="fp8_fa_sm120", platform=H200)
    assert d.backend == B.TORCH_CUDNN_SDPA and "SM120" in d.fallback_reason


def test_substitution_never_overrides_semantics():
    enc = LayerSpec(prefix="attn", role="self", head_dim=64, dtype=torch.float32, needs_bias=True)
    with pytest.raises(AttentionConfigError, match="bias"):
        sel(enc, comp="text_encoder", overrides="text_encoder=fa", platform=CPU)


# ---- override bookkeeping ----------------------------------------------------------------------


def test_unused_unknown_and_fixed_overrides_are_errors():
    ov = parse_component_overrides("transformer.cross=fa")
    with use_platform(H200), attention_settings(AttentionSettings(component_overrides=ov)):
        with component_scope("transformer") as t:
            LocalAttention(2, 64, role="self", dtype=BF16)
        with component_scope("vae", selectable=False) as vae:
            pass
    scopes = {"transformer": t, "vae": vae}
    with pytest.raises(AttentionConfigError, match="'transformer.cross' was not used"):
        check_overrides_used(ov, scopes, ["transformer", "vae"])
    with pytest.raises(AttentionConfigError, match="unknown component 'text_encoder_2'"):
        check_overrides_used(parse_component_overrides("text_encoder_2=fa"), scopes, ["transformer", "vae"])
    with pytest.raises(AttentionConfigError, match="'vae' has fixed attention"):
        check_overrides_used(parse_component_overrides("vae=fa"), scopes, ["transformer", "vae"])


def test_local_attention_records_decision_in_component():
    with use_platform(CPU), attention_settings(AttentionSettings(backend=B.FA)):
        with component_scope("transformer") as scope:
            layer = LocalAttention(2, 32, prefix="blocks.0.attn1", dtype=torch.float32)
    assert scope.decisions[0].to_json() == {
        "prefix": "blocks.0.attn1",
        "role": "self",
        "backend": "torch_sdpa",
        "source": "cli",
        "fallback_reason": scope.decisions[0].fallback_reason,
        "requested": "fa",
        "runtime": "in-tree",
    }
    q = torch.randn(1, 5, 2, 32)
    assert layer(q, q, q).shape == q.shape


def test_request_state_is_isolated_between_threads():
    seen = {}
    barrier = threading.Barrier(2)

    def worker(name):
        with request_scope(RequestState(override=B.from_name(name))):
            barrier.wait()
            seen[name] = current_request().override

    ts = [threading.Thread(target=worker, args=(n,)) for n in ("fa", "sage_attn")]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert seen == {"fa": B.FA, "sage_attn": B.SAGE_ATTN}
    assert current_request() is None
