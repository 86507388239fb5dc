"""Backend implementations of the sparse video backends on the in-tree sparse engine.

Registers ``sliding_tile_attn``, ``video_sparse_attn``, ``sparge_attn``, ``vmoba_attn``,
``sparse_video_gen_2_attn``, ``sla_attn``, ``sage_sla_attn`` and ``sol_attn`` (contract:
:mod:`ditattn.attention.backends.base`).  Common rules:

* self-attention over ``call.video_shape = (T, H, W)`` latent tokens (T-major) followed by
  ``call.text_len`` text tokens; ``video_shape`` None, a length that does not match, causal
  attention, an additive bias or cross-attention (different q/kv lengths) raise
  :class:`AttentionConfigError` (``sparge_attn`` instead runs dense SDPA on shapes it does not
  sparsify, as the seed says);
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

import dataclasses
import threading
from typing import Optional

import torch

from ditattn.attention.backends.base import AttnCall, expand_kv, register
from ditattn.attention.config import complete_backend_config, parse_layer_list
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.sparse import record_stats, stats_key
from ditattn.attention.sparse.block_sparse import dense_attention
from ditattn.attention.sparse.fallback import budget_stats, count_call, note_dense_once
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
from ditattn.errors import AttentionConfigError
from ditattn.settings import check_retired

Tensor = torch.Tensor

SEARCH_MODES = ("STA_searching", "STA_tuning", "STA_tuning_cfg")


def _config(backend: B, config: Optional[dict]) -> dict:
    """The backend's full config (defaults filled in, validated unless the layer already did)."""
    check_retired("DITATTN_BLOCK_SPARSE_IMPL")
    return complete_backend_config(backend, config)


def _check_call(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall) -> tuple[tuple[int, int, int], int]:
    if call.causal:
        raise AttentionConfigError(f"{name}: sparse video attention is non-causal; causal attention is not supported")
    if call.attn_bias is not None:
        raise AttentionConfigError(f"{name}: does not accept an additive attention bias/mask")
    if q.shape[1] != k.shape[1]:
        raise AttentionConfigError(
            f"{name}: sparse video attention needs self-attention (q has {q.shape[1]} tokens, k/v {k.shape[1]}); "
            "cross-attention is served by a dense backend"
        )
    if call.video_shape is None:
        raise AttentionConfigError(f"{name}: sparse video attention needs the latent grid video_shape=(T,H,W)")
    try:
        T, H, W = (int(x) for x in call.video_shape)
    except (TypeError, ValueError):
        raise AttentionConfigError(
            f"{name}: video_shape must be three positive integers (T, H, W), got {call.video_shape!r}") from None
    if min(T, H, W) <= 0:
        raise AttentionConfigError(f"{name}: video_shape must be three positive integers (T, H, W), got {call.video_shape!r}")
    text_len = int(call.text_len or 0)
    if T * H * W + text_len != q.shape[1]:
        raise AttentionConfigError(
            f"{name}: sequence length {q.shape[1]} != T*H*W + text_len = {T}*{H}*{W} + {text_len} "
            f"= {T * H * W + text_len} (video_shape={call.video_shape})"
        )
    return (T, H, W), text_len


def _grid_or_line(name: str, q, k, v, call: AttnCall, block: int) -> tuple[tuple[int, int, int], int, Optional[tuple]]:
    """``(grid, text_len, tile)`` of a call: the video grid and the backend's own tiles, or, for a
    plain sequence (no ``video_shape``), the grid ``(1, 1, S - text_len)`` in 1-D tiles of ``block`` tokens."""
    if call.video_shape is not None:
        vs, text_len = _check_call(name, q, k, v, call)
        return vs, text_len, None
    text_len = int(call.text_len or 0)
    n = q.shape[1] - text_len
    if n <= 0:
        raise AttentionConfigError(f"{name}: text_len {text_len} leaves no sequence tokens of {q.shape[1]}")
    call_1d = dataclasses.replace(call, video_shape=(1, 1, n))
    vs, text_len = _check_call(name, q, k, v, call_1d)
    return vs, text_len, (1, 1, block)


def _reused_dense(name: str, q, k, v, call: AttnCall, cfg: dict, backend: Optional[str] = None):
    """The dense kernel's ``(out, lse)`` when this layer's error budget sent an earlier step of the run to
    it and the decision is not due for a check (:func:`ditattn.attention.sparse.budget.reuse_dense`),
    else None."""
    from ditattn.attention.sparse import budget as eb

    if cfg.get("error_budget", 0.0) <= 0:
        return None
    key = f"{_key(name, call)}@{threading.get_ident()}"
    if not eb.reuse_dense(key, call.step):
        return None
    eb.remember_kept(key, call.step, 1.0, decided=False)
    return _dense(name, q, k, v, call, f"error budget: dense at an earlier step (checked again every "
                  f"{eb.RECHECK_EVERY} steps)", backend=backend, announce=True)


