"""CPU behaviour of the FlashAttention / Sage / aiter backends and the quantized reference."""

import logging

import pytest
import torch

from ditattn.attention.backends.base import AttnCall, get_impl, reference_attention
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.errors import AttentionConfigError, BackendUnavailableError


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def qkv(sq=77, skv=91, h=4, hkv=2, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(2, sq, h, d, generator=g).to(dtype),
        (torch.randn(2, skv, hkv, d, generator=g) + 0.5).to(dtype),
        torch.randn(2, skv, hkv, d, generator=g).to(dtype),
    )


def test_fa_on_cpu_runs_torch_sdpa_and_logs(caplog):
    from ditattn.attention.backends import flash

    q, k, v = qkv(dtype=torch.bfloat16)
    flash._warned.clear()
    with caplog.at_level(logging.WARNING, logger="ditattn.attention.backends.flash"):
        out, lse = get_impl(B.FA)(q, k, v, AttnCall(return_lse=True), {})
        get_impl(B.FA)(q, k, v, AttnCall(), {})
    assert sum("fa runs torch_sdpa" in r.getMessage() for r in caplog.records) == 1  # logged once
    ref, ref_lse = reference_attention(q, k, v)
    assert rel(out, ref) < 1e-2 and (lse - ref_lse).abs().max() < 2e-2
    assert flash.fa_fallback_reason("cpu") is not None


def test_fa_runtime_order():
    from ditattn.attention.backends import flash

    assert [r[0] for r in flash.FA_RUNTIMES] == ["fa4", "fa3", "fa2"]
    assert flash.FA_RUNTIMES[0][1] == "flash_attn.cute"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pv", ["fp16", "fp8"])
def test_sage_cpu_reference(dtype, pv):
    q, k, v = qkv(dtype=dtype, seed=3)
    k0 = k.clone()
    out, lse = get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(return_lse=True), {"pv_dtype": pv})
    ref, ref_lse = reference_attention(q, k, v)
    assert out.dtype == dtype and torch.equal(k, k0)
    assert rel(out, ref) < (0.025 if pv == "fp16" else 0.06)
    assert (lse - ref_lse).abs().max() < 0.05


def test_int8_reference_is_exact_without_quantization_error():
    """Inputs already on the INT8 grids (values k/127 * scale with one value hitting 127) are
    quantized exactly, so the reference must equal float attention up to the fp16 P.V rounding."""
    from ditattn.attention.kernels.int8_attention import int8_attention_reference

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (1, 64, 2, 32), generator=g).float()
    q[..., 0] = 127
    k = torch.randint(-127, 128, (1, 128, 2, 32), generator=g).float()
    k = k - k.mean(dim=1, keepdim=True)  # already smooth
    v = torch.randn(1, 128, 2, 32, generator=g)
    q, k = q / 400, k / 400
    out, lse = int8_attention_reference(q, k, v, return_lse=True, q_granularity="token", block_m=64, block_n=128)
    ref, ref_lse = reference_attention(q, k, v)
    assert rel(out, ref) < 2e-3 and (lse - ref_lse).abs().max() < 1e-3


def test_sage_rejects_bias_bad_config_and_retired_env(monkeypatch):
    q, k, v = qkv()
    with pytest.raises(AttentionConfigError, match="bias"):
        get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(attn_bias=torch.zeros(1, 1, 77, 91)), {})
    with pytest.raises(AttentionConfigError, match="invalid value 'fp4' for 'pv_dtype'"):
        get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"pv_dtype": "fp4"})
    with pytest.raises(AttentionConfigError, match="no sage_attn kernel implements fp8 Q.K yet"):
        get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"qk_dtype": "fp8"})
    monkeypatch.setenv("DITATTN_SAGE_PV", "fp8")  # retired: an error naming the config key, never ignored
    with pytest.raises(
        AttentionConfigError, match="DITATTN_SAGE_PV is no longer read; use the sage_attn config key 'pv_dtype'"
    ):
        get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {})


