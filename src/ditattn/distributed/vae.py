"""Parallel VAE decode: the tiles of a tiled decode spread over the ranks.

diffusers' ``AutoencoderKLWan`` decodes large latents in overlapping spatial tiles when tiling is on
(``enable_tiling``; default 256-pixel tiles every 192 pixels): each tile runs through the whole
decoder over all frames, then each tile's top and left edges are blended linearly into its upper and
left neighbours and the stride-sized parts are stitched together.  :func:`parallel_tiled_decode`
computes exactly that with the tiles dealt round-robin over the ranks of a process group: every rank
decodes its tiles, the decoded tiles are all-gathered, and every rank blends all of them in the same
order as the one-device decode, with the VAE's own tile sizes and blend functions — so the result is
the one-device tiled decode's (up to float rounding of the all-gather, i.e. none).

The decoder's cost grows with the tile area, so ``R`` ranks decode ``ceil(tiles / R)`` tiles each;
the all-gather carries every decoded tile (``[B, C, F, tile, tile]`` each) to every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """The tiles of one tiled decode, in the VAE's latent and decoder-output coordinates.

    origins: the latent ``(row, col)`` of every tile's top-left corner in raster order (rows of
    tiles top to bottom, each left to right); rows / cols: the tile grid's shape; tile: the latent
    tile size ``(h, w)``; up: decoder-output pixels per latent pixel; stride / blend: the
    decoder-output stride between tiles and the blended overlap ``(h, w)``; out: the decoded
    size ``(H, W)`` before un-patchifying; latent: the latent size ``(h, w)``.
    """

    origins: tuple[tuple[int, int], ...]
    rows: int
    cols: int
    tile: tuple[int, int]
    up: int
    stride: tuple[int, int]
    blend: tuple[int, int]
    out: tuple[int, int]
    latent: tuple[int, int]

    def size(self, index: int) -> tuple[int, int]:
        """Decoder-output ``(h, w)`` of tile ``index`` (tiles at the bottom and right edges are cut)."""
        i, j = self.origins[index]
        return (
            (min(i + self.tile[0], self.latent[0]) - i) * self.up,
            (min(j + self.tile[1], self.latent[1]) - j) * self.up,
        )


def tile_grid(vae, height: int, width: int) -> TileGrid:
    """The :class:`TileGrid` ``vae`` (diffusers ``AutoencoderKLWan``) uses for a tiled decode of a
    ``height × width`` latent with its current tile settings (``tile_sample_min_*``,
    ``tile_sample_stride_*``; set by ``enable_tiling``)."""
    ratio = vae.spatial_compression_ratio
    patch = vae.config.patch_size or 1
    tile = (vae.tile_sample_min_height // ratio, vae.tile_sample_min_width // ratio)
    step = (vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio)
    stride = (vae.tile_sample_stride_height // patch, vae.tile_sample_stride_width // patch)
    blend = (vae.tile_sample_min_height // patch - stride[0], vae.tile_sample_min_width // patch - stride[1])
    rows, cols = range(0, height, step[0]), range(0, width, step[1])
    return TileGrid(
        origins=tuple((i, j) for i in rows for j in cols),
        rows=len(rows),
        cols=len(cols),
        tile=tile,
        up=ratio // patch,
        stride=stride,
        blend=blend,
        out=(height * ratio // patch, width * ratio // patch),
        latent=(height, width),
    )


def needs_tiles(vae, z: torch.Tensor) -> bool:
    """Whether ``vae`` decodes latents ``z [B, C, T, h, w]`` in tiles when tiling is on (larger than
    one tile in either direction); smaller latents are decoded whole."""
    ratio = vae.spatial_compression_ratio
    return z.shape[-1] > vae.tile_sample_min_width // ratio or z.shape[-2] > vae.tile_sample_min_height // ratio


def decode_tile(vae, z: torch.Tensor) -> torch.Tensor:
    """One tile through the VAE's decoder: latents ``[B, C, T, h, w]`` -> the decoder's output
    ``[B, C', F, h*up, w*up]`` (patchified when the VAE has a ``patch_size``, not clamped), frame by
    frame with the decoder's causal feature cache, as the tiled decode runs each tile."""
    vae.clear_cache()
    frames = []
    for k in range(z.shape[2]):
        vae._conv_idx = [0]
        x = vae.post_quant_conv(z[:, :, k : k + 1])
        frames.append(vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=k == 0))
    vae.clear_cache()
    return torch.cat(frames, dim=2)


