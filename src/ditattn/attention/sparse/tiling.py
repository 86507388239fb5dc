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

Padding positions hold zeros after :func:`tile`; they must be masked out as keys (``valid`` is the
key-validity vector) and are dropped by :func:`untile`.  ``tile``/``untile`` are exact inverses on
the original positions.

With ``block_size == prod(tile_size)`` (the usual case, e.g. 4x4x4 tiles of 64 tokens) every tile
is exactly one block, and ``block_coords[i]`` is the tile coordinate of video block ``i``.
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


class TileLayout:
    """The permutation between original token order and tile order (see module docstring).

    Attributes (all index tensors live on the CPU; :meth:`on` returns a cached copy per device):

    video_shape ``(T, H, W)``; tile_size ``(tt, th, tw)``; text_len; block_size; seq_len
    ``T*H*W + text_len`` (original length); grid ``(nT, nH, nW)`` tiles per axis;
    n_video_blocks; n_special_blocks; n_blocks; padded_len ``n_blocks * block_size``;
    special_ranges: the extra special ranges ``((start, stop), ...)`` of original indices.

    position ``[seq_len]`` int64: where each original token sits in the tiled sequence.
    source ``[padded_len]`` int64: the original index at each tiled position, -1 for padding.
    valid ``[padded_len]`` bool: True where a real token sits (key validity).
    block_tile ``[n_blocks]`` int64: flat tile index ``(tile_t*nH + tile_h)*nW + tile_w`` of each
    video block, -1 for special blocks.
    block_coords ``[n_video_blocks, 3]`` int64: tile coordinate of each video block.
    block_count ``[n_blocks]`` int64: number of real tokens in each block.
    tile_first_block / tile_num_blocks ``[nT*nH*nW]`` int64: the block range of each tile.
    token_tile ``[T*H*W]`` int64: flat tile index of every video token (original order).
    """

    def __init__(self, video_shape, tile_size=DEFAULT_TILE_SIZE, text_len: int = 0,
                 block_size: Optional[int] = None, special_ranges: Iterable[tuple[int, int]] = ()):
        T, H, W = _as_triple("video_shape", video_shape)
        tt, th, tw = _as_triple("tile_size", tile_size)
        if isinstance(text_len, bool) or int(text_len) != text_len or text_len < 0:
            raise AttentionConfigError(f"text_len must be an integer >= 0, got {text_len!r}")
        text_len = int(text_len)
        vol = tt * th * tw
        block_size = vol if block_size is None else int(block_size)
        if block_size <= 0:
            raise AttentionConfigError(f"block_size must be > 0, got {block_size}")
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

        # order the non-special video tokens by (tile, local); compact each tile
        key = tile * vol + local
        key = torch.where(vid_keep, key, torch.full_like(key, n_tiles * vol))
        order = torch.argsort(key, stable=True)
        n_keep = int(vid_keep.sum())
        order = order[:n_keep]
        tile_sorted = tile[order]
        tile_count = torch.bincount(tile_sorted, minlength=n_tiles)
        tile_blocks = (tile_count + block_size - 1) // block_size
        tile_first = torch.cumsum(tile_blocks, 0) - tile_blocks
        tile_tok_start = torch.cumsum(tile_count, 0) - tile_count
        rank = torch.arange(n_keep, dtype=torch.int64) - tile_tok_start[tile_sorted]
        n_video_blocks = int(tile_blocks.sum())
        n_special = int(special.sum())
        n_special_blocks = -(-n_special // block_size)
        n_blocks = n_video_blocks + n_special_blocks
        padded = n_blocks * block_size

        position = torch.empty(seq_len, dtype=torch.int64)
        position[order] = tile_first[tile_sorted] * block_size + rank
        special_idx = torch.nonzero(special, as_tuple=False).flatten()
        position[special_idx] = n_video_blocks * block_size + torch.arange(n_special, dtype=torch.int64)
        source = torch.full((padded,), -1, dtype=torch.int64)
        source[position] = torch.arange(seq_len, dtype=torch.int64)

        block_tile = torch.full((n_blocks,), -1, dtype=torch.int64)
        block_tile[:n_video_blocks] = torch.repeat_interleave(torch.arange(n_tiles), tile_blocks)
        vt = block_tile[:n_video_blocks]
        coords = torch.stack([vt // (nH * nW), (vt // nW) % nH, vt % nW], dim=1)

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
        self.block_count = self.valid.view(n_blocks, block_size).sum(1)
        self.tile_first_block = tile_first
        self.tile_num_blocks = tile_blocks
        self._device_cache: dict = {}
        self._lock = threading.Lock()

    # -------------------------------------------------------------------------------------------
    @property
    def n_tiles(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def one_block_per_tile(self) -> bool:
        """True when every tile is exactly one block (block_size == tile volume, no special video
        tokens): then video block i is tile ``block_tile[i]`` and ``n_video_blocks == n_tiles``."""
        return self.n_video_blocks == self.n_tiles and bool((self.tile_num_blocks == 1).all())

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
        return (f"TileLayout(video_shape={self.video_shape}, tile_size={self.tile_size}, "
                f"text_len={self.text_len}, block_size={self.block_size}, grid={self.grid}, "
                f"video_blocks={self.n_video_blocks}, special_blocks={self.n_special_blocks})")


class _DeviceIndex:
    """A layout's index tensors on one device, built once (see :meth:`TileLayout.on`).

    position ``[seq_len]``, source_clamped ``[padded_len]`` (padding -> 0), pad ``[n_pad]`` (the
    padding positions), valid ``[padded_len]``, block_count ``[n_blocks]``; kv_valid: batch ->
    ``[batch, padded_len]`` view; counts: dtype -> ``block_count`` clamped to >= 1 as
    ``[1, n_blocks, 1, 1]`` of that dtype.
    """

    __slots__ = ("position", "source_clamped", "pad", "valid", "block_count", "kv_valid", "counts")

    def __init__(self, layout: TileLayout, device):
        self.position = layout.position.to(device)
        self.source_clamped = layout.source.clamp(min=0).to(device)
        self.pad = torch.nonzero(layout.source < 0).flatten().to(device)
        self.valid = layout.valid.to(device)
        self.block_count = layout.block_count.to(device)
        self.kv_valid: dict = {}
        self.counts: dict = {}

    def count_as(self, dtype: torch.dtype) -> Tensor:
        got = self.counts.get(dtype)
        if got is None:
            with torch.inference_mode(False):
                got = self.counts.setdefault(dtype, self.block_count.clamp(min=1).to(dtype).view(1, -1, 1, 1))
        return got


@lru_cache(maxsize=256)
def _cached_layout(video_shape, tile_size, text_len, block_size, special_ranges) -> TileLayout:
    with torch.inference_mode(False):  # cached: ordinary tensors even when first built under inference mode
        return TileLayout(video_shape, tile_size, text_len, block_size, special_ranges)


def make_tile_layout(video_shape, tile_size=DEFAULT_TILE_SIZE, text_len: int = 0,
                     block_size: Optional[int] = None,
                     special_ranges: Iterable[tuple[int, int]] = ()) -> TileLayout:
    """The (cached) :class:`TileLayout` of a latent grid ``video_shape=(T, H, W)`` with
    ``text_len`` trailing text tokens, tiles of ``tile_size=(tt, th, tw)`` and blocks of
    ``block_size`` tokens (default: the tile volume).  ``special_ranges``: extra half-open ranges
    of original token indices that are carried, like text, in the trailing special blocks.

    Raises :class:`AttentionConfigError` for non-positive sizes or ranges outside the sequence.
    """
    vs = _as_triple("video_shape", video_shape)
    ts = _as_triple("tile_size", tile_size)
    return _cached_layout(vs, ts, int(text_len), None if block_size is None else int(block_size),
                          tuple((int(a), int(b)) for a, b in special_ranges))


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
    if x.is_cuda and dim < x.dim() - 1 and (math.prod(x.shape[dim + 1:]) * x.element_size()) % 16 == 0:
        try:  # fails (no copy made) when the row is not contiguous or not 16-byte aligned
            wide = x.view(*x.shape[:dim + 1], -1).view(torch.complex128)
        except RuntimeError:
            wide = None
    src = x if wide is None else wide
    out = src.index_select(dim, index)
    if zero is not None and zero.numel():
        out.index_fill_(dim, zero, 0)
    if wide is not None:
        out = out.view(x.dtype).view(*out.shape[:dim + 1], *x.shape[dim + 1:])
    return out


def pooled_blocks(x_tiled: Tensor, layout: TileLayout) -> Tensor:
    """Mean of the real tokens of each block: ``[B, padded_len, H, D]`` -> ``[B, H, n_blocks, D]``
    (float32, or float64 for float64 input; an all-padding block gives zeros)."""
    B, P, H, D = x_tiled.shape
    dt = torch.float64 if x_tiled.dtype == torch.float64 else torch.float32
    xb = x_tiled.reshape(B, layout.n_blocks, layout.block_size, H, D)
    s = xb.sum(2, dtype=dt)  # padding is zero; reads the input dtype, accumulates in dt (no dt copy)
    return (s / layout.on(x_tiled.device).count_as(dt)).permute(0, 2, 1, 3).contiguous()
