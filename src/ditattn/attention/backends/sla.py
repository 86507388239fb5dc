"""``sla_attn`` and ``sage_sla_attn``: sparse-linear attention (critical blocks exact, marginal ones linear), on the
in-tree sparse engine: its parameter schema, capability row and implementation
(the prologue every sparse backend shares, and the rules common to them: :mod:`.sparse_common`)."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.sparse_common import (
    sparse_backend,
    sparse_done,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import (
    BLOCK_SPARSE_IMPL,
    EDGE_TILES,
    P,
    in_range,
)
from ditattn.attention.sparse.sla import sla_attention
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
)
from ditattn.attention.specs import ALL_FLOAT, IN_TREE_SPARSE, BackendSpec

Tensor = torch.Tensor


SLA_ATTN_SCHEMA = (
    P(
        "topk",
        "float",
        0.2,
        "Fraction of key blocks per query block computed exactly (critical)",
        check=in_range(0.0, 1.0, lo_open=True),
        accepted="a number in (0, 1]",
    ),
    P(
        "negligible_fraction",
        "float",
        0.0,
        "Fraction of key blocks skipped outright (lowest mass); the rest go through the linear branch",
        check=in_range(0.0, 1.0, hi_open=True),
        accepted="a number in [0, 1)",
    ),
    P("block_size", "int", 64, "Block size in tokens", choices=(32, 64, 128)),
    EDGE_TILES,
    BLOCK_SPARSE_IMPL,
)


# ------------------------------------------------------------------------------------------------


def _sla(name: str, q, k, v, call: AttnCall, cfg: dict, vs, text_len: int):
    out, lse, plan = sla_attention(
        q,
        k,
        v,
        video_shape=vs,
        text_len=text_len,
        topk=cfg["topk"],
        negligible_fraction=cfg["negligible_fraction"],
        block_size=cfg["block_size"],
        quantize=name == B.SAGE_SLA_ATTN.value,
        scale=call.scale,
        return_lse=call.return_lse,
        impl=cfg["block_sparse_impl"],
        edge_tiles=cfg["edge_tiles"],
    )
    sparse_done(name, call, plan, marginal_fraction=plan.extra["marginal_fraction"], linear_branch="absent (zero)")
    return out, lse


@sparse_backend(
    B.SLA_ATTN,
    schema=SLA_ATTN_SCHEMA,
    spec=BackendSpec(
        kind="sparse+linear",
        summary="Sparse-Linear Attention: exact critical blocks + linear branch",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=ALL_FLOAT,
        lossy=True,
        cross_attention=False,
        causal=False,
        config_schema="sla_attn",
        notes="linear branch projection from the checkpoint; zero when absent (pure sparse)",
    ),
)
def sla_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    return _sla(name, q, k, v, call, cfg, vs, text_len)


@sparse_backend(
    B.SAGE_SLA_ATTN,
    schema=SLA_ATTN_SCHEMA,
    spec=BackendSpec(
        kind="sparse+linear",
        summary="SageAttention + Sparse-Linear Attention (quantized sparse branch)",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=ALL_FLOAT,
        lossy=True,
        cross_attention=False,
        causal=False,
        config_schema="sla_attn",
    ),
)
def sage_sla_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    return _sla(name, q, k, v, call, cfg, vs, text_len)
