"""Sequence parallelism: Ulysses, ring and USP attention against single-process attention.

Two spawns (2 and 4 gloo ranks on 127.0.0.1) run every multi-rank check inside their workers; the
capability rules and the LSE merge run in this process.
"""

import math

import pytest
import torch

import ditattn
from ditattn import AttentionConfigError, LocalAttention
from ditattn.attention.backends.base import reference_attention
from ditattn.attention.context import (
    AttentionSettings,
    attention_settings,
    component_scope,
    forward_context,
    global_force_attn_backend_context_manager,
    request_scope,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.override import dit_layers, prepare_request_override, validate_override
from ditattn.distributed import (
    UlyssesAttention,
    USPAttention,
    destroy_sequence_parallel,
    gather_sequence,
    init_sequence_parallel,
    resolve_degrees,
    shard_sequence,
)
from ditattn.distributed.groups import rank_layout
from ditattn.distributed.launch import spawn_ranks
from ditattn.distributed.ring import merge_all, merge_partials
from ditattn.platforms import Platform, use_platform

BLACKWELL = Platform.simulate("cuda", (10, 0), {"sageattn3", "triton"})  # sage_attn_3 usable, no FA runtime


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# rules (one process)


def test_resolve_degrees():
    assert resolve_degrees(4) == (4, 1)
    assert resolve_degrees(4, 2) == (2, 2)
    assert resolve_degrees(4, None, 4) == (1, 4)
    assert resolve_degrees(4, 2, 2) == (2, 2)
    assert resolve_degrees(1) == (1, 1)
    with pytest.raises(
        AttentionConfigError,
        match=r"--ulysses-degree 2 × --ring-degree 3 = 6 does not equal --num-gpus 4.*1x4, 2x2, 4x1",
    ):
        resolve_degrees(4, 2, 3)
    with pytest.raises(AttentionConfigError, match="--ulysses-degree 3 does not divide --num-gpus 4"):
        resolve_degrees(4, 3)
    with pytest.raises(AttentionConfigError, match="--ring-degree 3 does not divide --num-gpus 4"):
        resolve_degrees(4, None, 3)
    with pytest.raises(AttentionConfigError, match="positive integer"):
        resolve_degrees(0)
    assert rank_layout(4, 2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert rank_layout(8, 2, 4)[1][1] == [1, 3, 5, 7]


def test_heads_must_divide_by_ulysses_degree():
    with attention_settings(AttentionSettings(ulysses_degree=3)):
        with pytest.raises(
            AttentionConfigError, match=r"4 attention heads do not divide by the Ulysses degree 3.*1, 2, 4"
        ):
            USPAttention(4, 16, prefix="blocks.0.attn1")
        USPAttention(6, 16)  # divides
        USPAttention(4, 16, role="cross")  # cross-attention is local: no head split


def test_ulysses_attention_refuses_ring():
    with attention_settings(AttentionSettings(ulysses_degree=2, ring_degree=2)):
        with pytest.raises(AttentionConfigError, match="shards heads only.*USPAttention"):
            UlyssesAttention(4, 16)
        assert USPAttention(4, 16).ring_degree == 2


def test_ring_refuses_backend_without_lse():
    kw = dict(dtype=torch.bfloat16, prefix="blocks.0.attn1")
    with use_platform(BLACKWELL), global_force_attn_backend_context_manager("sage_attn_3"):
        assert USPAttention(4, 128, **kw).backend is B.SAGE_ATTN_3  # fine without ring
        with attention_settings(AttentionSettings(ulysses_degree=2)):
            assert USPAttention(4, 128, **kw).backend is B.SAGE_ATTN_3  # Ulysses needs no LSE
        with attention_settings(AttentionSettings(ring_degree=2)):
            with pytest.raises(AttentionConfigError, match=r"sage_attn_3.*LSE.*fa, torch_sdpa"):
                USPAttention(4, 128, **kw)
            # cross-attention is not ring-sharded: it keeps the backend
            assert USPAttention(4, 128, role="cross", **kw).backend is B.SAGE_ATTN_3


def test_ring_refuses_platform_substitute_without_lse(monkeypatch):
    """fa requested, the platform substitutes a backend: the ring rule applies to what actually runs."""
    import ditattn.attention.selector as selector

    monkeypatch.setattr(
        selector, "substitute", lambda b, req, p: (B.SAGE_ATTN_3, "test substitution") if b is B.FA else None
    )
    kw = dict(dtype=torch.bfloat16, prefix="blocks.0.attn1")
    with use_platform(BLACKWELL), global_force_attn_backend_context_manager("fa"):
        layer = USPAttention(4, 128, **kw)
        assert layer.backend is B.SAGE_ATTN_3 and "test substitution" in layer.decision.fallback_reason
        with (
            attention_settings(AttentionSettings(ring_degree=2)),
            pytest.raises(
                AttentionConfigError,
                match=r"the platform would run sage_attn_3 instead \(test substitution\), which "
                r"does not return the LSE; ring attention",
            ),
        ):
            USPAttention(4, 128, **kw)


def test_ring_refuses_sparse_backends_ulysses_accepts_them():
    with global_force_attn_backend_context_manager("video_sparse_attn"):
        with attention_settings(AttentionSettings(ulysses_degree=2)):
            assert USPAttention(4, 64).backend is B.VIDEO_SPARSE_ATTN
        with attention_settings(AttentionSettings(ulysses_degree=2, ring_degree=2)):
            with pytest.raises(AttentionConfigError, match="sparse backends run under Ulysses only"):
                USPAttention(4, 64, prefix="blocks.0.attn1")
            # the sparse-on-cross rule still gives cross-attention a dense backend
            assert USPAttention(4, 64, role="cross").backend is B.TORCH_SDPA
    # the CLI global, strict for the DiT, fails closed too
    with (
        attention_settings(AttentionSettings(backend=B.SLIDING_TILE_ATTN, ring_degree=2)),
        component_scope("transformer"),
        pytest.raises(AttentionConfigError, match="Ulysses only"),
    ):
        USPAttention(4, 64)


def test_autotune_rebind_under_ring_is_checked():
    with attention_settings(AttentionSettings(ring_degree=2)):
        layer = USPAttention(4, 64)
    with pytest.raises(AttentionConfigError, match="ring attention"):
        layer.rebind(B.VIDEO_SPARSE_ATTN, "autotune")
    layer.rebind(B.TORCH_SDPA, "autotune")


class _Blocks(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.attn1 = USPAttention(4, 128, prefix="blocks.0.attn1", dtype=dtype)
        self.attn2 = USPAttention(4, 128, role="cross", prefix="blocks.0.attn2", dtype=dtype)


def test_request_override_under_ring_must_be_ring_capable():
    with use_platform(BLACKWELL):
        ring = AttentionSettings(ring_degree=2)
        with attention_settings(ring), component_scope("transformer"):
            model = _Blocks(torch.bfloat16)
        with pytest.raises(AttentionConfigError, match="ring parallelism.*LSE"):
            prepare_request_override([model], "sage_attn_3", ring, dtype=torch.bfloat16)
        st = prepare_request_override([model], "torch_sdpa", ring, dtype=torch.bfloat16)
        assert {b for b, _, _ in st.override_table.values()} == {B.TORCH_SDPA}
        # the layer's own spec carries the ring requirement even if the settings passed here forget it
        with pytest.raises(AttentionConfigError, match="LSE"):
            prepare_request_override([model], "sage_attn_3", AttentionSettings(), dtype=torch.bfloat16)
        # without ring the same override is accepted
        with component_scope("transformer"):
            plain = _Blocks(torch.bfloat16)
        assert validate_override("sage_attn_3", dit_layers([plain]), AttentionSettings()) is B.SAGE_ATTN_3


def test_world_size_one_is_local_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 30, 4, 32, generator=g) for _ in range(3))
    ctx = torch.randn(2, 7, 4, 32, generator=g)
    torch.manual_seed(0)
    with component_scope("transformer"):
        usp, loc = USPAttention(4, 32, prefix="a"), LocalAttention(4, 32, prefix="a")
        usp_x, loc_x = USPAttention(4, 32, role="cross"), LocalAttention(4, 32, role="cross")
    with forward_context(step=1, video_shape=(2, 3, 5)):
        o1, l1 = usp(q, k, v, return_lse=True)
        o2, l2 = loc(q, k, v, return_lse=True)
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
        assert torch.equal(usp_x(q, ctx, ctx), loc_x(q, ctx, ctx))
    assert usp.decision.backend == loc.decision.backend and usp.spec == loc.spec
    # the per-request override table reaches USPAttention (it is a LocalAttention)
    with component_scope("transformer"):
        model = _Blocks()
    state = prepare_request_override([model], "torch_sdpa")
    assert set(state.override_table) == {id(model.attn1), id(model.attn2)}
    seen = []
    backend, impl, cfg = state.override_table[id(model.attn1)]
    state.override_table[id(model.attn1)] = (backend, lambda *a: seen.append(1) or impl(*a), cfg)
    q4 = torch.randn(1, 9, 4, 128)
    with request_scope(state):
        model.attn1(q4, q4, q4)
    assert seen == [1]


# ------------------------------------------------------------------------------------------------
# LSE merge (one process)


def test_merge_partials_matches_full_attention():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 11, 3, 16, generator=g)
    k = torch.randn(2, 40, 3, 16, generator=g)
    v = torch.randn(2, 40, 3, 16, generator=g)
    ref, ref_lse = reference_attention(q, k, v, dtype=torch.float64)
    for cuts in ([0, 40], [0, 13, 40], [0, 1, 20, 21, 40]):
        parts = [reference_attention(q, k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])]
        out, lse = merge_all(parts)
        assert out.dtype == torch.float32 and lse.shape == (2, 3, 11)
        assert _rel(out, ref) < 1e-6
        assert (lse.double() - ref_lse).abs().max().item() < 1e-5


