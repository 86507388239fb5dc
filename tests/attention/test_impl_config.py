"""Kernel choices are backend config keys (``sage_attn``: ``impl``/``pv_dtype``/``qk_dtype``; the sparse
backends: ``block_sparse_impl``), validated like every other key, listed by ``ditattn backends``, and the
environment variables they replace are refused with the key to use instead."""

import math

import pytest
import torch

from ditattn.attention.backends.base import AttnCall, get_impl
from ditattn.attention.config import validate_backend_config
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import BLOCK_SPARSE_IMPLS, SCHEMAS
from ditattn.errors import AttentionConfigError
from ditattn.registry import list_backends

GRID, TEXT = (2, 4, 4), 3


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    S = math.prod(GRID) + TEXT
    return [torch.randn(1, S, 2, 32, generator=g) for _ in range(3)]


def test_block_sparse_impl_choices_match_the_engine():
    from ditattn.attention.sparse.block_sparse import IMPLS

    assert BLOCK_SPARSE_IMPLS == IMPLS
    engine = {k for k, params in SCHEMAS.items() if any(p.name == "block_sparse_impl" for p in params)}
    assert engine == {
        "sliding_tile_attn",
        "video_sparse_attn",
        "sparge_attn",
        "vmoba_attn",
        "sol_attn",
        "sla_attn",
        "sparse_video_gen_2_attn",
    }


def test_block_sparse_impl_selects_the_kernel(monkeypatch):
    """reference and flex run the same block lists: the same output; triton on the CPU without the
    interpreter is refused with the reason; a bad value names the key."""
    q, k, v = _qkv()
    call = AttnCall(video_shape=GRID, text_len=TEXT)
    outs = {}
    for impl in ("reference", "flex"):
        cfg = validate_backend_config(B.VIDEO_SPARSE_ATTN, {"sparsity": 0.5, "block_sparse_impl": impl})
        outs[impl] = get_impl(B.VIDEO_SPARSE_ATTN)(q, k, v, call, cfg)[0]
    assert torch.allclose(outs["reference"], outs["flex"], atol=1e-5)
    with pytest.raises(AttentionConfigError, match="invalid value 'cuda' for 'block_sparse_impl'.*reference"):
        validate_backend_config(B.VIDEO_SPARSE_ATTN, {"block_sparse_impl": "cuda"})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cfg = validate_backend_config(B.VIDEO_SPARSE_ATTN, {"sparsity": 0.5, "block_sparse_impl": "triton"})
    # the first Triton kernel on VSA's path (since the Triton selection stage: the block pooling) refuses
    with pytest.raises(AttentionConfigError, match="kernel:? needs CUDA tensors.*TRITON_INTERPRET=1"):
        get_impl(B.VIDEO_SPARSE_ATTN)(q, k, v, call, cfg)


