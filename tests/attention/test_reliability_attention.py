"""Reliability of ``ditattn.attention()`` on inputs a caller may legitimately pass: q/k/v views whose
head dim is strided (the LSE path), SVG2 at its exact setting and with a non-finite query, and the
error types that may leave the call (only ``AttentionConfigError`` and its subclasses)."""

import logging
import zlib

import pytest
import torch

import ditattn
from ditattn.attention.backends.base import reference_attention
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.errors import AttentionConfigError

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _quiet_substitutions():
    """``fa`` on the CPU logs its substitution by ``torch_sdpa`` once per reason: not the subject here."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


# ------------------------------------------------------------------------------------------------
# the LSE path on q/k/v whose last dimension is not packed


def _view(shape, layout, dtype=torch.float32, device="cpu", gen=None):
    """A ``[B, S, H, D]`` tensor of fresh normal values laid out as ``layout`` (a view, not a copy)."""
    b, s, h, d = shape
    rnd = lambda *sz: torch.randn(*sz, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    if layout == "every_other":  # x[..., 1::2]: stride 2 in the head dim
        return rnd(b, s, h, 2 * d + 1)[..., 1::2][..., :d]
    if layout == "head_dim_outermost":  # a [B, D, S, H] buffer permuted: stride S*H in the head dim
        return rnd(b, d, s, h).permute(0, 2, 3, 1)
    if layout == "broadcast_head_dim":  # one value per row expanded over the head dim: stride 0
        return rnd(b, s, h, 1).expand(b, s, h, d)
    if layout == "heads_major":  # a [B, H, S, D] buffer transposed: the head dim stays packed
        return rnd(b, h, s, d).transpose(1, 2)
    raise AssertionError(layout)


def _lse_backends_on_cpu() -> list[str]:
    """Every backend that serves ``return_lse=True`` on the CPU (asked of the real selector)."""
    q = torch.randn(1, 17, 2, 16)
    names = []
    for b in B:
        try:
            ditattn.attention(q, q, q, backend=b.value, return_lse=True, video_shape=(1, 3, 5), text_len=2)
        except AttentionConfigError:
            continue
        names.append(b.value)
    return names


LSE_BACKENDS = _lse_backends_on_cpu()


def test_the_lse_backends_on_cpu_include_the_dense_ones():
    assert {"torch_sdpa", "fa", "sage_attn"} <= set(LSE_BACKENDS), LSE_BACKENDS


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@pytest.mark.parametrize("layout", ["every_other", "head_dim_outermost", "broadcast_head_dim", "heads_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_path_with_a_strided_head_dim_matches_float64(backend, layout, dtype, causal):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{backend} {layout} {dtype} {causal}".encode()))
    # odd sizes, grouped-query heads, seq_q != seq_kv
    q = _view((2, 7, 6, 12), layout, dtype, gen=gen)
    k = _view((2, 11, 3, 12), layout, dtype, gen=gen)
    v = _view((2, 11, 3, 12), layout, dtype, gen=gen)
    if layout != "heads_major":
        assert q.stride(-1) != 1 and k.stride(-1) != 1 and v.stride(-1) != 1
    out, lse = ditattn.attention(q, k, v, backend=backend, return_lse=True, causal=causal)
    ref_out, ref_lse = reference_attention(q, k, v, causal=causal, dtype=torch.float64)
    # bf16 inputs: the output is rounded to bf16 (and sage_attn quantizes Q.K to INT8)
    tol_out = 2e-2 if backend == "sage_attn" or dtype == torch.bfloat16 else 1e-5
    tol_lse = 3e-2 if backend == "sage_attn" or dtype == torch.bfloat16 else 1e-4
    assert out.shape == q.shape and lse.shape == (2, 6, 7) and lse.dtype == torch.float32
    assert _rel(out, ref_out) < tol_out
    assert (lse.double() - ref_lse).abs().max().item() < tol_lse
    # the same call on packed copies gives the same result
    out_c, lse_c = ditattn.attention(
        q.contiguous(), k.contiguous(), v.contiguous(), backend=backend, return_lse=True, causal=causal
    )
    torch.testing.assert_close(out, out_c)
    torch.testing.assert_close(lse, lse_c)


def test_lse_path_with_a_strided_head_dim_keeps_gradients():
    """The packed copy the LSE path makes is part of the autograd graph: the output's gradients reach
    the strided views' base buffers and match the float64 reference's."""
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(1, 9, 2, 21, generator=gen).requires_grad_(True) for _ in range(3)]
    q, k, v = (t[..., ::2] for t in base)
    out, _ = ditattn.attention(q, k, v, backend="torch_sdpa", return_lse=True)
    out.double().square().sum().backward()
    grads = [t.grad.double() for t in base]
    base64 = [t.detach().double().requires_grad_(True) for t in base]
    ref_out, _ = reference_attention(*(t[..., ::2] for t in base64), dtype=torch.float64)
    ref_out.square().sum().backward()
    for g, t in zip(grads, base64):
        assert _rel(g, t.grad) < 1e-4


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch_sdpa", "fa", "torch_cudnn_sdpa", "sage_attn"])
@pytest.mark.parametrize("layout", ["every_other", "head_dim_outermost", "broadcast_head_dim"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_lse_path_with_a_strided_head_dim_matches_float64(backend, layout, dtype):
    gen = torch.Generator().manual_seed(11)
    q = _view((2, 77, 8, 64), layout, dtype, "cuda", gen=gen)
    k = _view((2, 131, 4, 64), layout, dtype, "cuda", gen=gen)
    v = _view((2, 131, 4, 64), layout, dtype, "cuda", gen=gen)
    try:
        out, lse = ditattn.attention(q, k, v, backend=backend, return_lse=True)
    except AttentionConfigError as exc:  # a backend that cannot serve this GPU: refused, never wrong
        pytest.skip(str(exc))
    ref_out, ref_lse = reference_attention(q, k, v, dtype=torch.float64)
    assert _rel(out, ref_out) < (3e-2 if backend == "sage_attn" else 1e-2)
    assert (lse.double() - ref_lse).abs().max().item() < 5e-2


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["every_other", "head_dim_outermost"])
def test_cuda_lse_path_with_a_bias_and_a_strided_head_dim_matches_float64(layout):
    gen = torch.Generator().manual_seed(12)
    q = _view((1, 40, 4, 64), layout, torch.float16, "cuda", gen=gen)
    k = _view((1, 56, 4, 64), layout, torch.float16, "cuda", gen=gen)
    v = _view((1, 56, 4, 64), layout, torch.float16, "cuda", gen=gen)
    bias = torch.randn(1, 1, 40, 56, generator=gen).cuda()
    out, lse = ditattn.attention(q, k, v, backend="torch_sdpa", attn_bias=bias, return_lse=True)
    ref_out, ref_lse = reference_attention(q, k, v, attn_bias=bias.half(), dtype=torch.float64)
    assert _rel(out, ref_out) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 5e-2


# ------------------------------------------------------------------------------------------------
# SVG2 at its exact setting, and one non-finite token

SVG2 = "sparse_video_gen_2_attn"
GRID, TEXT = (2, 5, 7), 3  # 70 video tokens + 3 text tokens


def _svg2(q, k, v, **config):
    cfg = {"num_q_clusters": 8, "num_k_clusters": 8, **config}
    return ditattn.attention(q, k, v, backend=SVG2, config=cfg, video_shape=GRID, text_len=TEXT)


def _qkv(seed: int, gain: float = 1.0, heads: int = 3, dim: int = 16):
    gen = torch.Generator().manual_seed(seed)
    s = GRID[0] * GRID[1] * GRID[2] + TEXT
    return [torch.randn(1, s, heads, dim, generator=gen) * g for g in (gain, gain, 1.0)]


@pytest.mark.parametrize("predictor", ["pooled_query", "centroids"])
@pytest.mark.parametrize("gain", [1.0, 8.0, 30.0])
def test_svg2_top_p_one_is_dense_exact_on_peaked_logits(predictor, gain):
    """q, k scaled by ``gain``: logits of spread ~gain^2, so most cluster masses round to 0 in float32;
    top_p=1 must still keep every key (as sparsity 0 / topk 1 do for the other block-sparse backends)."""
    q, k, v = _qkv(int(gain) * 7 + len(predictor), gain)
    out = _svg2(q, k, v, top_p=1.0, predictor=predictor)
    ref, _ = reference_attention(q, k, v, dtype=torch.float64)
    # float32 logits up to ~3e3 in the online softmax: ~1e-5; one missed key cluster: > 0.1
    assert _rel(out, ref) < 1e-4


def _nonfinite_rows(x: torch.Tensor) -> set:
    return {tuple(i) for i in (~torch.isfinite(x).all(-1)).nonzero().tolist()}


@pytest.mark.parametrize("where", ["q", "k"])
def test_svg2_top_p_one_with_one_inf_matches_dense_row_for_row(where):
    q, k, v = _qkv(5)
    (q if where == "q" else k)[0, 11, 1, 4] = float("-inf")
    out = _svg2(q, k, v, top_p=1.0)
    ref, _ = reference_attention(q, k, v, dtype=torch.float64)
    bad = _nonfinite_rows(ref)
    assert bad and _nonfinite_rows(out) == bad  # the same rows are non-finite as in dense attention
    if where == "q":
        assert bad == {(0, 11, 1)}  # only the -inf query's own row
    ok = torch.isfinite(ref).all(-1)
    assert _rel(out[ok], ref[ok]) < 1e-5


@pytest.mark.parametrize("bad_value", [float("-inf"), float("inf"), float("nan")])
@pytest.mark.parametrize("predictor", ["pooled_query", "centroids"])
def test_svg2_one_non_finite_query_changes_only_its_own_row(bad_value, predictor):
    """At the default top_p the selection is lossy; a non-finite query coordinate must still leave
    every other output row exactly as it is when that coordinate is 0."""
    q, k, v = _qkv(9)
    q0 = q.clone()
    q0[0, 20, 2, 3] = 0.0
    q[0, 20, 2, 3] = bad_value
    out, clean = _svg2(q, k, v, predictor=predictor), _svg2(q0, k, v, predictor=predictor)
    assert _nonfinite_rows(out) == {(0, 20, 2)}
    others = torch.ones(out.shape[:-1], dtype=torch.bool)
    others[0, 20, 2] = False
    torch.testing.assert_close(out[others], clean[others], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# the error types that leave attention()


def test_svg2_is_differentiable_like_dense_attention():
    """One batch element (the padded-buffer gather path) and two: at top_p=1 the gradients of q, k, v
    are dense attention's."""
    for batch in (1, 2):
        gen = torch.Generator().manual_seed(batch)
        base = torch.randn(3, batch, 73, 2, 16, generator=gen, dtype=torch.float64)
        x = [t.float().requires_grad_(True) for t in base]
        out = _svg2(*x, top_p=1.0)
        out.double().square().sum().backward()
        r = [t.clone().requires_grad_(True) for t in base]
        reference_attention(*r, dtype=torch.float64)[0].square().sum().backward()
        for a, b in zip(x, r):
            assert _rel(a.grad, b.grad) < 1e-5


