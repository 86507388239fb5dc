"""``sol_attn``: Sol attention (threshold routing to exact blocks or their centroids, exact KV sinks), on the
in-tree sparse engine: its parameter schema, capability row and implementation
(the prologue every sparse backend shares, and the rules common to them: :mod:`.sparse_common`)."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.flash import fa_fallback_reason
from ditattn.attention.backends.sparse_common import (
    block_size_runtime_label,
    budget_decision,
    budget_keys,
    layer_index,
    line_tile,
    remember_budget,
    reused_dense,
    sparse_backend,
    sparse_done,
)
from ditattn.attention.config import parse_layer_list
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import (
    BLOCK_SPARSE_IMPL,
    EDGE_TILES,
    SOL_PREDICTORS,
    P,
    layer_list_check,
    non_negative,
    positive,
)
from ditattn.attention.sparse.sol import sol_attention
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
)
from ditattn.attention.specs import BF16, IN_TREE_SPARSE, BackendSpec
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor


def kv_splits_check(v):
    if isinstance(v, str):
        return None if v == "auto" else "must be 'auto' or a positive integer"
    return None if v > 0 else "must be 'auto' or a positive integer"


SOL_ATTN_SCHEMA = (
    P(
        "tau",
        "float",
        1.0,
        "Routing threshold scale; higher keeps fewer exact KV blocks",
        check=positive,
        accepted="a number > 0",
    ),
    P("thresh_type", "str", "diag", "Threshold mode", choices=("diag", "exact")),
    P(
        "sink_tokens",
        "int",
        0,
        "Length of the exact KV sink (prefix tokens such as text rows)",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "sink_start",
        "int",
        0,
        "Start index of the exact KV sink range",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "dense_steps",
        "int",
        10,
        "Dense attention for the first N denoising steps",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    P(
        "dense_layers",
        "str",
        "0,1",
        "Layer indices kept dense, e.g. 0,1 or 0-2",
        check=layer_list_check,
        accepted="comma-separated indices or ranges like 0,1 or 0-2",
    ),
    P(
        "dense_backend",
        "str",
        "fa",
        "Backend for the dense prefix: fa or sage_attn (approximate)",
        choices=("fa", "sage_attn"),
    ),
    P(
        "kv_splits",
        "int|str",
        "auto",
        "KV split factor passed to the kernel; auto for long sequences",
        check=kv_splits_check,
        accepted="'auto' or a positive integer",
    ),
    P(
        "predictor",
        "str",
        "pooled_query",
        "Which blocks are exact: pooled_query (tau's rule sets how many per query block, its tile neighbours then "
        "the best by each query block's mean against every key, log-sum-exp per block) or pooled (upstream: the "
        "rule's blocks by mean(q) . mean(k))",
        choices=SOL_PREDICTORS,
    ),
    P(
        "centroid_variance",
        "bool",
        True,
        "Approximate blocks' virtual keys add the blocks' key variance term 0.5 * scale^2 * q^2 . var(k) (the mass "
        "of a spread block, which its mean key underestimates); false: upstream's mean key and log size only",
    ),
    P(
        "block_size",
        "int",
        64,
        "Block size in tokens of the routing, the exact kernel and the centroids (64: 4x4x4 tiles, as upstream; "
        "128: 4x4x8). 128 runs FlashAttention-4's block-sparse kernel on Hopper/Blackwell when installed: with "
        "tau=0.5 it is faster than the defaults at lower error on the structured 480p benchmark (about 2.0x FA4 "
        "dense at 3.0-4.1 %, the defaults 1.9x at 3.7-5.1 %; docs/benchmarks.md); coarser centroids want a lower "
        "tau",
        choices=(64, 128),
    ),
    EDGE_TILES,
    *budget_keys(0.01),
    BLOCK_SPARSE_IMPL,
)


def _sol_precheck(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict):
    if q.dtype != torch.bfloat16 or q.shape[3] != 128:
        raise AttentionConfigError(
            f"{name}: needs bfloat16 q/k/v with head dim 128 (got {str(q.dtype).replace('torch.', '')}, "
            f"head dim {q.shape[3]}); use --dtype bf16 with a head-dim-128 model, or another sparse backend"
        )
    return None


def _dense_backend(q: Tensor, cfg: dict):
    """Sol's dense kernel: its ``dense_backend``, or None (the platform's) for ``fa`` where FlashAttention is
    absent (without an "fa requested" note)."""
    backend = cfg["dense_backend"]
    return None if backend == "fa" and fa_fallback_reason(q.device) is not None else backend


def _sol_phase(q: Tensor, call: AttnCall, cfg: dict):
    backend = _dense_backend(q, cfg)
    label = backend or "the platform's dense kernel"
    if call.step is not None and call.step < cfg["dense_steps"]:
        return f"step {call.step} < dense_steps {cfg['dense_steps']} ({label})", backend
    layer = layer_index(call)
    if layer in parse_layer_list(cfg["dense_layers"]):
        return f"layer {layer} in dense_layers {cfg['dense_layers']} ({label})", backend
    return None


@sparse_backend(
    B.SOL_ATTN,
    dense_phase=_sol_phase,
    schema=SOL_ATTN_SCHEMA,
    precheck=_sol_precheck,
    lines=True,
    spec=BackendSpec(
        runtime_label=block_size_runtime_label,
        kind="sparse",
        summary="Sol attention: threshold routing with exact KV sinks",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=BF16,
        head_dims=frozenset({128}),
        lossy=True,
        cross_attention=False,
        causal=False,
        config_schema="sol_attn",
        notes="BF16 and head dim 128 only; first dense_steps steps and dense_layers run dense_backend",
    ),
)
def sol_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    tile_1d = line_tile(call, cfg["block_size"])
    dense_backend = _dense_backend(q, cfg)
    again = reused_dense(name, q, k, v, call, cfg, backend=dense_backend)
    if again is not None:
        return again
    out, lse, plan = sol_attention(
        q,
        k,
        v,
        video_shape=vs,
        text_len=text_len,
        tau=cfg["tau"],
        thresh_type=cfg["thresh_type"],
        sink_start=cfg["sink_start"],
        sink_tokens=cfg["sink_tokens"],
        predictor=cfg["predictor"],
        centroid_variance=cfg["centroid_variance"],
        scale=call.scale,
        return_lse=call.return_lse,
        impl=cfg["block_sparse_impl"],
        edge_tiles=cfg["edge_tiles"],
        error_budget=cfg.get("error_budget", 0.0),
        dense_backend=dense_backend,
        tile_size=tile_1d,
        block_size=cfg["block_size"],
        decide=budget_decision(name, call, cfg) is None,
        dense_above=cfg["dense_above"],
    )
    sparse_done(name, call, plan, approximate_fraction=1.0 - plan.kept_fraction_pending)
    remember_budget(name, call, cfg, plan)
    return out, lse
