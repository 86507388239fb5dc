"""Measured operating points of the sparse backends at their defaults (issue 19, docs/benchmarks.md §11).

Each entry is what ``bench/fidelity.py`` measured for the backend's default configuration (its sparse
path: dense phases such as ``dense_steps`` / ``first_full_step`` are not part of one call) on the
structured inputs at the Wan 480p grid: relative L2 error and cosine against float32 exact attention,
kept block fraction, and the speed-up over FlashAttention-4 dense on the H200, or None while that
measurement is pending (``speed_pending`` then names the command that produces it).  ``ditattn
backends`` prints them; nothing reads them to make decisions.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

#: the run that produced the error figures below
ERROR_SOURCE = ("bench/fidelity.py --grids wan480 --heads 5 --ref-rows 512 --error-only (CPU, bf16 inputs, "
                "structured: 2 spatial, 2 temporal, 1 global head)")
#: the H200 command that fills in the speed-ups (docs/benchmarks.md §11)
SPEED_COMMAND = ("bash bench/h200_session18.sh selection / selection40: bench/fidelity.py --grids wan480 --heads 12 / 40 "
                 "(H200, FA4 as 'fa')")


@dataclasses.dataclass(frozen=True)
class OperatingPoint:
    """One measured default: ``config`` (what "defaults" meant), ``rel_err``, ``cosine``, ``kept``
    (fraction of block pairs computed), ``speedup`` over FA4 dense (None: pending)."""

    config: str
    rel_err: float
    cosine: float
    kept: float
    speedup: Optional[float] = None
    speed_pending: str = SPEED_COMMAND
    source: str = ERROR_SOURCE

    def describe(self) -> str:
        speed = f"{self.speedup:.2f}x FA4 dense" if self.speedup is not None else \
            f"speed vs FA4 pending ({self.speed_pending})"
        return (f"at defaults ({self.config}) on structured 480p inputs: rel. error {self.rel_err:.3f}, cosine "
                f"{self.cosine:.4f}, kept {self.kept:.2f}; {speed}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


#: sparge_attn, sol_attn, sparse_video_gen_2_attn and vmoba_attn: re-measured with the same command after their
#: default block predictors became pooled_query (docs/benchmarks.md §11, CPU run 2); sla_attn after its default
#: became edge_tiles=packed (§13)
OPERATING_POINTS: dict[str, OperatingPoint] = {
    "sparge_attn": OperatingPoint("topk 0.5, pooled-query predictor, INT8 Q.K in kept blocks, packed edge tiles",
                                  0.054, 0.9986, 0.501),
    "sparse_video_gen_2_attn": OperatingPoint("64/128 clusters, top_p 0.9, pooled-query cluster mass, warm-started "
                                              "step", 0.135, 0.9921, 0.417),
    "sol_attn": OperatingPoint("tau 1.0, diag, pooled-query choice of the exact blocks, centroid variance, packed edge "
                               "tiles; sparse layers and steps", 0.070, 0.9977, 0.224),
    "vmoba_attn": OperatingPoint("threshold 0.25, pooled-query gate; mean of its temporal/spatial/st layers",
                                 0.606, 0.860, 0.179),
    "video_sparse_attn": OperatingPoint("sparsity 0.0: every tile kept, runs exact dense attention", 0.0017, 1.0, 1.0),
    "sliding_tile_attn": OperatingPoint("after STA_searching with the default candidate windows (about 27 tiles)",
                                        0.924, 0.5834, 0.042),
    "sla_attn": OperatingPoint("topk 0.2, packed edge tiles; no linear branch in any checkpoint", 0.422, 0.9123, 0.201),
}
