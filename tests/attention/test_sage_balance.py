"""``qk_balance``: the per-channel Q/K balance of ``sage_attn``'s INT8 quantization.

* CPU: the balance factors (formula, normalisation, zero channels, the product unchanged in float64), the
  reference's balanced quantization against an independent computation (GQA: one c per K/V head, shared by the
  query heads of its group), validation errors; the ``sage_attn`` parameter (schema, CPU path = the reference
  with the same option).
* Triton prologue (``quantize_qk(qk_balance=...)``; CPU under the interpreter, or the GPU): INT8 Q and K, scales,
  K's mean and the factors against the reference's steps; the Triton kernel with the balance against the
  reference of the same quantization (interpreter, small odd sizes).
* GPU: the SM90 kernel (SM90 only) and the Triton kernel (any CUDA GPU) with the balance against the reference
  of the same quantization and against float64, through the kernels and through the ``sage_attn`` backend.
"""

import os
import sys

import pytest
import torch
from test_sage_sm90 import _exact, _rel, _round_half_away  # the same helpers as the kernel's own tests

from ditattn.attention.kernels.int8_reference import int8_attention_reference, qk_balance_factors
from ditattn.errors import AttentionConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

HAS_CUDA = torch.cuda.is_available()
IS_SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
#: the Triton prologue runs on the GPU, or on the CPU in the interpreter (tests/conftest.py sets it without a GPU)
TRITON_DEV = "cuda" if HAS_CUDA else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="needs a CUDA GPU or TRITON_INTERPRET=1"
)
interpreter_only = pytest.mark.skipif(
    HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter test (CPU, TRITON_INTERPRET=1)"
)


def _exact_out(q, k, v):
    """float64 exact attention, the output only: ``[B, Sq, H, D]``."""
    return _exact(q, k, v)[0]


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
        r = got / prod**e
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
            qg = q[b, :, g * G : (g + 1) * G].float()  # [Sq, G, D]
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
                s = (q8 @ k8.T) * qsc[:, None] * ksc[None, :] * D**-0.5
                p = torch.exp(s - s.amax(-1, keepdim=True))
                vv = v[b, :, g].to(v.dtype).float()
                out[b, :, g * G + j] = ((p.to(v.dtype).float() @ vv) / p.sum(-1, keepdim=True)).double()
    return out


@pytest.mark.parametrize(
    "shape,dtype,kgran,alpha",
    [
        ((1, 70, 150, 4, 2, 64), torch.bfloat16, "block", 0.75),  # GQA: c shared by the 2 query heads of a group
        ((2, 33, 257, 3, 1, 128), torch.float16, "token", 0.5),
        ((1, 50, 130, 2, 2, 64), torch.bfloat16, "block", 1.0),
    ],
)
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
    ref = _exact_out(q, k, v)
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
    assert torch.isfinite(out).all() and _rel(out, _exact_out(q, k, v)) < 0.03


def test_qk_balance_validation():
    q = torch.randn(1, 8, 2, 64)
    k = v = torch.randn(1, 8, 2, 64)
    for bad in (-0.1, 1.5, "0.5", True, float("nan")):
        with pytest.raises(AttentionConfigError, match="qk_balance"):
            int8_attention_reference(q, k, v, qk_balance=bad)


def _channel_spread_qkv(b, sq, skv, h, hkv, d, dtype, seed, device="cpu"):
    """Q and K with channels of unequal size (what the balance moves), K with a mean to smooth away."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g) * torch.exp(0.5 * torch.randn(d, generator=g))
    k = torch.randn(b, skv, hkv, d, generator=g) * torch.exp(0.5 * torch.randn(d, generator=g)) + 0.4
    v = torch.randn(b, skv, hkv, d, generator=g)
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def _reference_balanced_qk(q, k, alpha):
    """The reference's balanced operands, step by step: ``(Q' [B, H, Sq, D], K' [B, Hkv, Skv, D], kmean, cq, ck)``."""
    B, Sq, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    qf, kf = q.float().transpose(1, 2), k.float().transpose(1, 2)
    kmean = kf.mean(dim=2)
    ks = kf - kmean[:, :, None]
    aq = qf.abs().amax(dim=2).reshape(B, Hkv, G, D).amax(dim=2)
    cq, ck = qk_balance_factors(aq, ks.abs().amax(dim=2), alpha)
    return qf * cq.repeat_interleave(G, dim=1)[:, :, None], ks * ck[:, :, None], kmean, cq, ck


