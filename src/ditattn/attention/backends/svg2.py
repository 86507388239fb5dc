"""``sparse_video_gen_2_attn``: Sparse-VideoGen2 (k-means permutation of q and k, top-p cluster blocks), on the
in-tree sparse engine: its parameter schema, capability row and implementation
(the prologue every sparse backend shares, and the rules common to them: :mod:`.sparse_common`)."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.sparse_common import (
    budget_decision,
    budget_key,
    budget_keys,
    run_dense,
    sparse_backend,
    sparse_done,
    sparse_runtime_label,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import (
    BLOCK_SPARSE_IMPL,
    SVG2_PREDICTORS,
    P,
    in_range,
    non_negative,
    positive,
)
from ditattn.attention.sparse import budget as eb
from ditattn.attention.sparse.budget import svg2_top_p
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
)
from ditattn.attention.sparse.svg2 import svg2_attention
from ditattn.attention.specs import ALL_FLOAT, IN_TREE_SPARSE, BackendSpec

Tensor = torch.Tensor


SPARSE_VIDEO_GEN_2_ATTN_SCHEMA = (
    P("num_q_clusters", "int", 64, "k-means clusters of queries per head", check=positive, accepted="an integer > 0"),
    P("num_k_clusters", "int", 128, "k-means clusters of keys per head", check=positive, accepted="an integer > 0"),
    P(
        "kmeans_iters",
        "int",
        5,
        "k-means iterations of a cold start (first step of a request)",
        check=positive,
        accepted="an integer > 0",
    ),
    P(
        "warm_iters",
        "int",
        1,
        "k-means iterations of later steps, started from the previous step's centroids of the layer",
        check=positive,
        accepted="an integer > 0",
    ),
    P(
        "recluster_every",
        "int",
        1,
        "cluster every N-th step; the steps between reuse the cached permutation and block lists",
        check=positive,
        accepted="an integer > 0",
    ),
    P(
        "top_p",
        "float",
        0.9,
        "Cumulative estimated attention mass kept per query cluster",
        check=in_range(0.0, 1.0, lo_open=True),
        accepted="a number in (0, 1]",
    ),
    P(
        "predictor",
        "str",
        "pooled_query",
        "Mass estimate of a (query cluster, key cluster) pair: pooled_query (log-sum-exp over the key cluster's keys "
        "of the query centroid . each key: sees sink keys and spread clusters) or centroids (upstream: query "
        "centroid . key centroid + log cluster size)",
        choices=SVG2_PREDICTORS,
    ),
    P(
        "first_full_steps",
        "int",
        0,
        "Dense attention for the first N denoising steps",
        check=non_negative,
        accepted="an integer >= 0",
    ),
    *budget_keys(0.005),
    BLOCK_SPARSE_IMPL,
)


def _svg2_phase(q: Tensor, call: AttnCall, cfg: dict):
    if call.step is not None and call.step < cfg["first_full_steps"]:
        return f"step {call.step} < first_full_steps {cfg['first_full_steps']}", None
    return None


@sparse_backend(
    B.SPARSE_VIDEO_GEN_2_ATTN,
    dense_phase=_svg2_phase,
    schema=SPARSE_VIDEO_GEN_2_ATTN_SCHEMA,
    spec=BackendSpec(
        runtime_label=sparse_runtime_label,
        kind="sparse",
        summary="Sparse-VideoGen2: k-means semantic permutation + block sparsity",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=ALL_FLOAT,
        lossy=True,
        cross_attention=False,
        causal=False,
        config_schema="sparse_video_gen_2_attn",
    ),
)
def sparse_video_gen_2_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    budget = cfg.get("error_budget", 0.0)
    state_key = budget_key(name, call)  # warm start and budget decision per layer and calling thread
    decision = budget_decision(name, call, cfg)  # None: decide at this call (or no budget)
    if decision is True:  # the budget sent an earlier step of the request dense: no probe, no clustering
        eb.remember(state_key, call.step, True)
        return run_dense(name, q, k, v, call, "error budget: dense from an earlier step of the request", announce=True)
    if budget > 0 and decision is None:  # before clustering: a layer predicted to keep most blocks runs dense
        if eb.precheck_dense(
            q, k, vs, text_len, budget, scale=call.scale, impl=cfg["block_sparse_impl"], above=cfg["dense_above"]
        ):
            eb.remember(state_key, call.step, True)
            return run_dense(
                name,
                q,
                k,
                v,
                call,
                "error budget: predicted to keep more than dense_above of the blocks (dense kernel)",
                announce=True,
            )
    out, lse, plan = svg2_attention(
        q,
        k,
        v,
        video_shape=vs,
        text_len=text_len,
        num_q_clusters=cfg["num_q_clusters"],
        num_k_clusters=cfg["num_k_clusters"],
        kmeans_iters=cfg["kmeans_iters"],
        top_p=svg2_top_p(cfg["top_p"], budget),
        warm_iters=cfg["warm_iters"],
        recluster_every=cfg["recluster_every"],
        predictor=cfg["predictor"],
        state_key=state_key,
        step=call.step,
        scale=call.scale,
        return_lse=call.return_lse,
        impl=cfg["block_sparse_impl"],
        dense_above=cfg["dense_above"] if budget > 0 and decision is None else None,
    )
    sparse_done(name, call, plan, mode=plan.extra["mode"])
    if budget > 0:
        eb.remember(state_key, call.step, bool(plan.extra.get("dense_fallback")))
    return out, lse
