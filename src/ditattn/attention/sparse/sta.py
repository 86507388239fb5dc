"""Sliding Tile Attention (STA): each query tile attends a fixed window of key tiles.

Window rule (per head, in tiles): along each axis with ``n`` tiles and window ``w`` (clamped to
``1 <= w <= n``), the query tile at coordinate ``c`` attends key tiles ``[s, s + w)`` with
``s = clamp(c - (w - 1) // 2, 0, n - w)``: centred for odd ``w`` and shifted inwards at the grid
edges so that the window keeps its full size ("windows clamp at the grid edges").  Text tokens
(and other special tokens) attend everything and are attended by everything.  The layout is the
padded one (:mod:`.tiling`, ``edge_tiles="padded"``): windows are boxes of tile coordinates, and a
block of packed edge tiles would sit at several coordinates at once.

Mask strategy file (JSON): ``{"<step>_<layer>_<head>": [wt, wh, ww], ...}`` (positive integers, in
tiles).  Lookup for (step, layer, head): the exact key; else the entry of the same layer/head with
the largest step <= the requested one; else its smallest step.  ``step=None`` uses the smallest
stored step.

Search (``STA_searching`` / ``STA_tuning`` / ``STA_tuning_cfg``): the call returns exact full
attention; in addition every candidate window runs on the same inputs and the per-head squared L2
error against the full output (and the squared norm of the full output) is accumulated per
(step, layer, head).  The strategy file is (re)written when the step changes, at process exit and
on :func:`flush_sta_search`:

* ``STA_searching``: per (step, layer, head) the candidate with the lowest relative L2 error;
* ``STA_tuning`` / ``STA_tuning_cfg``: per (layer, head) the candidate with the lowest relative L2
  error summed over all calibrated steps, written for every calibrated step (``_cfg`` pools the
  conditional and unconditional halves of a CFG batch, which the batch dimension already does).

Ties go to the candidate that keeps fewer tiles on this grid, then to the earlier candidate.  The
per-candidate errors are written next to the strategy as ``<path>.errors.json``.  Candidates are
the ``window_candidates`` config (flat ``[wt, wh, ww, ...]``) or :data:`DEFAULT_WINDOW_CANDIDATES`
(shapes of about 27 tiles that trade time extent for space extent).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from typing import Iterable, Optional, Sequence

import torch

from ditattn.attention.sparse.block_sparse import block_mask_to_lists, block_sparse_attention, full_lists
from ditattn.attention.sparse.common import SparsePlan, add_special_blocks, run_block_mask
from ditattn.attention.sparse.tiling import DEFAULT_TILE_SIZE, TileLayout, make_tile_layout, tile, untile
from ditattn.errors import AttentionConfigError, short_repr, short_text
from ditattn.files import atomic_write

Tensor = torch.Tensor
log = logging.getLogger(__name__)

DEFAULT_WINDOW_CANDIDATES: tuple[tuple[int, int, int], ...] = (
    (3, 3, 3),
    (1, 5, 5),
    (5, 1, 5),
    (5, 5, 1),
    (3, 1, 9),
    (3, 9, 1),
    (1, 3, 9),
    (1, 9, 3),
)


# ------------------------------------------------------------------------------------------------
# window geometry


def _windows_tensor(windows, heads: Optional[int] = None) -> Tensor:
    w = torch.as_tensor(windows, dtype=torch.int64)
    if w.dim() == 1:
        w = w.view(1, 3)
    if w.dim() != 2 or w.shape[1] != 3:
        raise AttentionConfigError(f"STA windows must be [wt, wh, ww] or one per head, got shape {tuple(w.shape)}")
    if (w <= 0).any():
        raise AttentionConfigError(f"STA windows must be positive tile counts, got {w.tolist()}")
    if heads is not None and w.shape[0] not in (1, heads):
        raise AttentionConfigError(f"STA got {w.shape[0]} windows for {heads} heads")
    return w


def window_starts(coords: Tensor, windows: Tensor, grid: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Clamped window start and size per (head, block, axis): ``coords [N, 3]``, ``windows
    [Hw, 3]`` -> ``(start [Hw, N, 3], size [Hw, 1, 3])``."""
    n = torch.tensor(grid, dtype=torch.int64, device=coords.device)
    w = torch.minimum(windows.to(coords.device), n).clamp(min=1).unsqueeze(1)  # [Hw,1,3]
    start = coords.unsqueeze(0) - (w - 1) // 2
    start = torch.minimum(start.clamp(min=0), n - w)
    return start, w


