"""The SM90 Gluon block-sparse kernel (ditattn.attention.kernels.block_sparse_sm90).

* CPU (no GPU needed): it compiles for sm_90 with the static-max and the online softmax, head dim
  128 and 64, bf16 and fp16, with and without padding keys and LSE, one CTA per tile and persistent
  (2 and 3 stages), keeps its wgmma products asynchronous (no wait after every product: ptxas
  serialises a kernel whose in-flight operands are redefined), does not spill and fits its shared
  memory estimate (every combination: ``tests/sm90_offline.py --kernel block_sparse --matrix``);
  ``impl="sm90"`` takes the SM90 kernel's config keys, ``impl="triton"`` rejects them; the SM90
  keys' values are checked on any device.
* GPU (SM90 only): numerics against float32 with the same block mask — odd padded lengths,
  padding keys, GQA, an empty query block (zeros, LSE -inf), an odd number of query blocks, both
  softmax paths, fp16 (whose static-max bound is tighter), no padding mask and no LSE — each with
  one CTA per tile and with the persistent schedule: on the full grid, and on a grid of 3 CTAs (many
  tiles per CTA: the rings' running counts and Q's phase carry across tiles), 2 and 3 stages (3 at
  head dim 128: the output staged in Q's buffer).
"""

import math

import pytest
import torch

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.sm90_census(
    "block_sparse",
    "static=;online=static_max:false;"
    "d64_fp16_static=head_dim:64/dtype:fp16/has_valid:false/return_lse:false;"
    "d64_fp16_online=head_dim:64/dtype:fp16/has_valid:false/return_lse:false/static_max:false;"
    "persist_static=persistent:true;persist_online=persistent:true/static_max:false;"
    "persist_s3_static=persistent:true/num_stages:3;"
    "d64_fp16_persist_s3_online=head_dim:64/dtype:fp16/has_valid:false/return_lse:false/"
    "persistent:true/num_stages:3/static_max:false",
)
def test_block_sparse_kernel_compiles_for_sm90_with_async_wgmma(sm90_census):
    from ditattn.attention.kernels.block_sparse_sm90 import SMEM_LIMIT, SMEM_SLACK, smem_bytes

    res = sm90_census
    for name, a in res.items():
        c = a["loop_census"]
        d = 64 if name.startswith("d64") else 128
        static = "static" in name
        stages = 3 if "_s3" in name else 2
        # the estimate kernel_config and out_buffer decide with covers what the build allocates
        persist = "persist" in name
        est = smem_bytes(d, stages, static_max=static, out_buffer=persist and (d == 64 or stages == 2))
        assert est <= a["shared"] <= min(est + SMEM_SLACK, SMEM_LIMIT), (name, a["shared"], est)
        # Q.K (D / 16 k-steps), P.V (4) and, with the static max, P x ones (4)
        assert c.get("HGMMA", 0) >= d // 16 + 4 + 4 * static, (name, c)
        assert c.get("WARPGROUP", 0) <= 8, (name, c)  # one fence/commit/wait set per key block
        assert a["spills"] == 0, (name, a["spills"])
        assert not a["ptxas_warnings"], (name, a["ptxas_warnings"])
        # no running maximum in the static loop; 32 per tile (+ the row reduction) in the online one
        assert (c.get("FMNMX", 0) == 0) if static else (c.get("FMNMX", 0) >= 32), (name, c)


