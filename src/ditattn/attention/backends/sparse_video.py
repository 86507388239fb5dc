"""Backend implementations of the sparse video backends on the in-tree sparse engine.

Registers ``sliding_tile_attn``, ``video_sparse_attn``, ``sparge_attn``, ``vmoba_attn``,
``sparse_video_gen_2_attn``, ``sla_attn``, ``sage_sla_attn`` and ``sol_attn`` (contract:
:mod:`ditattn.attention.backends.base`), each with its capability row and parameter schema, through
:func:`.sparse_common.sparse_backend`, which runs the prologue they share.  Common rules:

* self-attention over ``call.video_shape = (T, H, W)`` latent tokens (T-major) followed by
  ``call.text_len`` text tokens; ``video_shape`` None, a length that does not match, causal
  attention, an additive bias or cross-attention (different q/kv lengths) raise
  :class:`AttentionConfigError` (``sparge_attn`` instead runs dense SDPA on shapes it does not
  sparsify, as upstream does; ``sparge_attn`` and ``sol_attn`` take a call without ``video_shape`` as
  a plain sequence in 1-D tiles);
* text tokens attend and are attended by everything; GQA K/V heads are expanded;
* ``call.step`` None counts as a sparse step, ``call.layer_idx`` None as layer 0;
* dense phases (``skip_time_steps``, ``first_full_step``, ``dense_steps``, ``dense_layers``, ...)
  run PyTorch SDPA (``sol_attn``: its ``dense_backend``);
* each call records its kept block fraction in ``ditattn.attention.sparse.last_stats``.

The config key ``block_sparse_impl`` (``auto``/``reference``/``flex``/``triton``) picks the
engine's kernel (:func:`ditattn.attention.sparse.block_sparse.block_sparse_attention`).  The
pooled backends (``video_sparse_attn``, ``sparge_attn``, ``sla_attn``/``sage_sla_attn``,
``sol_attn``) take ``edge_tiles`` (``packed``, the default, or ``padded``; :mod:`ditattn.attention.sparse.tiling`);
``sliding_tile_attn`` (windows on tile coordinates) and ``vmoba_attn`` (chunks are its unit) keep
one block per tile.
"""
from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.sparse_common import (
    budget_decision,
    budget_key,
    layer_index,
    layer_stats_key,
    line_tile,
    remember_budget,
    reused_dense,
    run_dense,
    sparse_backend,
    sparse_done,
    sparse_runtime_label,
)
from ditattn.attention.config import parse_layer_list
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import (
    BLOCK_SPARSE_IMPL,
    EDGE_TILES,
    SOL_PREDICTORS,
    SPARGE_PREDICTORS,
    SVG2_PREDICTORS,
    VMOBA_GATES,
    P,
    dense_above,
    error_budget,
    in_range,
    layer_list_check,
    list_len,
    min_seq_len,
    non_negative,
    positive,
)
from ditattn.attention.sparse import budget as eb
from ditattn.attention.sparse import record_stats
from ditattn.attention.sparse.budget import DENSE_CALL_ABOVE, svg2_top_p
from ditattn.attention.sparse.fallback import MIN_SEQ_LEN
from ditattn.attention.sparse.sla import sla_attention
from ditattn.attention.sparse.sol import sol_attention
from ditattn.attention.sparse.sparge import sparge_applies, sparge_attention
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
    get_search,
    load_mask_strategy,
    parse_candidates,
    sliding_tile_attention,
    sta_search_attention,
)
from ditattn.attention.sparse.svg2 import svg2_attention
from ditattn.attention.sparse.vmoba import vmoba_attention, vmoba_layer_mode
from ditattn.attention.sparse.vsa import video_sparse_attention
from ditattn.attention.specs import ALL_FLOAT, BF16, FP16_BF16, IN_TREE_SPARSE, BackendSpec
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

SEARCH_MODES = ("STA_searching", "STA_tuning", "STA_tuning_cfg")


# ------------------------------------------------------------------------------------------------
# the parameter schemas