def test_sage_impl_dispatch_on_cpu(monkeypatch):
    """CPU: auto and reference run the PyTorch reference; the package and (without the Triton
    interpreter) the Triton kernel are refused with the reason; the schema's impl choices are the
    dispatch table's."""
    from ditattn.attention.backends import sage
    from ditattn.attention.schemas import SAGE_IMPLS

    assert set(SAGE_IMPLS) == {"auto", *sage.SAGE_IMPLS}
    q, k, v = qkv(dtype=torch.float32, seed=4)
    for impl in ("auto", "reference"):
        assert sage.sage_impl_for(q, AttnCall(), {"impl": impl}) == "reference"
    out, _ = get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"impl": "reference", "pv_dtype": "fp8"})
    from ditattn.attention.kernels.int8_attention import int8_attention_reference

    assert torch.equal(out, int8_attention_reference(q, k, v, pv="fp8", k_granularity="token")[0])  # auto: token
    with pytest.raises(AttentionConfigError, match=r"impl package\)?: .*sageattention"):
        get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"impl": "package"})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AttentionConfigError, match="triton: the Triton kernel needs a CUDA device"):
        get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"impl": "triton"})


def test_sage3_and_aiter_refused_on_cpu():
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="Blackwell"):
        get_impl(B.SAGE_ATTN_3)(q, k, v, AttnCall(), {})
    with pytest.raises(BackendUnavailableError, match="ROCm"):
        get_impl(B.AITER)(q, k, v, AttnCall(), {})


def test_skip_softmax_reference_dense_equals_attention():
    from ditattn.attention.kernels.skip_softmax import skip_softmax_reference

    q, k, v = qkv(sq=130, skv=130, h=2, hkv=1, d=32, seed=4)
    out, lse, frac = skip_softmax_reference(
        q, k, v, threshold_scale_factor=None, block_m=64, block_n=64, return_lse=True
    )
    ref, ref_lse = reference_attention(q, k, v)
    assert frac == 0.0 and rel(out, ref) < 1e-5 and (lse - ref_lse).abs().max() < 1e-4


def test_block_sparse_fa4_probe_cache(monkeypatch):
    """The FA4 path's host-side probe (valid key prefix, empty query blocks) syncs once per pair
    of tensor objects and recomputes after an in-place change."""
    pytest.importorskip("triton")
    from ditattn.attention.kernels import block_sparse_triton as bst

    calls = []
    real = bst._probe_uncached
    monkeypatch.setattr(bst, "_probe_uncached", lambda *a: calls.append(1) or real(*a))
    bst._PROBE_CACHE.clear()
    valid = torch.arange(256)[None, :].expand(2, 256) < 250
    valid = valid.clone()
    counts = torch.ones(2, 4, 4, dtype=torch.int32)
    assert bst._probe(valid, counts, 256) == (250, False)
    assert bst._probe(valid, counts, 256) == (250, False) and len(calls) == 1
    counts[0, 0, 0] = 0  # in-place change: the version moves, the probe runs again
    assert bst._probe(valid, counts, 256) == (250, True) and len(calls) == 2
    valid[1, 3] = False  # no longer one shared prefix
    assert bst._probe(valid, counts, 256) == (None, True) and len(calls) == 3
    assert bst._probe(None, counts, 256) == (256, True) and len(calls) == 4
    # lists vouched non-empty (kv_counts None): new lists every call cost nothing once kv_valid is known
    valid2 = torch.arange(256)[None, :].expand(2, 256) < 200
    assert bst._probe(valid2, None, 256) == (200, False) and len(calls) == 5
    assert bst._probe(valid2, None, 256) == (200, False) and len(calls) == 5
    assert bst._probe(None, None, 256) == (256, False) and len(calls) == 5


def test_block_sparse_identity_cache_drops_dead_entries():
    """The per-plan cache of the FA4 path keeps results only while their tensors live."""
    from ditattn.attention.kernels import identity_cached

    cache, runs = {}, []
    keep = [torch.zeros(3) for _ in range(70)]
    for t in keep:
        identity_cached(cache, (t, None), (1,), lambda: runs.append(1) or len(runs))
    assert identity_cached(cache, (keep[5], None), (1,), lambda: -1) == 6  # a hit, no recompute
    assert len(runs) == 70 and len(cache) == 70
    del keep[:60]
    new = torch.zeros(1)  # a live key: its entry stays
    identity_cached(cache, (new, None), (1,), lambda: 0)  # the dead are gone (freed, or pruned at insertion)
    assert len(cache) == 11
    with torch.inference_mode():  # inference tensors have no version counter: recomputed, never cached
        t = torch.zeros(3)
        assert [identity_cached(cache, (t, None), (1,), lambda: runs.append(1) or 7) for _ in range(2)] == [7, 7]
    assert len(runs) == 72 and len(cache) == 11


