"""The request's step cache at run time: the resolved setting (:class:`CacheSetting`), the run that
owns the per-branch states and the counts (:class:`CacheRun`), the context variable that carries it
to the DiT (:func:`cache_scope`, :func:`current_cache`) and the hook the DiT's forward calls
(:meth:`CacheRun.forward_blocks`).

State is request-scoped: each generate call makes its own :class:`CacheRun` and sets it in a context
variable for its denoise loop, so concurrent requests (threads, asyncio tasks) with different settings
cannot see each other's cache.  Inside a run, states are kept per classifier-free-guidance branch
(``ForwardContext.branch``: one state when both halves run as one batch, one per half when they run
as separate forwards) and are dropped when the denoise loop switches experts (two-expert Wan 2.2):
nothing cached by one expert is reused by the other.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from typing import Callable, Iterator, Optional, Sequence

import torch

from ditattn.attention.context import current_forward
from ditattn.cache.base import CacheMethod, StepView, new_state, start_step
from ditattn.errors import AttentionConfigError

log = logging.getLogger(__name__)
#: (calibration, what, recorded, run) differences already logged: a server logs each once, not per request
_WARNED: set = set()


@dataclasses.dataclass(frozen=True)
class CacheSetting:
    """A validated cache choice: ``method`` and its full ``config`` (schema keys with defaults);
    ``calibration``: the loaded calibration (:func:`~ditattn.cache.calibration.load_calibration`) or None."""

    method: CacheMethod
    config: dict
    calibration: Optional[dict] = None

    @property
    def name(self) -> str:
        return self.method.name

    def runtime_config(self) -> dict:
        cfg = dict(self.config)
        cal = self.calibration or {}
        cfg["_coefficients"] = cal.get("coefficients")
        cfg["_mag_ratios"] = cal.get("mag_ratios")
        cfg["_input_range"] = cal.get("input_range")
        return cfg

    def check_steps(
        self, num_steps: int, *, guidance_scale: Optional[float] = None, scheduler: Optional[str] = None
    ) -> None:
        """Refuse (:class:`AttentionConfigError`, ``field`` cache_backend_config) an ``end_step`` past the
        ``num_steps`` of the run, and a ``start_step`` / ``end_step`` the user set that leaves no step of the
        run that may be reused (step 0 never is: nothing is cached yet): the cache would silently do nothing.
        (With the defaults a run of very few steps may have no such step either; the run summary then shows
        no reuse.)  Logs a warning, once per difference, when the calibration was recorded with another step
        count, or another ``guidance_scale`` / ``scheduler`` than those given (None: not checked)."""
        self._check_reuse(num_steps)
        self._check_calibration(num_steps, guidance_scale, scheduler)

    def _check_reuse(self, num_steps: int) -> None:
        cfg = self.config
        if num_steps <= 0 or self.method.facts.reuses == "nothing":
            return

        def refuse(msg: str) -> None:
            err = AttentionConfigError(f"cache backend {self.name}: {msg}")
            err.field = "cache_backend_config"
            raise err

        if cfg["end_step"] > num_steps:
            refuse(
                f"end_step {cfg['end_step']} is past this run's {num_steps} steps; accepted: an index up to "
                f"{num_steps} ({num_steps}: no step computed for being at the end), or negative from the end "
                "(-1: the last step is computed)"
            )
        explicit = cfg.get("start_step") is not None or cfg.get("end_step") != self.method.defaults.get("end_step", -1)
        if not explicit:
            return
        first = start_step(cfg, num_steps)
        reusable = max(first, 1)  # step 0 has nothing cached to reuse
        end = cfg["end_step"] if cfg["end_step"] >= 0 else num_steps + cfg["end_step"]
        if reusable >= min(end, num_steps):
            shown = cfg["start_step"] if cfg.get("start_step") is not None else f"{first} (unset: the first 20 %)"
            zero = "" if first else ", step 0 never is: nothing is cached before it"
            refuse(
                f"start_step {shown} and end_step {cfg['end_step']} leave no step of this run's {num_steps} that "
                f"may be reused (reuse may start at step {reusable}{zero}; steps from {max(end, 0)} on are "
                "computed); accepted: start_step and end_step with a step from step 1 on between them (start_step <= "
                "step < end_step), end_step an index or negative from the end (-1: every step but the last may be "
                "reused)"
            )

    def _check_calibration(self, num_steps: int, guidance_scale, scheduler) -> None:
        cal = self.calibration
        if not cal:
            return
        for key, made, run in (
            ("num_steps", cal.get("num_steps"), num_steps),
            ("guidance_scale", cal.get("guidance_scale"), guidance_scale),
            ("scheduler", cal.get("scheduler"), scheduler),
        ):
            if made is None or run is None or made == run:
                continue
            seen = (cal.get("path"), key, made, run)
            if seen not in _WARNED:
                if len(_WARNED) < 1024:  # bounded: a long-running server sees many guidance scales
                    _WARNED.add(seen)
                log.warning(
                    "cache backend %s: calibration %s was recorded with %s=%s, this run has %s=%s (it is used "
                    "as it is; ditattn calibrate-cache records one for these settings)",
                    self.name,
                    cal.get("path"),
                    key,
                    made,
                    key,
                    run,
                )

    def new_run(self) -> "CacheRun":
        """A fresh request-scoped run of this setting."""
        return CacheRun(self)

    def describe(self) -> str:
        """``teacache (threshold=0.1, start_step=1, ...; calibration ditattn_shapes.json)``."""
        keys = ", ".join(f"{k}={v}" for k, v in self.config.items() if k != "calibration" and v is not None)
        cal = self.calibration
        where = f"; calibration {cal['path'].rsplit('/', 1)[-1]}" if cal else ""
        return f"{self.name} ({keys}{where})"

    def to_dict(self) -> dict:
        """JSON form for ``plan --json`` and reports."""
        cal = self.calibration
        return {
            "backend": self.name,
            "config": {k: v for k, v in self.config.items()},
            "calibration": cal["path"] if cal else None,
            "facts": dataclasses.asdict(self.method.facts),
        }


class CacheRun:
    """One request's step cache: the states per (branch), the expert they belong to, and what each
    forward did.  :meth:`stats` is the report (``forwards``, ``computed``, ``reused``, ``blocks_computed``,
    ``blocks_total``, ``trace``: one letter per forward, ``C`` computed / ``R`` reused)."""

    def __init__(self, setting: CacheSetting):
        self.setting = setting
        self.method = setting.method
        self.config = setting.runtime_config()
        self.states: dict = {}
        self.model_key: Optional[int] = None
        self.expert_switches = 0
        self.trace: list[str] = []
        self.blocks_computed = 0
        self.blocks_total = 0
        self.forward_blocks_run: list[tuple[int, int]] = []  # (blocks computed, blocks) of each forward

    def _forced(self, step: int, num_steps: int) -> bool:
        end = self.config["end_step"]
        end = end if end >= 0 else num_steps + end
        return step < start_step(self.config, num_steps) or step >= end

    def forward_blocks(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        run: Callable,
        num_blocks: int,
        modulated: Callable[[], torch.Tensor],
        valid: int,
    ) -> torch.Tensor:
        """The block stack of ``model`` on ``x [B, s, D]`` (this rank's shard; its first ``valid`` rows are
        tokens, the rest padding) computed or partly reused; ``run(a, b, x)`` runs blocks ``[a, b)``,
        ``modulated()`` gives the first block's modulated input.  Outside a denoise loop (no step in the
        forward context) every block runs and nothing is cached."""
        fwd = current_forward()
        if fwd.step is None or fwd.num_steps is None:
            return run(0, num_blocks, x)
        if self.model_key != id(model):  # a new expert: nothing crosses the switch
            if self.model_key is not None:
                self.expert_switches += 1
            self.states.clear()
            self.model_key = id(model)
        key = fwd.branch
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = new_state(self.config)
        view = StepView(
            x=x,
            run=run,
            num_blocks=num_blocks,
            step=fwd.step,
            num_steps=fwd.num_steps,
            forced=self._forced(fwd.step, fwd.num_steps),
            modulated=modulated,
            rel_l1=lambda a, b: rel_l1(a, b, valid),
        )
        outcome = self.method.forward(view, state, self.config)
        self.trace.append("R" if outcome.reused else "C")
        self.blocks_computed += outcome.blocks
        self.blocks_total += num_blocks
        self.forward_blocks_run.append((outcome.blocks, num_blocks))
        return outcome.out

    def stats(self) -> dict:
        n, r = len(self.trace), self.trace.count("R")
        return {
            "backend": self.method.name,
            "forwards": n,
            "computed": n - r,
            "reused": r,
            "blocks_computed": self.blocks_computed,
            "blocks_total": self.blocks_total,
            "expert_switches": self.expert_switches,
            "trace": "".join(self.trace),
        }


def merge_cfg_halves(halves: Sequence[tuple[dict, list]], guided: Sequence[bool]) -> dict:
    """The report of a run whose guidance halves ran on their own ranks (CFG parallelism) from each half's
    ``(stats, forward_blocks_run)``, conditional half first.  Each half ran one forward per step: its own half
    of the batch on a guided step (both count), the whole unguided batch on the others (the same forward on
    every half: counted once).  The trace then reads as a sequential run's (cond, uncond on a guided step).
    A half with another forward count than ``guided`` has steps: the first half's report as it is."""
    first = halves[0][0]
    if any(len(st["trace"]) != len(guided) or len(blocks) != len(guided) for st, blocks in halves):
        return first
    trace, computed, total = [], 0, 0
    for i, g in enumerate(guided):
        for st, blocks in halves if g else halves[:1]:
            trace.append(st["trace"][i])
            computed += blocks[i][0]
            total += blocks[i][1]
    reused = trace.count("R")
    return {
        **first,
        "forwards": len(trace),
        "computed": len(trace) - reused,
        "reused": reused,
        "blocks_computed": computed,
        "blocks_total": total,
        "trace": "".join(trace),
    }


