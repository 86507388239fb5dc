"""When a skip-softmax layer runs the dense kernel instead of the skip-softmax Triton kernel.

The Triton kernel computes every Q.K tile and skips only the softmax and P.V of the tiles whose mass is
below the threshold, so it beats a dense kernel only when it skips enough of them.  On the H200 (bf16, Wan
480p grid, 32,760 tokens, head dim 128, one process with FlashAttention-4, the dense kernel of skip
softmax's dense phase) it runs at 0.46-0.50x FA4 at ``threshold_scale_factor`` 4 while skipping 0-1 % of
the tiles (:data:`H200_SKIP_VS_FA`): its own dense speed is about half of FA4's, so it pays only when it skips
more than about half of the tiles (:data:`SKIP_BREAK_EVEN`).  The skipped fraction is known only after a
call, so per layer and request (:class:`LayerRoute`) the first skip-softmax call runs the kernel, and when
it skipped less than the break-even the layer runs the dense kernel for the rest of the request (one
device read per layer and request, of a finished value).  Calls shorter than the sparse backends'
``min_seq_len`` default (:data:`ditattn.attention.sparse.fallback.MIN_SEQ_LEN`) run the dense kernel at once
(H200: 0.66-0.97x FA4 at 2,304 tokens).  Each reason is said once (log line, the plan's dense notes).
"""

from __future__ import annotations

from typing import Optional

import torch

from ditattn.attention.sparse.fallback import MIN_SEQ_LEN

#: H200 measurements of the skip-softmax Triton kernel: ``(tokens, heads, threshold_scale_factor, skipped
#: fraction of tiles, speed / FlashAttention-4)``
H200_SKIP_VS_FA = (
    (32760, 12, 4.0, 0.005, 0.49),
    (32760, 12, 4.0, 0.0, 0.47),
    (32760, 40, 4.0, 0.004, 0.50),
    (2304, 2, 4.0, 0.065, 0.66),
    (2304, 2, 4.0, 0.0, 0.96),
)
#: per CUDA SM: the skipped tile fraction below which the kernel is slower than the dense kernel (absent: the
#: kernel always runs; Blackwell is not measured)
SKIP_BREAK_EVEN = {90: 0.5}
SHORT_REASON = "shorter than min_seq_len {limit} tokens (dense kernel)"
SLOW_REASON = (
    "skipped fewer tiles than the SM{sm} break-even {be:.0%} at the layer's first call "
    "(dense kernel for the rest of the request)"
)


class LayerRoute:
    """One skip-softmax layer's routing in one request (the request builds one per layer): :meth:`dense_reason`
    before a call, :meth:`record` after a kernel call."""

    def __init__(self, sm: Optional[int] = None) -> None:
        self.first = None  # the first kernel call's skipped fraction (0-d device tensor or float)
        self.skipped: Optional[float] = None
        self.sm = sm  # None: the CUDA device's, read at the first call (off CUDA: no break-even)

    def dense_reason(self, q: torch.Tensor) -> str:
        """Why this call of ``q [B, S, H, D]`` runs the dense kernel, "" when the skip-softmax path runs it:
        shorter than :data:`MIN_SEQ_LEN` of its device type, or on an SM with a :data:`SKIP_BREAK_EVEN`
        after a first call of this layer that skipped fewer tiles."""
        limit = MIN_SEQ_LEN.get(q.device.type, 0)
        if q.shape[1] < limit:
            return SHORT_REASON.format(limit=limit)
        if self.sm is None and q.is_cuda:
            major, minor = torch.cuda.get_device_capability(q.device)
            self.sm = 10 * major + minor
        be = SKIP_BREAK_EVEN.get(self.sm)
        if be is None:
            return ""
        if self.skipped is None and self.first is not None:
            self.skipped = float(self.first)  # one read per layer and request, of a finished value
        if self.skipped is not None and self.skipped < be:
            return SLOW_REASON.format(sm=self.sm, be=be)
        return ""

    def record(self, skipped) -> None:
        """Keep the first kernel call's skipped fraction (0-d device tensor or float, read at the next call)."""
        if self.first is None:
            self.first = skipped
