"""What the sparse video backends share (one module each: :mod:`.sliding_tile`, :mod:`.video_sparse`,
:mod:`.sparge`, :mod:`.vmoba`, :mod:`.svg2`, :mod:`.sla`, :mod:`.sol`): the prologue that completes the config
and checks the call (:func:`sparse_backend`), the dense runs of their dense phases and fallbacks, the
statistics each call records (``ditattn.attention.sparse.last_stats`` and the run's per-layer counts,
:mod:`ditattn.attention.sparse.fallback`) and the error budget's reuse of an earlier step's dense
decision (:mod:`ditattn.attention.sparse.budget`).

Together they register ``sliding_tile_attn``, ``video_sparse_attn``, ``sparge_attn``, ``vmoba_attn``,
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

import dataclasses
import functools
import threading
from typing import Optional

import torch

from ditattn.attention import schemas
from ditattn.attention.backends.base import AttnCall, register
from ditattn.attention.config import complete_backend_config
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.reference import expand_kv
from ditattn.attention.sparse import record_stats, stats_key
from ditattn.attention.sparse.block_sparse import dense_attention
from ditattn.attention.sparse.budget import DENSE_CALL_ABOVE
from ditattn.attention.sparse.fallback import (
    MIN_SEQ_LEN,
    budget_stats,
    count_call,
    min_seq_len,
    note_dense_once,
    short_call,
)
from ditattn.attention.specs import BackendSpec
from ditattn.errors import AttentionConfigError
from ditattn.settings import check_retired

Tensor = torch.Tensor


def backend_config(backend: B, config: Optional[dict]) -> dict:
    """The backend's full config (defaults filled in, validated unless the layer already did)."""
    check_retired("DITATTN_BLOCK_SPARSE_IMPL")
    return complete_backend_config(backend, config)


def check_call(name: str, q: Tensor, k: Tensor, v: Tensor, call: AttnCall) -> tuple[tuple[int, int, int], int]:
    """``(grid (T, H, W), text_len)`` of a non-causal, bias-free self-attention call over ``call.video_shape``
    latent tokens then ``call.text_len`` text tokens (q/k/v ``[B, S, H, D]``); anything else raises
    :class:`AttentionConfigError`."""
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
            f"{name}: video_shape must be three positive integers (T, H, W), got {call.video_shape!r}"
        ) from None
    if min(T, H, W) <= 0:
        raise AttentionConfigError(
            f"{name}: video_shape must be three positive integers (T, H, W), got {call.video_shape!r}"
        )
    text_len = int(call.text_len or 0)
    if T * H * W + text_len != q.shape[1]:
        raise AttentionConfigError(
            f"{name}: sequence length {q.shape[1]} != T*H*W + text_len = {T}*{H}*{W} + {text_len} "
            f"= {T * H * W + text_len} (video_shape={call.video_shape})"
        )
    return (T, H, W), text_len


def grid_or_line(name: str, q, k, v, call: AttnCall) -> tuple[tuple[int, int, int], int]:
    """``(grid, text_len)`` of a call: the video grid, or, for a plain sequence (no ``video_shape``), the
    grid ``(1, 1, S - text_len)`` (cut in 1-D tiles, :func:`line_tile`)."""
    if call.video_shape is not None:
        return check_call(name, q, k, v, call)
    text_len = int(call.text_len or 0)
    n = q.shape[1] - text_len
    if n <= 0:
        raise AttentionConfigError(f"{name}: text_len {text_len} leaves no sequence tokens of {q.shape[1]}")
    return check_call(name, q, k, v, dataclasses.replace(call, video_shape=(1, 1, n)))


def line_tile(call: AttnCall, block: int) -> Optional[tuple[int, int, int]]:
    """The tile of a plain-sequence call (no ``video_shape``): ``(1, 1, block)``; None (the backend's own
    tiles) for a video grid."""
    return (1, 1, block) if call.video_shape is None else None


def budget_key(name: str, call: AttnCall) -> str:
    """The key of the call's layer, guidance branch and calling thread under which the error budget's
    call-level decision (and SVG2's clusters) are kept: one request runs its steps on one thread, and under
    sequential guidance the conditional and unconditional forwards of a step each keep their own (else the
    second forward of a step would look like a new request)."""
    from ditattn.attention.context import current_forward

    branch = current_forward().branch
    return f"{layer_stats_key(name, call)}{'' if branch is None else '/' + branch}@{threading.get_ident()}"


def budget_decision(name: str, call: AttnCall, cfg: dict) -> Optional[bool]:
    """The error budget's call-level decision this layer took at an earlier step of the request (True:
    dense, False: sparse), or None: decide at this call (:func:`ditattn.attention.sparse.budget.decided`;
    None also without a budget)."""
    if cfg.get("error_budget", 0.0) <= 0:
        return None
    from ditattn.attention.sparse import budget as eb

    return eb.decided(budget_key(name, call), call.step)


def reused_dense(name: str, q, k, v, call: AttnCall, cfg: dict, backend: Optional[str] = None):
    """The dense kernel's ``(out, lse)`` when this layer's error budget sent an earlier step of the request
    to it (:func:`budget_decision` True: no tiling, no probes), else None."""
    if budget_decision(name, call, cfg) is not True:
        return None
    from ditattn.attention.sparse import budget as eb

    eb.remember(budget_key(name, call), call.step, True)
    return run_dense(
        name, q, k, v, call, "error budget: dense from an earlier step of the request", backend=backend, announce=True
    )