def sta_video_mask(layout: TileLayout, windows, device=None) -> Tensor:
    """Video-block mask of STA: bool ``[Hw, n_video_blocks, n_video_blocks]`` for ``windows``
    ``[3]`` or ``[Hw, 3]`` (tiles), on ``device`` (default: the windows' device).

    STA's windows are boxes of tiles: the layout must keep one block per tile (``edge_tiles=
    "padded"``); a block of packed edge tiles spans several window positions, so a packed layout
    raises :class:`AttentionConfigError`."""
    if layout.n_packed_blocks:
        raise AttentionConfigError(
            "sliding_tile_attn: STA windows are defined on tile coordinates and need one block per tile; "
            "build the layout with edge_tiles='padded'"
        )
    w = _windows_tensor(windows)
    device = w.device if device is None else torch.device(device)
    w = w.to(device)
    coords = layout.block_coords.to(device)
    start, size = window_starts(coords, w, layout.grid)  # [Hw,N,3]
    kc = coords.view(1, 1, -1, 3)
    inside = (kc >= start.unsqueeze(2)) & (kc < (start + size).unsqueeze(2))
    return inside.all(-1)


def sta_block_mask(layout: TileLayout, windows, device=None) -> Tensor:
    """Full STA block mask including special blocks: bool ``[1, Hw, n_blocks, n_blocks]``."""
    return add_special_blocks(layout, sta_video_mask(layout, windows, device)).unsqueeze(0)


def kept_tiles(window, grid) -> int:
    """Tiles one query tile keeps with ``window`` on ``grid`` (after clamping)."""
    out = 1
    for w, n in zip(window, grid):
        out *= max(1, min(int(w), int(n)))
    return out


def sliding_tile_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    windows,
    tile_size=DEFAULT_TILE_SIZE,
    text_len: int = 0,
    scale: Optional[float] = None,
    return_lse: bool = False,
    impl: str = "auto",
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """STA over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with the same head count as q).

    ``windows``: ``[wt, wh, ww]`` for every head or one per head ``[heads, 3]`` (in tiles).
    Returns ``(out [B, S, heads, D] in q.dtype, lse [B, heads, S] float32 or None, plan)``.
    """
    layout = make_tile_layout(video_shape, tile_size, text_len)
    w = _windows_tensor(windows, q.shape[2]).to(q.device)
    bm = sta_block_mask(layout, w, q.device)
    return run_block_mask(
        q, k, v, layout, bm, scale=scale, return_lse=return_lse, impl=impl, extra={"windows": w.cpu()}
    )


# ------------------------------------------------------------------------------------------------
# mask strategy files


