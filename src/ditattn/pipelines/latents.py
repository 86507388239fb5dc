"""The latent space of a Wan checkpoint as the pipelines use it.

:class:`VideoGeometry` is what maps a video to latents and to DiT tokens — the VAE's temporal and
spatial compression and latent channels, the DiT's patch size and input channels — with the size
rules that follow (:meth:`VideoGeometry.check_size`).  The native pipeline builds it from its
loaded components; the diffusers backend from the checkpoint's configs alone, before loading
(:meth:`VideoGeometry.from_model_index`).

The initial noise of a generation: :func:`prepare_latents`.  Latents are normalised by the VAE's
``latents_mean`` / ``latents_std`` (as diffusers' Wan pipelines do): :func:`normalize_latents` after encoding,
:func:`decode_latents` undoes it before
decoding.  Layouts: video ``[N, F, H, W, 3]``; latents ``[N, z, T, h, w]`` with
``T = (F - 1) / temporal + 1``, ``h = H / spatial``, ``w = W / spatial``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import numpy as np
import torch

from ditattn.errors import AttentionConfigError


@dataclasses.dataclass(frozen=True)
class VideoGeometry:
    """z_dim: latent channels; temporal / spatial: the VAE's compression (frames ``1 + temporal k``
    become ``1 + k`` latent frames; ``spatial`` pixels one latent row or column); patch: the DiT's
    ``(p_t, p_h, p_w)``; in_channels: the DiT's input channels; expand_timesteps: per-token
    timesteps (Wan 2.2 TI2V).  With ``in_channels`` and ``z_dim`` they decide the image
    conditioning layout (:func:`ditattn.pipelines.conditioning.conditioning_mode`)."""

    z_dim: int
    temporal: int = 4
    spatial: int = 8
    patch: tuple = (1, 2, 2)
    in_channels: int = 16
    expand_timesteps: bool = False

    @classmethod
    def from_configs(cls, vae: Mapping, transformer: Mapping, expand_timesteps: bool = False) -> "VideoGeometry":
        """From the VAE's ``config.json`` (empty: Wan 2.1's VAE factors, the DiT's output channels)
        and the transformer's (``in_channels``, ``out_channels``, ``patch_size``)."""
        in_channels = int(transformer.get("in_channels") or 16)
        return cls(
            z_dim=int(vae.get("z_dim") or transformer.get("out_channels") or in_channels),
            temporal=int(vae.get("scale_factor_temporal") or 4),
            spatial=int(vae.get("scale_factor_spatial") or 8),
            patch=tuple(int(p) for p in transformer.get("patch_size") or (1, 2, 2)),
            in_channels=in_channels,
            expand_timesteps=bool(expand_timesteps),
        )

    @classmethod
    def from_model_index(cls, mi) -> "VideoGeometry":
        """From the configs in the checkpoint folder of ``mi`` (a
        :class:`~ditattn.pipelines.model_index.ModelIndex`): its VAE's and its first DiT's."""
        from ditattn.models.weights import read_json

        vae = read_json(os.path.join(mi.folder("vae"), "config.json"))
        comp = "transformer" if "transformer" in mi.components else "transformer_2"
        tr = read_json(os.path.join(mi.folder(comp), "config.json"))
        return cls.from_configs(vae, tr, bool(mi.config.get("expand_timesteps")))

    @property
    def size_multiple(self) -> int:
        """Heights and widths must be multiples of this (VAE stride x patch size)."""
        return self.spatial * max(self.patch[1], self.patch[2])

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """``(z, T, h, w)``: one sample's latents for a ``num_frames x height x width`` video."""
        return (self.z_dim, (num_frames - 1) // self.temporal + 1, height // self.spatial, width // self.spatial)

    def check_size(self, height: int, width: int, num_frames: int, *, flags: bool = False) -> None:
        """Raise :class:`AttentionConfigError` unless the size is one this model can generate
        (``flags``: name the values as the CLI's ``--height`` / ``--width`` / ``--num-frames``)."""
        names = ("--height", "--width", "--num-frames") if flags else ("height", "width", "num_frames")
        mult = self.size_multiple
        for what, v in zip(names, (height, width)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % mult:
                raise AttentionConfigError(f"{what} {v!r} is not supported; accepted: positive multiples of {mult}")
        st = self.temporal
        if not isinstance(num_frames, int) or isinstance(num_frames, bool) or num_frames < 1 or (num_frames - 1) % st:
            raise AttentionConfigError(
                f"{names[2]} {num_frames!r} is not supported; accepted: 1 + {st}k (1, {1 + st}, {1 + 2 * st}, ...)"
            )


def prepare_latents(
    shape: tuple[int, int, int, int], seeds: list[int], device: torch.device, latents: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The initial noise ``[len(seeds), *shape]`` float32 on ``device``: one standard normal sample
    per seed, each from its own CPU generator (a clip does not depend on what it is batched with),
    or the given ``latents`` (their shape checked: :class:`AttentionConfigError` otherwise)."""
    if latents is None:
        latents = torch.stack(
            [torch.randn(shape, generator=torch.Generator("cpu").manual_seed(s), dtype=torch.float32) for s in seeds]
        )
    elif tuple(latents.shape) != (len(seeds), *shape):
        raise AttentionConfigError(f"latents must have shape {(len(seeds), *shape)}, got {tuple(latents.shape)}")
    return latents.to(device, torch.float32)


def _latent_stats(vae_config, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, 1 / std)`` of the VAE's latents, each ``[1, z, 1, 1, 1]`` in ``z``'s dtype and device."""
    mean = torch.tensor(vae_config.latents_mean, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae_config.latents_std, dtype=z.dtype, device=z.device).view(1, -1, 1, 1, 1)
    return mean, inv_std


def normalize_latents(z: torch.Tensor, vae_config) -> torch.Tensor:
    """Raw VAE latents ``[N, z, T, h, w]`` -> the normalised latents the DiT works in."""
    mean, inv_std = _latent_stats(vae_config, z)
    return (z - mean) * inv_std


def decode_latents(
    vae,
    latents: torch.Tensor,
    device: torch.device,
    *,
    parallel: bool = False,
    progress: bool = False,
    check_stop=None,
) -> np.ndarray:
    """Normalised latents ``[N, z, T, h, w]`` -> float32 frames in [0, 1], ``np.ndarray [N, F, H, W, 3]``
    (``vae``: diffusers' ``AutoencoderKLWan``, decoding on ``device`` in its own dtype).  ``parallel``:
    every rank of the default process group calls this with the same latents and the VAE's tiled decode
    is spread over them (:func:`ditattn.distributed.vae.parallel_tiled_decode`; the same frames).
    ``progress``: a bar on stderr counting the decoder's calls (one per latent frame and sample, more
    with tiling), shown on a terminal only.  ``check_stop``: optional callable called before each call
    of the VAE's decoder (diffusers decodes one latent frame per call), so that it can stop a long
    decode by raising; ignored with ``parallel`` (a stop on one rank alone would hang the collective)."""
    from ditattn.pipelines.loading import progress_bar

    z = latents.to(device, vae.dtype)
    mean, inv_std = _latent_stats(vae.config, z)
    z = z / inv_std + mean
    tiled = parallel or getattr(vae, "use_tiling", False)
    bar = progress_bar(
        total=None if tiled else z.shape[0] * z.shape[2], desc="decoding", unit="frame", enabled=progress
    )
    decoder = getattr(vae, "decoder", None)
    hooks = []
    if isinstance(decoder, torch.nn.Module):
        # A hook's non-None return value replaces the module's output (or arguments): tqdm's update()
        # returns True when it redraws, so neither hook may pass on what it calls.
        def count(*_):
            bar.update(1)

        def stop_point(*_):
            check_stop()

        hooks.append(decoder.register_forward_hook(count))
        if check_stop is not None and not parallel:
            hooks.append(decoder.register_forward_pre_hook(stop_point))
    try:
        if parallel:
            from ditattn.distributed.vae import parallel_tiled_decode

            video = parallel_tiled_decode(vae, z)
        else:
            video = vae.decode(z, return_dict=False)[0]  # [N, 3, F, H, W] in [-1, 1]
    finally:
        for hook in hooks:
            hook.remove()
        bar.close()
    video = (video.float() / 2 + 0.5).clamp(0, 1)
    return video.permute(0, 2, 3, 4, 1).cpu().numpy()
