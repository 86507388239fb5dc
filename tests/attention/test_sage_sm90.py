"""The SM90 Gluon kernel of ``sage_attn`` (ditattn.attention.kernels.sage_sm90).

* CPU (Triton interpreter): the INT8 prologue it shares with the Triton kernel — scales, smoothing,
  the LSE correction and the logit-bound norms that decide the static-max softmax; the FP8 P.V
  prologue (V's channel scales and means, the transposed copy in the token order of the kernel's
  FP8 P operand).
* CPU: the FP8 P.V semantics of the PyTorch reference (key-block running maximum, e4m3 P and V,
  two-level accumulation) against a sequential emulation of the kernel's loop and against float32.
* CPU (no GPU needed): the kernel compiles for sm_90 and its main loop keeps the wgmma products
  asynchronous (ptxas serialises every wgmma of a kernel when an in-flight product's registers are
  redefined — C7513 — which shows as a wait after each product), without spills, FP8 P without byte
  permutes.
* CPU: the persistent schedule (config ``persistent``) compiles with the same main loops — no spill
  or C7513 inside them, the same products per key tile.
* GPU (SM90 only): numerics against float32 and against the PyTorch reference of the same
  quantization, static-max and online paths, fp16 and fp8 P.V, odd lengths, GQA, head dims 64/128, LSE
  — each with one CTA per query tile and with the persistent schedule, on the full grid and on a grid
  of 3 CTAs (many tiles per CTA: the ring's running count, the ping-pong turns and Q's phase carry
  across tiles).
"""

import os
import sys

import pytest
import torch

from ditattn.attention.kernels.int8_attention import int8_attention_reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

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
    scale = D**-0.5
    q8, qs, qkm, k8, ks, sq_pad, skv_pad, qn, kn = quantize_qk(
        q, k, scale=scale, block_m=128, block_n=bn, need_qkm=True, k_per_token=k_per_token, norms=True
    )
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


@pytest.mark.sm90_census("sage", "token=;block=k_granularity:block")
def test_kernel_compiles_for_sm90_with_async_wgmma(sm90_census):
    res = sm90_census
    for name, a in res.items():
        c = a["loop_census"]
        assert c.get("IGMMA", 0) >= 4 and c.get("HGMMA", 0) >= 8, (name, c)  # INT8 Q.K, BF16 P.V (+ row sums)
        # one fence/commit/wait set per iteration; a serialised kernel waits after every product
        assert c.get("WARPGROUP", 0) <= 8, (name, c)
        assert a["registers"] <= 240 and a["spills"] <= 4, (name, a["registers"], a["spills"])
        assert a["shared"] <= 227 * 1024
        assert c.get("MUFU", 0) == 64, (name, c)  # one exp2 per score, no running-max exps in the static loop
        assert not a["ptxas_warnings"], (name, a["ptxas_warnings"])


@pytest.mark.sm90_census("sage", "fp8=pv_dtype:fp8;fp8_direct_kblock=pv_dtype:fp8/pv_accum:direct/k_granularity:block")
def test_fp8_pv_kernel_compiles_for_sm90_with_async_wgmma(sm90_census):
    """FP8 P.V: FP8 wgmma (QGMMA) for P.V (the row sums of P in FP32 on the CUDA cores), P packed without
    byte permutes or shuffles (the column relabelling makes the accumulator registers the A operand), no
    spills, no C7513."""
    res = sm90_census
    for name, a in res.items():
        c = a["loop_census"]
        assert c.get("IGMMA", 0) >= 4 and c.get("QGMMA", 0) >= 4 and "HGMMA" not in c, (name, c)
        assert c.get("WARPGROUP", 0) <= 8, (name, c)
        assert a["spills"] == 0 and a["registers"] <= 240, (name, a["registers"], a["spills"])
        assert not a["ptxas_warnings"], (name, a["ptxas_warnings"])
        # 8 shuffles: the row maxima and the row sums (two rows per thread, a quad each)
        assert c.get("PRMT", 0) == 0 and c.get("SHFL", 0) <= 8, (name, c)
        assert c.get("F2FP", 0) == 32, (name, c)  # 64 scores -> e4m3, two per instruction
        assert c.get("MUFU", 0) == 66, (name, c)  # an exp2 per score, one per row for the rescale


