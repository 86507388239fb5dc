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
from ditattn.attention.sparse.check import MAX_REL_ERR
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


def run_dense(
    name: str,
    q,
    k,
    v,
    call: AttnCall,
    reason: str,
    backend: Optional[str] = None,
    announce: bool = False,
    note: Optional[str] = None,
):
    """Dense attention for the whole call (``backend``: a dense backend name, None: the platform's
    automatic dense choice), recorded with ``reason``; ``announce``: a fallback (a shape the backend never
    sparsifies, or the error budget), said once (``note``, when given: the same reason without figures that
    vary per call, so the once-said notes stay few) and counted as such, else a dense phase.  q/k/v
    ``[B, S, H, D]``; returns ``(out, lse|None)``."""
    if announce:  # a size the backend never sparsifies, or the error budget: said once (log line, plan notes)
        note_dense_once(name, call, note or reason)  # ``note``: the reason without its per-call figures
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
    """The schema keys of a backend under the error budget: ``error_budget`` (``default_budget``), ``max_rel_err``
    (:data:`~ditattn.attention.sparse.check.MAX_REL_ERR`),
    ``dense_above`` (:data:`~ditattn.attention.sparse.budget.DENSE_CALL_ABOVE`) and ``min_seq_len`` (unset:
    the device's figure, :data:`~ditattn.attention.sparse.fallback.MIN_SEQ_LEN`)."""
    return (
        schemas.error_budget(default_budget),
        schemas.max_rel_err(MAX_REL_ERR),
        schemas.dense_above(DENSE_CALL_ABOVE),
        schemas.min_seq_len(MIN_SEQ_LEN["cuda"]),
    )


def layer_index(call: AttnCall) -> int:
    """The call's layer index (None counts as 0)."""
    return 0 if call.layer_idx is None else int(call.layer_idx)


def sparse_backend(backend: B, *, spec: BackendSpec, schema=(), precheck=None, lines: bool = False, dense_phase=None):
    """Register ``body`` as the implementation of the sparse video ``backend`` (with its capability row
    and schema, see ``backends.base.register``) behind the prologue every sparse backend shares:
    the config completed and validated, then ``precheck(name, q, k, v, call, cfg)`` when given (a
    result other than None is returned as is: a dense call on a shape the backend does not sparsify),
    the call checked (:func:`check_call`; with ``lines`` a call without ``video_shape`` is a plain sequence,
    the grid ``(1, 1, S - text_len)``, :func:`grid_or_line`), a call shorter than the config's ``min_seq_len``
    (:func:`ditattn.attention.sparse.fallback.short_call`) sent to the dense kernel (said once), K/V
    expanded to q's heads, and ``dense_phase(q, call, cfg)`` when given: ``(reason, dense backend or None)``
    for a call in one of the backend's dense phases (its first steps, its dense layers), run dense as a phase,
    or None.  ``body(name, q,
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
            phase = dense_phase(q, call, cfg) if dense_phase is not None else None
            if phase is not None:  # the steps / layers the backend keeps dense: no selection, no check
                why, dense_backend = phase
                return run_dense(name, q, k, v, call, why, backend=dense_backend)
            if cfg.get("max_rel_err", 0.0) > 0 and cfg.get("error_budget", 0.0) > 0:
                return checked_call(name, body, q, k, v, call, cfg, vs, text_len)
            return body(name, q, k, v, call, cfg, vs, text_len)

        return register(backend, spec=spec, schema=schema)(impl)

    return deco


def _entry(key: str):
    from ditattn.attention.sparse import last_stats

    return last_stats.get(key)


def _ran_dense(key: str) -> bool:
    entry = _entry(key)
    return entry is None or bool(dict.get(entry, "dense", False))


def _measure(name: str, q, k, v, call: AttnCall, cfg: dict, res, mode: str):
    """Check a sparse call's output (:func:`ditattn.attention.sparse.check.sampled_error`) and add the figures to
    its ``last_stats`` entry and its layer's run counts; returns ``(passed, rel_err)``."""
    from ditattn.attention.sparse import check as ck
    from ditattn.attention.sparse.fallback import note_check

    rel, head = ck.sampled_error(q, k, v, res[0], call.scale)
    key = layer_stats_key(name, call)
    _annotate(key, checked_rel_err=rel, checked_rel_err_head_max=head, max_rel_err=cfg["max_rel_err"], check=mode)
    note_check(key, rel)
    return rel <= cfg["max_rel_err"], rel


def _annotate(key: str, **fields) -> None:
    entry = _entry(key)
    if entry is not None:
        dict.update(entry, fields)


def _keep_or_dense(name: str, q, k, v, call: AttnCall, cfg: dict, key: str, res, mode: str):
    """Measure a sparse call run in ``mode``: within ``max_rel_err`` the layer keeps ``mode`` (checked now) and
    the call's output stands; over it, the dense kernel replaces the call (:func:`_dense_after_check`)."""
    from ditattn.attention.sparse import check as ck

    ok, rel = _measure(name, q, k, v, call, cfg, res, mode)
    if ok:
        ck.set_mode(key, call.step, mode, checked=call.step, rel_err=rel)
        return res
    return _dense_after_check(name, q, k, v, call, cfg, rel)