def _gather_tiles(
    mine: list[torch.Tensor], grid: TileGrid, world: int, group, like: torch.Tensor
) -> list[torch.Tensor]:
    """Every tile of ``grid``, decoded, on every rank: rank ``r`` holds tiles ``r, r + world, ...``
    (``mine``, in that order); they travel padded to the largest tile in one all-gather (``like``:
    a tensor of the decoder's dtype and device)."""
    n = len(grid.origins)
    per_rank = -(-n // world)
    # channels and frames of a decoded tile (a rank may have no tile: take the largest seen)
    shape = torch.tensor(list(mine[0].shape[:3]) if mine else [0, 0, 0], device=like.device, dtype=torch.int64)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    b, c, f = (int(v) for v in shape.tolist())
    th, tw = grid.tile[0] * grid.up, grid.tile[1] * grid.up
    send = like.new_zeros((per_rank, b, c, f, th, tw))
    for k, t in enumerate(mine):
        send[k, ..., : t.shape[-2], : t.shape[-1]] = t
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send, group=group)
    tiles = []
    for idx in range(n):
        h, w = grid.size(idx)
        tiles.append(recv[idx % world][idx // world, ..., :h, :w])
    return tiles


def parallel_tiled_decode(vae, z: torch.Tensor, group: Optional[object] = None) -> torch.Tensor:
    """``vae.tiled_decode(z)`` with the tiles spread over the ranks of ``group`` (None: the default
    group); call it on every rank of the group with the same ``z``.

    vae: diffusers ``AutoencoderKLWan`` (its tile settings as set by ``enable_tiling``; tiling need
    not be on); z: un-normalised latents ``[B, C, T, h, w]`` in the VAE's dtype and device.  Returns
    the video ``[B, 3, F, H, W]`` in ``[-1, 1]``, the same on every rank and equal to the one-device
    tiled decode.  Latents no larger than one tile are decoded whole on every rank (as the VAE
    decodes them with tiling on).
    """
    if not needs_tiles(vae, z):
        return vae._decode(z).sample
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    grid = tile_grid(vae, z.shape[-2], z.shape[-1])
    th, tw = grid.tile
    mine = [decode_tile(vae, z[:, :, :, i : i + th, j : j + tw]) for i, j in grid.origins[rank::world]]
    flat = _gather_tiles(mine, grid, world, group, z)
    rows = [flat[r * grid.cols : (r + 1) * grid.cols] for r in range(grid.rows)]
    # blend each tile's top edge into the tile above and its left edge into the left one, in the
    # one-device order (the VAE's blend functions update the lower / right tile in place)
    stitched = []
    for r, row in enumerate(rows):
        parts = []
        for c in range(len(row)):
            tile = row[c]
            if r > 0:
                tile = vae.blend_v(rows[r - 1][c], tile, grid.blend[0])
            if c > 0:
                tile = vae.blend_h(row[c - 1], tile, grid.blend[1])
            row[c] = tile
            parts.append(tile[:, :, :, : grid.stride[0], : grid.stride[1]])
        stitched.append(torch.cat(parts, dim=-1))
    dec = torch.cat(stitched, dim=3)[:, :, :, : grid.out[0], : grid.out[1]]
    if vae.config.patch_size is not None:
        dec = unpatchify(dec, patch_size=vae.config.patch_size)
    return dec.clamp(-1.0, 1.0)