def test_merge_partials_is_stable():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 5, 2, 8, generator=g) * 60  # scores ~ 1e3-1e4: exp() would overflow float32
    k = torch.randn(1, 24, 2, 8, generator=g) * 60
    v = torch.randn(1, 24, 2, 8, generator=g)
    ref, ref_lse = reference_attention(q, k, v, dtype=torch.float64)
    parts = [reference_attention(q, k[:, i : i + 8], v[:, i : i + 8]) for i in (0, 8, 16)]
    out, lse = merge_all(parts)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-5
    assert ((lse.double() - ref_lse).abs() / ref_lse.abs()).max().item() < 1e-6
    # a block that masks every key (LSE -inf, output 0) changes nothing; two of them stay empty
    empty = (torch.zeros_like(parts[0][0]), torch.full_like(parts[0][1], float("-inf")))
    out2, lse2 = merge_partials(*merge_all(parts), *empty)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    out3, lse3 = merge_partials(*empty, *empty)
    assert torch.equal(out3, empty[0]) and torch.isneginf(lse3).all()


# ------------------------------------------------------------------------------------------------
# multi-rank checks (gloo): every check runs inside the workers, the parent asserts on the numbers


def _data(seed, s, h, hkv, d=16, b=2):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, s, h, d, generator=g),
        torch.randn(b, s, hkv, d, generator=g),
        torch.randn(b, s, hkv, d, generator=g),
    )