def kv_splits_check(v):
    if isinstance(v, str):
        return None if v == "auto" else "must be 'auto' or a positive integer"
    return None if v > 0 else "must be 'auto' or a positive integer"


SLIDING_TILE_ATTN_SCHEMA = (
    P("mask_strategy_file_path", "str", None, "Path to the mask strategy JSON ('t_l_h' -> [wt, wh, ww] in tiles); written by STA_searching/STA_tuning", required=True, accepted="a path to a JSON file"),
    P("sta_mode", "str", "STA_inference", "STA mode", choices=("STA_inference", "STA_searching", "STA_tuning", "STA_tuning_cfg")),
    P("skip_time_steps", "int", 15, "Steps of full attention before switching to sparse", check=non_negative, accepted="an integer >= 0"),
    P("tile_size", "list[int]", [4, 4, 4], "Tile size (T, H, W) in latent tokens after patching", check=list_len(3), accepted="3 positive integers"),
    P("window_candidates", "list[int]", [], "STA_searching: flattened list of candidate windows [wt,wh,ww,...] (empty = built-in set)", check=lambda v: None if len(v) % 3 == 0 else "length must be a multiple of 3", accepted="a multiple of 3 integers"),
    BLOCK_SPARSE_IMPL,
)

VIDEO_SPARSE_ATTN_SCHEMA = (
    P("sparsity", "float", 0.0, "Fraction of key tiles skipped per query tile (0.0 - 1.0)", check=in_range(0.0, 1.0), accepted="a number in [0, 1]"),
    EDGE_TILES,
    BLOCK_SPARSE_IMPL,
)

