"""Measured operating points of the sparse backends at their defaults (docs/benchmarks.md, sparse frontier).

Each entry is what ``bench/fidelity.py`` measured for the backend's default configuration (its sparse
path: dense phases such as ``dense_steps`` / ``first_full_step`` are not part of one call) on the
structured inputs at the Wan 480p grid: relative L2 error and cosine against float32 exact attention,
kept block fraction, and the speed-up over FlashAttention-4 dense on the H200 at 12 and 40 heads with the
errors of those runs, or None while that measurement is pending (``speed_pending`` then names the command
that produces it).  ``ditattn backends`` prints them; nothing reads them to make decisions.

The figures of Sparge, Sol, V-MoBA and SVG2 predate their ``error_budget`` key: they are the plain
selection rules (``error_budget=0``).  With the budget on (their default now) the error is bounded and
the kept fraction grows with it; ``bench/fidelity.py --families all`` measures both (``--budget off``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

#: the run that produced the error figures below
ERROR_SOURCE = (
    "bench/fidelity.py --grids wan480 --heads 5 --ref-rows 512 --error-only (CPU, bf16 inputs, "
    "structured: 2 spatial, 2 temporal, 1 global head)"
)
#: the H200 runs that measured the speed-ups (and the errors at 12 / 40 heads) of the defaults
SPEED_SOURCE = (
    "H200: bench/fidelity.py --grids wan480 --heads 12|40 --gen-device cpu, FA4 'fa' dense = 1 "
    '(docs/benchmarks.md, "Sparse attention frontier")'
)
#: sol_attn's speed-ups and their errors: the budget off, errors on 8,190 of the 32,760 rows
SOL_SPEED_SOURCE = (
    "H200: bench/frontier.py --parts fidelity --families original --heads 12,40 --budget off --no-overhead "
    "--paired 0 --ref-rows 8190, FA4 'fa' dense = 1 (docs/benchmarks.md, \"Fast settings\")"
)
#: what a default without an H200 timing would be timed with
SPEED_COMMAND = "bench/fidelity.py --grids wan480 --heads 12,40 --gen-device cpu on the H200"


@dataclasses.dataclass(frozen=True)
class OperatingPoint:
    """One measured default: ``config`` (what "defaults" meant), ``rel_err``, ``cosine``, ``kept``
    (fraction of block pairs computed) from the CPU run :data:`ERROR_SOURCE`; ``speedup`` /
    ``speedup_40`` over FA4 dense on the H200 at 12 / 40 heads with the errors of those runs
    (``rel_err_12`` / ``rel_err_40``; None: not measured, ``speed_pending`` names the command);
    ``fast_setting``: the documented non-default setting that reaches >= 1.5x at <= 5 % error, if any."""

    config: str
    rel_err: float
    cosine: float
    kept: float
    speedup: Optional[float] = None
    speedup_40: Optional[float] = None
    rel_err_12: Optional[float] = None
    rel_err_40: Optional[float] = None
    fast_setting: str = ""
    speed_pending: str = SPEED_COMMAND
    speed_source: str = SPEED_SOURCE
    source: str = ERROR_SOURCE

    def describe(self) -> str:
        if self.speedup is None:
            speed = f"speed vs FA4 pending ({self.speed_pending})"
        else:
            parts = [
                f"{h} heads {x:.2f}x at {e * 100:.1f} % error"
                for h, x, e in ((12, self.speedup, self.rel_err_12), (40, self.speedup_40, self.rel_err_40))
                if x is not None and e is not None
            ]
            speed = "H200 vs FA4 dense: " + ", ".join(parts)
        fast = f"; faster setting: {self.fast_setting}" if self.fast_setting else ""
        return (
            f"at defaults ({self.config}) on structured 480p inputs: rel. error {self.rel_err:.3f}, cosine "
            f"{self.cosine:.4f}, kept {self.kept:.2f}; {speed}{fast}"
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


#: sparge_attn, sol_attn, sparse_video_gen_2_attn and vmoba_attn: re-measured with the same command after their
#: default block predictors became pooled_query (docs/benchmarks.md); sla_attn after its default
#: became edge_tiles=packed
OPERATING_POINTS: dict[str, OperatingPoint] = {
    "sparge_attn": OperatingPoint(
        "topk 0.5, pooled-query predictor, INT8 Q.K in kept blocks, packed edge tiles",
        0.054,
        0.9986,
        0.501,
        speedup=1.25,
        speedup_40=1.28,
        rel_err_12=0.037,
        rel_err_40=0.080,
        fast_setting="quantize=false block_size=128 cdfthreshd=0.95 topk=0.3: 1.71-1.82x at 4.0-4.1 % error (12 and "
        "40 heads, H200; H100 1.70-1.79x; FlashAttention-4's block-sparse kernel); cdfthreshd=0.93: 1.75-1.87x at "
        "4.4 %, closer to 5 % (H100)",
    ),
    "sparse_video_gen_2_attn": OperatingPoint(
        "64/128 clusters, top_p 0.9, pooled-query cluster mass, warm-started step",
        0.135,
        0.9921,
        0.417,
        speedup=1.43,
        speedup_40=1.64,
        rel_err_12=0.358,
        rel_err_40=0.309,
    ),
    "sol_attn": OperatingPoint(
        "tau 1.0, diag, pooled-query choice of the exact blocks, centroid variance, packed edge "
        "tiles; sparse layers and steps",
        0.070,
        0.9977,
        0.224,
        speedup=2.05,
        speedup_40=2.12,
        rel_err_12=0.051,
        rel_err_40=0.037,
        fast_setting="block_size=128 tau=0.5: 2.12x at 3.0-4.1 % error (12 and 40 heads, H200; H100 1.99-2.06x; "
        "FlashAttention-4's block-sparse kernel for the exact blocks)",
        speed_source=SOL_SPEED_SOURCE,
    ),
    "vmoba_attn": OperatingPoint(
        "threshold 0.25, pooled-query gate; mean of its temporal/spatial/st layers",
        0.606,
        0.860,
        0.179,
        speedup=1.79,
        speedup_40=2.68,
        rel_err_12=0.532,
        rel_err_40=0.649,
    ),
    "video_sparse_attn": OperatingPoint(
        "sparsity 0.0: every tile kept, runs exact dense attention",
        0.0017,
        1.0,
        1.0,
        speed_pending="bench/fidelity.py --grids wan480 --heads 12,40 --gen-device cpu "
        "--cases 'video_sparse_attn (defaults)' on the H200",
    ),
    "sliding_tile_attn": OperatingPoint(
        "after STA_searching with the default candidate windows (about 27 tiles)",
        0.924,
        0.5834,
        0.042,
        speedup=4.33,
        speedup_40=5.50,
        rel_err_12=0.857,
        rel_err_40=0.915,
    ),
    "sla_attn": OperatingPoint(
        "topk 0.2, packed edge tiles; no linear branch in any checkpoint",
        0.422,
        0.9123,
        0.201,
        speedup=2.96,
        speedup_40=3.12,
        rel_err_12=0.388,
        rel_err_40=0.534,
    ),
}