def _cmp(res, name, out, ref, lse=None, ref_lse=None):
    res[name] = _rel(out, ref)
    if lse is not None:
        fin = torch.isfinite(ref_lse)
        res[name + ":lse"] = (lse[fin].double() - ref_lse[fin].double()).abs().max().item()


def _run_config(groups, res):
    tag = f"U{groups.ulysses_degree}R{groups.ring_degree}"
    n = groups.world_size
    # 1. dense self-attention, GQA, LSE, sequence lengths that divide and that need padding
    for s_len in (40, 37, n + 1):
        for hkv in (4, 2, 1):
            q, k, v = _data(s_len * 10 + hkv, s_len, 4, hkv)
            ref, ref_lse = ditattn.attention(q, k, v, backend="torch_sdpa", return_lse=True)
            layer = USPAttention(4, 16, num_kv_heads=hkv, prefix="attn1")
            out, lse = layer(*(shard_sequence(t) for t in (q, k, v)), return_lse=True, seq_len=s_len)
            assert out.shape[1] == math.ceil(s_len / n) and lse.shape[2] == out.shape[1]
            _cmp(
                res,
                f"{tag}:dense:S{s_len}:kv{hkv}",
                gather_sequence(out, s_len),
                ref,
                gather_sequence(lse, s_len, dim=2),
                ref_lse,
            )
    # 2. replicated tokens (text appended to the video tokens, joint attention), GQA
    q, k, v = _data(7, 37 + 7, 4, 2)
    ref, ref_lse = ditattn.attention(q, k, v, backend="torch_sdpa", return_lse=True)
    loc = [torch.cat([shard_sequence(t[:, :37]), t[:, 37:]], dim=1) for t in (q, k, v)]
    with forward_context(video_shape=(1, 1, 37), text_len=7):
        out, lse = USPAttention(4, 16, num_kv_heads=2)(*loc, return_lse=True)
    s = out.shape[1] - 7
    _cmp(
        res,
        f"{tag}:joint:video",
        gather_sequence(out[:, :s], 37),
        ref[:, :37],
        gather_sequence(lse[:, :, :s], 37, dim=2),
        ref_lse[:, :, :37],
    )
    _cmp(res, f"{tag}:joint:text", out[:, s:], ref[:, 37:], lse[:, :, s:], ref_lse[:, :, 37:])
    # 3. cross-attention to replicated K/V: local only
    q, _, _ = _data(8, 37, 4, 4)
    _, kc, vc = _data(9, 11, 4, 2)
    layer = USPAttention(4, 16, num_kv_heads=2, role="cross")
    out = layer(shard_sequence(q), kc, vc)
    _cmp(res, f"{tag}:cross", gather_sequence(out, 37), ditattn.attention(q, kc, vc, backend="torch_sdpa"))
    # 4. causal
    q, k, v = _data(10, 37, 4, 4)
    out = USPAttention(4, 16, causal=True)(*(shard_sequence(t) for t in (q, k, v)), seq_len=37)
    _cmp(res, f"{tag}:causal", gather_sequence(out, 37), ditattn.attention(q, k, v, backend="torch_sdpa", causal=True))
    # 5. what the backend sees (the sequence length from the forward context's video grid): after the
    #    Ulysses all-to-all with ring 1 it is every token of H/U whole heads with video_shape intact
    q, k, v = _data(11, 30, 4, 4)
    with component_scope("transformer"):
        layer = USPAttention(4, 16, prefix="blocks.0.attn1")
    seen = []

    def spy(qq, kk, vv, call, cfg):
        seen.append((tuple(qq.shape), tuple(kk.shape), call.video_shape, call.text_len, call.step, call.return_lse))
        return layer.impl(qq, kk, vv, call, cfg)

    from ditattn.attention.context import RequestState

    state = RequestState(override_table={id(layer): (B.TORCH_SDPA, spy, {})})
    with request_scope(state), forward_context(video_shape=(2, 3, 5), step=3):
        out = layer(*(shard_sequence(t) for t in (q, k, v)))
    _cmp(res, f"{tag}:video_ctx", gather_sequence(out, 30), ditattn.attention(q, k, v, backend="torch_sdpa"))
    res[f"{tag}:seen"] = seen
    # 6. a sparse video backend after the Ulysses all-to-all (ring refuses it): whole heads over the full
    #    sequence, replicated text included, gives the single-process sparse result
    if groups.ring_degree == 1:
        q, k, v = _data(12, 128 + 5, 4, 2)
        cfg = {"sparsity": 0.5}
        ref = ditattn.attention(q, k, v, backend="video_sparse_attn", config=cfg, video_shape=(4, 4, 8), text_len=5)
        with (
            global_force_attn_backend_context_manager("video_sparse_attn"),
            attention_settings(AttentionSettings(config=cfg)),
        ):
            layer = USPAttention(4, 16, num_kv_heads=2, prefix="blocks.0.attn1")
        assert layer.backend is B.VIDEO_SPARSE_ATTN
        loc = [torch.cat([shard_sequence(t[:, :128]), t[:, 128:]], dim=1) for t in (q, k, v)]
        with forward_context(video_shape=(4, 4, 8), text_len=5):
            out = layer(*loc)
        s = out.shape[1] - 5
        _cmp(res, f"{tag}:vsa:video", gather_sequence(out[:, :s], 128), ref[:, :128])
        _cmp(res, f"{tag}:vsa:text", out[:, s:], ref[:, 128:])
    # 7. a shard that does not match the declared length is refused
    try:
        layer(*(shard_sequence(t) for t in (q, k, v)), seq_len=100)
        res[f"{tag}:bad_len"] = None
    except AttentionConfigError as exc:
        res[f"{tag}:bad_len"] = str(exc)


