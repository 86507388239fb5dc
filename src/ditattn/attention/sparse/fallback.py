"""Dense fallbacks of the sparse backends: said once per process and reason, and counted per layer.

A sparse backend runs dense attention for a whole call when the call's shape is outside its rule
(too short, another head dim, cross-attention) or when its error budget needs most blocks in every
head (:mod:`.budget`).  :func:`note_dense_once` logs the first such call of each (backend, reason)
at INFO (``-v`` shows it) and keeps it in :data:`dense_notes` for the plan and the run summary;
:func:`budget_stats` turns a plan's budget statistics into ``last_stats`` fields.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("ditattn.attention.sparse")

#: shortest query length a training-free sparse backend (and skip softmax) sparsifies when its ``min_seq_len``
#: config key is unset, per device type (absent: 0, every length).  H200, bf16, head dim 128, one process with
#: FlashAttention-4: at 2,304 tokens (the captured ``ditattn:shapes`` activations, 2 heads) dense takes
#: 0.12-0.25 ms and the Sparge / Sol / V-MoBA paths 2.9-6.4 ms (0.02-0.06x: a fixed per-call cost of
#: launches, probes and a device sync), skip softmax 0.66-0.97x; at 32,760 tokens the same paths without the
#: budget run at 1.24-2.2x.  16384 is also ``sage_attn``'s measured Hopper crossover.
MIN_SEQ_LEN = {"cuda": 16384}

#: ``{backend: [reason, ...]}``: the distinct reasons for which a sparse backend ran a call dense
dense_notes: dict[str, list[str]] = {}
_lock = threading.Lock()


def note_dense_once(backend: str, call: Any, reason: str) -> bool:
    """Record that ``backend`` ran a call dense for ``reason``; the first call per (backend, reason)
    logs one INFO line naming the layer.  Returns whether this was the first."""
    with _lock:
        seen = dense_notes.setdefault(backend, [])
        if reason in seen:
            return False
        seen.append(reason)
    layer = getattr(call, "layer_key", None) or f"layer {getattr(call, 'layer_idx', None)}"
    log.info("%s runs dense attention (%s), first at %s; said once per reason", backend, reason, layer)
    return True


def min_seq_len(cfg: dict, device: Any) -> int:
    """The shortest query length a sparse backend sparsifies: its config's ``min_seq_len``, or when unset
    (None) :data:`MIN_SEQ_LEN` of ``device``'s type (0 elsewhere)."""
    value = cfg.get("min_seq_len")
    return int(MIN_SEQ_LEN.get(getattr(device, "type", str(device)), 0) if value is None else value)


def short_call(seq_len: int, cfg: dict, device: Any) -> str:
    """Why a call of ``seq_len`` query tokens runs dense at once under :func:`min_seq_len` ("" when it does
    not): host integers only, no device work."""
    limit = min_seq_len(cfg, device)
    return f"{seq_len} tokens < min_seq_len {limit}" if seq_len < limit else ""


def clear_dense_notes() -> None:
    with _lock:
        dense_notes.clear()


BUDGET_FIELDS = (
    "error_budget",
    "dense_heads",
    "heads",
    "dropped_mass_max",
    "dropped_mass_mean",
    "est_rel_err",
    "est_rel_err_unbudgeted",
)


def budget_stats(plan) -> dict:
    """The budget statistics of a plan (``plan.extra["budget"]``, :func:`.budget.budgeted_lists`) as
    ``last_stats`` fields (device scalars stay tensors until read); ``{}`` without a budget."""
    stats = plan.extra.get("budget") if plan is not None else None
    if not stats:
        return {}
    return {k: stats[k] for k in BUDGET_FIELDS if k in stats}


#: per layer key, this run's sparse-backend calls: ``{"calls", "dense_fallbacks", "dense_phases",
#: "dense_heads", "heads", "kept"}`` (``kept``/``dense_heads``: lists of floats or device scalars)
_run_layers: dict[str, dict] = {}


def begin_run() -> None:
    """Start counting a run's sparse-backend calls per layer (:func:`run_summary` reads them)."""
    with _lock:
        _run_layers.clear()


