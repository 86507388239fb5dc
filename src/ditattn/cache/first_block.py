"""First-block cache (the DBCache generalisation of cache-dit's first-block cache): always compute
the first ``fn_blocks`` blocks; when their residual changed little since the last computed forward,
reuse the middle blocks' cached residual and compute only the last ``bn_blocks``.

The signal is the relative L1 change ``sum|f_t - f_ref| / sum|f_ref|`` of the front blocks' residual
``f_t`` (their output minus the stack's input) against ``f_ref``, the one of the last fully computed
forward (so drift over several reused forwards counts); the sums are all-reduced under sequence
parallelism.  Below ``threshold`` (and under ``max_consecutive_skips`` reuses in a row) the middle
blocks ``[fn_blocks, num_blocks - bn_blocks)`` are replaced by their cached residual — the last one,
or with ``taylorseer=true`` its Taylor extrapolation from the last computed ones — and the back
blocks run on the result, correcting part of the error.
"""

from __future__ import annotations

from ditattn.attention.schemas import Param
from ditattn.cache.base import BranchState, CacheFacts, CacheMethod, Outcome, StepView, _nonneg, _positive
from ditattn.errors import AttentionConfigError


class FirstBlockCache(CacheMethod):
    name = "first_block_cache"
    summary = "compute the first N blocks; while their residual barely changed, reuse the middle blocks' residual"
    params = (
        Param(
            "fn_blocks",
            "int",
            1,
            "Front blocks always computed; their residual is the signal",
            check=_positive,
            accepted="an integer > 0",
        ),
        Param(
            "bn_blocks",
            "int",
            0,
            "Back blocks always computed (on the reused middle's result)",
            check=_nonneg,
            accepted="an integer >= 0",
        ),
    )
    defaults = {"threshold": 0.08, "end_step": -1, "max_consecutive_skips": 3}
    facts = CacheFacts(
        reuses="middle blocks",
        signal="relative L1 change of the front blocks' residual",
        calibration=None,
        sequence_parallel="the L1 sums are all-reduced over the ranks",
    )

    def check_model(self, config: dict, num_blocks: int) -> None:
        fn, bn = config["fn_blocks"], config["bn_blocks"]
        if fn + bn >= num_blocks:
            raise AttentionConfigError(
                f"cache backend first_block_cache: fn_blocks={fn} + bn_blocks={bn} leave no middle block to reuse in "
                f"this model's {num_blocks} blocks; accepted: fn_blocks + bn_blocks < {num_blocks}"
            )

    def forward(self, view: StepView, state: BranchState, config: dict) -> Outcome:
        L, fn, bn = view.num_blocks, config["fn_blocks"], config["bn_blocks"]
        front = view.run(0, fn, view.x)
        f = front - view.x
        if not view.forced and state.prev is not None and state.store:
            d = view.rel_l1(f, state.prev)
            if d < config["threshold"] and state.skips < config["max_consecutive_skips"]:
                state.skips += 1
                mid = front + state.store.predict(view.step).to(front.dtype)
                return Outcome(view.run(L - bn, L, mid), True, fn + bn)
        mid = view.run(fn, L - bn, front)
        state.store.update(view.step, mid - front)
        state.prev, state.skips = f, 0
        return Outcome(view.run(L - bn, L, mid), False, L)


METHOD = FirstBlockCache()