def test_vmoba_on_meta_tensors_is_a_config_error():
    q = torch.empty(1, 70, 2, 16, device="meta")
    with pytest.raises(AttentionConfigError, match="vmoba_attn' cannot run on meta tensors") as info:
        ditattn.attention(q, q, q, backend="vmoba_attn", video_shape=(2, 5, 7))
    assert isinstance(info.value.__cause__, RuntimeError) and "accepted:" in str(info.value)
    # a backend that needs no values serves shape-only runs
    assert ditattn.attention(q, q, q, backend="torch_sdpa").shape == q.shape


@pytest.fixture
def fake_sdpa(monkeypatch):
    """Replace torch_sdpa's implementation with ``fn`` for one test."""
    from ditattn.attention.backends import base

    base.get_impl(B.TORCH_SDPA)

    def use(fn):
        monkeypatch.setitem(base._REGISTRY, B.TORCH_SDPA, fn)

    return use


def _grad_qkv():
    return [torch.randn(1, 5, 2, 8).requires_grad_(True) for _ in range(3)]


def test_a_backend_failing_under_autograd_is_a_config_error(fake_sdpa):
    def impl(q, k, v, call, cfg):
        if torch.is_grad_enabled() and q.requires_grad:
            raise RuntimeError("kernel has no backward")
        return q.clone(), None

    fake_sdpa(impl)
    with pytest.raises(AttentionConfigError, match="torch_sdpa' does not support autograd.*no backward"):
        ditattn.attention(*_grad_qkv(), backend="torch_sdpa")
    with torch.no_grad():
        assert ditattn.attention(*_grad_qkv(), backend="torch_sdpa").shape == (1, 5, 2, 8)