def count_call(key: str, *, kept, fallback: bool, dense: bool, dense_heads=None, heads: int = 0) -> None:
    """Count one call of layer ``key``: its kept fraction (float or device scalar), whether it ran
    dense as a fallback (size rule or error budget) or as a dense phase (steps / layers the backend
    keeps dense), and how many of its ``heads`` the error budget ran dense."""
    with _lock:
        e = _run_layers.setdefault(
            key, {"calls": 0, "dense_fallbacks": 0, "dense_phases": 0, "dense_heads": [], "heads": 0, "kept": []}
        )
        e["calls"] += 1
        e["dense_fallbacks"] += int(fallback)
        e["dense_phases"] += int(dense and not fallback)
        e["kept"].append(kept)
        e["last_fallback"], e["last_phase"] = bool(fallback), bool(dense and not fallback)
        e["last_heads"] = dense_heads is not None
        if dense_heads is not None:
            e["dense_heads"].append(dense_heads)
            e["heads"] = max(e["heads"], int(heads))


def drop_last_call(key: str) -> None:
    """Forget layer ``key``'s latest counted call (a run the error check replaced by another)."""
    with _lock:
        e = _run_layers.get(key)
        if not e or not e["calls"]:
            return
        e["calls"] -= 1
        e["kept"].pop()
        if e.pop("last_fallback", False):
            e["dense_fallbacks"] -= 1
        if e.pop("last_phase", False):
            e["dense_phases"] -= 1
        if e.pop("last_heads", False) and e["dense_heads"]:
            e["dense_heads"].pop()


def note_check(key: str, rel_err: float) -> None:
    """Record a measured error check of layer ``key`` (:mod:`.check`): the run summary gives the largest."""
    with _lock:
        e = _run_layers.get(key)
        if e is not None:
            e["checked_rel_err"] = max(float(rel_err), e.get("checked_rel_err", 0.0))


def run_summary() -> dict:
    """This run's per-layer summary since :func:`begin_run`: ``{layer_key: {"calls", "kept_fraction"
    (mean), "dense_fallbacks" (calls run dense by the size rule or the error budget), "dense_phases",
    "dense_heads" (heads the budget ran dense, summed over the calls), "heads"}}``, layers in call order;
    reads device scalars (one sync)."""
    with _lock:
        items = list(_run_layers.items())
    out = {}
    for key, e in items:
        kept = [float(x) for x in e["kept"]]
        out[key] = {
            "calls": e["calls"],
            "kept_fraction": sum(kept) / len(kept) if kept else None,
            "dense_fallbacks": e["dense_fallbacks"],
            "dense_phases": e["dense_phases"],
            "dense_heads": int(sum(float(x) for x in e["dense_heads"])),
            "heads": e["heads"],
        }
        if "checked_rel_err" in e:
            out[key]["checked_rel_err"] = e["checked_rel_err"]
    return out


def finish_run(stats: dict) -> dict:
    """End a run's count: its :func:`run_summary`, also stored in ``stats`` (a run's statistics) as
    ``"sparse_layers"`` with the :func:`totals` as ``"sparse"`` when a sparse backend ran."""
    summary = run_summary()
    if summary:
        stats["sparse"] = totals(summary)
        stats["sparse_layers"] = summary
    return summary


def totals(summary: dict) -> dict:
    """``{"sparse_layers", "calls", "dense_fallbacks", "dense_heads", "kept_fraction"}`` over a
    :func:`run_summary` (kept fraction: mean over the calls)."""
    calls = sum(e["calls"] for e in summary.values())
    kept = sum((e["kept_fraction"] or 0.0) * e["calls"] for e in summary.values())
    return {
        "sparse_layers": len(summary),
        "calls": calls,
        "dense_fallbacks": sum(e["dense_fallbacks"] for e in summary.values()),
        "dense_heads": sum(e["dense_heads"] for e in summary.values()),
        "kept_fraction": kept / calls if calls else None,
    }


def annotate_plan(plan: dict, summary: dict) -> dict:
    """Add each layer's run statistics (``summary[prefix]``, :func:`run_summary`) to the plan's
    layers as ``"sparse_run"``, the dense-fallback reasons said this process as ``"dense_notes"``,
    and the totals as ``"sparse_run"`` at the top; returns ``plan``."""
    if summary:
        for comp in plan.get("components", []):
            for layer in comp.get("layers", []):
                for key in (layer.get("prefix"), f"{comp.get('name')}.{layer.get('prefix')}"):
                    if key in summary:  # a layer key is the component name and the layer's prefix
                        layer["sparse_run"] = summary[key]
        plan["sparse_run"] = totals(summary)
    with _lock:
        notes = {k: list(v) for k, v in dense_notes.items() if v}
    if notes:
        plan["dense_notes"] = notes
    return plan
