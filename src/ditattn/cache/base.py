"""What every step-cache method shares: its parameter schema, its capability facts, the view of one
DiT forward it decides on, and the residual store it reuses (with optional Taylor extrapolation).

A method (one module each: :mod:`~ditattn.cache.teacache`, :mod:`~ditattn.cache.magcache`,
:mod:`~ditattn.cache.first_block`) is a :class:`CacheMethod`: a name, a tuple of
:class:`~ditattn.attention.schemas.Param` (typed, range-checked keys; the attention backends' machinery,
so errors read the same), :class:`CacheFacts` and :meth:`CacheMethod.forward`, which runs one forward of
the DiT block stack through a :class:`StepView` and either computes it or reuses the cached work.
Per-request, per-branch state lives in a :class:`BranchState`; the request's run
(:class:`~ditattn.cache.runtime.CacheRun`) owns those states and the counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from ditattn.attention.schemas import Param
from ditattn.attention.schemas import in_range as _in
from ditattn.attention.schemas import non_negative as _nonneg
from ditattn.attention.schemas import positive as _positive
from ditattn.errors import AttentionConfigError

P = Param


#: share of the steps computed before any reuse when ``start_step`` is unset
START_FRACTION = 0.2


def start_step(config: dict, num_steps: int) -> int:
    """The first step that may be reused: ``start_step``, or the first :data:`START_FRACTION` of the
    ``num_steps`` steps (at least one) when it is unset."""
    s = config.get("start_step")
    return s if s is not None else max(1, round(START_FRACTION * num_steps))


def _end_step_check(v):
    return None if v is None or isinstance(v, int) else "must be an integer"


#: keys every method takes (their defaults are overridden per method through ``CacheMethod.defaults``)
COMMON_PARAMS: tuple[Param, ...] = (
    P(
        "threshold",
        "float",
        0.1,
        "Skip budget: a forward is reused while the method's accumulated change estimate "
        "stays below it; 0 never skips (the output is then the uncached one, bit for bit)",
        check=_nonneg,
        accepted="a number >= 0",
    ),
    P(
        "start_step",
        "int",
        None,
        "Steps before this index are always computed (unset: the first 20 % of the "
        "steps, at least one: the early steps lay out the picture)",
        check=_nonneg,
        accepted="an integer >= 0",
    ),
    P(
        "end_step",
        "int",
        -1,
        "Steps from this index on are always computed; negative counts from the end (-1: the last step is computed)",
        check=_end_step_check,
        accepted="an integer",
    ),
    P(
        "max_consecutive_skips",
        "int",
        3,
        "Most forwards reused in a row before one is computed",
        check=_positive,
        accepted="an integer > 0",
    ),
    P(
        "taylorseer",
        "bool",
        False,
        "Reused forwards extrapolate the cached residual from the last computed ones "
        "(Taylor expansion in the step index, TaylorSeer) instead of repeating the last one",
    ),
    P(
        "taylorseer_order",
        "int",
        1,
        "Order of the Taylor extrapolation (1: linear, 2: quadratic; needs that many "
        "computed steps, fewer use a lower order)",
        choices=(1, 2),
    ),
)


@dataclasses.dataclass(frozen=True)
class CacheFacts:
    """Capability facts of a method, as data (``ditattn plan`` and the docs show them).

    reuses: what a reused forward skips (``blocks`` = the whole block stack; ``middle blocks`` = all
    but the first ``fn_blocks`` and last ``bn_blocks``); signal: what decides; calibration: None, or
    ``optional`` / ``required`` (a per-model calibration file, ``calibration=PATH``; shipped for
    built-in models); sequence_parallel: how every rank reaches the same decision.
    """

    reuses: str
    signal: str
    calibration: Optional[str]
    sequence_parallel: str


@dataclasses.dataclass
class StepView:
    """One forward of the DiT block stack as a cache method sees it.

    x: the stack's input ``[B, s, D]`` (this rank's token shard under sequence parallelism; B covers
    both classifier-free-guidance halves when they run batched); run(a, b, x): blocks ``[a, b)`` on
    ``x`` -> ``[B, s, D]``; num_blocks; step / num_steps: the denoising step; forced: the step is
    outside ``[start_step, end_step)`` (must be computed); modulated(): the first block's
    timestep-modulated input ``[B, s, D]``; rel_l1(a, b): ``sum|a - b| / sum|b|`` over the valid
    tokens of every rank (identical on every rank).
    """

    x: torch.Tensor
    run: Callable[[int, int, torch.Tensor], torch.Tensor]
    num_blocks: int
    step: int
    num_steps: int
    forced: bool
    modulated: Callable[[], torch.Tensor]
    rel_l1: Callable[[torch.Tensor, torch.Tensor], float]


class ResidualStore:
    """The residual of the skipped blocks (their output minus their input, ``[B, s, D]``) at the last
    computed steps; :meth:`predict` returns it for a later step: the last one (order 0) or its Taylor
    extrapolation in the step index (Newton's divided differences over the last ``order + 1``)."""

    def __init__(self, order: int = 0):
        self.order = order
        self.steps: list[int] = []
        self.values: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self.values)

    def update(self, step: int, residual: torch.Tensor) -> None:
        if self.steps and self.steps[-1] == step:  # same step again (a recomputed forward): replace
            self.steps.pop(), self.values.pop()
        self.steps.append(step)
        self.values.append(residual)
        keep = self.order + 1
        self.steps, self.values = self.steps[-keep:], self.values[-keep:]

    def predict(self, step: int) -> torch.Tensor:
        n = len(self.values)
        if n == 1 or self.order == 0:
            return self.values[-1]
        # Newton form through the last n points, evaluated at `step`
        xs = [float(s) for s in self.steps]
        coef = [v.float() for v in self.values]
        for j in range(1, n):
            for i in range(n - 1, j - 1, -1):
                coef[i] = (coef[i] - coef[i - 1]) / (xs[i] - xs[i - j])
        out, basis = coef[0].clone(), 1.0
        for i in range(1, n):
            basis *= step - xs[i - 1]
            out += basis * coef[i]
        return out.to(self.values[-1].dtype)