class MaskStrategy:
    """A parsed mask strategy: ``(step, layer, head) -> (wt, wh, ww)``."""

    def __init__(self, entries: dict[tuple[int, int, int], tuple[int, int, int]], source: str = "<memory>"):
        self.entries = dict(entries)
        self.source = source
        by_lh: dict[tuple[int, int], list[tuple[int, tuple[int, int, int]]]] = {}
        for (s, l, h), w in self.entries.items():
            by_lh.setdefault((l, h), []).append((s, w))
        for lst in by_lh.values():
            lst.sort()
        self._by_lh = by_lh

    def window(self, step: Optional[int], layer: int, head: int) -> tuple[int, int, int]:
        got = self.entries.get((step, layer, head)) if step is not None else None
        if got is not None:
            return got
        lst = self._by_lh.get((layer, head))
        if not lst:
            raise AttentionConfigError(
                f"sliding_tile_attn: mask strategy {self.source} has no window for layer {layer}, head {head} "
                f"(keys are 'step_layer_head', e.g. '{step if step is not None else 0}_{layer}_{head}'); "
                "produce one with sta_mode=STA_searching or STA_tuning"
            )
        if step is None:
            return lst[0][1]
        best = lst[0][1]
        for s, w in lst:
            if s <= step:
                best = w
        return best

    def windows(self, step: Optional[int], layer: int, heads: int, head_offset: int = 0) -> Tensor:
        """``[heads, 3]`` int64 windows for global heads ``head_offset .. head_offset+heads-1``."""
        return torch.tensor([self.window(step, layer, head_offset + h) for h in range(heads)], dtype=torch.int64)

    def to_json(self) -> dict:
        return {f"{s}_{l}_{h}": list(w) for (s, l, h), w in sorted(self.entries.items())}


def parse_mask_strategy(data, source: str = "<memory>") -> MaskStrategy:
    """Validate a strategy mapping ``{"t_l_h": [wt, wh, ww]}``; errors name the offending key."""
    source = short_text(source)
    if not isinstance(data, dict):
        raise AttentionConfigError(
            f"sliding_tile_attn: mask strategy {source} must be a JSON object mapping 'step_layer_head' "
            f"to [wt, wh, ww], got {type(data).__name__}"
        )
    entries = {}
    for key, val in data.items():
        parts = str(key).split("_")
        try:
            if len(parts) != 3:
                raise ValueError
            s, l, h = (int(p) for p in parts)
            if s < 0 or l < 0 or h < 0:
                raise ValueError
        except ValueError:
            raise AttentionConfigError(
                f"sliding_tile_attn: bad key {short_repr(key)} in mask strategy {source}; keys are "
                "'<step>_<layer>_<head>' with non-negative integers, e.g. '12_0_3'"
            ) from None
        if (
            not isinstance(val, (list, tuple))
            or len(val) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in val)
        ):
            raise AttentionConfigError(
                f"sliding_tile_attn: bad window {short_repr(val)} for key {short_repr(key)} in mask strategy "
                f"{source}; "
                "a window is [wt, wh, ww], three positive integers (tiles)"
            )
        entries[(s, l, h)] = tuple(val)
    return MaskStrategy(entries, source)


_strategy_cache: dict[str, tuple[tuple[int, int], MaskStrategy]] = {}
_strategy_lock = threading.Lock()


def load_mask_strategy(path: str) -> MaskStrategy:
    """Load (and cache until the file changes) the strategy JSON at ``path``.  A pending search for
    the same path is flushed first so that a search then inference in one process sees it."""
    path = os.path.abspath(os.fspath(path))
    if path in _searches:
        _searches[path].flush()
    try:
        st = os.stat(path)
    except OSError:
        raise AttentionConfigError(
            f"sliding_tile_attn: mask strategy file not found: {short_text(path)} (mask_strategy_file_path must point "
            "to a JSON file mapping 'step_layer_head' to [wt, wh, ww]; write one with sta_mode=STA_searching)"
        ) from None
    stamp = (st.st_mtime_ns, st.st_size)
    with _strategy_lock:
        got = _strategy_cache.get(path)
        if got is not None and got[0] == stamp:
            return got[1]
    from ditattn.attention.config import loads_json, read_text_file

    try:
        body = read_text_file(
            path,
            what="mask strategy",
            max_bytes=None,
            accepted="a JSON object mapping 'step_layer_head' to [wt, wh, ww]",
        )
    except AttentionConfigError as exc:
        raise AttentionConfigError(f"sliding_tile_attn: {exc}") from None
    data = loads_json(body, f"sliding_tile_attn: mask strategy {short_text(path)}")
    strat = parse_mask_strategy(data, path)
    with _strategy_lock:
        _strategy_cache[path] = (stamp, strat)
    return strat