def test_a_backend_returning_a_detached_output_is_a_config_error(fake_sdpa):
    fake_sdpa(lambda q, k, v, call, cfg: (q.detach().clone(), None))
    with pytest.raises(AttentionConfigError, match="not connected to q, k, v"):
        ditattn.attention(*_grad_qkv(), backend="torch_sdpa")
    q = torch.randn(1, 5, 2, 8)  # nothing requires grad: a detached output is the right output
    assert ditattn.attention(q, q, q, backend="torch_sdpa").shape == q.shape


@pytest.mark.parametrize("exc", [RuntimeError("an internal bug"), torch.OutOfMemoryError("out of memory")])
def test_failures_outside_the_known_input_classes_are_not_relabelled(fake_sdpa, exc):
    def impl(q, k, v, call, cfg):
        raise exc

    fake_sdpa(impl)
    for args in (_grad_qkv(), [torch.randn(1, 5, 2, 8)] * 3):
        with pytest.raises(type(exc)) as info:
            ditattn.attention(*args, backend="torch_sdpa")
        assert not isinstance(info.value, AttentionConfigError)


ODD_INPUTS = [
    "plain",
    "every_other",
    "head_dim_outermost",
    "broadcast_batch",
    "requires_grad",
    "meta",
    "neg_inf",
    "nan",
    "float64",
    "float16",
    "bfloat16",
    "gqa_batch2",
    "one_token",
    "no_text",
]