@dataclasses.dataclass
class BranchState:
    """A method's state for one branch (both CFG halves batched, or one of them) of one expert:
    ``store`` (the cached residual), ``skips`` (forwards reused in a row), ``prev`` (the previous
    signal tensor), ``acc`` (accumulated estimate) and ``extra`` (method-specific)."""

    store: ResidualStore
    skips: int = 0
    prev: Optional[torch.Tensor] = None
    acc: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outcome:
    """What one forward did: ``out`` the stack's output, ``reused`` whether cached work replaced
    computation, ``blocks`` how many blocks ran."""

    out: torch.Tensor
    reused: bool
    blocks: int


class CacheMethod:
    """A step-cache method.  Subclasses set ``name``, ``summary``, ``params`` (method keys, on top of
    :data:`COMMON_PARAMS`), ``defaults`` (common keys' defaults for this method) and ``facts``, and
    implement :meth:`forward`."""

    name: str = ""
    summary: str = ""
    params: tuple[Param, ...] = ()
    defaults: dict = {}
    facts: CacheFacts

    def schema(self) -> tuple[Param, ...]:
        """Every key this method takes, with this method's defaults."""
        common = tuple(
            dataclasses.replace(p, default=self.defaults[p.name]) if p.name in self.defaults else p
            for p in COMMON_PARAMS
        )
        return common + self.params

    def validate(self, raw: dict, base: Optional[dict] = None) -> dict:
        """``raw`` checked against :meth:`schema` (unknown keys, wrong types, out of range:
        :class:`AttentionConfigError` naming the key and what is accepted); the full config with defaults,
        or with ``base``'s values (an already validated config of this method) for the keys ``raw`` leaves
        out (a key given as None takes the default).  ``taylorseer_order`` is refused without ``taylorseer``
        on (it would do nothing)."""
        params = {p.name: p for p in self.schema()}
        unknown = [k for k in raw if k not in params]
        if unknown:
            raise AttentionConfigError(
                f"cache backend {self.name}: unknown config key(s) "
                f"{', '.join(map(repr, unknown))}; accepted keys: {', '.join(params)}"
            )
        out: dict[str, Any] = {}
        for name, p in params.items():
            if raw.get(name) is not None:
                out[name] = p.coerce(f"cache backend {self.name}", raw[name])
            else:
                out[name] = base[name] if base is not None and name not in raw else p.default
        if not out["taylorseer"]:
            if raw.get("taylorseer_order") is not None:
                raise AttentionConfigError(
                    f"cache backend {self.name}: 'taylorseer_order' {out['taylorseer_order']} is given with "
                    "taylorseer off (it orders the TaylorSeer extrapolation, which then does not run); "
                    "accepted: taylorseer=true with it, or no taylorseer_order"
                )
            out["taylorseer_order"] = params["taylorseer_order"].default  # unused: not carried from ``base``
        return out

    def check_model(self, config: dict, num_blocks: int) -> None:
        """Refuse (:class:`AttentionConfigError` with the reason) a config this model cannot take."""

    def forward(self, view: StepView, state: BranchState, config: dict) -> Outcome:  # pragma: no cover
        raise NotImplementedError

    # helpers shared by the methods
    @staticmethod
    def compute_all(view: StepView, state: BranchState) -> Outcome:
        """Run every block and cache the stack's residual."""
        out = view.run(0, view.num_blocks, view.x)
        state.store.update(view.step, out - view.x)
        state.skips = 0
        return Outcome(out, False, view.num_blocks)

    @staticmethod
    def reuse_all(view: StepView, state: BranchState) -> Outcome:
        """Skip every block: the input plus the cached (or extrapolated) residual."""
        state.skips += 1
        return Outcome(view.x + state.store.predict(view.step).to(view.x.dtype), True, 0)


def new_state(config: dict) -> BranchState:
    """A fresh branch state for a validated ``config``."""
    return BranchState(ResidualStore(config["taylorseer_order"] if config.get("taylorseer") else 0))


__all__ = [
    "COMMON_PARAMS",
    "CacheFacts",
    "CacheMethod",
    "StepView",
    "ResidualStore",
    "BranchState",
    "Outcome",
    "new_state",
    "_in",
    "_nonneg",
    "_positive",
]