def test_block_sparse_sm90_config_keys_route_to_their_kernel():
    """The SM90 kernel's keys (static_max, ...) are not the Triton kernel's: impl='sm90' must not check
    them against the Triton defaults (it used to reject them before reaching the SM90 kernel)."""
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.errors import AttentionConfigError

    q = torch.zeros(1, 128, 2, 64, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    cnt = torch.ones(1, 1, 2, dtype=torch.int32)
    if not IS_SM90:  # the call reaches the SM90 kernel's own checks
        with pytest.raises(AttentionConfigError, match="impl 'sm90' cannot take this call"):
            block_sparse_attention_triton(q, q, q, idx, cnt, impl="sm90", config={"static_max": False})
    with pytest.raises(AttentionConfigError, match=r"unknown config keys \['static_max'\]"):
        block_sparse_attention_triton(q, q, q, idx, cnt, impl="triton", config={"static_max": False})


def test_block_sparse_sm90_config_validation():
    """kernel_config checks the SM90 kernel's keys and values on any device, and the public entry point
    runs it before anything that needs the GPU; the defaults stay one CTA per tile."""
    from ditattn.attention.kernels.block_sparse_sm90 import SMEM_LIMIT, default_config, kernel_config, out_buffer
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.errors import AttentionConfigError

    assert default_config(128)["persistent"] is False and kernel_config(128, None)["persistent"] is False
    cfg = kernel_config(128, {"persistent": True})
    assert cfg["persistent"] is True and cfg["num_stages"] == 2 and cfg["static_max"] is True
    # the persistent schedule's own output tiles: where they fit next to the stages
    assert out_buffer(cfg, 128) and out_buffer(kernel_config(64, {"persistent": True, "num_stages": 3}), 64)
    assert not out_buffer(kernel_config(128, {"persistent": True, "num_stages": 3}), 128)
    assert not out_buffer(kernel_config(128, None), 128)  # one CTA per tile: the output goes through Q's buffer
    for bad, msg in (
        ({"persistent": 1}, "persistent must be True or False, got 1"),
        ({"persistent": "true"}, "persistent must be True or False, got 'true'"),
        ({"static_max": None}, "static_max must be True or False"),
        ({"persistant": True}, r"unknown config keys \['persistant'\]; accepted: .*'persistent'"),
        ({"num_stages": 0}, "num_stages must be >= 1, got 0"),
        ({"num_stages": 2.0}, "num_stages must be an int, got 2.0"),
        ({"num_stages": 4, "persistent": True}, f"num_stages 4 at head dim 128 needs .* over the {SMEM_LIMIT:,} B"),
        ({"consumer_regs": 230}, "consumer_regs must be a multiple of 8 in \\[24, 256\\], got 230"),
    ):
        with pytest.raises(AttentionConfigError, match=msg):
            kernel_config(128, bad)
    assert kernel_config(64, {"num_stages": 4})["num_stages"] == 4  # head dim 64: 4 stages fit
    q = torch.zeros(1, 128, 2, 64, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 2, 1, dtype=torch.int32)
    cnt = torch.ones(1, 1, 2, dtype=torch.int32)
    with pytest.raises(AttentionConfigError, match="persistent must be True or False"):  # before the device check
        block_sparse_attention_triton(q, q, q, idx, cnt, impl="sm90", config={"persistent": "yes"})


def test_block_sparse_sm90_static_bound_fits_p_dtype():
    """The static-max path computes P = exp2(logit) with |logit| <= the bound, in P's dtype (bf16/fp16):
    the bound must keep it finite (and the row sums of up to 2^20 keys finite in fp32)."""
    from ditattn.attention.kernels.block_sparse_sm90 import LOGIT_LIMITS

    for dt, lim in LOGIT_LIMITS.items():
        assert torch.isfinite(torch.tensor(2.0**lim).to(dt)), dt
        assert torch.tensor(2.0**-lim).to(dt) > 0, dt
        assert torch.isfinite(torch.tensor(2.0**lim) * 2**20)
    assert not torch.isfinite(torch.tensor(2.0**16).to(torch.float16))  # the old shared bound (100) overflowed


def _lists(b, h, nq, keep, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(nq, generator=g)[:keep] for _ in range(nq)]) for _ in range(b * h)])
    idx = idx.view(b, h, nq, keep).to(torch.int32)
    cnt = torch.randint(1, keep + 1, (b, h, nq), generator=g, dtype=torch.int32)
    return idx.cuda(), cnt.cuda()