@pytest.mark.sm90_census(
    "sage", "persist=persistent:true;fp8_kblk_persist=pv_dtype:fp8/k_granularity:block/persistent:true"
)
def test_persistent_kernel_compiles_for_sm90_with_the_same_main_loop(sm90_census):
    """The persistent schedule wraps the same key loop in a loop over query tiles: the loop's products,
    exp2 count and asynchrony stay; what the tile loop carries may spill (per query tile, outside the key
    loops: D = 128 token K 23 spill instructions under Triton 3.6.0, 132 under 3.7.1), never inside them."""
    res = sm90_census
    for name, a in res.items():
        c = a["loop_census"]
        fp8 = "fp8" in name
        assert c.get("IGMMA", 0) >= 4 and c.get(("QGMMA" if fp8 else "HGMMA"), 0) >= (4 if fp8 else 8), (name, c)
        assert c.get("WARPGROUP", 0) <= 8, (name, c)
        assert c.get("LDL", 0) == 0 and c.get("STL", 0) == 0, (name, c)  # no spill inside the key loop
        assert a["spills"] <= 200 and a["registers"] <= 240, (name, a["registers"], a["spills"])
        assert a["shared"] <= 227 * 1024
        assert c.get("MUFU", 0) == (66 if fp8 else 64), (name, c)
        assert not a["ptxas_warnings"], (name, a["ptxas_warnings"])