def _dense_after_check(name: str, q, k, v, call: AttnCall, cfg: dict, rel: float):
    """Replace a sparse call whose measured error failed the check by the dense kernel (counted once)."""
    from ditattn.attention.sparse import check as ck
    from ditattn.attention.sparse.fallback import drop_last_call

    drop_last_call(layer_stats_key(name, call))
    why = _check_reason(rel, cfg)
    ck.set_mode(_check_key(name, call, q, cfg), call.step, ck.DENSE, checked=call.step, rel_err=rel, reason=why)
    return run_dense(name, q, k, v, call, why, announce=True, note=_CHECK_NOTE)


def _check_key(name: str, call: AttnCall, q, cfg: dict) -> str:
    """The key of the error check's memory: the budget's (layer, guidance branch, thread), the call's length and
    heads and its config (another resolution or config of the same layer decides on its own)."""
    try:  # every call computes this: the items' own hash (~1 us), their repr only for an unhashable value
        config = hash(tuple(cfg.items()))
    except TypeError:
        config = hash(repr(sorted(cfg.items())))
    return f"{budget_key(name, call)}#{q.shape[1]}x{q.shape[2]}#{config}"


def _check_reason(rel: float, cfg: dict) -> str:
    return f"error check: {rel:.1%} measured > max_rel_err {cfg['max_rel_err']:.1%} (dense kernel)"


#: the once-said note of every dense call the error check decides (the figures are in the call's statistics)
_CHECK_NOTE = "error check: measured error over max_rel_err, or the selection past dense_above (dense kernel)"


def _kept(key: str) -> float:
    entry = _entry(key)
    return float(entry.get("kept_fraction", 1.0)) if entry is not None else 1.0


def _pilot(name: str, body, q, k, v, call: AttnCall, plain: dict, vs, text_len: int) -> Optional[float]:
    """The measured error of the backend's own selection on the pilot's heads
    (:func:`ditattn.attention.sparse.check.pilot_heads`), or None: no pilot (too few heads) or a pilot that ran
    dense.  The pilot is not counted as a call."""
    from ditattn.attention.sparse import check as ck
    from ditattn.attention.sparse.fallback import drop_last_call

    heads = ck.pilot_heads(q.shape[2], q.device)
    if heads is None:
        return None
    qs, ks, vs_ = (t.index_select(2, heads) for t in (q, k, v))
    res = body(name, qs, ks, vs_, call, plain, vs, text_len)
    skey = layer_stats_key(name, call)
    dense = _ran_dense(skey)
    drop_last_call(skey)
    return None if dense else ck.sampled_error(qs, ks, vs_, res[0], call.scale)[0]