def test_identity_cache_lets_go_of_an_entry_when_its_tensor_is_freed():
    """Per-call lists (a planner that re-plans every step) leave nothing behind: the entry, and the device
    memory its result holds, go with the key tensor, not 64 insertions later; a live key still hits."""
    from ditattn.attention.kernels import identity_cached

    cache = {}
    keep, gone = torch.zeros(3), torch.zeros(3)
    identity_cached(cache, (keep, None), (1,), lambda: "kept")
    identity_cached(cache, (gone, None), (1,), lambda: torch.ones(1000))
    assert len(cache) == 2
    del gone
    assert len(cache) == 1 and identity_cached(cache, (keep, None), (1,), lambda: "recomputed") == "kept"


def test_fa4_list_split_keeps_every_block_once_and_padded_ones_apart():
    """FA4's mask path gets each row's blocks without padding as full blocks and those with padding as mask
    blocks, both in list order, entries past a row's count ignored (random lists of odd sizes)."""
    pytest.importorskip("triton")
    from ditattn.attention.kernels.block_sparse_fa4 import split_lists

    g = torch.Generator().manual_seed(3)
    n_kv, m = 37, 29
    idx = torch.stack([torch.randperm(n_kv, generator=g)[:m] for _ in range(2 * 3 * 5)]).view(2, 3, 5, m)
    idx = idx.to(torch.int32)
    cnt = torch.randint(0, m + 1, (2, 3, 5), generator=g, dtype=torch.int32)
    idx[0, 0, 0, cnt[0, 0, 0] :] = 10_000  # garbage past the count is never read as a block
    partial = torch.rand(n_kv, generator=g) < 0.3
    fi, fc, mi, mc = split_lists(idx, cnt, partial)
    for row in range(30):
        b, h, i = row // 15, row // 5 % 3, row % 5
        listed = idx[b, h, i, : cnt[b, h, i]].tolist()
        want_full = [j for j in listed if not partial[j]]
        want_mask = [j for j in listed if partial[j]]
        assert fi[b, h, i, : fc[b, h, i]].tolist() == want_full
        assert mi[b, h, i, : mc[b, h, i]].tolist() == want_mask
    assert fc.dtype == mc.dtype == torch.int32 and fi.shape == mi.shape == idx.shape


@pytest.mark.parametrize("backend", ["sparge_attn", "sol_attn"])
def test_sparse_plan_names_the_block_sparse_kernel_its_block_size_runs(backend):
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.attention.specs import SPECS
    from ditattn.platforms import Platform

    spec = SPECS[B(backend)]
    hopper = Platform.simulate("cuda", capability=(9, 0), packages={"flash_attn.cute", "triton"})
    ampere = Platform.simulate("cuda", capability=(8, 0), packages={"flash_attn.cute", "triton"})
    label = lambda p, **cfg: spec.runtime_label(spec, p, None, cfg)  # noqa: E731
    assert "FlashAttention-4 block-sparse kernel (128-token blocks)" in label(hopper, block_size=128)
    assert "SM90 kernel from 60,000" in label(hopper, block_size=64)
    assert label(hopper, block_size=128, block_sparse_impl="triton").startswith("in-tree engine, Triton block-sparse")
    assert "FlashAttention-4" not in label(ampere, block_size=128)
    assert "FlexAttention block-sparse path" in label(hopper, block_size=128, block_sparse_impl="flex")
    assert label(Platform.simulate("cpu"), block_size=128) == "in-tree PyTorch reference"


def test_a_named_triton_impl_reaches_the_triton_kernel_alone(monkeypatch):
    """block_sparse_impl=triton is our Triton kernel: the kernel module is told so and does not pick FA4 or the
    SM90 kernel itself (impl auto leaves that choice to it)."""
    pytest.importorskip("triton")
    from ditattn.attention.sparse import block_sparse as bsp

    seen = []

    def fake(q, k, v, idx, cnt, **kw):
        seen.append(kw["impl"])
        return torch.zeros_like(q), None

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(bsp, "_load_triton", lambda: fake)
    q = torch.randn(1, 256, 2, 64, dtype=torch.float16)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    cnt = torch.ones(1, 1, 2, dtype=torch.int32)
    bsp.block_sparse_attention(q, q, q, idx, cnt, block_size=128, impl="triton")
    assert seen == ["triton"]