def _fp8_p_relabel(p):
    """What the kernel's ``fp8_pack`` does to P's columns (per 16; :data:`gluon_sm90.FP8_P_PERMUTE`)."""
    from ditattn.attention.kernels.gluon_sm90 import FP8_P_PERMUTE

    m, n = p.shape
    return p.reshape(m, n // 16, 2, 2, 2, 2).permute(*FP8_P_PERMUTE.value).reshape(m, n)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU)")
@pytest.mark.parametrize("smooth", [False, True])
def test_fp8_v_prologue_scales_and_token_order(smooth):
    from ditattn.attention.kernels.int8_attention import quantize_v_fp8

    torch.manual_seed(1)
    B, S, Hkv, D, s_pad = 1, 150, 2, 64, 256
    v = (torch.randn(B, S, Hkv, D) + 2.0 * torch.randn(D)).bfloat16()  # channel offsets
    vt, vs, vm = quantize_v_fp8(v, s_pad=s_pad, smooth=smooth, permute=True)
    assert vt.shape == (B, Hkv, D, s_pad) and vt.dtype == torch.float8_e4m3fn
    vf = v.float().transpose(1, 2)  # [B, Hkv, S, D]
    mean = vf.mean(dim=2)
    assert torch.allclose(vm, mean if smooth else torch.zeros_like(mean), atol=1e-6)
    x = vf - vm[:, :, None, :]
    assert torch.allclose(vs, x.abs().amax(dim=2) / 448, rtol=1e-6)
    want = (x / vs[:, :, None, :]).to(torch.float8_e4m3fn).float()  # [B, Hkv, S, D], tokens in order
    # the kernel multiplies its relabelled P with the stored V^T: must equal P . V in the tokens' order
    got = vt.float().transpose(-1, -2)  # [B, Hkv, s_pad, D], stored order
    p = torch.rand(64, s_pad, dtype=torch.float64)
    p[:, S:] = 0.0  # keys past the end have p = 0 in the kernel
    natural = torch.nn.functional.pad(want, (0, 0, 0, s_pad - S))
    assert torch.allclose(_fp8_p_relabel(p) @ got.double(), p @ natural.double(), rtol=1e-12, atol=1e-9)
    # and the stored tensor is exactly the quantized V, permuted within each 16 tokens; padding is 0
    perm = _fp8_p_relabel(torch.arange(s_pad, dtype=torch.float32)[None])[0].long()  # stored k <- token perm[k]
    assert torch.equal(got, natural[:, :, perm])
    assert torch.count_nonzero(got[:, :, (perm >= S)]) == 0
    unpermuted, _, _ = quantize_v_fp8(v, s_pad=s_pad, smooth=smooth, permute=False)
    assert torch.equal(unpermuted.float().transpose(-1, -2), natural)


def _fp8_kernel_emulation(q, k, v, block_n, v_smooth, k_granularity):
    """The SM90 kernel's FP8 P.V loop written out sequentially (online softmax per key tile,
    e4m3 P = exp2(t - m + 8), two-level accumulation, FP32 row sums of P before rounding), on the reference's
    quantized Q.K logits (pv fp16 path: the same INT8 scores)."""
    from ditattn.attention.kernels.int8_reference import LOG2E

    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    kr, vr = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
    # logits of the reference quantization: recover them from its LSE-free path by quantizing here
    qf, kf = q.float().transpose(1, 2), kr.float().transpose(1, 2)
    kf = kf - kf.mean(dim=2, keepdim=True)
    qa = qf.abs().amax(-1, keepdim=True) / 127
    q8 = torch.trunc(qf / qa + torch.where(qf >= 0, 0.5, -0.5))
    assert k_granularity == "token"
    ka = kf.abs().amax(-1, keepdim=True) / 127
    k8 = torch.trunc(kf / ka + torch.where(kf >= 0, 0.5, -0.5))
    t = (q8 @ k8.transpose(-1, -2)) * qa * ka.transpose(-1, -2) * D**-0.5 * LOG2E
    vf = vr.float().transpose(1, 2)
    vm = vf.mean(dim=2, keepdim=True) if v_smooth else torch.zeros_like(vf[:, :, :1])
    vs = (vf - vm).abs().amax(dim=2, keepdim=True) / 448
    vq = ((vf - vm) / vs).to(torch.float8_e4m3fn).float()
    m = torch.full((B, H, Sq, 1), float("-inf"))
    acc = torch.zeros(B, H, Sq, D)
    l_ = torch.zeros(B, H, Sq, 1)
    for j0 in range(0, Skv, block_n):
        tj = t[..., j0 : j0 + block_n]
        m_new = torch.maximum(m, tj.amax(-1, keepdim=True))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(tj - m_new + 8)
        acc = acc * alpha + p.to(torch.float8_e4m3fn).float() @ vq[:, :, j0 : j0 + block_n]
        l_ = l_ * alpha + p.sum(-1, keepdim=True)
        m = m_new
    return (acc / l_ * vs + vm).transpose(1, 2)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _exact(q, k, v):
    rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.double().transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    s = (qf @ kf.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), lse


@pytest.mark.parametrize("shape,v_smooth", [((1, 77, 333, 4, 2, 64), False), ((2, 130, 257, 2, 1, 128), True)])
def test_fp8_reference_is_the_kernel_loop(shape, v_smooth):
    """The reference's vectorised FP8 P.V (running maximum per key block via cummax, one matmul)
    equals the kernel's sequential loop; the error against float32 is e4m3's."""
    b, sq, skv, h, hkv, d = shape
    g = torch.Generator().manual_seed(sq)
    q = torch.randn(b, sq, h, d, generator=g).bfloat16()
    k = (torch.randn(b, skv, hkv, d, generator=g) + 0.4).bfloat16()
    v = (torch.randn(b, skv, hkv, d, generator=g) + torch.randn(d, generator=g)).bfloat16()
    out, lse = int8_attention_reference(
        q, k, v, return_lse=True, pv="fp8", p_rowsum="fp32", v_smooth=v_smooth, k_granularity="token", block_n=64
    )
    emu = _fp8_kernel_emulation(q, k, v, 64, v_smooth, "token")
    assert _rel(out.float(), emu) < 4e-3  # bf16 output rounding apart
    ref, ref_lse = _exact(q, k, v)
    assert _rel(out, ref) < 0.05
    assert float((lse.double() - ref_lse).abs().max()) < 0.02


def test_fp8_reference_error_on_structured_inputs_and_v_smoothing():
    """Structured q/k (Wan 3-D RoPE, bench/common.structured_qkv): FP8 P.V costs e4m3's ~3.6 % (P and
    V each ~2.5 %); smoothing V by its channel mean removes the offsets' share of V's rounding."""
    import common

    q, k, v = common.structured_qkv(1, (2, 16, 24), 4, 128, hkv=2, dtype=torch.bfloat16, seed=3, device="cpu")
    ref, _ = _exact(q, k, v)
    fp16, _ = int8_attention_reference(q, k, v, k_granularity="token")
    fp8, _ = int8_attention_reference(q, k, v, pv="fp8", p_rowsum="fp8", k_granularity="token")
    cos = torch.nn.functional.cosine_similarity(fp8.double().flatten(), ref.flatten(), dim=0).item()
    assert _rel(fp16, ref) < 0.02 and 0.02 < _rel(fp8, ref) < 0.045 and cos > 0.999
    vb = (v.float() + 4.0 * torch.randn(128, generator=torch.Generator().manual_seed(0))).bfloat16()
    ref_b, _ = _exact(q, k, vb)
    plain, _ = int8_attention_reference(q, k, vb, pv="fp8", p_rowsum="fp8", k_granularity="token")
    smooth, _ = int8_attention_reference(q, k, vb, pv="fp8", p_rowsum="fp8", k_granularity="token", v_smooth=True)
    err_plain = float((plain.double() - ref_b).norm() / (ref_b - ref_b.mean(dim=1, keepdim=True)).norm())
    err_smooth = float((smooth.double() - ref_b).norm() / (ref_b - ref_b.mean(dim=1, keepdim=True)).norm())
    assert err_smooth < 0.8 * err_plain, (err_smooth, err_plain)


def test_k_thread_groups_are_the_columns_of_one_thread_in_the_kernels_accumulator():
    """``k_granularity`` "thread": the keys that share a scale are exactly the S columns one thread holds in
    the kernel's Q.K accumulator layout (read off Gluon's linear layout of ``sage_sm90._mma_layouts``)."""
    gluon_ir = pytest.importorskip("triton._C.libtriton.gluon_ir")
    from triton._C.libtriton import ir

    from ditattn.attention.kernels.int8_reference import K_THREAD_GROUPS, k_thread_groups
    from ditattn.attention.kernels.sage_sm90 import _mma_layouts

    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    for bn in (128, 64):
        s_layout = _mma_layouts(bn, 128, False)[0]
        ll = builder.to_linear_layout(s_layout._to_ir(builder), [64, bn])
        groups = k_thread_groups(3 * bn, bn)
        for tile in range(3):
            for warp in range(4):
                for lane in range(32):
                    cols = set()
                    for reg in range(2 ** len(ll.reg_bases)):
                        col = 0
                        for bits, bases in ((reg, ll.reg_bases), (lane, ll.lane_bases), (warp, ll.warp_bases)):
                            for i, (_, c) in enumerate(bases):
                                if bits >> i & 1:
                                    col ^= c
                        cols.add(col)
                    assert len(cols) == bn // K_THREAD_GROUPS  # 32 (16) key columns per thread
                    got = {int(groups[tile * bn + c]) for c in cols}
                    assert got == {tile * K_THREAD_GROUPS + lane % 4}, (bn, warp, lane, got)


@pytest.mark.parametrize("skv,block_n", [(300, 128), (77, 64), (256, 128)])
def test_reference_k_thread_scales_against_a_loop(skv, block_n):
    """The reference's per-thread K quantization against a plain loop over blocks and groups: group g of a
    block holds keys 8 j + 2 g + {0, 1}; keys past the end count as zeros; an all-zero group has scale 1."""
    from ditattn.attention.kernels.int8_reference import _quant_k_thread, k_thread_groups

    g = torch.Generator().manual_seed(skv)
    x = torch.randn(2, 3, skv, 16, generator=g) * torch.rand(1, 1, skv, 1, generator=g) * 5
    x[:, :, 2:skv:8] *= 20.0  # outliers in group 1 only
    x[0, 0, 0:block_n:8] = 0.0  # group 0 of block 0 (keys 8j, 8j + 1) all zero in head (0, 0)
    x[0, 0, 1:block_n:8] = 0.0
    x8, sc = _quant_k_thread(x, block_n, "test")
    assert x8.shape == x.shape and sc.shape == x.shape[:3]
    want_sc = torch.empty(x.shape[:3])
    for blk in range(-(-skv // block_n)):
        for grp in range(4):
            keys = [blk * block_n + 8 * j + 2 * grp + p for j in range(block_n // 8) for p in (0, 1)]
            keys = [i for i in keys if i < skv]
            if not keys:
                continue
            amax = x[:, :, keys].abs().amax(dim=(-1, -2))
            want_sc[:, :, keys] = torch.where(amax > 0, amax / 127, torch.ones_like(amax))[..., None]
    assert torch.equal(sc, want_sc)
    assert torch.equal(x8, _round_half_away(x / want_sc[..., None]))
    assert x8.abs().max() <= 127 and sc[0, 0, 0] == 1.0 and sc[0, 0, 1] == 1.0
    # one scale per (block, group): every key with the same k_thread_groups index has the same scale
    idx = k_thread_groups(skv, block_n)
    for i in idx.unique():
        assert (sc[..., idx == i] == sc[..., idx == i][..., :1]).all()


def test_reference_k_granularity_thread_end_to_end():
    """``int8_attention_reference(k_granularity="thread")`` is the fp16 P.V attention of per-token INT8 Q and
    the per-thread INT8 K of the smoothed keys (computed here independently), GQA and odd lengths; a bad value
    names the accepted ones."""
    from ditattn.attention.kernels.int8_reference import k_thread_groups
    from ditattn.errors import AttentionConfigError

    g = torch.Generator().manual_seed(5)
    B, Sq, Skv, H, Hkv, D = 1, 50, 200, 4, 2, 64
    q = torch.randn(B, Sq, H, D, generator=g).bfloat16()
    k = (torch.randn(B, Skv, Hkv, D, generator=g) + 0.5).bfloat16()
    v = torch.randn(B, Skv, Hkv, D, generator=g).bfloat16()
    out, lse = int8_attention_reference(q, k, v, k_granularity="thread", return_lse=True)
    kr, vr = k.repeat_interleave(2, 2).float().transpose(1, 2), v.repeat_interleave(2, 2).float().transpose(1, 2)
    qf = q.float().transpose(1, 2)
    ks = kr - kr.mean(dim=2, keepdim=True)
    idx = k_thread_groups(Skv)
    ksc = torch.empty(B, H, Skv)
    for i in idx.unique():
        ksc[..., idx == i] = (ks[:, :, idx == i].abs().amax(dim=(-1, -2)) / 127)[..., None]
    k8 = _round_half_away(ks / ksc[..., None])
    qsc = qf.abs().amax(-1, keepdim=True) / 127
    q8 = _round_half_away(qf / qsc)
    s = (q8 @ k8.transpose(-1, -2)) * qsc * ksc[:, :, None, :] * D**-0.5
    p = torch.exp(s - s.amax(-1, keepdim=True))
    want = (p.bfloat16().float() @ vr.bfloat16().float()) / p.sum(-1, keepdim=True)
    assert _rel(out.float().transpose(1, 2), want) < 4e-3  # the output's bf16 rounding
    ref, _ = _exact(q, k, v)
    assert _rel(out, ref) < 0.02
    with pytest.raises(AttentionConfigError, match=r"accepts \['token', 'block', 'thread'\]"):
        int8_attention_reference(q, k, v, k_granularity="row")
    with pytest.raises(AttentionConfigError, match="multiple of 8"):
        int8_attention_reference(q, k, v, k_granularity="thread", block_n=60)


def test_kernel_config_validation():
    from ditattn.attention.kernels.sage_sm90 import kernel_config
    from ditattn.errors import AttentionConfigError

    cfg = kernel_config(128, {"pv_dtype": "fp8"})
    assert cfg["static_max"] is False and cfg["pv_accum"] == "two_level" and cfg["pv_overlap"] is False
    assert kernel_config(128, None)["static_max"] is True and kernel_config(128, None)["pv_dtype"] == "fp16"
    for bad, msg in (
        ({"pv_dtype": "fp4"}, "pv_dtype 'fp4' not supported"),
        ({"pv_dtype": "fp8", "static_max": True}, "static_max needs pv_dtype fp16"),
        ({"pv_accum": "direct"}, "apply to pv_dtype fp8 only"),
        ({"v_smooth": True}, "apply to pv_dtype fp8 only"),
        ({"pv_dtype": "fp8", "pv_accum": "fp22"}, "pv_accum 'fp22' not supported"),
        ({"k_granularity": "row"}, "k_granularity 'row' not supported"),
        ({"persistent": 1}, "persistent must be True or False, got 1"),
        ({"persistent": "true"}, "persistent must be True or False, got 'true'"),
        ({"persistant": True}, r"unknown config keys \['persistant'\]; accepted: .*'persistent'"),
    ):
        with pytest.raises(AttentionConfigError, match=msg):
            kernel_config(128, bad)
    assert kernel_config(128, None)["persistent"] is False
    assert kernel_config(64, {"persistent": True, "pv_dtype": "fp8"})["persistent"] is True


def test_kernel_constexprs_persistent():
    from ditattn.attention.kernels.sage_sm90 import kernel_config, kernel_constexprs

    for persistent in (False, True):
        ce = kernel_constexprs(kernel_config(128, {"persistent": persistent}), 128, return_lse=True, tma_store=True)
        assert ce["PERSISTENT"] is persistent


#: schedules the GPU numerics run: (config, CTAs of the persistent grid — None: one per SM)
SCHEDULES = {
    "tile": ({}, None),
    "persistent": ({"persistent": True}, None),
    "persistent_3ctas": ({"persistent": True}, 3),
}


def _schedule(name, monkeypatch):
    """The config of schedule ``name``; a small persistent grid (many tiles per CTA) via ``num_sms``."""
    from ditattn.attention.kernels import sage_sm90

    cfg, ctas = SCHEDULES[name]
    if ctas is not None:
        monkeypatch.setattr(sage_sm90, "num_sms", lambda device: ctas)
    return dict(cfg)


def _qkv(b, sq, skv, h, hkv, d, dtype, seed, q_scale=1.0, v_offset=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(b, sq, h, d, generator=g, device="cuda") * q_scale).to(dtype)
    k = (torch.randn(b, skv, hkv, d, generator=g, device="cuda") + 0.3).to(dtype)
    v = (
        torch.randn(b, skv, hkv, d, generator=g, device="cuda") + v_offset * torch.randn(d, generator=g, device="cuda")
    ).to(dtype)
    return q, k, v


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(
    "shape,dtype,kgran,q_scale",
    [
        ((2, 1000, 777, 6, 3, 128), torch.bfloat16, "token", 1.0),  # static max, GQA, odd lengths
        ((1, 555, 1333, 4, 4, 64), torch.float16, "token", 1.0),  # head dim 64
        ((1, 300, 129, 2, 1, 128), torch.bfloat16, "block", 1.0),  # per-block K, one key past a tile
        ((1, 640, 700, 2, 2, 128), torch.bfloat16, "token", 12.0),  # logit bound > limit: online softmax
        ((1, 400, 500, 2, 2, 64), torch.float16, "token", 5.0),  # fp16 P, logits up to ~35 (bound ~92): online
        # softmax (bf16's limit of 100 would round P = 2^35 to fp16 inf; found on the H200 via qk_balance)
        ((1, 1, 64, 2, 2, 128), torch.bfloat16, "token", 1.0),  # one query, keys within one tile
    ],
)
def test_sm90_kernel_numerics(shape, dtype, kgran, q_scale, schedule, monkeypatch):
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    b, sq, skv, h, hkv, d = shape
    q, k, v = _qkv(b, sq, skv, h, hkv, d, dtype, seed=sq + skv, q_scale=q_scale)
    cfg = {"k_granularity": kgran, **_schedule(schedule, monkeypatch)}
    out, lse = sage_attention_sm90(q, k, v, return_lse=True, config=cfg)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, sq)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref, ref_lse = _exact(q, k, v)
    qref, qref_lse = int8_attention_reference(q, k, v, block_n=128, k_granularity=kgran, return_lse=True)
    # the kernel computes the reference's quantization (bf16/fp16 rounding of P and the output apart)
    assert _rel(out, qref) < (6e-3 if dtype == torch.bfloat16 else 1.5e-3)
    # LSE against the reference of the same quantization: a value within rounding of an INT8 boundary can land
    # one step away from the reference's (Triton's fp32 division is approximate; the K mean is subtracted in a
    # different order), which moves a logit by up to one Q step x max|K| x scale: 0.2 at q_scale 12, where the
    # H200 measured 0.056; 5e-2 holds at q_scale 1
    q_step = float(q.float().abs().amax()) / 127 * float(k.float().abs().amax()) / d**0.5
    assert float((lse.double() - qref_lse.double()).abs().max()) < max(5e-2, q_step)
    # against float32: INT8 Q.K's own error, which grows with the logit scale (q_scale 12: the reference
    # of the same quantization is 3.4 % off float32, measured on CPU, and its LSE 0.40 off on the H200 at
    # logits of 30-47), so bounded by the reference's
    assert _rel(out, ref) < max(2.5e-2, 1.1 * _rel(qref, ref))
    lse_bound = max(0.1, 1.1 * float((qref_lse.double() - ref_lse).abs().max()))
    assert float((lse.double() - ref_lse).abs().max()) < lse_bound


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(
    "shape,dtype,cfg,v_offset",
    [
        ((2, 1000, 777, 6, 3, 128), torch.bfloat16, {}, 0.0),  # two-level, GQA, odd lengths
        ((1, 555, 1333, 4, 4, 64), torch.float16, {"pv_accum": "direct"}, 0.0),  # head dim 64, direct
        ((1, 300, 129, 2, 1, 128), torch.bfloat16, {"k_granularity": "block", "pv_overlap": True}, 0.0),
        ((1, 640, 700, 2, 2, 128), torch.bfloat16, {"v_smooth": True}, 3.0),  # V with channel offsets
        ((1, 1, 64, 2, 2, 128), torch.bfloat16, {}, 0.0),  # one query, one partial tile
    ],
)
def test_sm90_fp8_pv_numerics(shape, dtype, cfg, v_offset, schedule, monkeypatch):
    """FP8 P.V: the kernel against the reference's FP8 mode (same key blocks, e4m3 P and V, FP32 row
    sums of P before rounding) and against float32 (e4m3's ~3.7 %)."""
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    b, sq, skv, h, hkv, d = shape
    cfg = {"pv_dtype": "fp8", **cfg, **_schedule(schedule, monkeypatch)}
    q, k, v = _qkv(b, sq, skv, h, hkv, d, dtype, seed=sq + skv, v_offset=v_offset)
    out, lse = sage_attention_sm90(q, k, v, return_lse=True, config=cfg)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, sq)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref, ref_lse = _exact(q, k, v)
    qref, qlse = int8_attention_reference(
        q,
        k,
        v,
        return_lse=True,
        pv="fp8",
        p_rowsum="fp32",
        block_n=128,
        k_granularity=cfg.get("k_granularity", "token"),
        v_smooth=cfg.get("v_smooth", False),
    )
    # the same quantization (the output's bf16/fp16 rounding, exp2.approx flipping a rare e4m3 rounding
    # and, with direct accumulation, the tensor cores' shorter accumulator apart)
    bound = 8e-3 if dtype == torch.bfloat16 else 3e-3
    assert _rel(out, qref) < (bound if cfg.get("pv_accum", "two_level") == "two_level" else 1.5e-2)
    assert _rel(out, ref) < 0.05
    assert float((lse.double() - qlse.double()).abs().max()) < 1e-2
    assert float((lse.double() - ref_lse).abs().max()) < 0.1


@pytest.mark.skipif(not IS_SM90, reason="needs an SM90 (Hopper) GPU")
def test_sage_backend_runs_the_sm90_fp8_kernel():
    from ditattn.attention.backends.base import AttnCall, get_impl
    from ditattn.attention.backends.sage import sage_impl_for
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90
    from ditattn.attention.names import AttentionBackendEnum as B

    q, k, v = _qkv(1, 300, 500, 4, 2, 128, torch.bfloat16, seed=7)
    cfg = {"impl": "sm90", "pv_dtype": "fp8", "pv_accum": "direct"}
    assert sage_impl_for(q, AttnCall(), cfg) == "sm90"
    out, _ = get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), cfg)
    want, _ = sage_attention_sm90(q, k, v, config={"pv_dtype": "fp8", "pv_accum": "direct"})
    assert torch.equal(out, want)


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
