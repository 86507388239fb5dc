"""Sparse video attention engine: 3-D tiling, planners and one block-sparse core.

Every sparse video backend is "choose which key blocks each query block attends to, then run exact
attention over those blocks":

* :mod:`.tiling` permutes ``[B, T*H*W (+text), heads, D]`` tokens into 3-D tile order (and back);
* a planner builds a boolean block mask / block lists (:mod:`.sta`, :mod:`.vsa`, :mod:`.sparge`,
  :mod:`.vmoba`, :mod:`.svg2`, :mod:`.sla`, :mod:`.sol`);
* :func:`.block_sparse.block_sparse_attention` runs them (PyTorch reference on CPU, FlexAttention
  or the Triton kernel on CUDA).

``last_stats`` holds, per layer key, what the last sparse call of that layer did (kept fraction
of blocks, whether it ran dense and why) for benchmarks and the plan.  A planner whose kept
fraction is only known on the device records it as a 0-dim tensor; the entry turns it into a
float when it is first read (:class:`LayerStats`), so recording costs no device sync.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

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


class LayerStats(dict):
    """One ``last_stats`` entry: a dict whose 0-dim tensor values (a kept fraction still on the
    device) read as Python floats.  Every read path (``[]``, ``get``, ``items``, ``values``,
    ``dict(entry)``, ``{**entry}``, ``json.dumps``) sees floats; the first read syncs the device
    once and stores the float."""

    def __getitem__(self, key):
        val = dict.__getitem__(self, key)
        if isinstance(val, torch.Tensor):
            val = float(val)
            dict.__setitem__(self, key, val)
        return val

    def __iter__(self):  # defined here so that dict(entry) / {**entry} read through __getitem__
        return dict.__iter__(self)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def items(self):
        return [(k, self[k]) for k in dict.keys(self)]

    def values(self):
        return [self[k] for k in dict.keys(self)]

    def copy(self) -> dict:
        return dict(self.items())

    def __eq__(self, other):
        return dict(self.items()) == (dict(other.items()) if isinstance(other, dict) else other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(dict(self.items()))


#: ``{layer_key: {"backend", "kept_fraction", "dense", "reason", "step", "layer_idx", ...}}`` for
#: the most recent call of each layer (process-wide; statistics only, never read back by kernels;
#: entries are :class:`LayerStats`).
last_stats: dict[str, LayerStats] = {}
_stats_lock = threading.Lock()


def stats_key(backend: str, layer_key: Optional[str], layer_idx: Optional[int]) -> str:
    """The ``last_stats`` key of a call: its ``layer_key``, else ``"<backend>/layer<idx>"``."""
    if layer_key:
        return str(layer_key)
    return f"{backend}/layer{layer_idx if layer_idx is not None else 0}"


def record_stats(key: str, **info: Any) -> None:
    """Store ``info`` as the latest statistics of ``key`` (replacing the previous entry); 0-dim
    tensor values are read (as floats) only when the entry is."""
    with _stats_lock:
        last_stats[key] = LayerStats(info)


def clear_stats() -> None:
    with _stats_lock:
        last_stats.clear()