def _remember(name: str, call: AttnCall, cfg: dict, plan) -> None:
    """Record whether the budget sent this call to the dense kernel (for :func:`_reused_dense`)."""
    if cfg.get("error_budget", 0.0) > 0:
        from ditattn.attention.sparse import budget as eb

        eb.remember_kept(f"{_key(name, call)}@{threading.get_ident()}", call.step,
                         1.0 if plan.extra.get("dense_fallback") else 0.0)


def _key(name: str, call: AttnCall) -> str:
    return stats_key(name, call.layer_key, call.layer_idx)


def _dense(name: str, q, k, v, call: AttnCall, reason: str, backend: Optional[str] = None, announce: bool = False):
    if announce:  # a size the backend never sparsifies, or the error budget: said once (log line, plan notes)
        note_dense_once(name, call, reason)
    record_stats(_key(name, call), backend=name, kept_fraction=1.0, dense=True, reason=reason,
                 step=call.step, layer_idx=call.layer_idx, fallback=announce)
    count_call(_key(name, call), kept=1.0, fallback=announce, dense=True)
    return dense_attention(q, k, v, scale=call.scale, return_lse=call.return_lse, backend=backend)


def _sparse_done(name: str, call: AttnCall, plan, **extra):
    fallback = bool(plan.extra.get("dense_fallback"))
    reason = "error budget: every head needs most blocks (dense kernel)" if fallback else ""
    extra.update(budget_stats(plan))
    record_stats(_key(name, call), backend=name, kept_fraction=plan.kept_fraction_pending, dense=fallback,
                 reason=reason, step=call.step, layer_idx=call.layer_idx, fallback=fallback, **extra)
    count_call(_key(name, call), kept=plan.kept_fraction_pending, fallback=fallback, dense=fallback,
               dense_heads=extra.get("dense_heads"), heads=extra.get("heads", 0))
    if fallback:
        note_dense_once(name, call, reason)


def _layer(call: AttnCall) -> int:
    return 0 if call.layer_idx is None else int(call.layer_idx)


# ------------------------------------------------------------------------------------------------