def _int8_rows(x, per_token=True):
    amax = x.abs().amax(-1, keepdim=True) if per_token else x.abs().amax(dim=(-1, -2), keepdim=True)
    sc = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return _round_half_away(x / sc), sc


def _assert_int8_close(got, want, what):
    """Equal, or (float32 division on the GPU, the factors' last bit) one INT8 step apart on a handful of elements."""
    diff = (got.float() - want).abs()
    n = int(torch.count_nonzero(diff))
    share = 2000 if HAS_CUDA else 5000  # the GPU sums K's mean in another order and divides approximately
    assert float(diff.max()) <= 1 and n <= max(8, want.numel() // share), (what, n, float(diff.max()))


@needs_triton
@pytest.mark.parametrize(
    "shape,dtype,alpha,k_per_token",
    [
        ((1, 70, 150, 4, 2, 64), torch.bfloat16, 0.75, True),  # GQA 2, odd lengths
        ((2, 33, 257, 3, 1, 128), torch.float16, 0.5, False),  # GQA 3, per-block K
        ((1, 45, 600, 2, 2, 128), torch.bfloat16, 1.0, True),  # K over several statistics chunks (rows 512)
    ],
)
def test_prologue_balance_matches_the_reference(shape, dtype, alpha, k_per_token):
    from ditattn.attention.kernels.int8_attention import qk_balance_prologue, quantize_qk

    b, sq, skv, h, hkv, d = shape
    bn = 64
    q, k, _ = _channel_spread_qkv(b, sq, skv, h, hkv, d, dtype, seed=sq + skv, device=TRITON_DEV)
    qb, kb, kmean, cq, ck = _reference_balanced_qk(q.cpu(), k.cpu(), alpha)
    # the statistics and factors: K's mean to the float32 rounding of its sum, c to the last bit of log2 / exp2
    km, gq, gk = (t.cpu() for t in qk_balance_prologue(q, k, alpha))
    tol = 4e-6 if HAS_CUDA else 1e-6  # the GPU's log2 / exp2 are the approximate instructions
    assert torch.allclose(km, kmean, rtol=tol, atol=10 * tol)
    assert torch.allclose(gq, cq, rtol=tol) and torch.allclose(gk, ck, rtol=tol)
    assert torch.equal(gq == 0, cq == 0)
    scale = d**-0.5
    q8, qs, qkm, k8, ks, sq_pad, skv_pad, qn, kn = (
        t.cpu() if torch.is_tensor(t) else t
        for t in quantize_qk(
            q,
            k,
            scale=scale,
            block_m=128,
            block_n=bn,
            need_qkm=True,
            k_per_token=k_per_token,
            norms=True,
            qk_balance=alpha,
        )
    )
    want_q8, qsc = _int8_rows(qb)
    _assert_int8_close(q8[:, :, :sq], want_q8, "q8")
    assert torch.allclose(qs[:, :, :sq], qsc[..., 0] * scale * 1.4426950408889634, rtol=1e-5)
    assert torch.count_nonzero(q8[:, :, sq:]) == 0
    if k_per_token:
        want_k8, ksc = _int8_rows(kb)
        _assert_int8_close(k8[:, :, :skv], want_k8, "k8")
        assert torch.allclose(ks[:, :, :skv], ksc[..., 0], rtol=1e-5)
    else:
        blocks = torch.nn.functional.pad(kb, (0, 0, 0, skv_pad - skv)).reshape(b, hkv, -1, bn, d)
        want_k8, ksc = _int8_rows(blocks, per_token=False)
        _assert_int8_close(k8.reshape(b, hkv, -1, bn, d), want_k8, "k8")
        assert torch.allclose(ks, ksc.reshape(b, hkv, -1), rtol=1e-5)
    assert torch.count_nonzero(k8[:, :, skv:]) == 0
    # the LSE term is that of the unbalanced Q: scale * q . mean(K)
    qf = q.cpu().float().transpose(1, 2)
    want_qkm = scale * torch.einsum("bhsd,bhd->bhs", qf, kmean.repeat_interleave(h // hkv, 1))
    assert torch.allclose(qkm[:, :, :sq], want_qkm, rtol=1e-4, atol=1e-5)
    # the norms still bound every base-2 logit the kernel forms from the balanced rows
    s = q8[:, :, :sq].float() @ k8[:, :, :skv].float().repeat_interleave(h // hkv, 1).transpose(-1, -2)
    col = ks[:, :, :skv] if k_per_token else ks.repeat_interleave(bn, -1)[:, :, :skv]
    logits = s * qs[:, :, :sq, None] * col.repeat_interleave(h // hkv, 1)[:, :, None, :]
    bound = qn[:, :, :sq, None] * kn.repeat_interleave(h // hkv, 1)[:, :, None, None]
    assert (logits.abs() <= bound * (1 + 1e-5)).all()
    # off (None / 0): the unbalanced prologue, bit for bit
    plain = quantize_qk(q, k, scale=scale, block_m=128, block_n=bn, need_qkm=True, k_per_token=k_per_token)
    for off in (None, 0.0):
        again = quantize_qk(
            q, k, scale=scale, block_m=128, block_n=bn, need_qkm=True, k_per_token=k_per_token, qk_balance=off
        )
        assert all(torch.equal(x, y) for x, y in zip(plain[:5], again[:5]))


@interpreter_only
@pytest.mark.parametrize(
    "shape,dtype,alpha,pv",
    [
        ((1, 70, 130, 4, 2, 64), torch.bfloat16, 0.75, "fp16"),
        ((1, 33, 100, 3, 1, 128), torch.float16, 0.5, "fp16"),
        ((1, 40, 90, 2, 2, 64), torch.bfloat16, 0.5, "fp8"),
    ],
)
def test_triton_kernel_with_balance_is_the_reference(shape, dtype, alpha, pv):
    from ditattn.attention.kernels.int8_attention import int8_attention

    b, sq, skv, h, hkv, d = shape
    q, k, v = _channel_spread_qkv(b, sq, skv, h, hkv, d, dtype, seed=sq * skv)
    o, lse = int8_attention(q, k, v, return_lse=True, pv=pv, config={"block_m": 64, "block_n": 64}, qk_balance=alpha)
    qo, ql = int8_attention_reference(
        q, k, v, return_lse=True, pv=pv, block_m=64, block_n=64, k_granularity="block", qk_balance=alpha
    )
    plain = int8_attention_reference(q, k, v, pv=pv, block_m=64, block_n=64, k_granularity="block")[0]
    assert _rel(o, qo) < 2e-3 < _rel(o, plain)  # the balanced quantization, not the plain one
    assert float((lse - ql).abs().max()) < 2e-3


def test_sage_attn_parameter_cpu_path_is_the_reference():
    from ditattn.attention.backends.base import AttnCall, get_impl
    from ditattn.attention.config import validate_backend_config
    from ditattn.attention.names import AttentionBackendEnum as B

    q, k, v = _channel_spread_qkv(1, 60, 90, 4, 2, 64, torch.float32, seed=5)
    assert validate_backend_config(B.SAGE_ATTN, {})["qk_balance"] is None
    assert validate_backend_config(B.SAGE_ATTN, {"qk_balance": 1})["qk_balance"] == 1.0
    for bad in (0, -0.5, 1.5, "half", True):
        with pytest.raises(AttentionConfigError, match="'qk_balance'.*accepted: a number in \\(0, 1\\]"):
            validate_backend_config(B.SAGE_ATTN, {"qk_balance": bad})
    for kgran in ("auto", "block"):
        out, lse = get_impl(B.SAGE_ATTN)(
            q, k, v, AttnCall(return_lse=True), {"qk_balance": 0.5, "k_granularity": kgran}
        )
        want, wlse = int8_attention_reference(
            q, k, v, return_lse=True, qk_balance=0.5, k_granularity="token" if kgran == "auto" else kgran
        )
        assert torch.equal(out, want) and torch.equal(lse, wlse)
    assert not torch.equal(get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {})[0], out)


def test_sm90_config_validates_qk_balance():
    pytest.importorskip("triton.experimental.gluon")
    from ditattn.attention.kernels.sage_sm90 import kernel_config

    assert (
        kernel_config(128, None)["qk_balance"] is None and kernel_config(128, {"qk_balance": 0.5})["qk_balance"] == 0.5
    )
    with pytest.raises(AttentionConfigError, match="qk_balance 2"):
        kernel_config(128, {"qk_balance": 2})


def _lse_step_bound(q, k, alpha):
    """One INT8 step of the balanced Q times the largest balanced K times the scale: how far a logit (and the
    LSE) moves when the GPU's float32 division flips one Q value's rounding (test_sage_sm90's bound)."""
    qb, kb, *_ = _reference_balanced_qk(q.cpu(), k.cpu(), alpha)
    return max(5e-2, float(qb.abs().amax()) / 127 * float(kb.abs().amax()) / q.shape[-1] ** 0.5)


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize(
    "shape,dtype,kgran,alpha",
    [
        ((2, 1000, 777, 6, 3, 128), torch.bfloat16, "token", 0.5),  # GQA, odd lengths
        ((1, 555, 1333, 4, 4, 64), torch.float16, "token", 0.75),  # head dim 64
        ((1, 300, 129, 2, 1, 128), torch.bfloat16, "block", 0.75),  # per-block K, one key past a tile
    ],
)
def test_sm90_kernel_with_balance_is_the_reference(shape, dtype, kgran, alpha):
    from ditattn.attention.backends.base import AttnCall, get_impl
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90
    from ditattn.attention.names import AttentionBackendEnum as B

    b, sq, skv, h, hkv, d = shape
    q, k, v = _channel_spread_qkv(b, sq, skv, h, hkv, d, dtype, seed=sq + skv, device="cuda")
    cfg = {"k_granularity": kgran, "qk_balance": alpha}
    out, lse = sage_attention_sm90(q, k, v, return_lse=True, config=cfg)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    qref, qlse = int8_attention_reference(q, k, v, block_n=128, k_granularity=kgran, qk_balance=alpha, return_lse=True)
    assert _rel(out, qref) < (6e-3 if dtype == torch.bfloat16 else 1.5e-3)
    assert float((lse.double() - qlse.double()).abs().max()) < _lse_step_bound(q, k, alpha)
    exact = _exact_out(q.cpu(), k.cpu(), v.cpu()).to(out.device)
    assert _rel(out, exact) < max(2.5e-2, 1.1 * _rel(qref, exact))
    # the backend passes the option to the kernel
    got, _ = get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"impl": "sm90", **cfg})
    assert torch.equal(got, sage_attention_sm90(q, k, v, config=cfg)[0])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "shape,dtype,pv,causal,alpha",
    [
        ((1, 1000, 1234, 6, 3, 128), torch.bfloat16, "fp16", False, 0.5),
        ((1, 1000, 1000, 6, 3, 64), torch.float16, "fp16", True, 0.75),
        ((1, 777, 1001, 4, 2, 128), torch.bfloat16, "fp8", False, 0.75),
    ],
)
def test_triton_kernel_with_balance_is_the_reference_on_gpu(shape, dtype, pv, causal, alpha):
    from ditattn.attention.backends.base import AttnCall, get_impl
    from ditattn.attention.kernels.int8_attention import default_config, int8_attention
    from ditattn.attention.names import AttentionBackendEnum as B

    b, sq, skv, h, hkv, d = shape
    q, k, v = _channel_spread_qkv(b, sq, skv, h, hkv, d, dtype, seed=sq + skv + d, device="cuda")
    o, lse = int8_attention(q, k, v, causal=causal, return_lse=True, pv=pv, qk_balance=alpha)
    cfg = default_config(d, pv)  # the kernel's K blocks (contiguous V: the TMA path's block_n)
    qo, ql = int8_attention_reference(
        q,
        k,
        v,
        causal=causal,
        return_lse=True,
        pv=pv,
        block_m=cfg["block_m"],
        block_n=cfg["block_n"],
        k_granularity="block",
        qk_balance=alpha,
    )
    assert _rel(o, qo) < (3e-3 if pv == "fp16" else 0.03)
    assert float((lse - ql).abs().max()) < 1e-2  # test_gpu_kernels' 5e-3, with room for channels of unequal size
    got, _ = get_impl(B.SAGE_ATTN)(
        q, k, v, AttnCall(causal=causal), {"impl": "triton", "pv_dtype": pv, "qk_balance": alpha}
    )
    assert torch.equal(got, int8_attention(q, k, v, causal=causal, pv=pv, qk_balance=alpha)[0])
