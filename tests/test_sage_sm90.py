"""The SM90 Gluon kernel of ``sage_attn`` (ditattn.attention.kernels.sage_sm90).

* CPU (Triton interpreter): the INT8 prologue it shares with the Triton kernel — scales, smoothing,
  the LSE correction and the logit-bound norms that decide the static-max softmax.
* CPU (no GPU needed): the kernel compiles for sm_90 and its main loop keeps the wgmma products
  asynchronous (ptxas serialises every wgmma of a kernel when an in-flight product's registers are
  redefined — warning C7513 — which shows as a wait after each product).
* GPU (SM90 only): numerics against float32 and against the PyTorch reference of the same
  quantization, static-max and online paths, odd lengths, GQA, head dims 64/128, LSE.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from ditattn.attention.kernels.int8_attention import int8_attention_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _round_half_away(x):
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU)")
@pytest.mark.parametrize("k_per_token", [True, False])
def test_prologue_scales_and_logit_bound(k_per_token):
    from ditattn.attention.kernels.int8_attention import quantize_qk

    torch.manual_seed(0)
    B, Sq, Skv, H, Hkv, D, bn = 1, 70, 150, 2, 1, 64, 64
    q = torch.randn(B, Sq, H, D).half()
    k = (torch.randn(B, Skv, Hkv, D) + 0.7).half()  # a channel mean for the smoothing to remove
    scale = D ** -0.5
    q8, qs, qkm, k8, ks, sq_pad, skv_pad, qn, kn = quantize_qk(
        q, k, scale=scale, block_m=128, block_n=bn, need_qkm=True, k_per_token=k_per_token, norms=True)
    assert (sq_pad, skv_pad) == (128, 192)
    qf, kf = q.float().transpose(1, 2), k.float().transpose(1, 2)  # [B, H, S, D]
    kmean = kf.mean(dim=2, keepdim=True)
    ksm = kf - kmean
    # Q: per token, scale amax / 127 (times scale * log2 e), round half away from zero
    amax = qf.abs().amax(-1)
    assert torch.allclose(qs[:, :, :Sq], amax / 127 * scale * 1.4426950408889634, rtol=1e-5)
    assert torch.equal(q8[:, :, :Sq].float(), _round_half_away(qf / (amax[..., None] / 127)))
    assert torch.count_nonzero(q8[:, :, Sq:]) == 0
    # K: smoothed by its token mean; per token or per block of bn keys
    if k_per_token:
        ksc = ksm.abs().amax(-1) / 127
        assert torch.allclose(ks[:, :, :Skv], ksc, rtol=1e-5)
        assert torch.equal(k8[:, :, :Skv].float(), _round_half_away(ksm / ksc[..., None]))
    else:
        blocks = torch.nn.functional.pad(ksm, (0, 0, 0, skv_pad - Skv)).reshape(B, Hkv, -1, bn, D)
        ksc = blocks.abs().amax(dim=(-1, -2)) / 127
        assert torch.allclose(ks, ksc, rtol=1e-5)
    # LSE correction: scale * q . mean(K)
    assert torch.allclose(qkm[:, :, :Sq], scale * (qf @ kmean.transpose(-1, -2)).squeeze(-1), rtol=1e-4, atol=1e-5)
    # norms bound every base-2 logit of the row: |s_ij * qs_i * sK_j| <= qn_i * kn
    s = q8[:, :, :Sq].float() @ k8[:, :, :Skv].float().transpose(-1, -2)
    col = ks[:, :, :Skv] if k_per_token else ks.repeat_interleave(bn, -1)[:, :, :Skv]
    logits = s * qs[:, :, :Sq, None] * col[:, :, None, :]
    bound = qn[:, :, :Sq, None] * kn[:, :, None, None]
    assert (logits.abs() <= bound * (1 + 1e-5)).all()
    assert (logits.abs().amax(-1) >= 0.2 * bound[..., 0]).all()  # a bound, not a blanket constant


_OFFLINE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import sm90_offline as so
so.install_offline_driver()
out = {}
for name, cfg in (("token", {}), ("block", {"k_granularity": "block"})):
    kern = so.compile_kernel(cfg)
    a = so.analyse(so.sass_of(kern.asm["cubin"], sys.argv[2] + "/" + name + ".cubin"))
    a["shared"] = kern.metadata.shared
    out[name] = a
print(json.dumps(out))
"""


def test_kernel_compiles_for_sm90_with_async_wgmma(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _OFFLINE, os.path.join(ROOT, "bench"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, a in res.items():
        c = a["loop_census"]
        assert c.get("IGMMA", 0) >= 4 and c.get("HGMMA", 0) >= 8, (name, c)  # INT8 Q.K, BF16 P.V (+ row sums)
        # one fence/commit/wait set per iteration; a serialised kernel waits after every product
        assert c.get("WARPGROUP", 0) <= 8, (name, c)
        assert a["registers"] <= 240 and a["spills"] <= 4, (name, a["registers"], a["spills"])
        assert a["shared"] <= 227 * 1024
        assert c.get("MUFU", 0) == 64, (name, c)  # one exp2 per score, no running-max exps in the static loop


def _qkv(b, sq, skv, h, hkv, d, dtype, seed, q_scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(b, sq, h, d, generator=g, device="cuda") * q_scale).to(dtype)
    k = (torch.randn(b, skv, hkv, d, generator=g, device="cuda") + 0.3).to(dtype)
    v = torch.randn(b, skv, hkv, d, generator=g, device="cuda").to(dtype)
    return q, k, v


def _exact(q, k, v):
    rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    s = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), lse


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("shape,dtype,kgran,q_scale", [
    ((2, 1000, 777, 6, 3, 128), torch.bfloat16, "token", 1.0),   # static max, GQA, odd lengths
    ((1, 555, 1333, 4, 4, 64), torch.float16, "token", 1.0),     # head dim 64
    ((1, 300, 129, 2, 1, 128), torch.bfloat16, "block", 1.0),    # per-block K, one key past a tile
    ((1, 640, 700, 2, 2, 128), torch.bfloat16, "token", 12.0),   # logit bound > limit: online softmax
    ((1, 1, 64, 2, 2, 128), torch.bfloat16, "token", 1.0),       # one query, keys within one tile
])
def test_sm90_kernel_numerics(shape, dtype, kgran, q_scale):
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    b, sq, skv, h, hkv, d = shape
    q, k, v = _qkv(b, sq, skv, h, hkv, d, dtype, seed=sq + skv, q_scale=q_scale)
    out, lse = sage_attention_sm90(q, k, v, return_lse=True, config={"k_granularity": kgran})
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, sq)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref, ref_lse = _exact(q, k, v)
    qref, _ = int8_attention_reference(q, k, v, block_n=128, k_granularity=kgran)
    # the kernel computes the reference's quantization (bf16/fp16 rounding of P and the output apart)
    assert _rel(out, qref) < (6e-3 if dtype == torch.bfloat16 else 1.5e-3)
    assert _rel(out, ref) < 2.5e-2
    assert float((lse.double() - ref_lse).abs().max()) < 0.1


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
def test_sm90_kernel_refuses_what_it_cannot_run():
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90
    from ditattn.errors import AttentionConfigError

    q, k, v = _qkv(1, 64, 64, 2, 2, 96, torch.bfloat16, seed=1)
    with pytest.raises(AttentionConfigError, match="head dim 96"):
        sage_attention_sm90(q, k, v)
    q, k, v = _qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, seed=1)
    with pytest.raises(AttentionConfigError, match="unknown config keys"):
        sage_attention_sm90(q, k, v, config={"blocks": 3})
