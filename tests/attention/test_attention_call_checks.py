"""``ditattn.attention`` on inputs a user gets wrong or rarely uses: a boolean mask with the LSE matches a
float64 reference (it was added as a 0/1 bias), sage_attn refuses autograd (its INT8 Q.K has no gradient),
config keys that belong to no backend are refused also when the backend is chosen automatically, a JSON
config with a key twice is refused, NumPy integers are integers, text_len cannot exceed the sequence, a
scale must fit the inputs' dtype, and the model-building layer (LocalAttention) checks what it is built with and
called with (a NaN scale ran, and q with other heads than declared ran on a backend chosen for the declared ones)."""

import numpy as np
import pytest
import torch

import ditattn
from ditattn.attention.reference import reference_attention
from ditattn.errors import AttentionConfigError


@pytest.mark.parametrize("shape", [(1, 7, 3, 8), (2, 13, 1, 16)])
def test_a_boolean_mask_with_the_lse_matches_a_float64_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    b, s, h, d = shape
    q, k, v = (torch.randn(*shape, generator=g) for _ in range(3))
    mask = torch.rand(b, h, s, s, generator=g) > 0.5
    mask[..., 0, :] = False  # one query row attends nothing
    out, lse = ditattn.attention(q, k, v, attn_bias=mask, return_lse=True, backend="torch_sdpa")
    plain = ditattn.attention(q, k, v, attn_bias=mask, backend="torch_sdpa")
    # float64 truth: scores with -inf where the mask is False
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    sc = (qd @ kd.transpose(-1, -2)) * d**-0.5
    sc = sc.masked_fill(~mask, float("-inf"))
    ref_lse = torch.logsumexp(sc, -1)
    w = torch.exp(sc - torch.where(torch.isfinite(ref_lse), ref_lse, 0).unsqueeze(-1))
    ref = (w @ vd).transpose(1, 2)
    assert torch.allclose(out.double(), ref, atol=1e-5) and torch.allclose(plain.double(), ref, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=1e-5)
    assert out[:, 0].abs().max() == 0  # the empty row: zeros
    r_out, r_lse = reference_attention(q, k, v, attn_bias=mask, dtype=torch.float64)
    assert torch.allclose(r_out, ref, atol=1e-10)


def test_sage_attn_refuses_autograd_rather_than_give_wrong_gradients():
    q, k, v = (torch.randn(1, 12, 2, 16, requires_grad=True) for _ in range(3))
    with pytest.raises(AttentionConfigError, match="sage_attn does not support autograd"):
        ditattn.attention(q, k, v, backend="sage_attn", config={"impl": "reference"})
    with torch.no_grad():
        assert ditattn.attention(q, k, v, backend="sage_attn", config={"impl": "reference"}).shape == q.shape


def test_config_keys_of_no_backend_are_refused_also_under_the_automatic_choice():
    q = torch.randn(1, 6, 2, 8)
    with pytest.raises(AttentionConfigError, match="'foo'.* belong to no attention backend"):
        ditattn.attention(q, q, q, config={"foo": 1})
    assert ditattn.attention(q, q, q, config={"sparsity": 0.5}).shape == q.shape  # another backend's key: kept
    with pytest.raises(AttentionConfigError, match="key 'topk' is given twice"):
        ditattn.attention(q, q, q, backend="torch_sdpa", config='{"topk": 0.5, "topk": 0.4}')


def test_numpy_integers_are_integers_and_text_len_is_bounded():
    q = torch.randn(1, 6, 2, 8)
    ref = ditattn.attention(q, q, q, text_len=1)
    assert torch.equal(ditattn.attention(q, q, q, text_len=np.int64(1), step=np.int32(0)), ref)
    assert torch.equal(ditattn.attention(q, q, q, text_len=torch.tensor(1), layer_idx=np.uint8(2)), ref)
    for flag in (True, np.True_, torch.tensor(True)):  # a bool is not a count (ditattn.errors.as_integer)
        with pytest.raises(AttentionConfigError, match="text_len must be an integer >= 0"):
            ditattn.attention(q, q, q, text_len=flag)
    with pytest.raises(AttentionConfigError, match="text_len 100 is longer than the sequence"):
        ditattn.attention(q, q, q, text_len=100)