def remember_budget(name: str, call: AttnCall, cfg: dict, plan) -> None:
    """Record whether the budget sent this call to the dense kernel (reused at the request's later steps)."""
    if cfg.get("error_budget", 0.0) > 0:
        from ditattn.attention.sparse import budget as eb

        eb.remember(budget_key(name, call), call.step, bool(plan.extra.get("dense_fallback")))


def layer_stats_key(name: str, call: AttnCall) -> str:
    """The ``last_stats`` key of the call's layer."""
    return stats_key(name, call.layer_key, call.layer_idx)


def run_dense(name: str, q, k, v, call: AttnCall, reason: str, backend: Optional[str] = None, announce: bool = False):
    """Dense attention for the whole call (``backend``: a dense backend name, None: the platform's
    automatic dense choice), recorded with ``reason``; ``announce``: a fallback (a shape the backend never
    sparsifies, or the error budget), said once and counted as such, else a dense phase.  q/k/v
    ``[B, S, H, D]``; returns ``(out, lse|None)``."""
    if announce:  # a size the backend never sparsifies, or the error budget: said once (log line, plan notes)
        note_dense_once(name, call, reason)
    record_stats(
        layer_stats_key(name, call),
        backend=name,
        kept_fraction=1.0,
        dense=True,
        reason=reason,
        step=call.step,
        layer_idx=call.layer_idx,
        fallback=announce,
    )
    count_call(layer_stats_key(name, call), kept=1.0, fallback=announce, dense=True)
    return dense_attention(q, k, v, scale=call.scale, return_lse=call.return_lse, backend=backend)


def sparse_done(name: str, call: AttnCall, plan, **extra):
    """Record a sparse call's plan (kept fraction, the budget's statistics and dense fallback, ``extra``)."""
    fallback = bool(plan.extra.get("dense_fallback"))
    reason = "error budget: predicted to keep more than dense_above of the blocks (dense kernel)" if fallback else ""
    extra.update(budget_stats(plan))
    record_stats(
        layer_stats_key(name, call),
        backend=name,
        kept_fraction=plan.kept_fraction_pending,
        dense=fallback,
        reason=reason,
        step=call.step,
        layer_idx=call.layer_idx,
        fallback=fallback,
        **extra,
    )
    count_call(
        layer_stats_key(name, call),
        kept=plan.kept_fraction_pending,
        fallback=fallback,
        dense=fallback,
        dense_heads=extra.get("dense_heads"),
        heads=extra.get("heads", 0),
    )
    if fallback:
        note_dense_once(name, call, reason)


def budget_keys(default_budget: float) -> tuple:
    """The schema keys of a backend under the error budget: ``error_budget`` (``default_budget``),
    ``dense_above`` (:data:`~ditattn.attention.sparse.budget.DENSE_CALL_ABOVE`) and ``min_seq_len`` (unset:
    the device's figure, :data:`~ditattn.attention.sparse.fallback.MIN_SEQ_LEN`)."""
    return (
        schemas.error_budget(default_budget),
        schemas.dense_above(DENSE_CALL_ABOVE),
        schemas.min_seq_len(MIN_SEQ_LEN["cuda"]),
    )


def layer_index(call: AttnCall) -> int:
    """The call's layer index (None counts as 0)."""
    return 0 if call.layer_idx is None else int(call.layer_idx)


def sparse_backend(backend: B, *, spec: BackendSpec, schema=(), precheck=None, lines: bool = False):
    """Register ``body`` as the implementation of the sparse video ``backend`` (with its capability row
    and schema, see ``backends.base.register``) behind the prologue every sparse backend shares:
    the config completed and validated, then ``precheck(name, q, k, v, call, cfg)`` when given (a
    result other than None is returned as is: a dense call on a shape the backend does not sparsify),
    the call checked (:func:`check_call`; with ``lines`` a call without ``video_shape`` is a plain sequence,
    the grid ``(1, 1, S - text_len)``, :func:`grid_or_line`), a call shorter than the config's ``min_seq_len``
    (:func:`ditattn.attention.sparse.fallback.short_call`) sent to the dense kernel (said once), and K/V
    expanded to q's heads.  ``body(name, q,
    k, v, call, cfg, vs, text_len)`` gets q/k/v ``[B, S, H, D]``, the latent grid ``vs = (T, H, W)`` and the
    text length."""
    name = backend.value

    def deco(body):
        @functools.wraps(body)
        def impl(q: Tensor, k: Tensor, v: Tensor, call: AttnCall, config: dict):
            cfg = backend_config(backend, config)
            if precheck is not None:
                early = precheck(name, q, k, v, call, cfg)
                if early is not None:
                    return early
            vs, text_len = (grid_or_line if lines else check_call)(name, q, k, v, call)
            if "min_seq_len" in cfg:  # too short to gain: dense at once, before any tiling or probe
                why = short_call(q.shape[1], cfg, q.device)
                if why:
                    return run_dense(name, q, k, v, call, f"{why} (dense kernel)", announce=True)
            k, v = expand_kv(k, v, q.shape[2])
            return body(name, q, k, v, call, cfg, vs, text_len)

        return register(backend, spec=spec, schema=schema)(impl)

    return deco


def sparse_runtime_label(spec: BackendSpec, platform, req, config) -> str:
    """The plan's runtime label of a training-free sparse backend: its runtime on ``platform`` plus, where
    its ``min_seq_len`` (:func:`ditattn.attention.sparse.fallback.min_seq_len`, the platform's figure when
    unset) is positive, the lengths that run the dense kernel instead."""
    rt = spec.runtime_on(platform)
    label = rt.label if rt is not None else ""
    limit = min_seq_len(config or {}, platform.name)
    return f"{label}; dense kernel below {limit} tokens" if label and limit > 0 else label