SPARGE_ATTN_SCHEMA = (
    P("topk", "float", 0.5, "Fraction of predicted attention blocks kept per head (per query block the best ceil(topk * blocks)); with cdfthreshd the minimum kept", check=in_range(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
    P("cdfthreshd", "float", None, "Adaptive selection (upstream's name): per query block the fewest key blocks, best first, whose predicted share of its attention mass (softmax of the predictor's block log-masses) reaches this value, but at least topk's count (upstream: no floor, topk or cdfthreshd; here a topk of one block). Unset: topk alone", check=in_range(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
    P("block_size", "int", 64, "Block size in tokens for the block importance prediction", choices=(32, 64, 128)),
    P("quantize", "bool", True, "Kept blocks with INT8 Q.K per block (SageAttention-style, as upstream); false: exact kept blocks"),
    P("predictor", "str", "pooled_query", "Block predictor: pooled_query (each query block's mean against every key, log-sum-exp per key block: sees sink keys and fast RoPE channels; rel. error 5.4 % vs 10.2 % at topk 0.5 on the structured 480p inputs, for 1/128 of dense attention's FLOPs), pooled_query_var (plus the query variance term, twice that cost) or pooled (upstream: mean(q) . mean(k))", choices=SPARGE_PREDICTORS),
    P("simthreshd1", "float", -0.1, "Self-similarity threshold (upstream name): a block whose mean pairwise cosine similarity is <= it is computed for every query / key block on top of the topk / cdfthreshd blocks; the similarity is in [0, 1], so negative values (upstream's top-k default -0.1) turn the rule off", check=in_range(-1.0, 1.0), accepted="a number in [-1, 1]"),
    EDGE_TILES,
    error_budget(0.005),
    dense_above(DENSE_CALL_ABOVE),
    min_seq_len(MIN_SEQ_LEN["cuda"]),
    BLOCK_SPARSE_IMPL,
)

VMOBA_ATTN_SCHEMA = (
    P("temporal_chunk_size", "int", None, "Chunk size along time (latent frames)", check=positive, accepted="an integer > 0"),
    P("temporal_topk", "int", None, "Top-k chunks selected along time", check=positive, accepted="an integer > 0"),
    P("spatial_chunk_size", "list[int]", None, "Chunk size along (H, W)", check=list_len(2), accepted="2 positive integers"),
    P("spatial_topk", "int", None, "Top-k chunks selected along space", check=positive, accepted="an integer > 0"),
    P("st_chunk_size", "list[int]", None, "Chunk size along (T, H, W)", check=list_len(3), accepted="3 positive integers"),
    P("st_topk", "int", None, "Top-k chunks selected spatio-temporally", check=positive, accepted="an integer > 0"),
    P("moba_select_mode", "str", "threshold", "Selection mode", choices=("threshold", "topk")),
    P("moba_threshold", "float", 0.25, "Threshold for selection (cumulative gate mass)", check=in_range(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
    P("moba_threshold_type", "str", "query_head", "How the threshold is applied", choices=("query_head", "head_global", "overall")),
    P("gate", "str", "pooled_query", "Chunk gate: pooled_query (log-sum-exp over the chunk's keys of the query block's mean . each key: sees sink keys and peaks that a chunk mean hides) or mean (upstream: query block mean . chunk mean key; use it for checkpoints trained with V-MoBA's gate)", choices=VMOBA_GATES),
    P("first_full_step", "int", 12, "Initial steps with full attention", check=non_negative, accepted="an integer >= 0"),
    P("first_full_layer", "int", 0, "Initial layers with full attention", check=non_negative, accepted="an integer >= 0"),
    P("temporal_layer", "int", 1, "Layers of temporal chunking per cycle", check=non_negative, accepted="an integer >= 0"),
    P("spatial_layer", "int", 1, "Layers of spatial chunking per cycle", check=non_negative, accepted="an integer >= 0"),
    P("st_layer", "int", 1, "Layers of spatio-temporal chunking per cycle", check=non_negative, accepted="an integer >= 0"),
    error_budget(0.005),
    dense_above(DENSE_CALL_ABOVE),
    min_seq_len(MIN_SEQ_LEN["cuda"]),
    BLOCK_SPARSE_IMPL,
)

SOL_ATTN_SCHEMA = (
    P("tau", "float", 1.0, "Routing threshold scale; higher keeps fewer exact KV blocks", check=positive, accepted="a number > 0"),
    P("thresh_type", "str", "diag", "Threshold mode", choices=("diag", "exact")),
    P("sink_tokens", "int", 0, "Length of the exact KV sink (prefix tokens such as text rows)", check=non_negative, accepted="an integer >= 0"),
    P("sink_start", "int", 0, "Start index of the exact KV sink range", check=non_negative, accepted="an integer >= 0"),
    P("dense_steps", "int", 10, "Dense attention for the first N denoising steps", check=non_negative, accepted="an integer >= 0"),
    P("dense_layers", "str", "0,1", "Layer indices kept dense, e.g. 0,1 or 0-2", check=layer_list_check, accepted="comma-separated indices or ranges like 0,1 or 0-2"),
    P("dense_backend", "str", "fa", "Backend for the dense prefix: fa or sage_attn (approximate)", choices=("fa", "sage_attn")),
    P("kv_splits", "int|str", "auto", "KV split factor passed to the kernel; auto for long sequences", check=kv_splits_check, accepted="'auto' or a positive integer"),
    P("predictor", "str", "pooled_query", "Which blocks are exact: pooled_query (tau's rule sets how many per query block, its tile neighbours then the best by each query block's mean against every key, log-sum-exp per block) or pooled (upstream: the rule's blocks by mean(q) . mean(k))", choices=SOL_PREDICTORS),
    P("centroid_variance", "bool", True, "Approximate blocks' virtual keys add the blocks' key variance term 0.5 * scale^2 * q^2 . var(k) (the mass of a spread block, which its mean key underestimates); false: upstream's mean key and log size only"),
    EDGE_TILES,
    error_budget(0.01),
    dense_above(DENSE_CALL_ABOVE),
    min_seq_len(MIN_SEQ_LEN["cuda"]),
    BLOCK_SPARSE_IMPL,
)

SLA_ATTN_SCHEMA = (
    P("topk", "float", 0.2, "Fraction of key blocks per query block computed exactly (critical)", check=in_range(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
    P("negligible_fraction", "float", 0.0, "Fraction of key blocks skipped outright (lowest mass); the rest go through the linear branch", check=in_range(0.0, 1.0, hi_open=True), accepted="a number in [0, 1)"),
    P("block_size", "int", 64, "Block size in tokens", choices=(32, 64, 128)),
    EDGE_TILES,
    BLOCK_SPARSE_IMPL,
)

SPARSE_VIDEO_GEN_2_ATTN_SCHEMA = (
    P("num_q_clusters", "int", 64, "k-means clusters of queries per head", check=positive, accepted="an integer > 0"),
    P("num_k_clusters", "int", 128, "k-means clusters of keys per head", check=positive, accepted="an integer > 0"),
    P("kmeans_iters", "int", 5, "k-means iterations of a cold start (first step of a request)", check=positive, accepted="an integer > 0"),
    P("warm_iters", "int", 1, "k-means iterations of later steps, started from the previous step's centroids of the layer", check=positive, accepted="an integer > 0"),
    P("recluster_every", "int", 1, "cluster every N-th step; the steps between reuse the cached permutation and block lists", check=positive, accepted="an integer > 0"),
    P("top_p", "float", 0.9, "Cumulative estimated attention mass kept per query cluster", check=in_range(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
    P("predictor", "str", "pooled_query", "Mass estimate of a (query cluster, key cluster) pair: pooled_query (log-sum-exp over the key cluster's keys of the query centroid . each key: sees sink keys and spread clusters) or centroids (upstream: query centroid . key centroid + log cluster size)", choices=SVG2_PREDICTORS),
    P("first_full_steps", "int", 0, "Dense attention for the first N denoising steps", check=non_negative, accepted="an integer >= 0"),
    error_budget(0.005),
    dense_above(DENSE_CALL_ABOVE),
    min_seq_len(MIN_SEQ_LEN["cuda"]),
    BLOCK_SPARSE_IMPL,
)


# ------------------------------------------------------------------------------------------------


@sparse_backend(B.SLIDING_TILE_ATTN, schema=SLIDING_TILE_ATTN_SCHEMA, spec=BackendSpec(
    kind="sparse", summary="Sliding Tile Attention (3-D tile windows per step/layer/head)",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=ALL_FLOAT, cross_attention=False,
    causal=False, lossy=True, config_schema="sliding_tile_attn",
    notes="in-tree block-sparse engine (any resolution; upstream st_attn not needed); "
          "mask_strategy_file_path required"))
def sliding_tile_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    mode = cfg["sta_mode"]
    path = cfg["mask_strategy_file_path"]
    tile_size = tuple(cfg.get("tile_size") or (4, 4, 4))
    strategy = load_mask_strategy(path) if mode == "STA_inference" else None
    if call.step is not None and call.step < cfg["skip_time_steps"]:
        return run_dense(name, q, k, v, call, f"step {call.step} < skip_time_steps {cfg['skip_time_steps']}")
    head_offset = int(getattr(call, "head_offset", 0) or 0)
    if mode in SEARCH_MODES:
        search = get_search(path, mode, parse_candidates(cfg.get("window_candidates")))
        out, lse = sta_search_attention(q, k, v, video_shape=vs, search=search,
                                        step=0 if call.step is None else int(call.step), layer=layer_index(call),
                                        head_offset=head_offset, tile_size=tile_size, text_len=text_len,
                                        scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"])
        record_stats(layer_stats_key(name, call), backend=name, kept_fraction=1.0, dense=True,
                     reason=f"{mode}: full attention returned, candidates measured", step=call.step,
                     layer_idx=call.layer_idx)
        return out, lse
    windows = strategy.windows(call.step, layer_index(call), q.shape[2], head_offset)
    out, lse, plan = sliding_tile_attention(q, k, v, video_shape=vs, windows=windows, tile_size=tile_size,
                                            text_len=text_len, scale=call.scale, return_lse=call.return_lse,
                                            impl=cfg["block_sparse_impl"])
    sparse_done(name, call, plan, windows=windows.tolist())
    return out, lse


@sparse_backend(B.VIDEO_SPARSE_ATTN, schema=VIDEO_SPARSE_ATTN_SCHEMA, spec=BackendSpec(
    kind="sparse", summary="Video Sparse Attention: coarse top-k tiles + fine attention",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
    cross_attention=False, causal=False, config_schema="video_sparse_attn",
    notes="4x4x4 tiles of 64 tokens; in-tree engine (upstream vsa not needed)"))
def video_sparse_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    if cfg["sparsity"] == 0.0:  # k = every tile: the fine stage is exact full attention
        return run_dense(name, q, k, v, call, "sparsity 0.0 keeps every tile (exact dense attention)")
    out, lse, plan = video_sparse_attention(q, k, v, video_shape=vs, sparsity=cfg["sparsity"], text_len=text_len,
                                            scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                            edge_tiles=cfg["edge_tiles"])
    sparse_done(name, call, plan, tiles_per_query=plan.extra["k"])
    return out, lse


def _sparge_precheck(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict):
    """sparge_attn takes fp16/bf16 only, and runs dense SDPA on shapes it does not sparsify."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(
            f"{name}: needs float16 or bfloat16 q/k/v (got {str(q.dtype).replace('torch.', '')}): SpargeAttention "
            "quantizes its kept blocks SageAttention-style; use --dtype bfloat16 or float16")
    ok, why = sparge_applies(q.shape[1], k.shape[1], q.shape[3])
    if not ok:
        if call.causal or call.attn_bias is not None:
            raise AttentionConfigError(f"{name}: causal attention and additive biases are not supported")
        return run_dense(name, q, k, v, call, f"dense SDPA: {why}", announce=True)
    return None


@sparse_backend(B.SPARGE_ATTN, schema=SPARGE_ATTN_SCHEMA, precheck=_sparge_precheck, lines=True, spec=BackendSpec(
    runtime_label=sparse_runtime_label,
    kind="sparse+quantized", summary="SpargeAttention: top-k blocks by pooled-query block scores, INT8 Q.K in kept blocks",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=FP16_BF16,
    cuda_sm=(80, 86, 87, 89, 90), lossy=True, cross_attention=False, causal=False,
    config_schema="sparge_attn",
    notes="FP16/BF16; head dim 64/128, square self-attention of >=128 tokens; other shapes run dense SDPA; "
          "kept blocks INT8 Q.K (quantize=false: exact)"))
def sparge_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    again = reused_dense(name, q, k, v, call, cfg)
    if again is not None:
        return again
    tile_1d = line_tile(call, cfg.get("block_size", 64))
    out, lse, plan = sparge_attention(q, k, v, video_shape=vs, topk=cfg["topk"], cdfthreshd=cfg.get("cdfthreshd"),
                                      tile_size=tile_1d,
                                      block_size=cfg.get("block_size", 64), text_len=text_len,
                                      quantize=cfg.get("quantize", True),
                                      predictor=cfg["predictor"], simthreshd1=cfg["simthreshd1"], scale=call.scale,
                                      return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                      edge_tiles=cfg["edge_tiles"], error_budget=cfg.get("error_budget", 0.0),
                                      decide=budget_decision(name, call, cfg) is None, dense_above=cfg["dense_above"])
    sparse_done(name, call, plan, quantized=plan.extra["quantized"], predictor=plan.extra["predictor"])
    remember_budget(name, call, cfg, plan)
    return out, lse


@sparse_backend(B.VMOBA_ATTN, schema=VMOBA_ATTN_SCHEMA, spec=BackendSpec(
    runtime_label=sparse_runtime_label,
    kind="sparse", summary="V-MoBA: top-k temporal/spatial/spatio-temporal chunks",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
    cross_attention=False, causal=False, config_schema="vmoba_attn"))
def vmoba_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    mode = vmoba_layer_mode(call.layer_idx, first_full_layer=cfg["first_full_layer"],
                            temporal_layer=cfg["temporal_layer"], spatial_layer=cfg["spatial_layer"],
                            st_layer=cfg["st_layer"])
    if call.step is not None and call.step < cfg["first_full_step"]:
        return run_dense(name, q, k, v, call, f"step {call.step} < first_full_step {cfg['first_full_step']}")
    if mode == "full":
        return run_dense(name, q, k, v, call, f"layer {layer_index(call)} < first_full_layer {cfg['first_full_layer']}")
    chunk = {"temporal": cfg.get("temporal_chunk_size"), "spatial": cfg.get("spatial_chunk_size"),
             "st": cfg.get("st_chunk_size")}[mode]
    again = reused_dense(name, q, k, v, call, cfg)
    if again is not None:
        return again
    topk = {"temporal": cfg.get("temporal_topk"), "spatial": cfg.get("spatial_topk"), "st": cfg.get("st_topk")}[mode]
    out, lse, plan = vmoba_attention(q, k, v, video_shape=vs, mode=mode, chunk=chunk, topk=topk,
                                     select_mode=cfg["moba_select_mode"], threshold=cfg["moba_threshold"],
                                     threshold_type=cfg["moba_threshold_type"], gate=cfg["gate"], text_len=text_len,
                                     scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                     error_budget=cfg.get("error_budget", 0.0),
                                     decide=budget_decision(name, call, cfg) is None, dense_above=cfg["dense_above"])
    sparse_done(name, call, plan, mode=mode, chunk=plan.extra["chunk"], topk=plan.extra["topk"])
    remember_budget(name, call, cfg, plan)
    return out, lse


@sparse_backend(B.SPARSE_VIDEO_GEN_2_ATTN, schema=SPARSE_VIDEO_GEN_2_ATTN_SCHEMA, spec=BackendSpec(
    runtime_label=sparse_runtime_label,
    kind="sparse", summary="Sparse-VideoGen2: k-means semantic permutation + block sparsity",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
    cross_attention=False, causal=False, config_schema="sparse_video_gen_2_attn"))
def sparse_video_gen_2_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    if call.step is not None and call.step < cfg["first_full_steps"]:
        return run_dense(name, q, k, v, call, f"step {call.step} < first_full_steps {cfg['first_full_steps']}")
    budget = cfg.get("error_budget", 0.0)
    state_key = budget_key(name, call)  # warm start and budget decision per layer and calling thread
    decision = budget_decision(name, call, cfg)  # None: decide at this call (or no budget)
    if decision is True:  # the budget sent an earlier step of the request dense: no probe, no clustering
        eb.remember(state_key, call.step, True)
        return run_dense(name, q, k, v, call, "error budget: dense from an earlier step of the request",
                         announce=True)
    if budget > 0 and decision is None:  # before clustering: a layer predicted to keep most blocks runs dense
        if eb.precheck_dense(q, k, vs, text_len, budget, scale=call.scale, impl=cfg["block_sparse_impl"],
                             above=cfg["dense_above"]):
            eb.remember(state_key, call.step, True)
            return run_dense(name, q, k, v, call, "error budget: predicted to keep more than dense_above of the "
                             "blocks (dense kernel)", announce=True)
    out, lse, plan = svg2_attention(q, k, v, video_shape=vs, text_len=text_len, num_q_clusters=cfg["num_q_clusters"],
                                    num_k_clusters=cfg["num_k_clusters"], kmeans_iters=cfg["kmeans_iters"],
                                    top_p=svg2_top_p(cfg["top_p"], budget), warm_iters=cfg["warm_iters"],
                                    recluster_every=cfg["recluster_every"], predictor=cfg["predictor"],
                                    state_key=state_key, step=call.step,
                                    scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                    dense_above=cfg["dense_above"] if budget > 0 and decision is None else None)
    sparse_done(name, call, plan, mode=plan.extra["mode"])
    if budget > 0:
        eb.remember(state_key, call.step, bool(plan.extra.get("dense_fallback")))
    return out, lse


def _sla(name: str, q, k, v, call: AttnCall, cfg: dict, vs, text_len: int):
    out, lse, plan = sla_attention(q, k, v, video_shape=vs, text_len=text_len, topk=cfg["topk"],
                                   negligible_fraction=cfg["negligible_fraction"], block_size=cfg["block_size"],
                                   quantize=name == B.SAGE_SLA_ATTN.value, scale=call.scale,
                                   return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                   edge_tiles=cfg["edge_tiles"])
    sparse_done(name, call, plan, marginal_fraction=plan.extra["marginal_fraction"], linear_branch="absent (zero)")
    return out, lse


@sparse_backend(B.SLA_ATTN, schema=SLA_ATTN_SCHEMA, spec=BackendSpec(
    kind="sparse+linear", summary="Sparse-Linear Attention: exact critical blocks + linear branch",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
    cross_attention=False, causal=False, config_schema="sla_attn",
    notes="linear branch projection from the checkpoint; zero when absent (pure sparse)"))
def sla_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    return _sla(name, q, k, v, call, cfg, vs, text_len)


@sparse_backend(B.SAGE_SLA_ATTN, schema=SLA_ATTN_SCHEMA, spec=BackendSpec(
    kind="sparse+linear", summary="SageAttention + Sparse-Linear Attention (quantized sparse branch)",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=ALL_FLOAT, lossy=True,
    cross_attention=False, causal=False, config_schema="sla_attn"))
def sage_sla_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    return _sla(name, q, k, v, call, cfg, vs, text_len)


def _sol_precheck(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict):
    if q.dtype != torch.bfloat16 or q.shape[3] != 128:
        raise AttentionConfigError(
            f"{name}: needs bfloat16 q/k/v with head dim 128 (got {str(q.dtype).replace('torch.', '')}, "
            f"head dim {q.shape[3]}); use --dtype bf16 with a head-dim-128 model, or another sparse backend"
        )
    return None


@sparse_backend(B.SOL_ATTN, schema=SOL_ATTN_SCHEMA, precheck=_sol_precheck, lines=True, spec=BackendSpec(
    runtime_label=sparse_runtime_label,
    kind="sparse", summary="Sol attention: threshold routing with exact KV sinks",
    runtimes=IN_TREE_SPARSE, upstream_platforms=("cuda",), dtypes=BF16, head_dims=frozenset({128}),
    lossy=True, cross_attention=False, causal=False, config_schema="sol_attn",
    notes="BF16 and head dim 128 only; first dense_steps steps and dense_layers run dense_backend"))
def sol_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    tile_1d = line_tile(call, 64)
    dense_backend = cfg["dense_backend"]
    if call.step is not None and call.step < cfg["dense_steps"]:
        return run_dense(name, q, k, v, call, f"step {call.step} < dense_steps {cfg['dense_steps']} ({dense_backend})",
                      backend=dense_backend)
    layer = layer_index(call)
    if layer in parse_layer_list(cfg["dense_layers"]):
        return run_dense(name, q, k, v, call, f"layer {layer} in dense_layers {cfg['dense_layers']} ({dense_backend})",
                      backend=dense_backend)
    again = reused_dense(name, q, k, v, call, cfg, backend=dense_backend)
    if again is not None:
        return again
    out, lse, plan = sol_attention(q, k, v, video_shape=vs, text_len=text_len, tau=cfg["tau"],
                                   thresh_type=cfg["thresh_type"], sink_start=cfg["sink_start"],
                                   sink_tokens=cfg["sink_tokens"], predictor=cfg["predictor"],
                                   centroid_variance=cfg["centroid_variance"], scale=call.scale,
                                   return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                   edge_tiles=cfg["edge_tiles"], error_budget=cfg.get("error_budget", 0.0),
                                   dense_backend=dense_backend, tile_size=tile_1d,
                                   decide=budget_decision(name, call, cfg) is None, dense_above=cfg["dense_above"])
    sparse_done(name, call, plan, approximate_fraction=1.0 - plan.kept_fraction_pending)
    remember_budget(name, call, cfg, plan)
    return out, lse
