"""``qk_balance``: the per-channel Q/K balance of ``sage_attn``'s INT8 quantization (issue 17).

* CPU: the balance factors (formula, normalisation, zero channels, the product unchanged in float64), the
  reference's balanced quantization against an independent computation (GQA: one c per K/V head, shared by the
  query heads of its group), validation errors.
"""
import os
import sys

import pytest
import torch

from ditattn.attention.kernels.int8_reference import int8_attention_reference, qk_balance_factors
from ditattn.errors import AttentionConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))


def _round_half_away(x):
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _exact(q, k, v):
    rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    s = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (torch.softmax(s, -1) @ vf).transpose(1, 2)


@pytest.mark.parametrize("alpha", [0.25, 0.5, 0.75, 1.0])
def test_balance_factors_formula_and_product_invariance(alpha):
    g = torch.Generator().manual_seed(0)
    D = 64
    q = torch.randn(3, 200, D, generator=g) * torch.exp(torch.randn(D, generator=g))  # channels of unequal size
    k = torch.randn(3, 300, D, generator=g) * torch.exp(torch.randn(D, generator=g))
    aq, ak = q.abs().amax(1), k.abs().amax(1)
    cq, ck = qk_balance_factors(aq, ak, alpha)
    raw = ak.double() ** alpha / aq.double() ** (1 - alpha)
    want = raw / torch.exp(torch.log(raw).mean(-1, keepdim=True))  # geometric mean 1
    assert torch.allclose(cq.double(), want, rtol=1e-5)
    assert float((cq.double() * ck.double() - 1).abs().max()) < 2e-7
    # Q c . (K / c) in float64 equals Q . K up to the float32 rounding of c and 1 / c
    exact = q.double() @ k.double().transpose(-1, -2)
    bal = (q * cq[:, None]).double() @ (k * ck[:, None]).double().transpose(-1, -2)
    assert float((bal - exact).abs().max() / exact.abs().max()) < 1e-6
    # the balanced channel maxima: (aq ak)^alpha and (aq ak)^(1 - alpha), up to the common normaliser
    qa, ka = (q * cq[:, None]).abs().amax(1).double(), (k * ck[:, None]).abs().amax(1).double()
    prod = aq.double() * ak.double()
    for got, e in ((qa, alpha), (ka, 1 - alpha)):
        r = got / prod ** e
        assert torch.allclose(r, r[:, :1].expand_as(r), rtol=1e-5)


def test_balance_factors_zero_and_extreme_channels():
    aq = torch.tensor([[1.0, 0.0, 2.0, 1e-30, 3.0]])
    ak = torch.tensor([[0.0, 1.0, 2.0, 1e30, 0.5]])
    cq, ck = qk_balance_factors(aq, ak, 0.75)
    assert cq[0, 0] == 0 and ck[0, 0] == 0 and cq[0, 1] == 0 and ck[0, 1] == 0  # either side all zero
    assert torch.isfinite(cq).all() and torch.isfinite(ck).all()
    assert float(cq[0, 2:].abs().log2().max()) <= 64 and float(ck[0, 2:].abs().log2().max()) <= 64  # clamped
    cq, ck = qk_balance_factors(torch.zeros(2, 4), torch.ones(2, 4), 0.5)  # nothing live: all zero
    assert torch.count_nonzero(cq) == 0 and torch.count_nonzero(ck) == 0


def _independent_balanced(q, k, v, alpha, k_granularity, block_n=128):
    """The balanced quantization written out per K/V head: c from the group's Q and the head's smoothed K."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    out = torch.empty(B, Sq, H, D, dtype=torch.float64)
    for b in range(B):
        for g in range(Hkv):
            kf = k[b, :, g].float()
            ks = kf - kf.mean(0)
            qg = q[b, :, g * G:(g + 1) * G].float()  # [Sq, G, D]
            cq, ck = qk_balance_factors(qg.abs().amax(dim=(0, 1)), ks.abs().amax(0), alpha)
            kb = ks * ck
            if k_granularity == "token":
                ksc = kb.abs().amax(-1) / 127
            else:
                nb = -(-Skv // block_n)
                blocks = torch.nn.functional.pad(kb, (0, 0, 0, nb * block_n - Skv)).reshape(nb, block_n, D)
                ksc = (blocks.abs().amax(dim=(1, 2)) / 127).repeat_interleave(block_n)[:Skv]
            k8 = _round_half_away(kb / ksc[:, None])
            for j in range(G):
                qb = qg[:, j] * cq
                qsc = qb.abs().amax(-1) / 127
                q8 = _round_half_away(qb / qsc[:, None])
                s = (q8 @ k8.T) * qsc[:, None] * ksc[None, :] * D ** -0.5
                p = torch.exp(s - s.amax(-1, keepdim=True))
                vv = v[b, :, g].to(v.dtype).float()
                out[b, :, g * G + j] = ((p.to(v.dtype).float() @ vv) / p.sum(-1, keepdim=True)).double()
    return out


@pytest.mark.parametrize("shape,dtype,kgran,alpha", [
    ((1, 70, 150, 4, 2, 64), torch.bfloat16, "block", 0.75),   # GQA: c shared by the 2 query heads of a group
    ((2, 33, 257, 3, 1, 128), torch.float16, "token", 0.5),
    ((1, 50, 130, 2, 2, 64), torch.bfloat16, "block", 1.0),
])
def test_reference_balanced_quantization_is_the_independent_one(shape, dtype, kgran, alpha):
    b, sq, skv, h, hkv, d = shape
    g = torch.Generator().manual_seed(sq + skv)
    q = (torch.randn(b, sq, h, d, generator=g) * torch.exp(0.5 * torch.randn(d, generator=g))).to(dtype)
    k = (torch.randn(b, skv, hkv, d, generator=g) * torch.exp(0.5 * torch.randn(d, generator=g)) + 0.4).to(dtype)
    v = torch.randn(b, skv, hkv, d, generator=g).to(dtype)
    out, lse = int8_attention_reference(q, k, v, k_granularity=kgran, qk_balance=alpha, return_lse=True)
    want = _independent_balanced(q, k, v, alpha, kgran)
    assert _rel(out, want) < 5e-3  # the output's fp16/bf16 rounding
    plain, plse = int8_attention_reference(q, k, v, k_granularity=kgran, return_lse=True)
    assert not torch.equal(out, plain)  # the balance moved the rounding
    ref = _exact(q, k, v)
    assert _rel(out, ref) < 0.03 and _rel(plain, ref) < 0.03
    assert float((lse - plse).abs().max()) < 0.05  # the LSE is that of the same scores
    for off in (None, 0, 0.0):
        assert torch.equal(int8_attention_reference(q, k, v, k_granularity=kgran, qk_balance=off)[0], plain)


def test_reference_balance_with_zero_channels():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 40, 2, 64, generator=g).bfloat16()
    k = torch.randn(1, 90, 2, 64, generator=g).bfloat16()
    v = torch.randn(1, 90, 2, 64, generator=g).bfloat16()
    q[..., 5] = 0.0
    k[..., 7] = 1.5  # constant: zero after the smoothing
    out = int8_attention_reference(q, k, v, qk_balance=0.75)[0]
    assert torch.isfinite(out).all() and _rel(out, _exact(q, k, v)) < 0.03


def test_qk_balance_validation():
    q = torch.randn(1, 8, 2, 64)
    k = v = torch.randn(1, 8, 2, 64)
    for bad in (-0.1, 1.5, "0.5", True, float("nan")):
        with pytest.raises(AttentionConfigError, match="qk_balance"):
            int8_attention_reference(q, k, v, qk_balance=bad)
