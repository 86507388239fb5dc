"""Sparse video attention engine: 3-D tiling, planners and one block-sparse core (DESIGN §3).

Every sparse video backend is "choose which key blocks each query block attends to, then run exact
attention over those blocks":

* :mod:`.tiling` permutes ``[B, T*H*W (+text), heads, D]`` tokens into 3-D tile order (and back);
* a planner builds a boolean block mask / block lists (:mod:`.sta`, :mod:`.vsa`, :mod:`.sparge`,
  :mod:`.vmoba`, :mod:`.svg2`, :mod:`.sla`, :mod:`.sol`);
* :func:`.block_sparse.block_sparse_attention` runs them (PyTorch reference on CPU, FlexAttention
  or the Triton kernel on CUDA).

``last_stats`` holds, per layer key, what the last sparse call of that layer did (kept fraction
of blocks, whether it ran dense and why) for benchmarks and the plan.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

from ditattn.attention.sparse.block_sparse import (  # noqa: F401
    block_lists_to_dense_mask,
    block_mask_to_lists,
    block_sparse_attention,
    dense_attention,
    full_lists,
    kept_fraction,
    lists_to_block_mask,
)
from ditattn.attention.sparse.tiling import TileLayout, make_tile_layout, tile, untile  # noqa: F401

#: ``{layer_key: {"backend", "kept_fraction", "dense", "reason", "step", "layer_idx", ...}}`` for
#: the most recent call of each layer (process-wide; statistics only, never read back by kernels).
last_stats: dict[str, dict[str, Any]] = {}
_stats_lock = threading.Lock()


def stats_key(backend: str, layer_key: Optional[str], layer_idx: Optional[int]) -> str:
    """The ``last_stats`` key of a call: its ``layer_key``, else ``"<backend>/layer<idx>"``."""
    if layer_key:
        return str(layer_key)
    return f"{backend}/layer{layer_idx if layer_idx is not None else 0}"


def record_stats(key: str, **info: Any) -> None:
    """Store ``info`` as the latest statistics of ``key`` (replacing the previous entry)."""
    with _stats_lock:
        last_stats[key] = dict(info)


def clear_stats() -> None:
    with _stats_lock:
        last_stats.clear()
