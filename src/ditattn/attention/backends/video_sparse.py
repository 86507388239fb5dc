"""``video_sparse_attn``: VSA (pooled tile scores, a fixed top-k of key tiles per query tile), on the in-tree sparse
engine: its parameter schema, capability row and implementation
(the prologue every sparse backend shares, and the rules common to them: :mod:`.sparse_common`)."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.sparse_common import (
    run_dense,
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
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
)
from ditattn.attention.sparse.vsa import video_sparse_attention
from ditattn.attention.specs import ALL_FLOAT, IN_TREE_SPARSE, BackendSpec

Tensor = torch.Tensor


VIDEO_SPARSE_ATTN_SCHEMA = (
    P(
        "sparsity",
        "float",
        0.0,
        "Fraction of key tiles skipped per query tile (0.0 - 1.0)",
        check=in_range(0.0, 1.0),
        accepted="a number in [0, 1]",
    ),
    EDGE_TILES,
    BLOCK_SPARSE_IMPL,
)


@sparse_backend(
    B.VIDEO_SPARSE_ATTN,
    schema=VIDEO_SPARSE_ATTN_SCHEMA,
    spec=BackendSpec(
        kind="sparse",
        summary="Video Sparse Attention: coarse top-k tiles + fine attention",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=ALL_FLOAT,
        lossy=True,
        cross_attention=False,
        causal=False,
        config_schema="video_sparse_attn",
        notes="4x4x4 tiles of 64 tokens; in-tree engine (upstream vsa not needed)",
    ),
)
def video_sparse_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    if cfg["sparsity"] == 0.0:  # k = every tile: the fine stage is exact full attention
        return run_dense(name, q, k, v, call, "sparsity 0.0 keeps every tile (exact dense attention)")
    out, lse, plan = video_sparse_attention(
        q,
        k,
        v,
        video_shape=vs,
        sparsity=cfg["sparsity"],
        text_len=text_len,
        scale=call.scale,
        return_lse=call.return_lse,
        impl=cfg["block_sparse_impl"],
        edge_tiles=cfg["edge_tiles"],
    )
    sparse_done(name, call, plan, tiles_per_query=plan.extra["k"])
    return out, lse
