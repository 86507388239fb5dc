"""``vmoba_attn``: V-MoBA (top-k temporal / spatial / spatio-temporal chunks per layer mode), on the in-tree sparse
engine: its parameter schema, capability row and implementation
(the prologue every sparse backend shares, and the rules common to them: :mod:`.sparse_common`)."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.sparse_common import (
    budget_decision,
    budget_keys,
    layer_index,
    remember_budget,
    reused_dense,
    sparse_backend,
    sparse_done,
    sparse_runtime_label,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import (
    BLOCK_SPARSE_IMPL,
    VMOBA_GATES,
    P,
    in_range,
    list_len,
    non_negative,
    positive,
)
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
)
from ditattn.attention.sparse.vmoba import vmoba_attention, vmoba_layer_mode
from ditattn.attention.specs import ALL_FLOAT, IN_TREE_SPARSE, BackendSpec

Tensor = torch.Tensor


VMOBA_ATTN_SCHEMA = (
    P(
        "temporal_chunk_size",
        "int",
        None,
        "Chunk size along time (latent frames)",
        check=positive,
        accepted="an integer > 0",
    ),
    P("temporal_topk", "int", None, "Top-k chunks selected along time", check=positive, accepted="an integer > 0"),
    P(
        "spatial_chunk_size",
        "list[int]",
        None,
        "Chunk size along (H, W)",
        check=list_len(2),
        accepted="2 positive integers",
    ),
    P("spatial_topk", "int", None, "Top-k chunks selected along space", check=positive, accepted="an integer > 0"),
    P(
        "st_chunk_size",
        "list[int]",
        None,
        "Chunk size along (T, H, W)",
        check=list_len(3),
        accepted="3 positive integers",
    ),
    P("st_topk", "int", None, "Top-k chunks selected spatio-temporally", check=positive, accepted="an integer > 0"),
    P("moba_select_mode", "str", "threshold", "Selection mode", choices=("threshold", "topk")),
    P(
        "moba_threshold",
        "float",
        0.25,
        "Threshold for selection (cumulative gate mass)",
        check=in_range(0.0, 1.0, lo_open=True),
        accepted="a number in (0, 1]",
    ),
    P(
        "moba_threshold_type",
        "str",
        "query_head",
        "How the threshold is applied",
        choices=("query_head", "head_global", "overall"),
    ),
    P(
        "gate",
        "str",
        "pooled_query",
        "Chunk gate: pooled_query (log-sum-exp over the chunk's keys of the query block's mean . each key: sees sink "
        "keys and peaks that a chunk mean hides) or mean (upstream: query block mean . chunk mean key; use it for "
        "checkpoints trained with V-MoBA's gate)",
        choices=VMOBA_GATES,
    ),
    P(
        "first_full_step",
        "int",
        12,
        "Initial steps with full attention",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "first_full_layer",
        "int",
        0,
        "Initial layers with full attention",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "temporal_layer",
        "int",
        1,
        "Layers of temporal chunking per cycle",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "spatial_layer",
        "int",
        1,
        "Layers of spatial chunking per cycle",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "st_layer",
        "int",
        1,
        "Layers of spatio-temporal chunking per cycle",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    *budget_keys(0.005),
    BLOCK_SPARSE_IMPL,
)


def _layer_mode(call: AttnCall, cfg: dict) -> str:
    return vmoba_layer_mode(
        call.layer_idx,
        first_full_layer=cfg["first_full_layer"],
        temporal_layer=cfg["temporal_layer"],
        spatial_layer=cfg["spatial_layer"],
        st_layer=cfg["st_layer"],
    )


def _vmoba_phase(q: Tensor, call: AttnCall, cfg: dict):
    if call.step is not None and call.step < cfg["first_full_step"]:
        return f"step {call.step} < first_full_step {cfg['first_full_step']}", None
    if _layer_mode(call, cfg) == "full":
        return f"layer {layer_index(call)} < first_full_layer {cfg['first_full_layer']}", None
    return None


@sparse_backend(
    B.VMOBA_ATTN,
    dense_phase=_vmoba_phase,
    schema=VMOBA_ATTN_SCHEMA,
    spec=BackendSpec(
        runtime_label=sparse_runtime_label,
        kind="sparse",
        summary="V-MoBA: top-k temporal/spatial/spatio-temporal chunks",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=ALL_FLOAT,
        lossy=True,
        cross_attention=False,
        causal=False,
        config_schema="vmoba_attn",
    ),
)
def vmoba_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    mode = _layer_mode(call, cfg)
    chunk = {
        "temporal": cfg.get("temporal_chunk_size"),
        "spatial": cfg.get("spatial_chunk_size"),
        "st": cfg.get("st_chunk_size"),
    }[mode]
    again = reused_dense(name, q, k, v, call, cfg)
    if again is not None:
        return again
    topk = {"temporal": cfg.get("temporal_topk"), "spatial": cfg.get("spatial_topk"), "st": cfg.get("st_topk")}[mode]
    out, lse, plan = vmoba_attention(
        q,
        k,
        v,
        video_shape=vs,
        mode=mode,
        chunk=chunk,
        topk=topk,
        select_mode=cfg["moba_select_mode"],
        threshold=cfg["moba_threshold"],
        threshold_type=cfg["moba_threshold_type"],
        gate=cfg["gate"],
        text_len=text_len,
        scale=call.scale,
        return_lse=call.return_lse,
        impl=cfg["block_sparse_impl"],
        error_budget=cfg.get("error_budget", 0.0),
        decide=budget_decision(name, call, cfg) is None,
        dense_above=cfg["dense_above"],
    )
    sparse_done(name, call, plan, mode=mode, chunk=plan.extra["chunk"], topk=plan.extra["topk"])
    remember_budget(name, call, cfg, plan)
    return out, lse