def _sp_worker(groups, configs):
    torch.manual_seed(0)
    res = {}
    for u, r in configs:
        destroy_sequence_parallel()
        _run_config(init_sequence_parallel(u, r), res)
    return res


def _check(results, configs, world):
    assert len(results) == world
    for res in results:
        for u, r in configs:
            tag = f"U{u}R{r}"
            errs = {k: v for k, v in res.items() if k.startswith(tag + ":") and isinstance(v, float)}
            assert len(errs) >= 20, sorted(res)
            bad = {k: v for k, v in errs.items() if v > (1e-4 if k.endswith(":lse") else 1e-5)}
            assert not bad, bad
            assert "this rank holds" in res[f"{tag}:bad_len"] and "ceil(100/" in res[f"{tag}:bad_len"]
            seen = res[f"{tag}:seen"]
            if r == 1:  # one backend call: the full 30-token grid, H/U heads, context passed unchanged
                assert f"{tag}:vsa:video" in errs and f"{tag}:vsa:text" in errs
                assert seen == [((2, 30, 4 // u, 16), (2, 30, 4 // u, 16), (2, 3, 5), 0, 3, False)]
            else:  # ring: one LSE call per block, on block-sized pieces without the video grid
                assert len(seen) == r and all(x[2] is None and x[5] for x in seen)
                assert sum(x[1][1] for x in seen) == 30  # every real key once, padding never
    # the replicated rows are identical on every rank
    texts = [res for res in results]
    assert all(set(t) == set(texts[0]) for t in texts)


def test_two_ranks_ulysses_and_ring():
    configs = [(2, 1), (1, 2)]
    _check(spawn_ranks(_sp_worker, 2, args=(configs,), timeout_s=120), configs, 2)


def test_four_ranks_usp_2x2_ulysses_4_ring_4():
    configs = [(2, 2), (4, 1), (1, 4)]
    _check(spawn_ranks(_sp_worker, 4, args=(configs,), timeout_s=120), configs, 4)


def _fail_on_rank1(groups):
    if groups.rank == 1:
        raise AttentionConfigError("rank 1 refused this call")
    return groups.rank


def test_spawn_ranks_raises_a_rank_user_error_here():
    with pytest.raises(AttentionConfigError, match="rank 1 refused this call"):
        spawn_ranks(_fail_on_rank1, 2, timeout_s=60)
