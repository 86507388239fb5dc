"""ditattn.attention() against a float64 reference at odd sizes (fp32 and bf16, GQA, LSE, bias)."""

import pytest
import torch

import ditattn
from ditattn import AttentionConfigError
from ditattn.attention.backends.base import reference_attention


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _sdpa_err(q, k, v, ref, **kw):
    """Error of plain PyTorch SDPA in the same dtype (the yardstick for low-precision kernels)."""
    rep = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), **kw
    )
    return _rel(o.transpose(1, 2), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,skv,d,h,hkv", [(97, 97, 64, 4, 4), (255, 255, 80, 6, 2), (97, 131, 128, 4, 1)])
@pytest.mark.parametrize("backend", [None, "torch_sdpa"])
def test_matches_float64_reference(dtype, sq, skv, d, h, hkv, backend):
    g = torch.Generator().manual_seed(sq * d + h)
    q = torch.randn(2, sq, h, d, generator=g).to(dtype)
    k = torch.randn(2, skv, hkv, d, generator=g).to(dtype)
    v = torch.randn(2, skv, hkv, d, generator=g).to(dtype)
    out, lse = ditattn.attention(q, k, v, backend=backend, return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, dtype=torch.float64)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, h, sq) and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2 * _sdpa_err(q, k, v, ref) + 1e-3
    assert _rel(out, ref) < tol
    assert (lse.double() - ref_lse).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_and_bias(dtype):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 97, 4, 64, generator=g).to(dtype) for _ in range(3))
    bias = torch.randn(1, 4, 97, 97, generator=g)
    for kw in ({"causal": True}, {"attn_bias": bias}):
        out, lse = ditattn.attention(q, k, v, return_lse=True, **kw)
        ref, ref_lse = reference_attention(q, k, v, dtype=torch.float64, **kw)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert _rel(out, ref) < tol
        assert (lse.double() - ref_lse).abs().max().item() < 1e-4


def test_fa_on_cpu_is_substituted_and_correct():
    q, k, v = (torch.randn(1, 33, 2, 64) for _ in range(3))
    out = ditattn.attention(q, k, v, backend="fa4")
    ref, _ = reference_attention(q, k, v, dtype=torch.float64)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(q=torch.randn(2, 3, 4), k=torch.randn(2, 3, 4), v=torch.randn(2, 3, 4)), "4-D"),
        (dict(q=torch.randn(1, 5, 3, 8), k=torch.randn(1, 5, 2, 8), v=torch.randn(1, 5, 2, 8)), "multiple"),
        (dict(q=torch.randn(1, 5, 2, 8), k=torch.randn(1, 5, 2, 16), v=torch.randn(1, 5, 2, 16)), "head dims"),
        (dict(q=torch.randn(1, 5, 2, 8), k=torch.randn(1, 5, 2, 8), v=torch.randn(1, 6, 2, 8)), "same shape"),
        (
            dict(q=torch.randn(1, 5, 2, 8), k=torch.randn(1, 5, 2, 8).half(), v=torch.randn(1, 5, 2, 8).half()),
            "dtypes",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, match):
    with pytest.raises(AttentionConfigError, match=match):
        ditattn.attention(kwargs["q"], kwargs["k"], kwargs["v"])


def test_explicit_backend_that_cannot_run_here_explains():
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(AttentionConfigError, match="torch_cudnn_sdpa.*not supported on cpu"):
        ditattn.attention(q, q, q, backend="cudnn_sdpa")
    with pytest.raises(AttentionConfigError, match="unknown attention backend 'flashy'"):
        ditattn.attention(q, q, q, backend="flashy")


def test_video_shape_must_match_sequence():
    q = torch.randn(1, 10, 2, 64)
    with pytest.raises(AttentionConfigError, match="does not match the sequence length"):
        ditattn.attention(q, q, q, video_shape=(1, 2, 4), text_len=1)


def test_force_applies_to_automatic_calls():
    q = torch.randn(1, 8, 2, 64)
    with ditattn.global_force_attn_backend_context_manager("torch_cudnn_sdpa"):
        with pytest.raises(AttentionConfigError, match="torch_cudnn_sdpa"):
            ditattn.attention(q, q, q)
    ditattn.attention(q, q, q)  # restored