def test_retired_block_sparse_env_var_is_refused(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setenv("DITATTN_BLOCK_SPARSE_IMPL", "flex")
    with pytest.raises(AttentionConfigError, match="DITATTN_BLOCK_SPARSE_IMPL is no longer read.*block_sparse_impl"):
        get_impl(B.VIDEO_SPARSE_ATTN)(q, k, v, AttnCall(video_shape=GRID, text_len=TEXT), {"sparsity": 0.5})


def test_sage_keys_are_validated_and_listed():
    cfg = validate_backend_config(B.SAGE_ATTN, {})
    assert cfg == {
        "impl": "auto",
        "pv_dtype": "fp16",
        "pv_accum": "two_level",
        "qk_dtype": "int8",
        "k_granularity": "auto",
        "min_seq_len": 16384,
        "qk_balance": None,
    }
    with pytest.raises(AttentionConfigError, match="invalid value 'cuda' for 'impl'; accepted: one of"):
        validate_backend_config(B.SAGE_ATTN, {"impl": "cuda"})
    with pytest.raises(
        AttentionConfigError, match="'qk_dtype' .no sage_attn kernel implements fp8 Q.K yet.; accepted: int8"
    ):
        validate_backend_config(B.SAGE_ATTN, {"qk_dtype": "fp8"})
    info = {b.name: b for b in list_backends()}["sage_attn"]
    params = {p["name"]: p for p in info.params}
    assert set(params) == {"impl", "pv_dtype", "pv_accum", "qk_dtype", "k_granularity", "min_seq_len", "qk_balance"}
    assert params["impl"]["default"] == "auto" and params["pv_accum"]["choices"] == ["two_level", "direct"]
    assert "sm90" in params["impl"]["choices"]
    vsa = {p["name"] for p in {b.name: b for b in list_backends()}["video_sparse_attn"].params}
    assert "block_sparse_impl" in vsa


def test_backends_lists_the_implementation_keys(capsys):
    from ditattn.cli import main

    assert main(["backends", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "param impl: str = 'auto'" in out and "param pv_dtype: str = 'fp16'" in out
    assert "param block_sparse_impl: str = 'auto'" in out
    assert "param qk_balance: float = None" in out and "2.09 % to 1.82 %" in out


def test_sage_auto_rule_picks_the_sm90_kernel_on_hopper_only():
    from ditattn.attention.backends.sage import sage_cuda_runtime
    from ditattn.platforms import Platform

    hopper = Platform.simulate("cuda", capability=(9, 0), packages={"triton"})
    assert sage_cuda_runtime(hopper, 128) == ("sm90", "")
    assert sage_cuda_runtime(hopper, 64, needs_lse=True) == ("sm90", "")  # the kernel returns the LSE
    # sm90 has FP8 P.V too (impl sm90); auto keeps fp8 on the Triton kernel until the H200 measures it
    assert sage_cuda_runtime(hopper, 128, pv_dtype="fp8")[0] == "triton"
    assert sage_cuda_runtime(hopper, 32)[0] == "triton"  # head dim 32: only the Triton kernel
    ampere = Platform.simulate("cuda", capability=(8, 0), packages={"triton"})
    assert sage_cuda_runtime(ampere, 128)[0] == "triton"
    # with the package the rule picks it off Hopper, but not with qk_balance (the package has none): the plan
    # names the Triton kernel that then runs; without Triton nothing serves it, and the reason says why
    ada_pkg = Platform.simulate("cuda", capability=(8, 9), packages={"triton", "sageattention"})
    assert sage_cuda_runtime(ada_pkg, 128)[0] == "package"
    assert sage_cuda_runtime(ada_pkg, 128, qk_balance=True)[0] == "triton"
    pkg_only = Platform.simulate("cuda", capability=(8, 9), packages={"sageattention"})
    impl, why = sage_cuda_runtime(pkg_only, 128, qk_balance=True)
    assert impl is None and "no qk_balance" in why, why


def test_sage_k_granularity_reaches_the_implementations(monkeypatch):
    import torch

    from ditattn.attention.backends.base import AttnCall
    from ditattn.attention.backends.sage import SAGE_IMPLS, sage_impl_for
    from ditattn.attention.kernels.int8_attention import int8_attention_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 200, 2, 64, generator=g) for _ in range(3))
    k = k + 0.5
    call = AttnCall()
    out_auto, _ = SAGE_IMPLS["reference"].run(q, k, v, call, {"pv_dtype": "fp16", "k_granularity": "auto"})
    out_tok, _ = int8_attention_reference(q, k, v, k_granularity="token")
    out_blk, _ = int8_attention_reference(q, k, v, k_granularity="block")
    assert torch.equal(out_auto, out_tok) and not torch.equal(out_tok, out_blk)
    # the Triton kernel has per-block K scales only: an explicit token granularity is refused with the reason
    # (asked as the CPU interpreter would be, so that a GPU machine's CPU run reaches the same check)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    why = SAGE_IMPLS["triton"].why_not(q.half(), call, {"k_granularity": "token"})
    assert why is not None and "per block" in why
    with pytest.raises(AttentionConfigError, match="sm90 kernel needs an SM90"):
        sage_impl_for(q, call, {"impl": "sm90"})


def test_sage_pv_accum_is_checked_against_precision_and_implementation():
    import torch

    from ditattn.attention.backends.base import AttnCall
    from ditattn.attention.backends.sage import SAGE_IMPLS, sage_impl_for

    q = torch.randn(1, 64, 2, 64)
    call = AttnCall()
    with pytest.raises(AttentionConfigError, match="pv_accum direct applies to pv_dtype fp8 only"):
        sage_impl_for(q, call, {"pv_accum": "direct"})
    with pytest.raises(AttentionConfigError, match="reference adds each key block's FP8 P.V in float32"):
        sage_impl_for(q, call, {"pv_dtype": "fp8", "pv_accum": "direct"})
    assert sage_impl_for(q, call, {"pv_dtype": "fp8", "pv_accum": "two_level"}) == "reference"
    # the sm90 kernel implements fp8 P.V: off Hopper it is refused for the device, not the precision
    assert "fp8" in SAGE_IMPLS["sm90"].pv_dtypes
    with pytest.raises(AttentionConfigError, match="sm90 kernel needs an SM90"):
        sage_impl_for(q.half(), call, {"impl": "sm90", "pv_dtype": "fp8"})
    with pytest.raises(AttentionConfigError, match="invalid value 'fp22' for 'pv_accum'"):
        sage_impl_for(q, call, {"pv_dtype": "fp8", "pv_accum": "fp22"})