@register(B.SLIDING_TILE_ATTN)
def sliding_tile_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    name = B.SLIDING_TILE_ATTN.value
    cfg = _config(B.SLIDING_TILE_ATTN, config)
    vs, text_len = _check_call(name, q, k, v, call)
    k, v = expand_kv(k, v, q.shape[2])
    mode = cfg["sta_mode"]
    path = cfg["mask_strategy_file_path"]
    tile_size = tuple(cfg.get("tile_size") or (4, 4, 4))
    strategy = load_mask_strategy(path) if mode == "STA_inference" else None
    if call.step is not None and call.step < cfg["skip_time_steps"]:
        return _dense(name, q, k, v, call, f"step {call.step} < skip_time_steps {cfg['skip_time_steps']}")
    head_offset = int(getattr(call, "head_offset", 0) or 0)
    if mode in SEARCH_MODES:
        search = get_search(path, mode, parse_candidates(cfg.get("window_candidates")))
        out, lse = sta_search_attention(q, k, v, video_shape=vs, search=search,
                                        step=0 if call.step is None else int(call.step), layer=_layer(call),
                                        head_offset=head_offset, tile_size=tile_size, text_len=text_len,
                                        scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"])
        record_stats(_key(name, call), backend=name, kept_fraction=1.0, dense=True,
                     reason=f"{mode}: full attention returned, candidates measured", step=call.step,
                     layer_idx=call.layer_idx)
        return out, lse
    windows = strategy.windows(call.step, _layer(call), q.shape[2], head_offset)
    out, lse, plan = sliding_tile_attention(q, k, v, video_shape=vs, windows=windows, tile_size=tile_size,
                                            text_len=text_len, scale=call.scale, return_lse=call.return_lse,
                                            impl=cfg["block_sparse_impl"])
    _sparse_done(name, call, plan, windows=windows.tolist())
    return out, lse


@register(B.VIDEO_SPARSE_ATTN)
def video_sparse_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    name = B.VIDEO_SPARSE_ATTN.value
    cfg = _config(B.VIDEO_SPARSE_ATTN, config)
    vs, text_len = _check_call(name, q, k, v, call)
    if cfg["sparsity"] == 0.0:  # k = every tile: the fine stage is exact full attention
        return _dense(name, q, k, v, call, "sparsity 0.0 keeps every tile (exact dense attention)")
    k, v = expand_kv(k, v, q.shape[2])
    out, lse, plan = video_sparse_attention(q, k, v, video_shape=vs, sparsity=cfg["sparsity"], text_len=text_len,
                                            scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                            edge_tiles=cfg["edge_tiles"])
    _sparse_done(name, call, plan, tiles_per_query=plan.extra["k"])
    return out, lse


@register(B.SPARGE_ATTN)
def sparge_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    name = B.SPARGE_ATTN.value
    cfg = _config(B.SPARGE_ATTN, config)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(
            f"{name}: needs float16 or bfloat16 q/k/v (got {str(q.dtype).replace('torch.', '')}): SpargeAttention "
            "quantizes its kept blocks SageAttention-style; use --dtype bfloat16 or float16")
    ok, why = sparge_applies(q.shape[1], k.shape[1], q.shape[3])
    if not ok:
        if call.causal or call.attn_bias is not None:
            raise AttentionConfigError(f"{name}: causal attention and additive biases are not supported")
        return _dense(name, q, k, v, call, f"dense SDPA: {why}", announce=True)
    vs, text_len, tile_1d = _grid_or_line(name, q, k, v, call, cfg.get("block_size", 64))
    k, v = expand_kv(k, v, q.shape[2])
    again = _reused_dense(name, q, k, v, call, cfg)
    if again is not None:
        return again
    out, lse, plan = sparge_attention(q, k, v, video_shape=vs, topk=cfg["topk"], cdfthreshd=cfg.get("cdfthreshd"),
                                      tile_size=tile_1d,
                                      block_size=cfg.get("block_size", 64), text_len=text_len,
                                      quantize=cfg.get("quantize", True),
                                      predictor=cfg["predictor"], simthreshd1=cfg["simthreshd1"], scale=call.scale,
                                      return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                      edge_tiles=cfg["edge_tiles"], error_budget=cfg.get("error_budget", 0.0))
    _sparse_done(name, call, plan, quantized=plan.extra["quantized"], predictor=plan.extra["predictor"])
    _remember(name, call, cfg, plan)
    return out, lse


@register(B.VMOBA_ATTN)
def vmoba_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    name = B.VMOBA_ATTN.value
    cfg = _config(B.VMOBA_ATTN, config)
    vs, text_len = _check_call(name, q, k, v, call)
    k, v = expand_kv(k, v, q.shape[2])
    mode = vmoba_layer_mode(call.layer_idx, first_full_layer=cfg["first_full_layer"],
                            temporal_layer=cfg["temporal_layer"], spatial_layer=cfg["spatial_layer"],
                            st_layer=cfg["st_layer"])
    if call.step is not None and call.step < cfg["first_full_step"]:
        return _dense(name, q, k, v, call, f"step {call.step} < first_full_step {cfg['first_full_step']}")
    if mode == "full":
        return _dense(name, q, k, v, call, f"layer {_layer(call)} < first_full_layer {cfg['first_full_layer']}")
    chunk = {"temporal": cfg.get("temporal_chunk_size"), "spatial": cfg.get("spatial_chunk_size"),
             "st": cfg.get("st_chunk_size")}[mode]
    again = _reused_dense(name, q, k, v, call, cfg)
    if again is not None:
        return again
    topk = {"temporal": cfg.get("temporal_topk"), "spatial": cfg.get("spatial_topk"), "st": cfg.get("st_topk")}[mode]
    out, lse, plan = vmoba_attention(q, k, v, video_shape=vs, mode=mode, chunk=chunk, topk=topk,
                                     select_mode=cfg["moba_select_mode"], threshold=cfg["moba_threshold"],
                                     threshold_type=cfg["moba_threshold_type"], gate=cfg["gate"], text_len=text_len,
                                     scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                     error_budget=cfg.get("error_budget", 0.0))
    _sparse_done(name, call, plan, mode=mode, chunk=plan.extra["chunk"], topk=plan.extra["topk"])
    _remember(name, call, cfg, plan)
    return out, lse


@register(B.SPARSE_VIDEO_GEN_2_ATTN)
def sparse_video_gen_2_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    name = B.SPARSE_VIDEO_GEN_2_ATTN.value
    cfg = _config(B.SPARSE_VIDEO_GEN_2_ATTN, config)
    vs, text_len = _check_call(name, q, k, v, call)
    k, v = expand_kv(k, v, q.shape[2])
    if call.step is not None and call.step < cfg["first_full_steps"]:
        return _dense(name, q, k, v, call, f"step {call.step} < first_full_steps {cfg['first_full_steps']}")
    budget = cfg.get("error_budget", 0.0)
    # warm start per layer and calling thread (one request runs its steps on one thread)
    state_key = f"{_key(name, call)}@{threading.get_ident()}"
    if budget > 0:  # decide before clustering: a layer that needs most blocks runs dense
        from ditattn.attention.sparse import budget as eb
        from ditattn.attention.sparse.budget import precheck_dense

        last = eb.kept_last_step(state_key, call.step)
        if last is not None and last > eb.DENSE_ABOVE:  # it kept most blocks last step: dense for the request
            eb.remember_kept(state_key, call.step, 1.0)
            return _dense(name, q, k, v, call, "error budget: the layer kept most blocks at an earlier step "
                          "(dense kernel for the rest of the request)", announce=True)
        if precheck_dense(q, k, vs, text_len, budget, scale=call.scale, impl=cfg["block_sparse_impl"]):
            eb.remember_kept(state_key, call.step, 1.0)
            return _dense(name, q, k, v, call, "error budget: every head needs most blocks (dense kernel)",
                          announce=True)
    out, lse, plan = svg2_attention(q, k, v, video_shape=vs, text_len=text_len, num_q_clusters=cfg["num_q_clusters"],
                                    num_k_clusters=cfg["num_k_clusters"], kmeans_iters=cfg["kmeans_iters"],
                                    top_p=max(cfg["top_p"], 1.0 - budget) if budget > 0 else cfg["top_p"],
                                    warm_iters=cfg["warm_iters"],
                                    recluster_every=cfg["recluster_every"], predictor=cfg["predictor"],
                                    state_key=state_key, step=call.step,
                                    scale=call.scale, return_lse=call.return_lse, impl=cfg["block_sparse_impl"])
    _sparse_done(name, call, plan, mode=plan.extra["mode"])
    if budget > 0:
        eb.remember_kept(state_key, call.step, plan.kept_fraction_pending)
    return out, lse


def _sla(backend: B, q, k, v, call: AttnCall, config: dict):
    name = backend.value
    cfg = _config(backend, config)
    vs, text_len = _check_call(name, q, k, v, call)
    k, v = expand_kv(k, v, q.shape[2])
    out, lse, plan = sla_attention(q, k, v, video_shape=vs, text_len=text_len, topk=cfg["topk"],
                                   negligible_fraction=cfg["negligible_fraction"], block_size=cfg["block_size"],
                                   quantize=backend is B.SAGE_SLA_ATTN, scale=call.scale,
                                   return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                   edge_tiles=cfg["edge_tiles"])
    _sparse_done(name, call, plan, marginal_fraction=plan.extra["marginal_fraction"], linear_branch="absent (zero)")
    return out, lse


@register(B.SLA_ATTN)
def sla_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    return _sla(B.SLA_ATTN, q, k, v, call, config)


@register(B.SAGE_SLA_ATTN)
def sage_sla_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    return _sla(B.SAGE_SLA_ATTN, q, k, v, call, config)


@register(B.SOL_ATTN)
def sol_attn(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
    name = B.SOL_ATTN.value
    cfg = _config(B.SOL_ATTN, config)
    if q.dtype != torch.bfloat16 or q.shape[3] != 128:
        raise AttentionConfigError(
            f"{name}: needs bfloat16 q/k/v with head dim 128 (got {str(q.dtype).replace('torch.', '')}, "
            f"head dim {q.shape[3]}); use --dtype bf16 with a head-dim-128 model, or another sparse backend"
        )
    vs, text_len, tile_1d = _grid_or_line(name, q, k, v, call, 64)
    dense_backend = cfg["dense_backend"]
    if call.step is not None and call.step < cfg["dense_steps"]:
        return _dense(name, q, k, v, call, f"step {call.step} < dense_steps {cfg['dense_steps']} ({dense_backend})",
                      backend=dense_backend)
    layer = _layer(call)
    if layer in parse_layer_list(cfg["dense_layers"]):
        return _dense(name, q, k, v, call, f"layer {layer} in dense_layers {cfg['dense_layers']} ({dense_backend})",
                      backend=dense_backend)
    k, v = expand_kv(k, v, q.shape[2])
    again = _reused_dense(name, q, k, v, call, cfg, backend=dense_backend)
    if again is not None:
        return again
    out, lse, plan = sol_attention(q, k, v, video_shape=vs, text_len=text_len, tau=cfg["tau"],
                                   thresh_type=cfg["thresh_type"], sink_start=cfg["sink_start"],
                                   sink_tokens=cfg["sink_tokens"], predictor=cfg["predictor"],
                                   centroid_variance=cfg["centroid_variance"], scale=call.scale,
                                   return_lse=call.return_lse, impl=cfg["block_sparse_impl"],
                                   edge_tiles=cfg["edge_tiles"], error_budget=cfg.get("error_budget", 0.0),
                                   dense_backend=dense_backend, tile_size=tile_1d)
    _sparse_done(name, call, plan, approximate_fraction=1.0 - plan.kept_fraction_pending)
    _remember(name, call, cfg, plan)
    return out, lse
