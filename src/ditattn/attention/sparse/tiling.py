"""3-D tile layout of video tokens for block-sparse attention.

Video tokens arrive in T-major raster order (``index = (t * H + h) * W + w``) followed by ``text_len``
text tokens.  A :class:`TileLayout` permutes them so that every 3-D tile of ``tile_size`` latent
tokens occupies whole blocks of ``block_size`` contiguous positions:

* tiles are ordered ``(tile_t, tile_h, tile_w)`` row-major; inside a tile the tokens keep their
  ``(t, h, w)`` row-major order;
* a tile holds ``ceil(n_tokens_in_tile / block_size)`` blocks; a partial tile (the grid does not
  divide by the tile size, or some of its tokens are "special", see below) is compacted to the
  front of its blocks and the rest of its last block is padding;
* "special" tokens — every text token, plus optional extra ranges of the original sequence such as
  Sol's exact KV sinks — are not tiled; they follow the video blocks, in original order, as
  ``n_special_blocks`` trailing blocks (the last one padded).

Packed edge tiles (``edge_tiles="packed"``): where the grid does not divide by the tile size, the
tiles of the last slab along an axis are cut by the grid edge (at 21x30x52 in 4x4x4 tiles: 1x4x4 =
16-token tiles in the 1-frame last slab of time, 4x2x4 = 32-token tiles in the 2-row last slab of
height), and padding each to a whole block costs 624 blocks for 512 blocks' worth of tokens.  A
packed layout puts several such *edge tiles* into one block:

* an edge tile is a tile whose extent is cut by the grid edge and whose (non-special) tokens fit in
  less than one block; edge tiles of the same extent form a box of tiles;
* each box is walked in boustrophedon (serpentine) order over its tile coordinates — every step
  goes to a face neighbour — and cut greedily into runs whose token counts sum to at most
  ``block_size``; each run is one block: a connected chain of whole edge tiles of one shape;
* every other tile keeps its own blocks as above.  Units (a tile, or a packed run) are ordered by
  their first tile in ``(tile_t, tile_h, tile_w)`` order; inside a run, tile by tile in walk order.

A packed block has its own token count (``block_count``) and centroid (``block_centroid``, the mean
tile coordinate of its real tokens).  The block count approaches ``ceil(n_video / block_size)``
(21x30x52: 513 blocks for 32,760 tokens, 512 minimum; 21x45x80: 1,182, the minimum).

Padding positions hold zeros after :func:`tile`; they must be masked out as keys (``valid`` is the
key-validity vector) and are dropped by :func:`untile`.  ``tile``/``untile`` are exact inverses on
the original positions.

With ``block_size == prod(tile_size)`` (the usual case, e.g. 4x4x4 tiles of 64 tokens) and no
packing every tile is exactly one block, and ``block_coords[i]`` is the tile coordinate of video
block ``i``.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache
from typing import Iterable, Optional

import torch

from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

DEFAULT_TILE_SIZE = (4, 4, 4)
#: how tiles cut by the grid edge are laid out (module docstring)
EDGE_TILE_MODES = ("padded", "packed")


def _as_triple(name: str, value, *, positive: bool = True) -> tuple[int, int, int]:
    try:
        items = tuple(int(v) for v in value)
    except TypeError:
        raise AttentionConfigError(f"{name} must be three integers (T, H, W), got {value!r}") from None
    if len(items) != 3 or any(isinstance(v, bool) for v in value):
        raise AttentionConfigError(f"{name} must be three integers (T, H, W), got {value!r}")
    if positive and any(v <= 0 for v in items):
        raise AttentionConfigError(f"{name} must be three positive integers, got {value!r}")
    return items  # type: ignore[return-value]


def check_edge_tiles(value) -> str:
    """``value`` if it is one of :data:`EDGE_TILE_MODES`, else :class:`AttentionConfigError`."""
    if value not in EDGE_TILE_MODES:
        raise AttentionConfigError(f"edge_tiles must be one of {list(EDGE_TILE_MODES)}, got {value!r}")
    return value


def serpentine_order(coords: Tensor) -> Tensor:
    """Boustrophedon walk of a box of tile coordinates: ``coords [N, 3]`` int64 (all points of a
    box, any order) -> the permutation of ``0..N-1`` visiting them so that each step moves to a
    face neighbour (the last axis runs back and forth, the middle axis turns at each end, ...)."""
    r = coords - coords.min(0).values
    dims = r.max(0).values + 1
    mid = torch.where(r[:, 0] % 2 == 0, r[:, 1], dims[1] - 1 - r[:, 1])
    row = r[:, 0] * dims[1] + mid
    last = torch.where(row % 2 == 0, r[:, 2], dims[2] - 1 - r[:, 2])
    return torch.argsort(row * dims[2] + last)


def _pack_edge_tiles(
    tile_coords: Tensor, extent: Tensor, tile_count: Tensor, vol: int, block_size: int
) -> tuple[Tensor, Tensor]:
    """``(unit_key [n_tiles], member_rank [n_tiles])``: each packed run of edge tiles (module
    docstring) gets the smallest flat index of its tiles as key and its tiles their rank in the
    walk; every other tile is its own unit (key = its index, rank 0)."""
    n_tiles = tile_coords.shape[0]
    unit_key = torch.arange(n_tiles, dtype=torch.int64)
    member_rank = torch.zeros(n_tiles, dtype=torch.int64)
    cand = (extent.prod(1) < vol) & (tile_count > 0) & (tile_count < block_size)
    if not bool(cand.any()):
        return unit_key, member_rank
    for shape in torch.unique(extent[cand], dim=0):
        ids = torch.nonzero(cand & (extent == shape).all(1)).flatten()
        walk = ids[serpentine_order(tile_coords[ids])].tolist()
        counts = tile_count[walk].tolist()
        run: list[int] = []
        filled = 0
        for tid, n in zip(walk + [-1], counts + [block_size + 1]):  # a sentinel closes the last run
            if run and filled + n > block_size:
                unit_key[run] = min(run)
                member_rank[run] = torch.arange(len(run))
                run, filled = [], 0
            run.append(tid)
            filled += n
    return unit_key, member_rank


class TileLayout:
    """The permutation between original token order and tile order (see module docstring).

    Attributes (all index tensors live on the CPU; :meth:`on` returns a cached copy per device):

    video_shape ``(T, H, W)``; tile_size ``(tt, th, tw)``; text_len; block_size; seq_len
    ``T*H*W + text_len`` (original length); grid ``(nT, nH, nW)`` tiles per axis; edge_tiles
    (``"padded"`` or ``"packed"``); n_video_blocks; n_special_blocks; n_blocks; padded_len
    ``n_blocks * block_size``; n_packed_blocks (blocks holding more than one tile);
    special_ranges: the extra special ranges ``((start, stop), ...)`` of original indices.

    position ``[seq_len]`` int64: where each original token sits in the tiled sequence.
    source ``[padded_len]`` int64: the original index at each tiled position, -1 for padding.
    valid ``[padded_len]`` bool: True where a real token sits (key validity).
    block_tile ``[n_blocks]`` int64: flat tile index ``(tile_t*nH + tile_h)*nW + tile_w`` of each
    video block (of a packed block: its tile with the smallest flat index), -1 for special blocks.
    block_coords ``[n_video_blocks, 3]`` int64: tile coordinate of ``block_tile``.
    block_centroid ``[n_video_blocks, 3]`` float64: mean tile coordinate of each video block's real
    tokens (a tile's own coordinate for a block of one tile).
    block_count ``[n_blocks]`` int64: number of real tokens in each block.
    tile_first_block / tile_num_blocks ``[nT*nH*nW]`` int64: the block range holding each tile
    (a packed tile: its one shared block; a tile with no token: 0 blocks).
    token_tile ``[T*H*W]`` int64: flat tile index of every video token (original order).
    """

    def __init__(
        self,
        video_shape,
        tile_size=DEFAULT_TILE_SIZE,
        text_len: int = 0,
        block_size: Optional[int] = None,
        special_ranges: Iterable[tuple[int, int]] = (),
        edge_tiles: str = "padded",
    ):
        T, H, W = _as_triple("video_shape", video_shape)
        tt, th, tw = _as_triple("tile_size", tile_size)
        if isinstance(text_len, bool) or int(text_len) != text_len or text_len < 0:
            raise AttentionConfigError(f"text_len must be an integer >= 0, got {text_len!r}")
        text_len = int(text_len)
        vol = tt * th * tw
        block_size = vol if block_size is None else int(block_size)
        if block_size <= 0:
            raise AttentionConfigError(f"block_size must be > 0, got {block_size}")
        self.edge_tiles = check_edge_tiles(edge_tiles)
        n_video = T * H * W
        seq_len = n_video + text_len
        ranges = []
        for start, stop in special_ranges:
            start, stop = int(start), int(stop)
            if not 0 <= start <= stop <= seq_len:
                raise AttentionConfigError(
                    f"special token range [{start}, {stop}) lies outside the sequence of {seq_len} tokens"
                )
            if stop > start:
                ranges.append((start, stop))
        self.video_shape = (T, H, W)
        self.tile_size = (tt, th, tw)
        self.text_len = text_len
        self.block_size = block_size
        self.seq_len = seq_len
        self.special_ranges = tuple(ranges)
        nT, nH, nW = -(-T // tt), -(-H // th), -(-W // tw)
        self.grid = (nT, nH, nW)
        n_tiles = nT * nH * nW

        idx = torch.arange(n_video, dtype=torch.int64)
        t = idx // (H * W)
        h = (idx // W) % H
        w = idx % W
        tile = ((t // tt) * nH + (h // th)) * nW + (w // tw)
        local = ((t % tt) * th + (h % th)) * tw + (w % tw)
        self.token_tile = tile

        special = torch.zeros(seq_len, dtype=torch.bool)
        special[n_video:] = True
        for start, stop in ranges:
            special[start:stop] = True
        vid_keep = ~special[:n_video]
        tile_count = torch.bincount(tile[vid_keep], minlength=n_tiles)
        tid = torch.arange(n_tiles, dtype=torch.int64)
        tile_coords = torch.stack([tid // (nH * nW), (tid // nW) % nH, tid % nW], dim=1)

        # units: a tile, or (packed) a run of edge tiles; ordered by their smallest tile index
        if self.edge_tiles == "packed":
            extent = torch.minimum(
                torch.tensor([tt, th, tw]), torch.tensor([T, H, W]) - tile_coords * torch.tensor([tt, th, tw])
            )
            unit_key, member_rank = _pack_edge_tiles(tile_coords, extent, tile_count, vol, block_size)
        else:
            unit_key, member_rank = tid, torch.zeros(n_tiles, dtype=torch.int64)
        present = tile_count > 0
        units = torch.unique(unit_key[present])  # sorted
        unit_of_tile = torch.searchsorted(units, unit_key)  # for a tile with no token: the next unit
        n_units = units.numel()
        max_rank = int(member_rank.max()) + 1 if n_tiles else 1

        # order the non-special video tokens by (unit, rank in unit, local); compact each unit
        key = (unit_key[tile] * max_rank + member_rank[tile]) * vol + local
        key = torch.where(vid_keep, key, torch.full_like(key, n_tiles * max_rank * vol))
        order = torch.argsort(key, stable=True)
        n_keep = int(vid_keep.sum())
        order = order[:n_keep]
        unit_sorted = unit_of_tile[tile[order]]
        unit_count = torch.bincount(unit_sorted, minlength=n_units)
        unit_blocks = (unit_count + block_size - 1) // block_size
        unit_first = torch.cumsum(unit_blocks, 0) - unit_blocks
        unit_tok_start = torch.cumsum(unit_count, 0) - unit_count
        rank = torch.arange(n_keep, dtype=torch.int64) - unit_tok_start[unit_sorted]
        n_video_blocks = int(unit_blocks.sum())
        n_special = int(special.sum())
        n_special_blocks = -(-n_special // block_size)
        n_blocks = n_video_blocks + n_special_blocks
        padded = n_blocks * block_size

        position = torch.empty(seq_len, dtype=torch.int64)
        position[order] = unit_first[unit_sorted] * block_size + rank
        special_idx = torch.nonzero(special, as_tuple=False).flatten()
        position[special_idx] = n_video_blocks * block_size + torch.arange(n_special, dtype=torch.int64)
        source = torch.full((padded,), -1, dtype=torch.int64)
        source[position] = torch.arange(seq_len, dtype=torch.int64)

        block_tile = torch.full((n_blocks,), -1, dtype=torch.int64)
        block_tile[:n_video_blocks] = torch.repeat_interleave(units, unit_blocks)
        vt = block_tile[:n_video_blocks]
        coords = torch.stack([vt // (nH * nW), (vt // nW) % nH, vt % nW], dim=1)
        tok_block = position[order] // block_size
        centroid = torch.zeros(n_video_blocks, 3, dtype=torch.float64).index_add_(
            0, tok_block, tile_coords[tile[order]].to(torch.float64)
        )
        centroid /= torch.bincount(tok_block, minlength=n_video_blocks).clamp(min=1).unsqueeze(1)
        unit_first_ext = torch.cat([unit_first, torch.tensor([n_video_blocks])])
        tile_first = unit_first_ext[unit_of_tile]
        tile_blocks = torch.where(
            present,
            torch.cat([unit_blocks, torch.zeros(1, dtype=torch.int64)])[unit_of_tile],
            torch.zeros_like(tile_first),
        )

        self.n_video_blocks = n_video_blocks
        self.n_special_blocks = n_special_blocks
        self.n_blocks = n_blocks
        self.padded_len = padded
        self.n_special = n_special
        self.position = position
        self.source = source
        self.valid = source >= 0
        self.block_tile = block_tile
        self.block_coords = coords
        self.block_centroid = centroid
        self.block_count = self.valid.view(n_blocks, block_size).sum(1)
        self.tile_first_block = tile_first
        self.tile_num_blocks = tile_blocks
        self.n_packed_blocks = int((torch.bincount(unit_key[present], minlength=n_tiles) > 1).sum())
        self._device_cache: dict = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------------------------------------
    @property
    def n_tiles(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def one_block_per_tile(self) -> bool:
        """True when every tile is exactly one block (block_size == tile volume, no special video
        tokens, no packing): then video block i is tile ``block_tile[i]`` and ``n_video_blocks == n_tiles``."""
        return self.n_video_blocks == self.n_tiles and bool((self.tile_num_blocks == 1).all())

    def block_tile_pairs(self) -> tuple[Tensor, Tensor]:
        """``(blocks, tiles)`` int64: one pair per (video block, tile with tokens in that block)."""
        tiles = torch.nonzero(self.tile_num_blocks > 0).flatten()
        nb = self.tile_num_blocks[tiles]
        first = self.tile_first_block[tiles]
        offs = torch.arange(int(nb.sum())) - torch.repeat_interleave(torch.cumsum(nb, 0) - nb, nb)
        return torch.repeat_interleave(first, nb) + offs, torch.repeat_interleave(tiles, nb)

    def on(self, device) -> "_DeviceIndex":
        """Index tensors of this layout on ``device`` (cached)."""
        device = torch.device(device)
        key = str(device)
        got = self._device_cache.get(key)
        if got is None:
            with self._lock:
                got = self._device_cache.get(key)
                if got is None:
                    with torch.inference_mode(False):  # cached constants: ordinary tensors even when first
                        got = _DeviceIndex(self, device)  # built under inference mode (kernels cache on them)
                    self._device_cache[key] = got
        return got

    @property
    def has_padding(self) -> bool:
        """True when some tiled position is padding (then keys need the validity mask)."""
        return self.padded_len != self.seq_len

    def kv_valid(self, batch: int, device=None) -> Optional[Tensor]:
        """Key validity ``[batch, padded_len]`` bool (a broadcast view; do not write to it), or
        None when the layout has no padding (every key valid: the kernels skip the mask)."""
        if not self.has_padding:
            return None
        idx = self.on(device or "cpu")
        got = idx.kv_valid.get(batch)
        if got is None:  # the same view object per batch size (kernels may cache by identity)
            with torch.inference_mode(False):
                got = idx.kv_valid.setdefault(batch, idx.valid.unsqueeze(0).expand(batch, -1))
        return got

    def __repr__(self) -> str:
        return (
            f"TileLayout(video_shape={self.video_shape}, tile_size={self.tile_size}, "
            f"text_len={self.text_len}, block_size={self.block_size}, grid={self.grid}, "
            f"edge_tiles={self.edge_tiles!r}, video_blocks={self.n_video_blocks}, "
            f"special_blocks={self.n_special_blocks})"
        )


class _DeviceIndex:
    """A layout's index tensors on one device, built once (see :meth:`TileLayout.on`).

    position ``[seq_len]``, source_clamped ``[padded_len]`` (padding -> 0), pad ``[n_pad]`` (the
    padding positions), valid ``[padded_len]``, block_count ``[n_blocks]``, chunk_of_block ``[n_video_blocks]``
    (each video block's tile renumbered over the non-empty tiles in tile order) and n_chunks (the number of
    non-empty tiles, a Python int); kv_valid: batch ->
    ``[batch, padded_len]`` view; counts: dtype -> ``block_count`` clamped to >= 1 as
    ``[1, n_blocks, 1, 1]`` of that dtype.
    """

    __slots__ = (
        "position",
        "source_clamped",
        "pad",
        "valid",
        "block_count",
        "chunk_of_block",
        "n_chunks",
        "kv_valid",
        "counts",
    )

    def __init__(self, layout: TileLayout, device):
        self.position = layout.position.to(device)
        self.source_clamped = layout.source.clamp(min=0).to(device)
        self.pad = torch.nonzero(layout.source < 0).flatten().to(device)
        self.valid = layout.valid.to(device)
        self.block_count = layout.block_count.to(device)
        present = torch.nonzero(layout.tile_num_blocks > 0, as_tuple=False).flatten()
        remap = torch.full((layout.n_tiles,), -1, dtype=torch.int64)
        remap[present] = torch.arange(present.numel())
        self.chunk_of_block = remap[layout.block_tile[: layout.n_video_blocks]].to(device)
        self.n_chunks = int(present.numel())
        self.kv_valid: dict = {}
        self.counts: dict = {}

    def count_as(self, dtype: torch.dtype) -> Tensor:
        got = self.counts.get(dtype)
        if got is None:
            with torch.inference_mode(False):
                got = self.counts.setdefault(dtype, self.block_count.clamp(min=1).to(dtype).view(1, -1, 1, 1))
        return got


@lru_cache(maxsize=256)
def _cached_layout(video_shape, tile_size, text_len, block_size, special_ranges, edge_tiles) -> TileLayout:
    with torch.inference_mode(False):  # cached: ordinary tensors even when first built under inference mode
        return TileLayout(video_shape, tile_size, text_len, block_size, special_ranges, edge_tiles)


def make_tile_layout(
    video_shape,
    tile_size=DEFAULT_TILE_SIZE,
    text_len: int = 0,
    block_size: Optional[int] = None,
    special_ranges: Iterable[tuple[int, int]] = (),
    edge_tiles: str = "padded",
) -> TileLayout:
    """The (cached) :class:`TileLayout` of a latent grid ``video_shape=(T, H, W)`` with
    ``text_len`` trailing text tokens, tiles of ``tile_size=(tt, th, tw)`` and blocks of
    ``block_size`` tokens (default: the tile volume).  ``special_ranges``: extra half-open ranges
    of original token indices that are carried, like text, in the trailing special blocks.
    ``edge_tiles``: ``"padded"`` (each tile its own blocks) or ``"packed"`` (edge tiles cut by the
    grid packed several to a block; module docstring).

    Raises :class:`AttentionConfigError` for non-positive sizes, ranges outside the sequence or an
    unknown ``edge_tiles``.
    """
    vs = _as_triple("video_shape", video_shape)
    ts = _as_triple("tile_size", tile_size)
    return _cached_layout(
        vs,
        ts,
        int(text_len),
        None if block_size is None else int(block_size),
        tuple((int(a), int(b)) for a, b in special_ranges),
        check_edge_tiles(edge_tiles),
    )


def tile(x: Tensor, layout: TileLayout, dim: int = 1) -> Tensor:
    """Permute ``x`` (original order along ``dim``, length ``layout.seq_len``) into tile order.

    ``x``: e.g. ``[B, S, H, D]`` with ``dim=1``.  Returns a new tensor with ``layout.padded_len``
    along ``dim``; padding positions are zero.
    """
    if x.shape[dim] != layout.seq_len:
        raise AttentionConfigError(
            f"sequence length {x.shape[dim]} does not match the latent grid {layout.video_shape} "
            f"({math.prod(layout.video_shape)} video tokens) + text_len {layout.text_len} = {layout.seq_len}"
        )
    idx = layout.on(x.device)
    return gather_rows(x, dim, idx.source_clamped, zero=idx.pad)


def untile(y: Tensor, layout: TileLayout, dim: int = 1) -> Tensor:
    """Inverse of :func:`tile`: gather the ``layout.seq_len`` original positions back (padding is
    dropped).  ``y`` has ``layout.padded_len`` along ``dim``."""
    if y.shape[dim] != layout.padded_len:
        raise ValueError(f"untile expects {layout.padded_len} positions along dim {dim}, got {y.shape[dim]}")
    return gather_rows(y, dim, layout.on(y.device).position)


def gather_rows(x: Tensor, dim: int, index: Tensor, zero: Optional[Tensor] = None) -> Tensor:
    """``x.index_select(dim, index)`` (a new contiguous tensor), then the output positions in
    ``zero`` (int64 indices along ``dim``) set to 0.

    A pure copy.  On CUDA, when the dims after ``dim`` form one contiguous row whose size is a
    multiple of 16 bytes, rows move as 16-byte words (the same bytes, fewer and wider accesses).
    """
    dim = dim % x.dim()
    wide = None
    if x.is_cuda and dim < x.dim() - 1 and (math.prod(x.shape[dim + 1 :]) * x.element_size()) % 16 == 0:
        try:  # fails (no copy made) when the row is not contiguous or not 16-byte aligned
            wide = x.view(*x.shape[: dim + 1], -1).view(torch.complex128)
        except RuntimeError:
            wide = None
    src = x if wide is None else wide
    out = src.index_select(dim, index)
    if zero is not None and zero.numel():
        out.index_fill_(dim, zero, 0)
    if wide is not None:
        out = out.view(x.dtype).view(*out.shape[: dim + 1], *x.shape[dim + 1 :])
    return out


def pooled_blocks(
    x_tiled: Tensor, layout: TileLayout, n_blocks: Optional[int] = None, *, scale: Optional[float] = None
) -> Tensor:
    """Mean of the real tokens of each of the first ``n_blocks`` blocks (default: all), times
    ``scale`` when given: ``[B, padded_len, H, D]`` -> ``[B, H, n_blocks, D]`` (float32, or float64
    for float64 input; an all-padding block gives zeros)."""
    B, P, H, D = x_tiled.shape
    n = layout.n_blocks if n_blocks is None else int(n_blocks)
    dt = torch.float64 if x_tiled.dtype == torch.float64 else torch.float32
    xb = x_tiled[:, : n * layout.block_size].reshape(B, n, layout.block_size, H, D)
    s = xb.sum(2, dtype=dt)  # padding is zero; reads the input dtype, accumulates in dt (no dt copy)
    s.div_(layout.on(x_tiled.device).count_as(dt)[:, :n])
    if scale is not None:
        s.mul_(scale)
    return s.permute(0, 2, 1, 3).contiguous()