def rel_l1(a: torch.Tensor, b: torch.Tensor, valid: Optional[int] = None) -> float:
    """``sum|a - b| / sum|b|`` over the first ``valid`` rows (dim 1) of ``a`` and ``b`` ``[B, s, D]``, summed
    over every sequence-parallel rank (all-reduced in float64: the same number on every rank).  Each rank's
    sums accumulate in float32 (float64 for float64 inputs) without a widened copy of the tensors: one pass
    over them, a small share of a DiT forward."""
    from ditattn.distributed.groups import get_sequence_parallel

    if valid is not None and valid < a.shape[1]:
        a, b = a[:, :valid], b[:, :valid]
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    sums = torch.stack(
        [torch.linalg.vector_norm(a - b, ord=1, dtype=acc), torch.linalg.vector_norm(b, ord=1, dtype=acc)]
    ).double()
    groups = get_sequence_parallel()
    if groups is not None and groups.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(sums, group=groups.group)  # the ranks sharing this sequence (one CFG half)
    num, den = sums.tolist()
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


_current: contextvars.ContextVar[Optional[CacheRun]] = contextvars.ContextVar("ditattn_cache", default=None)


def current_cache() -> Optional[CacheRun]:
    """The step cache of the request running in this context, or None."""
    return _current.get()


@contextlib.contextmanager
def cache_scope(run: Optional[CacheRun]) -> Iterator[Optional[CacheRun]]:
    """Make ``run`` the step cache of the DiT forwards inside the block (None: no caching)."""
    token = _current.set(run)
    try:
        yield run
    finally:
        _current.reset(token)
