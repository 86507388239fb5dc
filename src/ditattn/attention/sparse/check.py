"""The measured error check of the training-free sparse backends: compare a sparse call's output with exact
attention on a sample of its query rows, and run the layer dense when the error is too large.

The error budget (:mod:`.budget`) predicts the error of a selection from the attention mass it drops; that
prediction has to be conservative (it bounds the worst row), so on its own it sends most calls dense.  This
check measures instead: for :data:`CHECK_ROWS` query rows spread evenly over the sequence (every row when the
sequence is shorter), exact attention over every key gives the reference, and the call's relative error is
``|O_sparse - O_exact| / |O_exact|`` (Frobenius norms over the sampled rows, every batch entry and head),
the figure the backends' ``max_rel_err`` config key bounds.  Cost: ``CHECK_ROWS / S`` of one dense call
(1.6 % at the Wan 480p grid's 32,760 tokens) and one device sync, at the first sparse step of a layer in a
request and every :data:`CHECK_EVERY` steps after it.

The decision ladder of a layer (:func:`ditattn.attention.backends.sparse_common.checked_call`): the backend's
own selection first (its planner alone, no budget widening; with 8 heads or more it is first tried on a sixth of
the heads, and a selection off by more than 1.5x ``max_rel_err`` there is not run in full); if its measured
error exceeds ``max_rel_err``,
the selection widened by the error budget (which may itself decide to run dense); if that is measured over
``max_rel_err`` too, the dense kernel.  The layer keeps the mode it reached for the rest of the request
(:func:`mode_of`); a later check that fails sends it dense from that step on.  Where its own selection failed,
the layer's next requests start past it (:func:`seed_for`: at the budget's rung, still checked, or dense), and
every :data:`RETRY_EVERY` requests it runs the whole ladder again.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor

#: query rows the check compares (evenly spaced over the sequence)
CHECK_ROWS = 512
#: a layer that runs sparse is checked again every this many steps of the request
CHECK_EVERY = 10
#: the ``max_rel_err`` default: the largest measured relative error a sparse call may keep (below 5 %, the
#: figure the defaults promise, by the sampling error of :data:`CHECK_ROWS` rows)
MAX_REL_ERR = 0.045

#: a call with at least this many heads first tries the backend's own selection on a share of them (the pilot,
#: :func:`pilot_heads`): a selection that is far off costs that share of a call instead of a whole one
PILOT_MIN_HEADS = 8
#: the pilot's share of the heads (at least 2 heads)
PILOT_SHARE = 1 / 6
#: the pilot skips the full run of the backend's own selection when its error exceeds this many times
#: ``max_rel_err`` (a few heads are a noisy sample of the call; in between, the full call is run and checked)
PILOT_MARGIN = 1.5

PLAIN, BUDGET, DENSE = "plain", "budget", "dense"


@functools.lru_cache(maxsize=128)
def _spread(count: int, total: int, device: torch.device) -> Tensor:
    """``count`` int64 indices spread evenly over ``range(total)``, on ``device`` (cached: no upload per call)."""
    idx = torch.linspace(0, total - 1, count).round().long().unique()
    with torch.inference_mode(False):
        return idx.to(device)


def pilot_heads(heads: int, device) -> Optional[Tensor]:
    """The heads of the pilot run for a call of ``heads`` heads (evenly spread, :data:`PILOT_SHARE` of them, at
    least 2), on ``device``; None below :data:`PILOT_MIN_HEADS` heads (no pilot)."""
    if heads < PILOT_MIN_HEADS:
        return None
    return _spread(max(2, -(-int(heads) // round(1 / PILOT_SHARE))), int(heads), torch.device(device))


def check_rows(seq_len: int, device) -> Tensor:
    """The int64 query rows the check samples for a sequence of ``seq_len`` tokens, on ``device`` (cached)."""
    return _spread(min(int(seq_len), CHECK_ROWS), int(seq_len), torch.device(device))


def sampled_error(q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: Optional[float]) -> tuple[float, float]:
    """``(relative error, worst head's relative error)`` of ``out`` against exact attention on the
    :func:`check_rows` rows.  q/k/v ``[B, S, H, D]`` (k/v with q's heads), ``out`` ``[B, S, H, D]``.  The
    reference runs the platform's dense kernel in the input dtype on CUDA (float32 accumulation) and
    :func:`ditattn.attention.reference.reference_attention` in float32 elsewhere.  One device sync."""
    from ditattn.attention.reference import reference_attention
    from ditattn.attention.sparse.block_sparse import dense_attention

    rows = check_rows(q.shape[1], q.device)
    qs = q.index_select(1, rows)
    if q.is_cuda:
        ref, _ = dense_attention(qs, k, v, scale=scale)
    else:
        ref, _ = reference_attention(qs, k, v, scale=scale)
    ref = ref.float()
    diff = out.index_select(1, rows).float() - ref
    num = diff.pow(2).sum((0, 1, 3))  # [H]
    den = ref.pow(2).sum((0, 1, 3))
    both = torch.stack([num.sum() / den.sum().clamp_min(1e-30), (num / den.clamp_min(1e-30)).amax()]).sqrt()
    rel, head = both.tolist()
    return float(rel), float(head)


@dataclass
class Mode:
    """A layer's mode in the current request: ``mode`` (:data:`PLAIN`, :data:`BUDGET` or :data:`DENSE`),
    ``step`` (the latest step seen), ``checked`` (the step of the latest check), its error ``rel_err`` and, for a
    dense layer, ``reason``."""

    mode: str
    step: int
    checked: int
    rel_err: float
    reason: str = ""


@dataclass
class Seed:
    """Where layer ``key`` ended its latest request (``mode``, ``reason``, ``rel_err``: the measured error of the
    rung that failed) and how many requests since then started from it (``skipped``)."""

    mode: str
    reason: str
    rel_err: float
    skipped: int = 0


#: a layer whose own selection failed the check in a request starts the next requests past it (at the budget's
#: rung, or dense where that failed too) and runs the whole ladder again every this many requests
RETRY_EVERY = 8

_modes: dict[str, Mode] = {}
_seeds: dict[str, Seed] = {}
_lock = threading.Lock()


def seed_for(key: str) -> Optional[Seed]:
    """At the first sparse step of a request: where layer ``key``'s previous request ended when that was past
    its own selection (:data:`BUDGET` or :data:`DENSE`) and fewer than :data:`RETRY_EVERY` - 1 requests have
    started from it since the whole ladder last ran (counted here); None: run the whole ladder (the count
    starts over)."""
    with _lock:
        seed = _seeds.get(key)
        if seed is None or seed.mode == PLAIN or seed.skipped >= RETRY_EVERY - 1:
            if seed is not None:
                seed.skipped = 0
            return None
        seed.skipped += 1
        return Seed(seed.mode, seed.reason, seed.rel_err, seed.skipped)


def mode_of(key: str, step: Optional[int]) -> Optional[Mode]:
    """Layer ``key``'s mode from an earlier step of the current request, or None (decide at this call): no
    step, a step that did not advance (a new request starts over) or no decision yet.  Host values only."""
    with _lock:
        prev = _modes.get(key)
    if prev is None or step is None or int(step) <= prev.step:
        return None
    return prev


def set_mode(
    key: str, step: Optional[int], mode: str, *, checked: Optional[int] = None, rel_err=None, reason: str = ""
) -> None:
    """Record layer ``key``'s mode at ``step`` (``checked``: the step of a check made now; None keeps the
    previous one, as does an empty ``reason``)."""
    if step is None:
        return
    with _lock:
        prev = _modes.get(key)
        last = int(step) if checked is not None else (prev.checked if prev else int(step))
        err = float(rel_err) if rel_err is not None else (prev.rel_err if prev else 0.0)
        why = reason or (prev.reason if prev else "")
        _modes[key] = Mode(mode, int(step), last, err, why)
        seed = _seeds.get(key)
        _seeds[key] = Seed(mode, why, err, seed.skipped if seed is not None else 0)


def due(mode: Mode, step: Optional[int]) -> bool:
    """Whether a sparse layer is checked again at ``step`` (:data:`CHECK_EVERY` steps after its last check)."""
    return step is None or int(step) - mode.checked >= CHECK_EVERY


def clear_memory() -> None:
    """Forget every layer's mode (tests; a new request starts over by itself when its steps do not advance)."""
    with _lock:
        _modes.clear()
        _seeds.clear()