#: schedules the GPU numerics run: (config, CTAs of the persistent grid — None: one per SM)
SCHEDULES = {
    "tile": ({}, None),
    "persistent": ({"persistent": True}, None),
    "persistent_3ctas": ({"persistent": True}, 3),
    "persistent_s3_3ctas": ({"persistent": True, "num_stages": 3}, 3),
}


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(
    "b,h,hkv,d,s_real,q_scale,static,dtype,padded",
    [
        (2, 6, 3, 128, 1064, 1.0, True, torch.bfloat16, True),  # GQA, padding, even number of query blocks
        (1, 4, 4, 64, 777, 1.0, True, torch.bfloat16, True),  # head dim 64, odd number of query blocks
        (1, 2, 2, 128, 700, 12.0, True, torch.bfloat16, True),  # logit bound > limit: the online path runs
        (1, 2, 1, 128, 333, 1.0, False, torch.bfloat16, True),  # online softmax forced
        (1, 2, 2, 128, 700, 0.5, True, torch.float16, True),  # fp16, bound < 15: the static path in fp16
        (1, 2, 2, 128, 700, 4.0, True, torch.float16, True),  # fp16, logits past 2^16 (bound < 100): online
        (2, 4, 2, 64, 640, 1.0, True, torch.bfloat16, False),  # no padding mask, no LSE (the bench's timing call)
    ],
)
def test_block_sparse_sm90_numerics(b, h, hkv, d, s_real, q_scale, static, dtype, padded, schedule, monkeypatch):
    from ditattn.attention.backends.base import reference_attention
    from ditattn.attention.kernels import block_sparse_sm90
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.attention.sparse.block_sparse import block_lists_to_dense_mask

    sched_cfg, ctas = SCHEDULES[schedule]
    if ctas is not None:  # a small persistent grid: many tiles per CTA
        monkeypatch.setattr(block_sparse_sm90, "num_sms", lambda device: ctas)

    bs = 64
    s = math.ceil(s_real / bs) * bs
    nq = s // bs
    g = torch.Generator(device="cuda").manual_seed(s_real)
    q = (torch.randn(b, s, h, d, generator=g, device="cuda") * q_scale).to(dtype)
    k = torch.randn(b, s, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(b, s, hkv, d, generator=g, device="cuda").to(dtype)
    idx, cnt = _lists(b, h, nq, max(1, nq // 3), seed=s_real)
    cnt[0, 0, 1] = 0  # an empty query block
    valid = torch.arange(s, device="cuda")[None, :].expand(b, s) < s_real if padded else None
    out, lse = block_sparse_attention_triton(
        q,
        k,
        v,
        idx,
        cnt,
        impl="sm90",
        block_size=bs,
        kv_valid=valid,
        return_lse=padded,
        config={"static_max": static, **sched_cfg},
    )
    mask = block_lists_to_dense_mask(idx, cnt, block_size=bs, kv_valid=valid)
    ref, ref_lse = reference_attention(q, k, v, mask=mask)
    assert torch.isfinite(out).all()
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 6e-3  # bf16/fp16 rounding of P and of the output
    assert (out[0, bs : 2 * bs, 0] == 0).all()
    if not padded:
        assert lse is None
        return
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert float((lse[fin] - ref_lse[fin]).abs().max()) < 1e-2


def test_block_sparse_auto_keeps_the_sm90_kernel_for_long_sequences_only(monkeypatch):
    """impl="auto" routes 64-token tiles to the SM90 kernel from SM90_AUTO_MIN_TOKENS query tokens on
    (run 24: faster than Triton at 75,600, not at 32,760), never off CUDA, at other block sizes, or
    below the threshold; on the GPU the routed call is bit-identical to impl="sm90" and differs from
    the Triton kernel's result only by rounding."""
    from ditattn.attention.kernels import block_sparse_triton as bst

    assert 32_760 < bst.SM90_AUTO_MIN_TOKENS <= 75_600
    cpu_q = torch.zeros(1, bst.SM90_AUTO_MIN_TOKENS, 1, 64)
    assert not bst._sm90_auto(cpu_q, 64)
    if not IS_SM90:
        return
    s, h, d = 1024, 2, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, s, h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    idx, cnt = _lists(1, h, s // 64, 5, seed=3)
    assert not bst._sm90_auto(q, 64)  # 1,024 tokens: below the threshold
    monkeypatch.setattr(bst, "SM90_AUTO_MIN_TOKENS", s)
    assert bst._sm90_auto(q, 64) and not bst._sm90_auto(q, 128)
    auto, _ = bst.block_sparse_attention_triton(q, k, v, idx, cnt, block_size=64)
    sm90, _ = bst.block_sparse_attention_triton(q, k, v, idx, cnt, block_size=64, impl="sm90")
    tri, _ = bst.block_sparse_attention_triton(q, k, v, idx, cnt, block_size=64, impl="triton")
    assert torch.equal(auto, sm90)
    assert float((auto.float() - tri.float()).norm() / tri.float().norm()) < 6e-3
