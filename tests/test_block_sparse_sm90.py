"""The SM90 Gluon block-sparse kernel (ditattn.attention.kernels.block_sparse_sm90).

* CPU (no GPU needed): it compiles for sm_90 with the static-max and the online softmax, head dim
  128 and 64, bf16 and fp16, with and without padding keys and LSE, keeps its wgmma products
  asynchronous (no wait after every product: ptxas serialises a kernel whose in-flight operands are
  redefined) and does not spill (every combination: ``bench/sm90_offline.py --kernel block_sparse
  --matrix``); ``impl="sm90"`` takes the SM90 kernel's config keys, ``impl="triton"`` rejects them.
* GPU (SM90 only): numerics against float32 with the same block mask — odd padded lengths,
  padding keys, GQA, an empty query block (zeros, LSE -inf), an odd number of query blocks, both
  softmax paths, fp16 (whose static-max bound is tighter), no padding mask and no LSE.
"""
import math

import pytest
import torch

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.sm90_census("block_sparse", "static=;online=static_max:false;"
                         "d64_fp16_static=head_dim:64/dtype:fp16/has_valid:false/return_lse:false;"
                         "d64_fp16_online=head_dim:64/dtype:fp16/has_valid:false/return_lse:false/static_max:false")
def test_block_sparse_kernel_compiles_for_sm90_with_async_wgmma(sm90_census):
    res = sm90_census
    for name, a in res.items():
        c = a["loop_census"]
        d = 64 if name.startswith("d64") else 128
        static = "static" in name
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


def test_block_sparse_sm90_static_bound_fits_p_dtype():
    """The static-max path computes P = exp2(logit) with |logit| <= the bound, in P's dtype (bf16/fp16):
    the bound must keep it finite (and the row sums of up to 2^20 keys finite in fp32)."""
    from ditattn.attention.kernels.block_sparse_sm90 import LOGIT_LIMITS

    for dt, lim in LOGIT_LIMITS.items():
        assert torch.isfinite(torch.tensor(2.0 ** lim).to(dt)), dt
        assert torch.tensor(2.0 ** -lim).to(dt) > 0, dt
        assert torch.isfinite(torch.tensor(2.0 ** lim) * 2 ** 20)
    assert not torch.isfinite(torch.tensor(2.0 ** 16).to(torch.float16))  # the old shared bound (100) overflowed


def _lists(b, h, nq, keep, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(nq, generator=g)[:keep] for _ in range(nq)]) for _ in range(b * h)])
    idx = idx.view(b, h, nq, keep).to(torch.int32)
    cnt = torch.randint(1, keep + 1, (b, h, nq), generator=g, dtype=torch.int32)
    return idx.cuda(), cnt.cuda()


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("b,h,hkv,d,s_real,q_scale,static,dtype,padded", [
    (2, 6, 3, 128, 1064, 1.0, True, torch.bfloat16, True),   # GQA, padding, even number of query blocks
    (1, 4, 4, 64, 777, 1.0, True, torch.bfloat16, True),     # head dim 64, odd number of query blocks
    (1, 2, 2, 128, 700, 12.0, True, torch.bfloat16, True),   # logit bound > limit: the online path runs
    (1, 2, 1, 128, 333, 1.0, False, torch.bfloat16, True),   # online softmax forced
    (1, 2, 2, 128, 700, 0.5, True, torch.float16, True),     # fp16, bound < 15: the static path in fp16
    (1, 2, 2, 128, 700, 4.0, True, torch.float16, True),     # fp16, logits past 2^16 (bound < 100): online
    (2, 4, 2, 64, 640, 1.0, True, torch.bfloat16, False),    # no padding mask, no LSE (the bench's timing call)
])
def test_block_sparse_sm90_numerics(b, h, hkv, d, s_real, q_scale, static, dtype, padded):
    from ditattn.attention.backends.base import reference_attention
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.attention.sparse.block_sparse import block_lists_to_dense_mask

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
    out, lse = block_sparse_attention_triton(q, k, v, idx, cnt, impl="sm90", block_size=bs, kv_valid=valid,
                                             return_lse=padded, config={"static_max": static})
    mask = block_lists_to_dense_mask(idx, cnt, block_size=bs, kv_valid=valid)
    ref, ref_lse = reference_attention(q, k, v, mask=mask)
    assert torch.isfinite(out).all()
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 6e-3  # bf16/fp16 rounding of P and of the output
    assert (out[0, bs:2 * bs, 0] == 0).all()
    if not padded:
        assert lse is None
        return
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert float((lse[fin] - ref_lse[fin]).abs().max()) < 1e-2