@pytest.mark.parametrize("backend", ["torch_sdpa", "sage_attn", "video_sparse_attn", "sparge_attn"])
def test_a_scale_the_inputs_dtype_cannot_hold_is_refused_not_a_nan_output(backend):
    """scale=1e300 gave NaN (the scores were inf): a finite scale must also fit the inputs' dtype,
    checked before any backend runs; nan / inf, 0 and negative scales stay refused."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=g, dtype=torch.bfloat16) for _ in range(3))
    kw = dict(backend=backend, video_shape=(1, 8, 8))
    for scale in (1e300, 1e39, 10**400):
        with pytest.raises(
            AttentionConfigError,
            match=r"^scale must be None .* > 0 that bfloat16 inputs can hold .at most 3.38953e\+38., got ",
        ):
            ditattn.attention(q, k, v, scale=scale, **kw)
    for scale in (float("nan"), float("inf"), -float("inf"), np.float32("inf"), 0.0, -0.5):
        with pytest.raises(
            AttentionConfigError, match=r"^scale must be None \(1/sqrt\(head_dim\)\) or a finite number > 0, got "
        ):
            ditattn.attention(q, k, v, scale=scale, **kw)
    out = ditattn.attention(q, k, v, scale=np.float64(0.125), **kw)
    assert torch.isfinite(out).all()


def test_the_scale_limit_is_the_inputs_dtypes():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(AttentionConfigError, match=r"float16 inputs can hold \(at most 65504\), got 100000.0$"):
        ditattn.attention(q.half(), q.half(), q.half(), scale=1e5)
    out = ditattn.attention(q, q, q, scale=1e5)  # float32 holds it: a sharp but finite softmax
    assert torch.isfinite(out).all()


def test_sols_default_dense_kernel_is_not_reported_as_a_request_for_fa(caplog):
    q = torch.randn(1, 256, 2, 128, dtype=torch.bfloat16)
    with caplog.at_level("INFO", logger="ditattn.attention"):
        out = ditattn.attention(q, q, q, backend="sol_attn", video_shape=(1, 16, 16))
    assert out.shape == q.shape
    assert not [r for r in caplog.records if "fa requested" in r.getMessage()], caplog.text[-500:]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"scale": float("nan")}, "scale"),
        ({"scale": -1.0}, "scale"),
        ({"num_heads": 0}, "num_heads must be a positive integer"),
        ({"num_heads": 2.5}, "num_heads must be a positive integer"),
        ({"num_kv_heads": 3}, "must divide num_heads"),
        ({"causal": "yes"}, "causal must be True or False"),
    ],
)
def test_local_attention_refuses_what_it_cannot_be_built_with(kwargs, words):
    from ditattn.attention.layer import LocalAttention

    args = {"num_heads": 2, "head_dim": 8, **kwargs}
    with pytest.raises(AttentionConfigError, match=words):
        LocalAttention(**args)


def test_local_attention_checks_q_k_v_against_the_heads_it_was_built_for():
    from ditattn.attention.layer import LocalAttention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 7, 2, 8, generator=g) for _ in range(3))
    with pytest.raises(AttentionConfigError, match="q has 2 heads of size 8.*built for 4 heads of size 16"):
        LocalAttention(num_heads=4, head_dim=16)(q, k, v)
    with pytest.raises(AttentionConfigError, match="k has 2 heads.*built for 1 heads"):
        LocalAttention(num_heads=2, head_dim=8, num_kv_heads=1)(q, k, v)
    with pytest.raises(AttentionConfigError, match="k and v must have the same shape"):
        LocalAttention(num_heads=2, head_dim=8)(q, k, v[:, :5])
    # grouped-query and NumPy sizes still work, and the output matches a float64 reference
    layer = LocalAttention(num_heads=np.int64(2), head_dim=8, num_kv_heads=1)
    assert isinstance(layer.num_heads, int)
    out = layer(q, k[:, :, :1], v[:, :, :1])
    ref, _ = reference_attention(
        q, k[:, :, :1].expand(-1, -1, 2, -1), v[:, :, :1].expand(-1, -1, 2, -1), dtype=torch.float64
    )
    assert torch.allclose(out.double(), ref, atol=1e-5)
