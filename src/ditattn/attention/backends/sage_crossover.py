"""When ``sage_attn`` hands a call to the exact dense kernel: the measured Hopper crossover.

On the H200 (one process, side by side with FlashAttention-4, ``fa``) the SM90 INT8 kernel is slower
than ``fa`` below about 16k tokens (:data:`H200_SAGE_VS_FA`).  With ``impl=auto`` on an SM90 GPU a
call whose query length is below the config key ``min_seq_len`` (default :data:`DEFAULT_MIN_SEQ_LEN`;
0 turns the routing off) therefore runs ``fa`` — exact dense attention — and says so once.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ditattn.attention.backends.base import AttnCall, get_impl
from ditattn.attention.names import AttentionBackendEnum as B

log = logging.getLogger("ditattn.attention.sage")

#: measured speed of sage_attn (SM90 kernel) relative to fa on the H200: (tokens, head dim, heads, x fa)
H200_SAGE_VS_FA = (
    (4096, 64, None, 0.70),
    (4096, 128, None, 0.89),
    (4600, 128, None, 0.97),
    (8192, 128, None, 0.98),
    (16384, 128, 40, 1.02),
    (32768, 128, None, 1.09),
    (32768, 128, 40, 1.13),
)
#: shortest query length sage_attn keeps on SM90 with impl auto (the first measured row >= 1.0x)
DEFAULT_MIN_SEQ_LEN = min(s for s, _, _, x in H200_SAGE_VS_FA if x >= 1.0)
_said: set = set()


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    """Whether CUDA ``device`` is an SM90 GPU (asked once per device: a routed call pays no query)."""
    return torch.cuda.get_device_capability(device) == (9, 0)


def _routing_limit(q: torch.Tensor, cfg: dict) -> int:
    """``min_seq_len`` when this call runs ``fa`` instead, else 0.  The per-call check is a few
    comparisons: a routed call costs within a microsecond or two of calling ``fa`` directly."""
    limit = cfg.get("min_seq_len", DEFAULT_MIN_SEQ_LEN)
    if not limit or q.shape[1] >= limit or cfg.get("impl", "auto") != "auto":
        return 0
    device = q.device
    return int(limit) if device.type == "cuda" and _is_sm90(device) else 0


def routes_to_dense(q: torch.Tensor, cfg: dict) -> Optional[str]:
    """Why this call runs ``fa`` instead (None: sage_attn runs it): ``impl`` auto, a CUDA SM90 device,
    and a query length below ``min_seq_len``.  q ``[B, S, H, D]``."""
    limit = _routing_limit(q, cfg)
    return f"{q.shape[1]} tokens < min_seq_len {limit}: fa (exact dense) is faster on SM90" if limit else None


def say_once(reason: str) -> None:
    key = reason.split(":")[-1]
    if key not in _said:
        _said.add(key)
        log.info("sage_attn runs fa: %s; said once", reason)


def dense_below_crossover(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, cfg: dict):
    """``fa``'s ``(out, lse|None)`` for a non-causal call :func:`routes_to_dense` hands to it (said once),
    else None (``sage_attn`` runs it).  q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` fp16/bf16.
    ``cfg`` may omit keys (their defaults apply), so that the check runs before the config is completed."""
    if call.causal or not _routing_limit(q, cfg):
        return None
    if not _said:
        say_once(routes_to_dense(q, cfg))
    return get_impl(B.FA)(q, k, v, call, {})


def crossover_label(platform, cfg: dict) -> str:
    """What the plan's runtime label of ``sage_attn`` adds on an SM90 ``platform`` under ``impl`` auto:
    the query lengths that run ``fa`` instead ("" elsewhere, or with ``min_seq_len`` 0)."""
    limit = int(cfg.get("min_seq_len", DEFAULT_MIN_SEQ_LEN) or 0)
    if platform.sm != 90 or cfg.get("impl", "auto") != "auto" or limit <= 0:
        return ""
    return f"; fa (exact dense) below {limit} tokens"
