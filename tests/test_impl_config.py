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
    assert engine == {"sliding_tile_attn", "video_sparse_attn", "sparge_attn", "vmoba_attn", "sol_attn", "sla_attn",
                      "sparse_video_gen_2_attn"}


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
    with pytest.raises(AttentionConfigError, match="Triton block-sparse kernel needs CUDA tensors"):
        get_impl(B.VIDEO_SPARSE_ATTN)(q, k, v, call, cfg)


def test_retired_block_sparse_env_var_is_refused(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setenv("DITATTN_BLOCK_SPARSE_IMPL", "flex")
    with pytest.raises(AttentionConfigError, match="DITATTN_BLOCK_SPARSE_IMPL is no longer read.*block_sparse_impl"):
        get_impl(B.VIDEO_SPARSE_ATTN)(q, k, v, AttnCall(video_shape=GRID, text_len=TEXT), {"sparsity": 0.5})


def test_sage_keys_are_validated_and_listed():
    cfg = validate_backend_config(B.SAGE_ATTN, {})
    assert cfg == {"impl": "auto", "pv_dtype": "fp16", "qk_dtype": "int8"}
    with pytest.raises(AttentionConfigError, match="invalid value 'cuda' for 'impl'; accepted: one of"):
        validate_backend_config(B.SAGE_ATTN, {"impl": "cuda"})
    with pytest.raises(AttentionConfigError, match="'qk_dtype' .no sage_attn kernel implements fp8 Q.K yet.; "
                                                   "accepted: int8"):
        validate_backend_config(B.SAGE_ATTN, {"qk_dtype": "fp8"})
    info = {b.name: b for b in list_backends()}["sage_attn"]
    params = {p["name"]: p for p in info.params}
    assert set(params) == {"impl", "pv_dtype", "qk_dtype"} and params["impl"]["default"] == "auto"
    vsa = {p["name"] for p in {b.name: b for b in list_backends()}["video_sparse_attn"].params}
    assert "block_sparse_impl" in vsa


def test_backends_lists_the_implementation_keys(capsys):
    from ditattn.cli import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "param impl: str = 'auto'" in out and "param pv_dtype: str = 'fp16'" in out
    assert "param block_sparse_impl: str = 'auto'" in out
