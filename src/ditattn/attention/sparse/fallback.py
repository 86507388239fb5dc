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


def clear_dense_notes() -> None:
    with _lock:
        dense_notes.clear()


BUDGET_FIELDS = ("error_budget", "dense_heads", "heads", "dropped_mass_max", "dropped_mass_mean", "est_rel_err",
                 "est_rel_err_unbudgeted")


def budget_stats(plan) -> dict:
    """The budget statistics of a plan (``plan.extra["budget"]``, :func:`.budget.budgeted_lists`) as
    ``last_stats`` fields (device scalars stay tensors until read); ``{}`` without a budget."""
    stats = plan.extra.get("budget") if plan is not None else None
    if not stats:
        return {}
    return {k: stats[k] for k in BUDGET_FIELDS if k in stats}
