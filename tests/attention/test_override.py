"""Per-request override and skip-softmax parameter validation, on a toy DiT."""

import pytest
import torch
from torch import nn

from ditattn import AttentionConfigError, LocalAttention
from ditattn.attention.context import (
    AttentionSettings,
    attention_settings,
    component_scope,
    request_scope,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.override import parse_skip_softmax, prepare_request_override
from ditattn.platforms import Platform, use_platform

CPU = Platform.simulate("cpu")


class ToyDiT(nn.Module):
    def __init__(self, heads=2, dim=32):
        super().__init__()
        self.attn1 = LocalAttention(heads, dim, role="self", prefix="blocks.0.attn1", dtype=torch.float32)
        self.attn2 = LocalAttention(heads, dim, role="cross", prefix="blocks.0.attn2", dtype=torch.float32)

    def forward(self, x, ctx):
        return self.attn2(self.attn1(x, x, x), ctx, ctx)


def build(settings=None, platform=CPU):
    settings = settings if settings is not None else AttentionSettings()
    with use_platform(platform), attention_settings(settings), component_scope("transformer"):
        return ToyDiT()


def prep(model, name=None, settings=None, platform=CPU, **kw):
    settings = settings if settings is not None else AttentionSettings()
    with use_platform(platform):
        return prepare_request_override([model], name, settings, **kw)


def test_override_applies_to_request_only_and_default_returns():
    model = build()
    seen = []
    import ditattn.attention.backends.sage  # noqa: F401  (register the CPU reference)
    from ditattn.attention.backends import base

    real = base.get_impl(B.SAGE_ATTN)

    def spy(q, k, v, call, cfg):
        seen.append(call.layer_key)
        return real(q, k, v, call, cfg)

    state = prep(model, "sage_attn")
    state.override_table = {k: (b, spy, c) for k, (b, _, c) in state.override_table.items()}
    x, ctx = torch.randn(1, 16, 2, 32), torch.randn(1, 7, 2, 32)
    with request_scope(state):
        model(x, ctx)
    assert seen == ["transformer.blocks.0.attn1", "transformer.blocks.0.attn2"]
    seen.clear()
    model(x, ctx)  # next request: server default (torch_sdpa), the spy is not called
    assert seen == [] and model.attn1.backend == B.TORCH_SDPA


@pytest.mark.parametrize(
    "name,match",
    [
        ("nope", "unknown attention backend 'nope'"),
        ("sliding_tile_attn", "not a per-request drop-in"),
        ("torch_cudnn_sdpa", "not a per-request drop-in"),
        ("fa", "would run torch_sdpa instead"),
        ("sage_attn_3", "cannot serve"),
    ],
)
def test_override_refusals(name, match):
    with pytest.raises(AttentionConfigError, match=match):
        prep(build(), name)


def test_refused_under_compile_graphs_sparse_and_ring():
    model = build()
    with pytest.raises(AttentionConfigError, match="torch.compile"):
        prep(model, "torch_sdpa", AttentionSettings(compiled=True))
    with pytest.raises(AttentionConfigError, match="CUDA graphs"):
        prep(model, "torch_sdpa", AttentionSettings(cuda_graphs=True))
    sparse = build(AttentionSettings(backend=B.VIDEO_SPARSE_ATTN))
    with pytest.raises(AttentionConfigError, match="sparse backend video_sparse_attn"):
        prep(sparse, "torch_sdpa")
    h200 = Platform.simulate("cuda", (9, 0), {"flash_attn.cute", "triton", "sageattn3"})
    ring = AttentionSettings(ring_degree=2)
    m = build(ring, h200)
    with pytest.raises(AttentionConfigError, match="sage_attn_3.*LSE|needs a backend that returns the softmax LSE"):
        prep(m, "sage_attn_3", ring, h200)


def test_all_or_nothing():
    """A refusal for one layer leaves no partial switch: nothing global changes."""
    model = build()
    before = (model.attn1.backend, model.attn2.backend)
    with pytest.raises(AttentionConfigError):
        prep(model, "fa")
    assert (model.attn1.backend, model.attn2.backend) == before


@pytest.mark.parametrize(
    "value,match",
    [
        ({}, "threshold_scale_factor is required"),
        ({"threshold_scale_factor": 0}, "positive number"),
        ({"threshold_scale_factor": -1.0}, "positive number"),
        ({"threshold_scale_factor": "big"}, "positive number"),
        ({"threshold_scale_factor": 10, "start_step": -1}, "start_step must be an integer >= 0"),
        ({"threshold_scale_factor": 10, "start_step": 1.5}, "start_step must be an integer >= 0"),
        ({"threshold_scale_factor": 10, "foo": 1}, "unknown key"),
        ([1, 2], "must be an object"),
    ],
)
def test_skip_softmax_param_validation(value, match):
    with pytest.raises(AttentionConfigError, match=match):
        parse_skip_softmax(value)


def test_skip_softmax_defaults():
    p = parse_skip_softmax({"threshold_scale_factor": 500})
    assert (p.threshold_scale_factor, p.start_step) == (500.0, 0)
    assert parse_skip_softmax(None) is None


def test_skip_softmax_refused_under_ring_and_compile():
    model = build()
    for settings, match in (
        (AttentionSettings(ring_degree=2), "ring attention"),
        (AttentionSettings(compiled=True), "torch.compile"),
        (AttentionSettings(cuda_graphs=True), "CUDA graphs"),
    ):
        with pytest.raises(AttentionConfigError, match=match):
            prep(model, None, settings, skip_softmax={"threshold_scale_factor": 10.0})


def test_skip_softmax_runs_reference_on_cpu_from_start_step():
    from ditattn.attention.context import forward_context
    from ditattn.attention.kernels.skip_softmax import skip_softmax_reference
    from ditattn.attention.override import skipped_fraction

    with use_platform(CPU), attention_settings(AttentionSettings()), component_scope("transformer"):
        layer = LocalAttention(2, 128, role="self", prefix="blocks.0.attn1", dtype=torch.bfloat16)
    model = nn.ModuleList([layer])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 2, 128, generator=g).bfloat16() for _ in range(3))
    k[:, :150] *= 4  # make some tiles dominant so others fall under the threshold
    state = prep(model, None, skip_softmax={"threshold_scale_factor": 5.0, "start_step": 2})
    with request_scope(state):
        with forward_context(step=0):
            dense = layer(q, k, v)
        with forward_context(step=2):
            sparse = layer(q, k, v)
    ref_dense = layer(q, k, v)
    assert torch.equal(dense, ref_dense)
    expect, _, frac = skip_softmax_reference(q, k, v, threshold_scale_factor=5.0)
    assert torch.equal(sparse, expect)
    assert frac > 0.2 and skipped_fraction(state) == pytest.approx(frac)
    assert not torch.equal(sparse, dense)


