"""Measured per-layer backend selection (``--enable-attention-backend-autotune true``).

A layer whose backend was chosen automatically tunes once, on its first call whose query holds at
least ``MIN_QUERY_ELEMENTS`` elements: every compatible candidate of the platform's automatic list
runs the same inputs (warm-up, then timed calls); a candidate whose output differs from the
incumbent's by more than the numerical guard is rejected; the layer switches only when the best
candidate is faster than the incumbent by more than the noise margin.  Explicit, forced, required
and component/CLI choices are never replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch

from ditattn.attention.backends.base import AttnCall, get_impl
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import SPECS
from ditattn.platforms import Platform
from ditattn.platforms.policy import auto_candidates

log = logging.getLogger("ditattn.attention")

MIN_QUERY_ELEMENTS = 4_194_304
NOISE_MARGIN = 0.03  # a candidate must be >3 % faster than the incumbent
WARMUP, REPEATS = 2, 5


def numerical_guard(dtype: torch.dtype, lossy: bool) -> float:
    """Largest accepted relative L2 difference between a candidate's and the incumbent's output."""
    base = 1e-4 if dtype == torch.float32 else 1e-2
    return max(base, 3e-2) if lossy else base


def time_call(fn: Callable[[], object], device: torch.device, warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """Median wall time of ``fn`` in seconds (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


@dataclasses.dataclass
class TuneResult:
    chosen: B
    timings: dict  # backend name -> seconds (or None if rejected)
    rejected: dict  # backend name -> reason
    reason: str


def tune(
    incumbent: B,
    request,
    platform: Platform,
    q,
    k,
    v,
    call: AttnCall,
    *,
    timer: Callable = time_call,
    noise_margin: float = NOISE_MARGIN,
) -> TuneResult:
    """Time the compatible automatic candidates on ``q, k, v`` and pick one (see module doc).

    ``timer(fn, device) -> seconds`` is injectable for tests. Returns the choice with timings and
    the reason of every rejection.
    """
    cands = [incumbent] + [b for b in auto_candidates(request, platform) if b != incumbent]
    timings: dict = {}
    rejected: dict = {}
    ref = get_impl(incumbent)(q, k, v, call, {})[0].float()
    ref_norm = ref.norm().clamp_min(1e-12)
    for b in cands:
        reasons = SPECS[b].reasons(request, platform)
        if reasons:
            rejected[b.value] = "; ".join(reasons)
            continue
        impl = get_impl(b)
        try:
            out = impl(q, k, v, call, {})[0]
        except Exception as exc:  # a kernel that fails on this shape is simply not a candidate
            rejected[b.value] = f"failed: {exc}"
            continue
        err = ((out.float() - ref).norm() / ref_norm).item()
        guard = numerical_guard(q.dtype, SPECS[b].lossy or SPECS[incumbent].lossy)
        if b != incumbent and not err <= guard:
            rejected[b.value] = f"output differs from {incumbent.value} by {err:.2e} > guard {guard:.0e}"
            continue
        timings[b.value] = timer(lambda impl=impl: impl(q, k, v, call, {}), q.device)
    best = min(timings, key=timings.get)
    inc_t = timings[incumbent.value]
    if best != incumbent.value and timings[best] < inc_t * (1 - noise_margin):
        chosen = B(best)
        reason = (
            f"autotune: {best} {timings[best] * 1e3:.3f} ms vs {incumbent.value} {inc_t * 1e3:.3f} ms "
            f"({inc_t / timings[best]:.2f}x)"
        )
    else:
        chosen = incumbent
        reason = f"autotune kept {incumbent.value} ({inc_t * 1e3:.3f} ms; no candidate faster by > {noise_margin:.0%})"
    return TuneResult(chosen, timings, rejected, reason)