EMPTY_SHAPES = [
    ((1, 4, 2, 32), (1, 0, 2, 32)),  # empty key sequence (was SIGFPE with return_lse)
    ((1, 4, 0, 32), (1, 4, 0, 32)),  # zero heads
    ((1, 0, 2, 32), (1, 4, 2, 32)),  # empty query sequence
    ((0, 4, 2, 32), (0, 4, 2, 32)),  # empty batch
    ((1, 4, 2, 0), (1, 4, 2, 0)),  # empty head dim
]


def _empty_dimension_run(folder):
    """Every EMPTY_SHAPES call in ONE fresh interpreter (a kernel that kills the process fails these
    tests instead of pytest), run in the background (tests/background.py)."""
    import sys

    code = (
        "import sys, torch, ditattn\n"
        f"for i, (qs, ks) in enumerate({EMPTY_SHAPES!r}):\n"
        "    q, k = torch.randn(qs), torch.randn(ks)\n"
        "    try:\n        ditattn.attention(q, k, k, return_lse=True)\n        print(i, 'returned', flush=True)\n"
        "    except ditattn.AttentionConfigError as e:\n        print(i, 'refused:', e, flush=True)\n"
    )
    return dict(args=[sys.executable, "-c", code], timeout=120)


def _empty_dimension_calls(background_run):
    """``(stdout lines by case index, stderr)``; a case the process did not reach has no line."""
    r, _ = background_run
    lines = {int(ln.split(" ", 1)[0]): ln for ln in r.stdout.splitlines() if ln.split(" ", 1)[0].isdigit()}
    return lines, f"exit status {r.returncode}\n{r.stderr[-3000:]}"


@pytest.mark.background.with_args(_empty_dimension_run)  # one run for every case
@pytest.mark.parametrize("case", range(len(EMPTY_SHAPES)), ids=[str(s) for s in EMPTY_SHAPES])
def test_empty_dimensions_are_refused_not_crashed(case, background_run):
    lines, stderr = _empty_dimension_calls(background_run)
    assert case in lines, stderr  # the interpreter died at this case (or before it)
    assert "refused:" in lines[case] and "empty" in lines[case], lines[case]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(scale=float("nan")), "scale must be None"),
        (dict(scale=float("inf")), "scale must be None"),
        (dict(scale=0.0), "finite number > 0"),
        (dict(scale=-1), "finite number > 0"),
        (dict(scale="0.1"), "scale must be None"),
        (dict(scale=True), "scale must be None"),
        (dict(causal="yes"), "causal must be True or False"),
        (dict(causal=1), "causal must be True or False"),
        (dict(return_lse=None), "return_lse must be True or False"),
        (dict(attn_bias=5), "attn_bias must be None or a torch.Tensor"),
        (dict(attn_bias=torch.zeros(1, 2, 8, 8, dtype=torch.int64)), "floating-point bias or a bool mask"),
        (dict(attn_bias=torch.zeros(3, 3)), "does not broadcast"),
        (dict(attn_bias=torch.zeros(1, 1, 1, 2, 8, 8)), "does not broadcast"),
        (dict(attn_bias=torch.zeros(2, 1, 8, 8)), "does not broadcast"),
        (dict(text_len=-1), "text_len must be an integer >= 0"),
        (dict(text_len=1.5), "text_len must be an integer >= 0"),
        (dict(step=-2), "step must be None or an integer >= 0"),
        (dict(layer_idx="0"), "layer_idx must be None"),
        (dict(video_shape=(1, 2, 4.0)), "video_shape must be three positive integers"),
        (dict(video_shape="124"), "video_shape must be three positive integers"),
    ],
)
def test_call_arguments_are_validated(kwargs, match):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(AttentionConfigError, match=match):
        ditattn.attention(q, q, q, **kwargs)


def test_valid_scale_and_broadcast_bias_still_run():
    import numpy as np

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(3))
    out = ditattn.attention(q, k, v, scale=np.float32(0.25))
    ref, _ = reference_attention(q, k, v, scale=0.25, dtype=torch.float64)
    assert _rel(out, ref) < 1e-5
    for bias in (torch.zeros(8), torch.zeros(8, 8), torch.zeros(1, 2, 1, 8), torch.ones(8, 8, dtype=torch.bool)):
        assert ditattn.attention(q, k, v, attn_bias=bias, return_lse=True)[0].shape == q.shape