def test_skip_softmax_refusals_on_dtype_and_platform():
    model = build()  # fp32 toy DiT, head dim 32
    with pytest.raises(AttentionConfigError, match="float16 or bfloat16"):
        prep(model, None, skip_softmax={"threshold_scale_factor": 10.0})
    with pytest.raises(AttentionConfigError, match="SM90"):
        prep(model, None, platform=Platform.simulate("mps"), skip_softmax={"threshold_scale_factor": 10.0})
    with pytest.raises(AttentionConfigError, match="SM90"):
        prep(
            model,
            None,
            platform=Platform.simulate("cuda", (8, 0), {"triton"}),
            skip_softmax={"threshold_scale_factor": 10.0},
        )


def test_skip_softmax_route_runs_the_dense_kernel_where_it_is_faster(monkeypatch):
    """ditattn.attention.skip_route: on an SM with a measured break-even, a layer whose first skip-softmax call
    skipped fewer tiles runs the dense kernel for the rest of the request (decided from the first call only);
    calls shorter than the device's min_seq_len run it at once."""
    from ditattn.attention import skip_route
    from ditattn.attention.sparse import fallback

    q = torch.zeros(1, 300, 1, 8)
    slow = skip_route.LayerRoute(sm=90)
    assert slow.dense_reason(q) == ""  # the first call runs the kernel
    slow.record(torch.tensor(0.1))
    slow.record(torch.tensor(0.9))  # only the first call counts
    assert "break-even 50%" in slow.dense_reason(q) and "break-even" in slow.dense_reason(q)
    fast = skip_route.LayerRoute(sm=90)
    fast.record(torch.tensor(0.7))
    assert fast.dense_reason(q) == ""
    unmeasured = skip_route.LayerRoute(sm=100)
    unmeasured.record(0.0)
    assert unmeasured.dense_reason(q) == ""
    assert skip_route.SKIP_BREAK_EVEN[90] == 0.5 and fallback.MIN_SEQ_LEN["cuda"] == 16384
    monkeypatch.setitem(fallback.MIN_SEQ_LEN, "cpu", 301)
    assert fast.dense_reason(q) == "shorter than min_seq_len 301 tokens (dense kernel)"


def test_skip_softmax_short_call_runs_the_dense_phase_kernel_and_says_so(monkeypatch, caplog):
    import logging

    from ditattn.attention.context import forward_context
    from ditattn.attention.override import skipped_fraction
    from ditattn.attention.sparse import fallback

    fallback.clear_dense_notes()
    monkeypatch.setitem(fallback.MIN_SEQ_LEN, "cpu", 1000)
    with use_platform(CPU), attention_settings(AttentionSettings()), component_scope("transformer"):
        layer = LocalAttention(2, 128, role="self", prefix="blocks.0.attn1", dtype=torch.bfloat16)
    model = nn.ModuleList([layer])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 300, 2, 128, generator=g).bfloat16() for _ in range(3))
    k[:, :150] *= 4
    state = prep(model, None, skip_softmax={"threshold_scale_factor": 5.0, "start_step": 0})
    with caplog.at_level(logging.INFO, logger="ditattn.attention.sparse"), request_scope(state):
        outs = []
        for step in (0, 1):
            with forward_context(step=step):
                outs.append(layer(q, k, v))
    assert torch.equal(outs[0], layer(q, k, v)) and torch.equal(outs[1], outs[0])  # the dense kernel's output
    assert skipped_fraction(state) == 0.0
    assert fallback.dense_notes["skip_softmax"] == ["shorter than min_seq_len 1000 tokens (dense kernel)"]
    assert sum("skip_softmax runs dense" in r.getMessage() for r in caplog.records) == 1
    fallback.clear_dense_notes()
