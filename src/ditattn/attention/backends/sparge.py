"""``sparge_attn``: SpargeAttention (top-k blocks by pooled-query scores, INT8 Q.K in the kept blocks), on the
in-tree sparse engine: its parameter schema, capability row and implementation
(the prologue every sparse backend shares, and the rules common to them: :mod:`.sparse_common`)."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.backends.sparse_common import (
    block_size_runtime_label,
    budget_decision,
    budget_keys,
    line_tile,
    remember_budget,
    reused_dense,
    run_dense,
    sparse_backend,
    sparse_done,
)
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import (
    BLOCK_SPARSE_IMPL,
    EDGE_TILES,
    SPARGE_PREDICTORS,
    P,
    in_range,
)
from ditattn.attention.sparse.sparge import sparge_applies, sparge_attention
from ditattn.attention.sparse.sta import (
    flush_sta_search,  # noqa: F401  (re-exported for callers that end a calibration run)
)
from ditattn.attention.specs import FP16_BF16, IN_TREE_SPARSE, BackendSpec
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor


SPARGE_ATTN_SCHEMA = (
    P(
        "topk",
        "float",
        0.5,
        "Fraction of predicted attention blocks kept per head (per query block the best ceil(topk * blocks)); with "
        "cdfthreshd the minimum kept",
        check=in_range(0.0, 1.0, lo_open=True),
        accepted="a number in (0, 1]",
    ),
    P(
        "cdfthreshd",
        "float",
        None,
        "Adaptive selection (upstream's name): per query block the fewest key blocks, best first, whose predicted "
        "share of its attention mass (softmax of the predictor's block log-masses) reaches this value, but at least "
        "topk's count (upstream: no floor, topk or cdfthreshd; here a topk of one block). Unset: topk alone",
        check=in_range(0.0, 1.0, lo_open=True),
        accepted="a number in (0, 1]",
    ),
    P(
        "block_size",
        "int",
        64,
        "Block size in tokens of the selection and the kernel (32: 2x4x4 tiles, 64: 4x4x4, 128: 4x4x8). 128 runs "
        "FlashAttention-4's block-sparse kernel on Hopper/Blackwell when installed, much faster than the Triton "
        "kernel at 64: with quantize=false, cdfthreshd=0.95, topk=0.3 about 1.7-1.8x FA4 dense at 4.0-4.1 % error "
        "on the structured 480p benchmark (docs/benchmarks.md)",
        choices=(32, 64, 128),
    ),
    P(
        "quantize",
        "bool",
        True,
        "Kept blocks with INT8 Q.K per block (SageAttention-style, as upstream); false: exact kept blocks",
    ),
    P(
        "predictor",
        "str",
        "pooled_query",
        "Block predictor: pooled_query (each query block's mean against every key, log-sum-exp per key block: sees "
        "sink keys and fast RoPE channels; rel. error 5.4 % vs 10.2 % at topk 0.5 on the structured 480p inputs, for "
        "1/128 of dense attention's FLOPs), pooled_query_var (plus the query variance term, twice that cost) or "
        "pooled (upstream: mean(q) . mean(k))",
        choices=SPARGE_PREDICTORS,
    ),
    P(
        "simthreshd1",
        "float",
        -0.1,
        "Self-similarity threshold (upstream name): a block whose mean pairwise cosine similarity is <= it is "
        "computed for every query / key block on top of the topk / cdfthreshd blocks; the similarity is in [0, 1], "
        "so negative values (upstream's top-k default -0.1) turn the rule off",
        check=in_range(-1.0, 1.0),
        accepted="a number in [-1, 1]",
    ),
    EDGE_TILES,
    *budget_keys(0.005),
    BLOCK_SPARSE_IMPL,
)


def _sparge_precheck(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict):
    """sparge_attn takes fp16/bf16 only, and runs dense SDPA on shapes it does not sparsify."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(
            f"{name}: needs float16 or bfloat16 q/k/v (got {str(q.dtype).replace('torch.', '')}): SpargeAttention "
            "quantizes its kept blocks SageAttention-style; use --dtype bfloat16 or float16"
        )
    ok, why = sparge_applies(q.shape[1], k.shape[1], q.shape[3])
    if not ok:
        if call.causal or call.attn_bias is not None:
            raise AttentionConfigError(f"{name}: causal attention and additive biases are not supported")
        return run_dense(name, q, k, v, call, f"dense SDPA: {why}", announce=True)
    return None


@sparse_backend(
    B.SPARGE_ATTN,
    schema=SPARGE_ATTN_SCHEMA,
    precheck=_sparge_precheck,
    lines=True,
    spec=BackendSpec(
        runtime_label=block_size_runtime_label,
        kind="sparse+quantized",
        summary="SpargeAttention: top-k blocks by pooled-query block scores, INT8 Q.K in kept blocks",
        runtimes=IN_TREE_SPARSE,
        upstream_platforms=("cuda",),
        dtypes=FP16_BF16,
        cuda_sm=(80, 86, 87, 89, 90),
        lossy=True,
        cross_attention=False,
        causal=False,
        config_schema="sparge_attn",
        notes="FP16/BF16; head dim 64/128, square self-attention of >=128 tokens; other shapes run dense SDPA; "
        "kept blocks INT8 Q.K (quantize=false: exact)",
    ),
)
def sparge_attn(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict, vs, text_len: int):
    again = reused_dense(name, q, k, v, call, cfg)
    if again is not None:
        return again
    tile_1d = line_tile(call, cfg.get("block_size", 64))
    out, lse, plan = sparge_attention(
        q,
        k,
        v,
        video_shape=vs,
        topk=cfg["topk"],
        cdfthreshd=cfg.get("cdfthreshd"),
        tile_size=tile_1d,
        block_size=cfg.get("block_size", 64),
        text_len=text_len,
        quantize=cfg.get("quantize", True),
        predictor=cfg["predictor"],
        simthreshd1=cfg["simthreshd1"],
        scale=call.scale,
        return_lse=call.return_lse,
        impl=cfg["block_sparse_impl"],
        edge_tiles=cfg["edge_tiles"],
        error_budget=cfg.get("error_budget", 0.0),
        decide=budget_decision(name, call, cfg) is None,
        dense_above=cfg["dense_above"],
    )
    sparse_done(name, call, plan, quantized=plan.extra["quantized"], predictor=plan.extra["predictor"])
    remember_budget(name, call, cfg, plan)
    return out, lse
