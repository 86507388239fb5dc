"""TeaCache: skip the whole block stack while the timestep-modulated input has barely changed.

Each forward computes the first block's modulated input ``m_t = norm1(x) * (1 + scale1) + shift1``
and its relative L1 change against the previous forward's, ``d_t = sum|m_t - m_{t-1}| / sum|m_{t-1}|``
(over every token of every rank: the sums are all-reduced under sequence parallelism, so every rank
decides the same).  A polynomial from the model's calibration rescales ``d_t`` into an estimate of the
relative change of the stack's output; the estimates accumulate over reused forwards.  While the
accumulated estimate stays below ``threshold`` (and ``max_consecutive_skips`` is not reached) the
forward is reused: the input plus the cached residual (blocks' output minus input) of the last
computed forward.  A computed forward resets the accumulator.
"""

from __future__ import annotations

import numpy as np

from ditattn.attention.schemas import Param
from ditattn.cache.base import BranchState, CacheFacts, CacheMethod, Outcome, StepView


class TeaCache(CacheMethod):
    name = "teacache"
    summary = (
        "reuse the whole block stack while the rescaled change of the modulated input accumulates below a threshold"
    )
    params = (
        Param(
            "calibration",
            "str",
            None,
            "Calibration JSON (ditattn calibrate-cache) whose polynomial rescales the "
            "input change; unset: the file shipped for the model, else no rescaling",
            accepted="a path to a JSON file",
        ),
    )
    defaults = {"threshold": 0.1, "end_step": -1, "max_consecutive_skips": 3}
    facts = CacheFacts(
        reuses="blocks",
        signal="rescaled relative L1 change of the first block's modulated input",
        calibration="optional",
        sequence_parallel="the L1 sums are all-reduced over the ranks",
    )

    def forward(self, view: StepView, state: BranchState, config: dict) -> Outcome:
        m = view.modulated()
        prev, state.prev = state.prev, m
        if view.forced or prev is None or not state.store:
            state.acc = 0.0
            return self.compute_all(view, state)
        d = view.rel_l1(m, prev)
        state.acc += rescale(config.get("_coefficients"), d, config.get("_input_range"))
        if state.acc < config["threshold"] and state.skips < config["max_consecutive_skips"]:
            return self.reuse_all(view, state)
        state.acc = 0.0
        return self.compute_all(view, state)


def rescale(coefficients, d: float, span=None) -> float:
    """``d`` through the calibration polynomial (highest power first, as :func:`numpy.polyval`;
    None: ``d`` itself).  Outside the ``span`` ``[lo, hi]`` of input changes it was fitted on, the
    polynomial's value at the nearer end scaled by ``d / end`` (a fitted polynomial is not to be trusted
    beyond its data); negative estimates count as 0."""
    if coefficients is None:
        return d
    if span is not None:
        lo, hi = span
        end = hi if d > hi else lo if d < lo else None
        if end is not None and end > 0:
            return max(float(np.polyval(coefficients, end)), 0.0) * d / end
    return max(float(np.polyval(coefficients, d)), 0.0)


METHOD = TeaCache()
