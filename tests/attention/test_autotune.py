"""Autotune decision logic with injected timings."""

import pytest
import torch

from ditattn import LocalAttention
from ditattn.attention import autotune
from ditattn.attention.backends import base
from ditattn.attention.backends.base import AttnCall
from ditattn.attention.context import AttentionSettings, attention_settings, component_scope
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import LayerRequest
from ditattn.platforms import Platform, use_platform

CPU = Platform.simulate("cpu")


@pytest.fixture
def fake_backends(monkeypatch):
    """Three CPU-runnable stand-ins: the incumbent (sdpa), a faster exact one, a fast wrong one."""
    sdpa = base.get_impl(B.TORCH_SDPA)

    def exact(q, k, v, call, cfg):
        return sdpa(q, k, v, call, cfg)

    def wrong(q, k, v, call, cfg):
        out, lse = sdpa(q, k, v, call, cfg)
        return out + 0.5, lse

    impls = {B.TORCH_SDPA: sdpa, B.TORCH_CUDNN_SDPA: exact, B.SAGE_ATTN: wrong}
    monkeypatch.setattr(autotune, "get_impl", lambda b: impls[b])
    monkeypatch.setattr(autotune, "auto_candidates", lambda req, plat: [B.TORCH_SDPA, B.TORCH_CUDNN_SDPA, B.SAGE_ATTN])
    # pretend these run on this "platform"
    monkeypatch.setattr(autotune, "SPECS", {b: _Usable() for b in B})
    return impls


class _Usable:
    lossy = False

    def reasons(self, req, platform):
        return []


def _timer(times):
    def timer(fn, device):
        impl = fn.__defaults__[0]
        return times[impl.__name__]

    return timer


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 64, 2, 32, generator=g) for _ in range(3)]


def test_switches_to_faster_candidate_that_agrees(fake_backends):
    q, k, v = _qkv()
    res = autotune.tune(
        B.TORCH_SDPA,
        LayerRequest(dtype=torch.float32),
        CPU,
        q,
        k,
        v,
        AttnCall(),
        timer=_timer({"torch_sdpa": 1.0, "exact": 0.5, "wrong": 0.1}),
    )
    assert res.chosen == B.TORCH_CUDNN_SDPA
    assert "output differs" in res.rejected["sage_attn"]
    assert "2.00x" in res.reason


def test_keeps_incumbent_within_noise_margin(fake_backends):
    q, k, v = _qkv()
    res = autotune.tune(
        B.TORCH_SDPA,
        LayerRequest(dtype=torch.float32),
        CPU,
        q,
        k,
        v,
        AttnCall(),
        timer=_timer({"torch_sdpa": 1.0, "exact": 0.99, "wrong": 0.1}),
    )
    assert res.chosen == B.TORCH_SDPA and "kept" in res.reason


def test_layer_tunes_once_on_first_large_call_and_only_auto_choices(fake_backends, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_QUERY_ELEMENTS", 64 * 2 * 32)
    calls = []

    def fake_tune(incumbent, req, platform, q, k, v, call, **kw):
        calls.append(q.shape)
        return autotune.TuneResult(B.TORCH_SDPA if incumbent != B.TORCH_SDPA else B.TORCH_SDPA, {}, {}, "kept")

    monkeypatch.setattr(autotune, "tune", fake_tune)
    with use_platform(CPU), attention_settings(AttentionSettings(autotune=True)):
        with component_scope("transformer"):
            auto_layer = LocalAttention(2, 32, dtype=torch.float32)
            explicit_layer = LocalAttention(2, 32, dtype=torch.float32, required_backend="torch_sdpa")
    small = torch.randn(1, 8, 2, 32)
    big = torch.randn(1, 64, 2, 32)
    auto_layer(small, small, small)
    assert calls == []  # below the size threshold
    auto_layer(big, big, big)
    auto_layer(big, big, big)
    assert calls == [big.shape]  # once
    explicit_layer(big, big, big)
    assert calls == [big.shape]  # never for a required/explicit choice


def test_layer_records_autotune_switch(fake_backends, monkeypatch):
    monkeypatch.setattr(autotune, "MIN_QUERY_ELEMENTS", 1)
    monkeypatch.setattr(autotune, "time_call", _timer({"torch_sdpa": 1.0, "exact": 0.5, "wrong": 0.1}))
    monkeypatch.setattr(autotune.tune, "__kwdefaults__", {"timer": autotune.time_call, "noise_margin": 0.03})
    import ditattn.attention.layer as layer_mod

    monkeypatch.setattr(layer_mod, "get_impl", lambda b: fake_backends[b])
    with use_platform(CPU), attention_settings(AttentionSettings(autotune=True)):
        with component_scope("transformer") as scope:
            layer = LocalAttention(2, 32, dtype=torch.float32, prefix="blocks.0.attn1")
    q, k, v = _qkv()
    layer(q, k, v)
    assert layer.backend == B.TORCH_CUDNN_SDPA
    assert scope.decisions[0].source == "autotune" and "autotune" in scope.decisions[0].fallback_reason


def test_cli_choice_is_never_tuned():
    with use_platform(CPU), attention_settings(AttentionSettings(autotune=True, backend=B.TORCH_SDPA)):
        with component_scope("transformer"):
            layer = LocalAttention(2, 32, dtype=torch.float32)
    assert layer._autotune_pending is False


def test_real_cpu_timer_measures():
    t = autotune.time_call(lambda: sum(range(1000)), torch.device("cpu"), warmup=1, repeats=3)
    assert t > 0
