"""MagCache: skip the whole block stack while the calibrated residual-magnitude curve says the
skipped steps' error stays small.

The calibration records, per step ``t``, the mean over tokens of ``||r_t|| / ||r_{t-1}||`` where
``r_t`` is the block stack's residual (output minus input): the magnitude ratio, close to 1 through
most of the schedule and falling at the end.  At a step that may be skipped, the method multiplies
the ratios since the last computed forward (``gamma``), adds ``|1 - gamma|`` to the accumulated error
and counts the step; while the error stays below ``threshold`` and the count at most
``max_consecutive_skips``, the forward is reused (input + cached residual), else it is computed and
the accumulators reset.  The decision reads only the calibration curve and the step index: every
sequence-parallel rank and every request decides the same, and it costs no reduction.
"""

from __future__ import annotations

import numpy as np

from ditattn.attention.schemas import Param
from ditattn.cache.base import BranchState, CacheFacts, CacheMethod, Outcome, StepView


class MagCache(CacheMethod):
    name = "magcache"
    summary = "reuse the whole block stack while the calibrated residual-magnitude ratios accumulate little error"
    params = (
        Param(
            "calibration",
            "str",
            None,
            "Calibration JSON (ditattn calibrate-cache) with the magnitude-ratio curve; "
            "unset: the file shipped for the model (required otherwise)",
            accepted="a path to a JSON file",
        ),
    )
    defaults = {"threshold": 0.06, "end_step": -1, "max_consecutive_skips": 2}
    facts = CacheFacts(
        reuses="blocks",
        signal="accumulated error of the calibrated residual-magnitude ratios",
        calibration="required",
        sequence_parallel="decided from replicated values (curve and step)",
    )

    def forward(self, view: StepView, state: BranchState, config: dict) -> Outcome:
        if view.forced or not state.store:
            return self._compute(view, state)
        ratio = ratio_at(config["_mag_ratios"], view.step, view.num_steps)
        gamma = state.extra.get("gamma", 1.0) * ratio
        err = state.acc + abs(1.0 - gamma)
        if err < config["threshold"] and state.skips < config["max_consecutive_skips"]:
            state.extra["gamma"], state.acc = gamma, err
            return self.reuse_all(view, state)
        return self._compute(view, state)

    def _compute(self, view: StepView, state: BranchState) -> Outcome:
        state.extra["gamma"], state.acc = 1.0, 0.0
        return self.compute_all(view, state)


def ratio_at(curve, step: int, num_steps: int) -> float:
    """The magnitude ratio of ``step`` of ``num_steps``: the calibration ``curve`` (one value per
    calibrated step) read at the same position of the schedule, linearly interpolated when the step
    counts differ."""
    n = len(curve)
    if n == num_steps:
        return float(curve[step])
    pos = step * (n - 1) / max(num_steps - 1, 1)
    return float(np.interp(pos, np.arange(n), curve))


METHOD = MagCache()