def save_mask_strategy(path: str, strategy: "MaskStrategy | dict") -> None:
    """Write a strategy (``MaskStrategy`` or ``{(step, layer, head): window}``) as JSON atomically."""
    if not isinstance(strategy, MaskStrategy):
        strategy = MaskStrategy(strategy)
    _write_json(path, strategy.to_json())


def _write_json(path: str, data: dict) -> None:
    """Atomic write, one top-level key per line (values compact)."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    body = "{\n" + ",\n".join(f" {json.dumps(key)}: {json.dumps(val)}" for key, val in data.items()) + "\n}\n"
    atomic_write(path, body if data else "{}\n")


# ------------------------------------------------------------------------------------------------
# search / tuning


def parse_candidates(flat: Iterable[int] | None) -> tuple[tuple[int, int, int], ...]:
    """``[wt, wh, ww, wt, wh, ww, ...]`` -> tuple of windows (empty/None -> defaults)."""
    flat = list(flat or [])
    if not flat:
        return DEFAULT_WINDOW_CANDIDATES
    if len(flat) % 3 or any(int(x) <= 0 for x in flat):
        raise AttentionConfigError(
            f"sliding_tile_attn: window_candidates must be a flat list of positive integers, three per "
            f"window ([wt, wh, ww, ...]), got {flat}"
        )
    return tuple(tuple(int(x) for x in flat[i : i + 3]) for i in range(0, len(flat), 3))  # type: ignore[misc]


class StaSearch:
    """Accumulates per-head candidate errors for one strategy path and writes the strategy."""

    def __init__(self, path: str, mode: str, candidates: Sequence[tuple[int, int, int]]):
        self.path = path
        self.mode = mode
        self.candidates = tuple(tuple(c) for c in candidates)
        self.err: dict[tuple[int, int, int], Tensor] = {}  # (step, layer, head) -> [C] float64
        self.ref: dict[tuple[int, int, int], float] = {}
        self.kept: dict[tuple[int, int, int], list[int]] = {}  # tiles kept per candidate
        self.last_step: Optional[int] = None
        self.dirty = False
        self.lock = threading.Lock()

    def record(self, step: int, layer: int, head_offset: int, err2: Tensor, ref2: Tensor, kept: list[int]) -> None:
        with self.lock:
            if self.last_step is not None and step != self.last_step and self.dirty:
                self._flush_locked()
            self.last_step = step
            err2 = err2.detach().to("cpu", torch.float64)
            ref2 = ref2.detach().to("cpu", torch.float64)
            for h in range(err2.shape[0]):
                key = (step, layer, head_offset + h)
                if key in self.err:
                    self.err[key] += err2[h]
                    self.ref[key] += float(ref2[h])
                else:
                    self.err[key] = err2[h].clone()
                    self.ref[key] = float(ref2[h])
                self.kept[key] = kept
            self.dirty = True

    def strategy(self) -> dict[tuple[int, int, int], tuple[int, int, int]]:
        def best(err: Tensor, ref: float, kept: list[int]) -> int:
            rel = (err / max(ref, 1e-30)).sqrt().tolist()
            return min(range(len(rel)), key=lambda i: (round(rel[i], 12), kept[i], i))

        out: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        if self.mode == "STA_searching":
            for key, err in self.err.items():
                out[key] = self.candidates[best(err, self.ref[key], self.kept[key])]
            return out
        pooled: dict[tuple[int, int], list] = {}
        for (s, l, h), err in self.err.items():
            acc = pooled.setdefault((l, h), [torch.zeros_like(err), 0.0, self.kept[(s, l, h)], []])
            acc[0] = acc[0] + err
            acc[1] += self.ref[(s, l, h)]
            acc[3].append(s)
        for (l, h), (err, ref, kept, steps) in pooled.items():
            win = self.candidates[best(err, ref, kept)]
            for s in steps:
                out[(s, l, h)] = win
        return out

    def errors_json(self) -> dict:
        return {
            "mode": self.mode,
            "candidates": [list(c) for c in self.candidates],
            "relative_l2_error": {
                f"{s}_{l}_{h}": [float(x) for x in (err / max(self.ref[(s, l, h)], 1e-30)).sqrt()]
                for (s, l, h), err in sorted(self.err.items())
            },
        }

    def _flush_locked(self) -> None:
        save_mask_strategy(self.path, self.strategy())
        _write_json(self.path + ".errors.json", self.errors_json())
        self.dirty = False
        log.info(
            "sliding_tile_attn: wrote mask strategy %s (%d entries, mode %s)", self.path, len(self.err), self.mode
        )

    def flush(self) -> None:
        with self.lock:
            if self.dirty or not os.path.exists(self.path):
                self._flush_locked()


_searches: dict[str, StaSearch] = {}
_searches_lock = threading.Lock()


def get_search(path: str, mode: str, candidates) -> StaSearch:
    """The accumulator of ``path`` (created on first use; a new mode/candidate set restarts it)."""
    path = os.path.abspath(os.fspath(path))
    cands = tuple(tuple(c) for c in candidates)
    with _searches_lock:
        s = _searches.get(path)
        if s is None or s.mode != mode or s.candidates != cands:
            if s is not None and s.dirty:
                s.flush()
            s = StaSearch(path, mode, cands)
            _searches[path] = s
        return s


def flush_sta_search(path: Optional[str] = None) -> list[str]:
    """Write pending search results (all paths, or one); returns the paths written/up to date."""
    with _searches_lock:
        items = (
            list(_searches.values())
            if path is None
            else [s for p, s in _searches.items() if p == os.path.abspath(os.fspath(path))]
        )
    for s in items:
        s.flush()
    return [s.path for s in items]


def reset_sta_search(path: Optional[str] = None) -> None:
    """Forget accumulated search state without writing (tests, new calibration runs)."""
    with _searches_lock:
        if path is None:
            _searches.clear()
        else:
            _searches.pop(os.path.abspath(os.fspath(path)), None)


atexit.register(lambda: flush_sta_search())


def sta_search_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    search: StaSearch,
    step: int,
    layer: int,
    head_offset: int = 0,
    tile_size=DEFAULT_TILE_SIZE,
    text_len: int = 0,
    scale: Optional[float] = None,
    return_lse: bool = False,
    impl: str = "auto",
) -> tuple[Tensor, Optional[Tensor]]:
    """One calibration call: returns exact full attention and records every candidate's per-head
    squared L2 error into ``search`` (q/k/v ``[B, S, heads, D]``, k/v expanded)."""
    layout = make_tile_layout(video_shape, tile_size, text_len)
    B, S, H, D = q.shape
    qt, kt, vt = tile(q, layout), tile(k, layout), tile(v, layout)
    kvv = layout.kv_valid(B, q.device)
    nb = layout.n_blocks
    fi, fc = full_lists(1, 1, nb, nb, device=q.device)
    full_t, lse_t = block_sparse_attention(
        qt, kt, vt, fi, fc, block_size=layout.block_size, scale=scale, kv_valid=kvv, return_lse=return_lse, impl=impl
    )
    full = untile(full_t, layout)
    ref2 = full.float().pow(2).sum(dim=(0, 1, 3))
    err2 = torch.zeros(H, len(search.candidates), dtype=torch.float64, device=q.device)
    for ci, cand in enumerate(search.candidates):
        bm = sta_block_mask(layout, torch.tensor(cand), q.device)
        idx, cnt = block_mask_to_lists(bm)
        o_t, _ = block_sparse_attention(
            qt, kt, vt, idx, cnt, block_size=layout.block_size, scale=scale, kv_valid=kvv, impl=impl
        )
        o = untile(o_t, layout)
        err2[:, ci] = (o.float() - full.float()).pow(2).sum(dim=(0, 1, 3)).double()
    kept = [kept_tiles(c, layout.grid) for c in search.candidates]
    search.record(step, layer, head_offset, err2, ref2, kept)
    lse = untile(lse_t, layout, dim=2) if lse_t is not None else None
    return full, lse