def checked_call(name: str, body, q, k, v, call: AttnCall, cfg: dict, vs, text_len: int):
    """Run ``body`` (a sparse backend's implementation) under the measured error check
    (:mod:`ditattn.attention.sparse.check`): at the first sparse step of a layer in a request, the planner's own
    selection (``error_budget`` 0) is run and checked (from 8 heads on, first on a sixth of them: :func:`_pilot`;
    1.5x over ``max_rel_err`` there, the full run is skipped); over ``max_rel_err``, the budgeted selection (which may
    run dense by itself) is run and checked; over again, the dense kernel.  Later steps reuse the mode reached
    and check again every ``CHECK_EVERY`` steps; a failed check runs the layer dense from that step on.
    Dense phases and shapes the backend does not sparsify pass through unchecked."""
    from ditattn.attention.sparse import check as ck
    from ditattn.attention.sparse.fallback import drop_last_call, note_check

    key, skey = _check_key(name, call, q, cfg), layer_stats_key(name, call)
    plain = dict(cfg, error_budget=0.0)
    state = ck.mode_of(key, call.step)
    if state is not None:
        if state.mode == ck.DENSE:
            ck.set_mode(key, call.step, ck.DENSE)
            why = f"{state.reason or 'error check'}; dense from an earlier step of the request"
            return run_dense(name, q, k, v, call, why, announce=True, note=_CHECK_NOTE)
        res = body(name, q, k, v, call, plain if state.mode == ck.PLAIN else cfg, vs, text_len)
        if _ran_dense(skey) or not ck.due(state, call.step):
            ck.set_mode(key, call.step, state.mode)
            return res
        return _keep_or_dense(name, q, k, v, call, cfg, key, res, state.mode)
    seed = ck.seed_for(key)
    if seed is not None and seed.mode == ck.DENSE:  # dense at the end of an earlier request: no ladder
        ck.set_mode(key, call.step, ck.DENSE, checked=call.step, rel_err=seed.rel_err, reason=seed.reason)
        why = f"{seed.reason}; dense since an earlier request (the whole check again every {ck.RETRY_EVERY} requests)"
        return run_dense(name, q, k, v, call, why, announce=True, note=_CHECK_NOTE)
    rel = seed.rel_err if seed is not None else _pilot(name, body, q, k, v, call, plain, vs, text_len)
    ran_plain = seed is None and (rel is None or rel <= ck.PILOT_MARGIN * cfg["max_rel_err"])
    if ran_plain:
        res = body(name, q, k, v, call, plain, vs, text_len)
        if _ran_dense(skey):  # a dense phase or a shape the backend does not sparsify: nothing to decide
            return res
        ok, rel = _measure(name, q, k, v, call, cfg, res, ck.PLAIN)
        kept = _kept(skey)
    else:  # far off on the pilot's heads, or in an earlier request: straight to the budget's rung
        ok, kept = False, 0.0
        if seed is None:
            note_check(skey, rel)
    if ok and kept > cfg["dense_above"]:  # accurate, but past the break-even: the dense kernel from now on
        why = (
            f"error check: the backend's own selection keeps {kept:.2f} of the blocks > dense_above "
            f"{cfg['dense_above']} (dense kernel)"
        )
        ck.set_mode(key, call.step, ck.DENSE, checked=call.step, rel_err=rel, reason=why)
        drop_last_call(skey)
        return run_dense(name, q, k, v, call, why, announce=True, note=_CHECK_NOTE)
    if ok:
        ck.set_mode(key, call.step, ck.PLAIN, checked=call.step, rel_err=rel)
        return res
    if ran_plain:
        drop_last_call(skey)  # the budgeted run replaces the plain one
    res = body(name, q, k, v, call, cfg, vs, text_len)
    if _ran_dense(skey):  # the budget itself ran the call dense (its own reason, said once)
        why = f"error budget after a {rel:.1%} error check (dense kernel)"
        ck.set_mode(key, call.step, ck.DENSE, checked=call.step, rel_err=rel, reason=why)
        _annotate(skey, checked_rel_err=rel, max_rel_err=cfg["max_rel_err"], check=ck.PLAIN)
        return res
    return _keep_or_dense(name, q, k, v, call, cfg, key, res, ck.BUDGET)


def block_kernel_label(platform, block_size: int, impl: str = "auto") -> str:
    """The block-sparse kernel a CUDA call at ``block_size``-token blocks runs under ``block_sparse_impl``
    ``impl`` on ``platform`` (the plan's words; :func:`ditattn.attention.sparse.block_sparse.block_sparse_attention`
    decides the same per call from the same constants, and takes FlexAttention where the Triton kernel cannot serve
    a call)."""
    from ditattn.attention.kernels import FA4_AUTO_BLOCK_SIZES, SM90_AUTO_MIN_TOKENS

    if impl in ("flex", "reference"):
        return "FlexAttention block-sparse path" if impl == "flex" else "PyTorch reference block-sparse path"
    sm = platform.sm or 0
    if impl == "auto" and block_size in FA4_AUTO_BLOCK_SIZES and 90 <= sm < 110:
        if platform.has_package("flash_attn.cute"):
            return f"FlashAttention-4 block-sparse kernel ({block_size}-token blocks)"
    if impl == "auto" and block_size == 64 and sm == 90:
        return f"Triton block-sparse kernel (the SM90 kernel from {SM90_AUTO_MIN_TOKENS:,} query tokens)"
    return "Triton block-sparse kernel"


def block_size_runtime_label(spec: BackendSpec, platform, req, config) -> str:
    """The plan's runtime label (:func:`sparse_runtime_label`) of a backend with a ``block_size`` key (default 64)
    plus, on CUDA, the block-sparse kernel that the configured ``block_size`` and ``block_sparse_impl`` run
    (128-token blocks: FlashAttention-4's where installed, :func:`block_kernel_label`)."""
    cfg = config or {}
    kernel = None
    if platform.name == "cuda":
        impl = str(cfg.get("block_sparse_impl", "auto"))
        kernel = block_kernel_label(platform, int(cfg.get("block_size", 64)), impl)
    return sparse_runtime_label(spec, platform, req, config, kernel=kernel)


def sparse_runtime_label(spec: BackendSpec, platform, req, config, kernel: Optional[str] = None) -> str:
    """The plan's runtime label of a training-free sparse backend: its runtime on ``platform`` (or, given
    ``kernel``, "in-tree engine, <kernel>") plus, where its ``min_seq_len``
    (:func:`ditattn.attention.sparse.fallback.min_seq_len`, the platform's figure when unset) is positive, the
    lengths that run the dense kernel instead."""
    rt = spec.runtime_on(platform)
    label = "" if rt is None else f"in-tree engine, {kernel}" if kernel else rt.label
    limit = min_seq_len(config or {}, platform.name)
    return f"{label}; dense kernel below {limit} tokens" if label and limit > 0 else label
