"""Backend config schemas: every parameter a backend accepts, with its type, default and range.

:data:`SCHEMAS` maps a schema key (``BackendSpec.config_schema``) to its :class:`Param` tuple: the
seed's parameter tables, the parameters of the in-tree algorithms the seed leaves unnamed, and the
implementation choices of backends with several kernels (``sage_attn``: ``impl``, ``pv_dtype``,
``qk_dtype``; the sparse backends on the block-sparse engine: ``block_sparse_impl``).  Parsing and
validation against these schemas: :mod:`ditattn.attention.config`.  ``ditattn backends`` prints them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from ditattn.attention.names import AttentionBackendEnum
from ditattn.errors import AttentionConfigError, short_repr


@dataclasses.dataclass(frozen=True)
class Param:
    """One backend parameter: type ('int','float','bool','str','list[int]','int|str'), default,
    an optional check returning an error fragment, and accepted choices."""

    name: str
    type: str
    default: Any
    help: str
    required: bool = False
    choices: tuple | None = None
    check: Callable[[Any], "str | None"] | None = None
    accepted: str = ""  # text describing the accepted range for messages

    def coerce(self, backend: str, value: Any) -> Any:
        def bad(extra: str = "") -> AttentionConfigError:
            acc = self.accepted or (f"one of {list(self.choices)}" if self.choices else f"a {self.type}")
            return AttentionConfigError(
                f"{backend}: invalid value {short_repr(value)} for '{self.name}'{extra}; accepted: {acc}"
            )

        t = self.type
        if t == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(" (must be an integer)")
        elif t == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise bad(" (must be a number)")
            try:
                value = float(value)
            except OverflowError:
                raise bad(" (too large)") from None
            if not math.isfinite(value):
                raise bad(" (must be finite)")
        elif t == "bool":
            if not isinstance(value, bool):
                raise bad(" (must be true or false)")
        elif t == "str":
            if not isinstance(value, str):
                value = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
            if not isinstance(value, str):
                raise bad(" (must be a string)")
        elif t.startswith("list[int]"):
            if isinstance(value, int) and not isinstance(value, bool):
                value = [value]
            if isinstance(value, str):
                value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
                try:
                    value = [int(v) for v in value]
                except ValueError:
                    raise bad(" (must be a list of integers)") from None
            if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            ):
                raise bad(" (must be a list of integers)")
            value = list(value)
        elif t == "int|str":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise bad()
        if self.choices is not None and value not in self.choices:
            raise bad()
        if self.check is not None:
            msg = self.check(value)
            if msg:
                raise bad(f" ({msg})")
        return value


def _in(lo, hi, lo_open=False, hi_open=False):
    def check(v):
        ok_lo = v > lo if lo_open else v >= lo
        ok_hi = v < hi if hi_open else v <= hi
        return None if ok_lo and ok_hi else "out of range"

    return check


def _nonneg(v):
    return None if v >= 0 else "must be >= 0"


def _positive(v):
    return None if v > 0 else "must be > 0"


def parse_layer_list(v: "str | int | list") -> list[int]:
    """``"0,1"`` / ``"0-2"`` / ``[0, 1]`` / ``3`` → sorted unique layer indices."""
    if isinstance(v, bool):
        raise ValueError("not a layer list")
    if isinstance(v, int):
        items = [v]
    elif isinstance(v, (list, tuple)):
        items = list(v)
    else:
        items = []
        for part in str(v).replace(" ", "").split(","):
            if not part:
                continue
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                a, b = int(a), int(b)
                if b < a:
                    raise ValueError(f"empty range {part}")
                items.extend(range(a, b + 1))
            else:
                items.append(int(part))
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in items):
        raise ValueError("layer indices must be non-negative integers")
    return sorted(set(items))


def _layer_list_check(v):
    try:
        parse_layer_list(v)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def _list_len(n, positive=True):
    def check(v):
        if len(v) != n:
            return f"needs exactly {n} integers"
        if positive and any(i <= 0 for i in v):
            return "sizes must be positive"
        return None

    return check


def _kv_splits_check(v):
    if isinstance(v, str):
        return None if v == "auto" else "must be 'auto' or a positive integer"
    return None if v > 0 else "must be 'auto' or a positive integer"


P = Param

# implementation choices (values the backends dispatch on; tests check they match the dispatch tables)
SAGE_IMPLS = ("auto", "sm90", "triton", "package", "reference")
SAGE_K_GRANULARITIES = ("auto", "token", "block")
SAGE_PV_DTYPES = ("fp16", "fp8")
SAGE_PV_ACCUMS = ("two_level", "direct")
SAGE_QK_DTYPES = ("int8", "fp8")
SAGE_QK_IMPLEMENTED = ("int8",)  # Q.K precisions some sage_attn kernel implements
BLOCK_SPARSE_IMPLS = ("auto", "reference", "flex", "triton")
SPARGE_PREDICTORS = ("pooled_query", "pooled_query_var", "pooled")
SOL_PREDICTORS = ("pooled_query", "pooled")
VMOBA_GATES = ("pooled_query", "mean")
SVG2_PREDICTORS = ("pooled_query", "centroids")


def _qk_implemented(v):
    return None if v in SAGE_QK_IMPLEMENTED else f"no sage_attn kernel implements {v} Q.K yet"


# one key shared by every backend on the block-sparse engine (same meaning for all of them)
BLOCK_SPARSE_IMPL = P(
    "block_sparse_impl", "str", "auto",
    "Kernel of the block-sparse engine: auto (CUDA: our Triton kernel when the call fits it, else FlexAttention; "
    "CPU: the blocked PyTorch reference), triton (CUDA, or CPU under TRITON_INTERPRET=1), flex or reference",
    choices=BLOCK_SPARSE_IMPLS)

# the pooled top-k / routing backends on the block-sparse engine: how tiles cut by the grid edge are laid out
EDGE_TILES = P(
    "edge_tiles", "str", "packed",
    "Tiles cut by the grid edge: packed (several such tiles share one block, so the block count approaches "
    "tokens / block size: 513 instead of 624 blocks at 21x30x52 in 4x4x4 tiles) or padded (every tile its own "
    "block, padded to full size)",
    choices=("packed", "padded"))


def error_budget(default: float) -> Param:
    """The ``error_budget`` key of a training-free sparse backend (:mod:`ditattn.attention.sparse.budget`)."""
    return P(
        "error_budget", "float", default,
        "Largest predicted attention mass a query block may drop (0 turns the check off): the selection keeps "
        "more blocks until its estimate meets it, a head that then keeps most blocks runs dense, and a call whose "
        f"heads all do runs the dense kernel; default {default} keeps the output within 5 % relative error on the structured "
        "families (docs/attention.md, error budget)",
        check=_in(0.0, 1.0, hi_open=True), accepted="a number in [0, 1) (0: off)")


SCHEMAS: dict[str, tuple[Param, ...]] = {
    "sage_attn": (
        P("impl", "str", "auto", "Implementation: auto (CUDA: the rule the plan reports — SM90: the warp-specialised Gluon kernel (sm90) for head dim 64/128 with fp16 P.V, else the in-tree Triton INT8 kernel; other GPUs: the sageattention package when it is installed and neither the LSE nor pv_dtype fp8 is needed, else the Triton kernel; MUSA: the package; CPU: reference), triton (in-tree INT8 kernel; CUDA, or CPU under TRITON_INTERPRET=1), package (sageattention; CUDA/MUSA, no LSE, fp16 P.V; on Hopper only a build with the SM90 fix), reference (PyTorch, any device), sm90 (Gluon kernel: SM90 only, head dim 64/128, fp16 or fp8 P.V, non-causal)", choices=SAGE_IMPLS),
        P("pv_dtype", "str", "fp16", "P.V precision: fp16 (about 1.3 % relative error on random inputs) or fp8 (P and V in e4m3: twice the tensor-core rate, about 3.7 % on random and structured inputs); impl package chooses its own and accepts fp16 only; impl auto runs fp8 on the Triton kernel (sm90 serves it with impl sm90)", choices=SAGE_PV_DTYPES),
        P("pv_accum", "str", "two_level", "FP8 P.V accumulation (pv_dtype fp8 only): two_level (each key block's P.V in a fresh accumulator, added in FP32) or direct (one accumulator across all keys: fewer instructions, but the FP8 tensor cores add with fewer mantissa bits than FP32, so the error grows with the sequence length; impl sm90 or triton)", choices=SAGE_PV_ACCUMS),
        P("qk_dtype", "str", "int8", "Q.K precision: int8 (per-token Q scales, smoothed K); fp8 is reserved for a kernel that implements it", choices=SAGE_QK_DTYPES, check=_qk_implemented, accepted="int8 (fp8: no kernel yet)"),
        P("k_granularity", "str", "auto", "INT8 scale granularity of the smoothed K: token (one scale per key; 1.7 % error on structured inputs) or block (one per 128 keys; 2.3 %, about 10 % faster on the sm90 kernel); auto: token on sm90 and reference, block on the Triton kernel (the only one it has)", choices=SAGE_K_GRANULARITIES),
        P("min_seq_len", "int", 16384, "Hopper crossover: with impl auto on an SM90 GPU a call shorter than this many query tokens runs fa (exact dense) instead, where it is faster (H200, vs FlashAttention-4: 0.70x at 4096 tokens head dim 64, 0.89x at 4096/128, 0.97-0.98x at 4.6k-8k, 1.02x at 16k x 40 heads, 1.09-1.13x at 32k); 0 keeps sage_attn at every length", check=_nonneg, accepted="an integer >= 0 (0: off)"),
        P("qk_balance", "float", None, "Per-channel Q/K balance before the INT8 rounding (SmoothQuant-style, per batch and K/V head: Q's channels times c, smoothed K's divided by c, c = amax|K~|^a / amax|Q|^(1-a) normalised to geometric mean 1, so Q.K is unchanged): unset = off; a in (0, 1]. CPU reference (docs/sage_sm90_notes.md): token K scales with a = 0.5 bring the worst structured input from 2.09 % to 1.82 % error (every structured input <= 1.83 %), real DiT activations unchanged (<= 0.47 %); block K scales with a = 0.75 take 0.04-0.5 pp off but stay above 2 % on some inputs. Costs one more read of Q in the quantization prologue (impl sm90, triton, reference; not the package)", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1] (unset: off)"),
    ),
    "sliding_tile_attn": (
        P("mask_strategy_file_path", "str", None, "Path to the mask strategy JSON ('t_l_h' -> [wt, wh, ww] in tiles); written by STA_searching/STA_tuning", required=True, accepted="a path to a JSON file"),
        P("sta_mode", "str", "STA_inference", "STA mode", choices=("STA_inference", "STA_searching", "STA_tuning", "STA_tuning_cfg")),
        P("skip_time_steps", "int", 15, "Steps of full attention before switching to sparse", check=_nonneg, accepted="an integer >= 0"),
        P("tile_size", "list[int]", [4, 4, 4], "Tile size (T, H, W) in latent tokens after patching", check=_list_len(3), accepted="3 positive integers"),
        P("window_candidates", "list[int]", [], "STA_searching: flattened list of candidate windows [wt,wh,ww,...] (empty = built-in set)", check=lambda v: None if len(v) % 3 == 0 else "length must be a multiple of 3", accepted="a multiple of 3 integers"),
        BLOCK_SPARSE_IMPL,
    ),
    "video_sparse_attn": (
        P("sparsity", "float", 0.0, "Fraction of key tiles skipped per query tile (0.0 - 1.0)", check=_in(0.0, 1.0), accepted="a number in [0, 1]"),
        EDGE_TILES,
        BLOCK_SPARSE_IMPL,
    ),
    "sparge_attn": (
        P("topk", "float", 0.5, "Fraction of predicted attention blocks kept per head (per query block the best ceil(topk * blocks)); with cdfthreshd the minimum kept", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("cdfthreshd", "float", None, "Adaptive selection (upstream's name): per query block the fewest key blocks, best first, whose predicted share of its attention mass (softmax of the predictor's block log-masses) reaches this value, but at least topk's count (upstream: no floor, topk or cdfthreshd; here a topk of one block). Unset: topk alone", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("block_size", "int", 64, "Block size in tokens for the block importance prediction", choices=(32, 64, 128)),
        P("quantize", "bool", True, "Kept blocks with INT8 Q.K per block (SageAttention-style, as upstream); false: exact kept blocks"),
        P("predictor", "str", "pooled_query", "Block predictor: pooled_query (each query block's mean against every key, log-sum-exp per key block: sees sink keys and fast RoPE channels; rel. error 5.4 % vs 10.2 % at topk 0.5 on the structured 480p inputs, for 1/128 of dense attention's FLOPs), pooled_query_var (plus the query variance term, twice that cost) or pooled (upstream: mean(q) . mean(k))", choices=SPARGE_PREDICTORS),
        P("simthreshd1", "float", -0.1, "Self-similarity threshold (upstream name): a block whose mean pairwise cosine similarity is <= it is computed for every query / key block on top of the topk / cdfthreshd blocks; the similarity is in [0, 1], so negative values (upstream's top-k default -0.1) turn the rule off", check=_in(-1.0, 1.0), accepted="a number in [-1, 1]"),
        EDGE_TILES,
        error_budget(0.005),
        BLOCK_SPARSE_IMPL,
    ),
    "video_sparse_attn_h3": (
        P("VSA_sparsity", "float", 0.9, "Fraction of video tiles excluded from top-k", check=_in(0.0, 1.0), accepted="a number in [0, 1]"),
        P("vsa_mode", "str", "exempt", "exempt: non-video keys always selected; compete: they compete in top-k", choices=("exempt", "compete")),
        P("vsa_dense_first_n_steps", "int", 0, "Dense attention for the first N denoising steps", check=_nonneg, accepted="an integer >= 0"),
        P("vsa_dense_layers", "list[int]", [], "Layer indices kept dense, e.g. [0, 1]", check=lambda v: None if all(i >= 0 for i in v) else "indices must be >= 0", accepted="a list of non-negative integers"),
        P("vsa_tile_size", "int", 64, "Kernel tile size; only 64 (the trained (4,4,4) geometry)", choices=(64,)),
    ),
    "hybrid_window_attn_h3": (
        P("vdn_h3_dense_smoke", "bool", False, "Allow a dense transformer backend (fa) on VDN-H3 weights for base-H3 + LoRA parity smoke tests (skips gates and linear branch)"),
        P("vdn_max_gather_rows", "int", 200000, "Upper bound of K/V rows gathered per windowed FlashAttention call", check=_positive, accepted="an integer > 0"),
    ),
    "vmoba_attn": (
        P("temporal_chunk_size", "int", None, "Chunk size along time (latent frames)", check=_positive, accepted="an integer > 0"),
        P("temporal_topk", "int", None, "Top-k chunks selected along time", check=_positive, accepted="an integer > 0"),
        P("spatial_chunk_size", "list[int]", None, "Chunk size along (H, W)", check=_list_len(2), accepted="2 positive integers"),
        P("spatial_topk", "int", None, "Top-k chunks selected along space", check=_positive, accepted="an integer > 0"),
        P("st_chunk_size", "list[int]", None, "Chunk size along (T, H, W)", check=_list_len(3), accepted="3 positive integers"),
        P("st_topk", "int", None, "Top-k chunks selected spatio-temporally", check=_positive, accepted="an integer > 0"),
        P("moba_select_mode", "str", "threshold", "Selection mode", choices=("threshold", "topk")),
        P("moba_threshold", "float", 0.25, "Threshold for selection (cumulative gate mass)", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("moba_threshold_type", "str", "query_head", "How the threshold is applied", choices=("query_head", "head_global", "overall")),
        P("gate", "str", "pooled_query", "Chunk gate: pooled_query (log-sum-exp over the chunk's keys of the query block's mean . each key: sees sink keys and peaks that a chunk mean hides) or mean (upstream: query block mean . chunk mean key; use it for checkpoints trained with V-MoBA's gate)", choices=VMOBA_GATES),
        P("first_full_step", "int", 12, "Initial steps with full attention", check=_nonneg, accepted="an integer >= 0"),
        P("first_full_layer", "int", 0, "Initial layers with full attention", check=_nonneg, accepted="an integer >= 0"),
        P("temporal_layer", "int", 1, "Layers of temporal chunking per cycle", check=_nonneg, accepted="an integer >= 0"),
        P("spatial_layer", "int", 1, "Layers of spatial chunking per cycle", check=_nonneg, accepted="an integer >= 0"),
        P("st_layer", "int", 1, "Layers of spatio-temporal chunking per cycle", check=_nonneg, accepted="an integer >= 0"),
        error_budget(0.005),
        BLOCK_SPARSE_IMPL,
    ),
    "block_sparse_attn": (
        P("skip_first_steps", "int", 10, "Steps that use laser attention before switching to sparse", check=_nonneg, accepted="an integer >= 0"),
        P("sparsity", "float", 0.2, "Sparsity coefficient", check=_in(0.0, 1.0, lo_open=True, hi_open=True), accepted="a number in (0, 1)"),
    ),
    "sol_attn": (
        P("tau", "float", 1.0, "Routing threshold scale; higher keeps fewer exact KV blocks", check=_positive, accepted="a number > 0"),
        P("thresh_type", "str", "diag", "Threshold mode", choices=("diag", "exact")),
        P("sink_tokens", "int", 0, "Length of the exact KV sink (prefix tokens such as text rows)", check=_nonneg, accepted="an integer >= 0"),
        P("sink_start", "int", 0, "Start index of the exact KV sink range", check=_nonneg, accepted="an integer >= 0"),
        P("dense_steps", "int", 10, "Dense attention for the first N denoising steps", check=_nonneg, accepted="an integer >= 0"),
        P("dense_layers", "str", "0,1", "Layer indices kept dense, e.g. 0,1 or 0-2", check=_layer_list_check, accepted="comma-separated indices or ranges like 0,1 or 0-2"),
        P("dense_backend", "str", "fa", "Backend for the dense prefix: fa or sage_attn (approximate)", choices=("fa", "sage_attn")),
        P("kv_splits", "int|str", "auto", "KV split factor passed to the kernel; auto for long sequences", check=_kv_splits_check, accepted="'auto' or a positive integer"),
        P("predictor", "str", "pooled_query", "Which blocks are exact: pooled_query (tau's rule sets how many per query block, its tile neighbours then the best by each query block's mean against every key, log-sum-exp per block) or pooled (upstream: the rule's blocks by mean(q) . mean(k))", choices=SOL_PREDICTORS),
        P("centroid_variance", "bool", True, "Approximate blocks' virtual keys add the blocks' key variance term 0.5 * scale^2 * q^2 . var(k) (the mass of a spread block, which its mean key underestimates); false: upstream's mean key and log size only"),
        EDGE_TILES,
        error_budget(0.01),
        BLOCK_SPARSE_IMPL,
    ),
    "sla_attn": (
        P("topk", "float", 0.2, "Fraction of key blocks per query block computed exactly (critical)", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("negligible_fraction", "float", 0.0, "Fraction of key blocks skipped outright (lowest mass); the rest go through the linear branch", check=_in(0.0, 1.0, hi_open=True), accepted="a number in [0, 1)"),
        P("block_size", "int", 64, "Block size in tokens", choices=(32, 64, 128)),
        EDGE_TILES,
        BLOCK_SPARSE_IMPL,
    ),
    "sparse_video_gen_2_attn": (
        P("num_q_clusters", "int", 64, "k-means clusters of queries per head", check=_positive, accepted="an integer > 0"),
        P("num_k_clusters", "int", 128, "k-means clusters of keys per head", check=_positive, accepted="an integer > 0"),
        P("kmeans_iters", "int", 5, "k-means iterations of a cold start (first step of a request)", check=_positive, accepted="an integer > 0"),
        P("warm_iters", "int", 1, "k-means iterations of later steps, started from the previous step's centroids of the layer", check=_positive, accepted="an integer > 0"),
        P("recluster_every", "int", 1, "cluster every N-th step; the steps between reuse the cached permutation and block lists", check=_positive, accepted="an integer > 0"),
        P("top_p", "float", 0.9, "Cumulative estimated attention mass kept per query cluster", check=_in(0.0, 1.0, lo_open=True), accepted="a number in (0, 1]"),
        P("predictor", "str", "pooled_query", "Mass estimate of a (query cluster, key cluster) pair: pooled_query (log-sum-exp over the key cluster's keys of the query centroid . each key: sees sink keys and spread clusters) or centroids (upstream: query centroid . key centroid + log cluster size)", choices=SVG2_PREDICTORS),
        P("first_full_steps", "int", 0, "Dense attention for the first N denoising steps", check=_nonneg, accepted="an integer >= 0"),
        error_budget(0.005),
        BLOCK_SPARSE_IMPL,
    ),
    "subblock_sparse_attn": (
        P("compute_mode", "str", "bf16", "bf16, or sage_fp8 (SM90 only, needs SpargeAttn)", choices=("bf16", "sage_fp8")),
    ),
}


def schema_for(backend: AttentionBackendEnum) -> tuple[Param, ...]:
    from ditattn.attention.specs import SPECS

    key = SPECS[backend].config_schema
    return SCHEMAS.get(key, ()) if key else ()