def _odd_call(kind: str, gen: torch.Generator):
    """q, k, v and the keyword arguments of one self-attention call of the odd input class ``kind``
    (a 3x5 or 1x1 latent grid plus text tokens, 4 heads, head dim 16)."""
    grid, text = ((1, 1, 1), 0) if kind == "one_token" else ((1, 3, 5), 0 if kind == "no_text" else 2)
    s = grid[0] * grid[1] * grid[2] + text
    b, hkv = (2, 2) if kind == "gqa_batch2" else (1, 4)
    dtype = {"float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(kind, torch.float32)
    layout = kind if kind in ("every_other", "head_dim_outermost") else "plain"

    def make(h):
        if kind == "broadcast_batch":
            return torch.randn(1, s, h, 16, generator=gen).expand(3, s, h, 16)
        t = (
            _view((b, s, h, 16), layout, dtype, gen=gen)
            if layout != "plain"
            else torch.randn(b, s, h, 16, generator=gen).to(dtype)
        )
        if kind in ("neg_inf", "nan"):
            t[0, s // 2, 0, 3] = float("-inf") if kind == "neg_inf" else float("nan")
        if kind == "meta":
            t = torch.empty_like(t, device="meta")
        return t.requires_grad_(True) if kind == "requires_grad" else t

    return make(4), make(hkv), make(hkv), {"video_shape": grid, "text_len": text}


@pytest.mark.parametrize("backend", [b.value for b in B])
def test_only_config_errors_leave_attention_on_odd_inputs(backend):
    """Every backend x every odd input class x LSE or not: a correct-shape result or an
    AttentionConfigError (a one-line message), never another exception; a differentiable input
    gives a differentiable output."""
    gen = torch.Generator().manual_seed(zlib.crc32(backend.encode()))
    outcomes = {}
    for kind in ODD_INPUTS:
        for lse in (False, True):
            q, k, v, kw = _odd_call(kind, gen)
            try:
                res = ditattn.attention(q, k, v, backend=backend, return_lse=lse, **kw)
            except AttentionConfigError as exc:
                msg = str(exc)
                assert msg and "\n" not in msg and len(msg) < 2000, msg[:300]
                outcomes[kind, lse] = "refused"
                continue
            out = res[0] if lse else res
            assert out.shape == q.shape and out.device == q.device
            if lse:
                assert res[1].shape == (q.shape[0], q.shape[2], q.shape[1])
            if kind == "requires_grad":
                assert out.requires_grad
                out.float().sum().backward()
            outcomes[kind, lse] = "ran"
    assert len(outcomes) == 2 * len(ODD_INPUTS)
