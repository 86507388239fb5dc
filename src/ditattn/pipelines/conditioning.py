"""Image conditioning of the Wan image-to-video checkpoints: reading the input image, and the
conditioning tensors each layout feeds its DiT.

Three layouts, told apart by the transformer's input channels against the VAE's latent channels
``z`` (:func:`conditioning_mode`):

* ``t2v`` — text-to-video (``in_channels == z``, no ``expand_timesteps``): no image.
* ``i2v`` — Wan 2.1 I2V and Wan 2.2 I2V-A14B (``in_channels == 2 z + 4``): the DiT input is the noise
  concatenated on channels with a 4-channel first-frame mask and the VAE latents of the video
  ``[image, 0, 0, ...]``; Wan 2.1 I2V (transformer ``image_dim``) also cross-attends to the CLIP
  image tokens (``image_embeds``: the penultimate hidden states of the ``image_encoder``).
* ``ti2v`` — Wan 2.2 TI2V-5B (``in_channels == z`` with ``expand_timesteps``): the first latent frame
  is the VAE latent of the image, kept fixed (timestep 0 on its tokens, per-token timesteps elsewhere);
  without an image the same checkpoint generates from text.

Tensor layouts: latents ``[N, z, T, h, w]`` (``T = (F - 1) / 4 + 1``, ``h = H / s``, ``w = W / s``
with the VAE's temporal and spatial compression), images as float ``[N, 3, H, W]`` in ``[-1, 1]``.
The numbers follow diffusers' ``WanImageToVideoPipeline`` (image resized to the output size with
Lanczos, latents normalised by the VAE's ``latents_mean`` / ``latents_std``, the posterior mode).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import os
import re
import warnings
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from ditattn.errors import AttentionConfigError
from ditattn.pipelines.latents import normalize_latents

log = logging.getLogger("ditattn.pipelines")
MODES = ("t2v", "i2v", "ti2v")
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")  # what PIL must identify an input image as
MIN_IMAGE_SIDE = 16
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # larger inputs are refused before decoding (decompression bombs)
#: the widest aspect ratio (long side : short side) an output sized from its image takes; a more extreme
#: image gets this ratio at the same area (the image is resized to fill the frame)
MAX_IMAGE_ASPECT = 4.0
#: integer modes holding 16-bit samples (16-bit grayscale PNG); scaled to 8 bits, not clipped
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")

ImageInput = Union[str, "os.PathLike[str]", bytes, np.ndarray, Any]  # Any: a PIL.Image.Image


class ImageInputError(AttentionConfigError):
    """An input image that cannot be used (missing file, not an image, unsupported format, size)."""


def conditioning_mode(in_channels: int, z_dim: int, expand_timesteps: bool, temporal: int = 4) -> str:
    """The conditioning layout (one of :data:`MODES`) of a transformer with ``in_channels`` input
    channels next to a VAE of ``z_dim`` latent channels; an unknown combination is an error."""
    if in_channels == z_dim:
        return "ti2v" if expand_timesteps else "t2v"
    if in_channels == 2 * z_dim + temporal:
        return "i2v"
    raise AttentionConfigError(
        f"transformer in_channels {in_channels} does not fit the VAE's {z_dim} latent channels: expected {z_dim} "
        f"(text-to-video / TI2V) or {2 * z_dim + temporal} (image-to-video: noise + mask + condition latents)"
    )


# ------------------------------------------------------------------------------------------------
# reading images


def _check_pil(img, where: str, max_pixels: int):
    fmt = getattr(img, "format", None)
    if fmt is not None and fmt not in IMAGE_FORMATS:
        raise ImageInputError(
            f"{where}: image format {fmt} is not supported; accepted: {', '.join(f.lower() for f in IMAGE_FORMATS)}"
        )
    w, h = img.size
    if min(w, h) < MIN_IMAGE_SIDE:
        raise ImageInputError(f"{where}: image is {w}x{h}; each side must be at least {MIN_IMAGE_SIDE} pixels")
    if w * h > max_pixels:
        raise ImageInputError(f"{where}: image is {w}x{h} ({w * h} pixels); at most {max_pixels} pixels accepted")
    return img


def _to_rgb(img, where: str):
    """``img`` upright (its EXIF orientation applied, as diffusers' ``load_image`` does) in RGB; 16-bit
    samples (:data:`SIXTEEN_BIT_MODES`) are scaled to 8 bits (``round(v * 255 / 65535)``) rather than
    clipped; transparent pixels are composited over white (said in a warning: their hidden colour is often black or
    noise); a mode with no 8-bit RGB form (float ``F``) is refused."""
    from PIL import Image, ImageOps

    try:
        img = ImageOps.exif_transpose(img)
    except (OSError, ValueError, SyntaxError, TypeError, KeyError) as exc:
        raise ImageInputError(f"{where}: the image's EXIF data is damaged ({str(exc)[:120]})") from None
    if img.mode in SIXTEEN_BIT_MODES:
        a = np.asarray(img)
        if a.size and (int(a.min()) < 0 or int(a.max()) > 65535):
            raise ImageInputError(
                f"{where}: a mode-{img.mode} image with values outside 0-65535 cannot be shown in 8 bits; accepted: "
                "8-bit images (L, RGB, RGBA, P) or 16-bit grayscale (I;16)"
            )
        a = (a.astype(np.uint32) * 255 + 32767) // 65535  # 16 -> 8 bits, rounded
        img = Image.fromarray(a.astype(np.uint8), mode="L")
    if img.mode == "F":
        raise ImageInputError(
            f"{where}: float (mode F) images are not accepted; accepted: 8-bit images (L, RGB, RGBA, P), 16-bit "
            "grayscale (I;16) or a uint8 array"
        )
    keyed = img.mode in ("P", "L", "RGB") and "transparency" in img.info  # a palette or colour-key transparency
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or keyed:
        rgba = img.convert("RGBA")
        if rgba.getchannel("A").getextrema()[0] < 255:  # some pixel is (partly) transparent
            log.warning(
                "%s has transparent pixels: they are composited over white (flatten the image onto the background "
                "you want first to choose another)",
                where,
            )
            return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        img = rgba
    try:
        return img.convert("RGB")
    except ValueError:
        raise ImageInputError(
            f"{where}: an image of mode {img.mode} cannot be converted to RGB; accepted: L, RGB, RGBA, P, CMYK "
            "or 16-bit grayscale (I;16)"
        ) from None


def decode_image_bytes(data: bytes, *, where: str = "image", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """An RGB ``PIL.Image`` from encoded bytes (PNG, JPEG, WebP or BMP), checked before the pixels
    are decoded (format, at least 16 pixels a side, at most ``max_pixels``), upright (EXIF orientation
    applied) with 16-bit samples scaled to 8 bits (:func:`_to_rgb`); anything else raises
    :class:`ImageInputError` naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageInputError(f"{where}: empty image data")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is checked below
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError:  # Pillow's own limit, from the header: far beyond any max_pixels
        raise ImageInputError(
            f"{where}: the image header claims more than {2 * Image.MAX_IMAGE_PIXELS} pixels; "
            f"at most {max_pixels} pixels accepted"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        fmt = _sniff_format(data)
        if fmt is not None and fmt not in IMAGE_FORMATS:
            raise ImageInputError(
                f"{where}: image format {fmt} is not supported; accepted: "
                f"{', '.join(f.lower() for f in IMAGE_FORMATS)}"
            ) from None
        raise ImageInputError(
            f"{where}: not a readable image; accepted formats: {', '.join(f.lower() for f in IMAGE_FORMATS)}"
        ) from None
    _check_pil(img, where, max_pixels)
    if getattr(img, "n_frames", 1) > 1:  # animated PNG / WebP: which frame conditions would be a guess
        raise ImageInputError(
            f"{where}: an animated image ({img.n_frames} frames) is not accepted; give the one frame to start from "
            f"as a still {img.format} or JPEG"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
    except Image.DecompressionBombError:
        raise ImageInputError(
            f"{where}: the image is larger than {2 * Image.MAX_IMAGE_PIXELS} pixels; at most "
            f"{max_pixels} pixels accepted"
        ) from None
    except (OSError, ValueError, SyntaxError, MemoryError) as exc:
        raise ImageInputError(f"{where}: the image data is damaged ({str(exc)[:120]})") from None
    return _to_rgb(img, where)


def _sniff_format(data: bytes):
    """The format PIL identifies ``data`` as among all it knows (None when none), without decoding."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as img:
                return img.format
    except Exception:  # noqa: BLE001 - any failure: not an image PIL knows
        return None


def load_image(value: ImageInput, *, where: str = "image", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """An RGB ``PIL.Image`` from a file path (``~`` expanded; not a URL: nothing is downloaded), encoded
    bytes, a PIL image or a uint8 array ``[H, W, 3|4]`` / ``[H, W]``, upright (EXIF orientation applied)
    with 16-bit samples scaled to 8 bits; errors are :class:`ImageInputError` naming ``where``."""
    from PIL import Image

    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and not path.strip():
            raise ImageInputError(f"{where}: expected a non-empty value (leave the setting out for its default)")
        if isinstance(path, str) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path):
            raise ImageInputError(
                f"{where}: remote URLs are not fetched; download the image and give its local path "
                f"(PNG, JPEG, WebP or BMP), got {path[:200]}"
            )
        path = os.path.expanduser(path)
        if os.path.isdir(path):
            raise ImageInputError(f"{where}: {path} is a folder; expected an image file (PNG, JPEG, WebP or BMP)")
        if not os.path.exists(path):
            raise ImageInputError(f"{where}: no such file: {path}")
        if not os.path.isfile(path):
            raise ImageInputError(f"{where}: {path} is not a regular file; expected an image file")
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ImageInputError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
        return decode_image_bytes(data, where=f"{where} {path}", max_pixels=max_pixels)
    if isinstance(value, (bytes, bytearray)):
        return decode_image_bytes(bytes(value), where=where, max_pixels=max_pixels)
    if isinstance(value, Image.Image):
        return _to_rgb(_check_pil(value, where, max_pixels), where)
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim not in (2, 3) or (value.ndim == 3 and value.shape[2] not in (3, 4)):
            raise ImageInputError(
                f"{where}: an array image must be uint8 [H, W, 3], [H, W, 4] or [H, W]; got "
                f"{value.dtype} {list(value.shape)}"
            )
        return _check_pil(Image.fromarray(value), where, max_pixels).convert("RGB")
    raise ImageInputError(
        f"{where}: expected a file path, image bytes, a PIL image or a uint8 array, got {type(value).__name__}"
    )


def batch_images(image, n: int, mode: str) -> Optional[list]:
    """The input images of a batch of ``n`` prompts (one RGB PIL image per prompt; one image given
    serves them all) or None; ``image``: None, one :data:`ImageInput` or a list of 1 or ``n``.
    :class:`AttentionConfigError` when a checkpoint of ``mode`` needs one (``i2v``) and none is
    given, or takes none (``t2v``)."""
    if image is None:
        if mode == "i2v":
            raise AttentionConfigError(
                "this checkpoint is image-to-video: give the first frame (--image PATH; input_reference on the "
                "server; image= in Python)"
            )
        return None
    if mode == "t2v":
        raise AttentionConfigError(
            "this checkpoint is text-to-video and takes no image; image conditioning needs an image-to-video "
            "checkpoint (Wan 2.1 I2V, Wan 2.2 I2V-A14B or TI2V-5B)"
        )
    items = list(image) if isinstance(image, (list, tuple)) else [image]
    if len(items) not in (1, n):
        raise AttentionConfigError(f"image has {len(items)} entries for {n} prompts (give 1 or {n})")
    images = [load_image(x, where="image" if len(items) == 1 else f"image {i}") for i, x in enumerate(items)]
    return images * n if len(images) == 1 else images


def _clamped_aspect(aspect: float) -> float:
    return min(max(aspect, 1.0 / MAX_IMAGE_ASPECT), MAX_IMAGE_ASPECT)


def size_for_image(width: int, height: int, area: int, multiple: int) -> tuple[int, int]:
    """``(height, width)`` with about ``area`` pixels, the aspect ratio of a ``width x height``
    image, each side a positive multiple of ``multiple`` (how Wan sizes image-to-video outputs).
    The aspect ratio is clamped to at most :data:`MAX_IMAGE_ASPECT` : 1 either way, so an extreme
    image (16x10000) keeps the area instead of making a clip many times the default's pixels."""
    aspect = _clamped_aspect(height / width)
    h = max(multiple, int(round(math.sqrt(area * aspect) / multiple)) * multiple)
    w = max(multiple, int(round(math.sqrt(area / aspect) / multiple)) * multiple)
    return h, w


def output_size_for_image(
    image_width: int, image_height: int, height: Optional[int], width: Optional[int], area: int, multiple: int
) -> tuple[int, int]:
    """The ``(height, width)`` of a clip conditioned on a ``image_width x image_height`` image: both
    given are kept; neither: :func:`size_for_image` (``area`` pixels); one: the other from the image's
    aspect ratio (clamped as there), a positive multiple of ``multiple``."""
    if height is not None and width is not None:
        return height, width
    if height is None and width is None:
        return size_for_image(image_width, image_height, area, multiple)
    aspect = _clamped_aspect(image_height / image_width)  # height / width
    if width is None:
        return height, max(multiple, int(round(height / aspect / multiple)) * multiple)
    return max(multiple, int(round(width * aspect / multiple)) * multiple), width


# ------------------------------------------------------------------------------------------------
# conditioning tensors


@dataclasses.dataclass
class ImageCondition:
    """What one batch's images add to the denoise loop.

    mode: ``i2v`` or ``ti2v``; latents: ``i2v``: mask + condition latents ``[N, 4 + z, T, h, w]``
    (concatenated to the noise on channels), ``ti2v``: the image's latent ``[N, z, 1, h, w]``;
    mask: ``ti2v`` only, ``[1, 1, T, h, w]`` float32, 0 on the first latent frame, 1 elsewhere;
    image_embeds: CLIP image tokens ``[N, tokens, image_dim]`` for transformers with ``image_dim``, else
    None.  All float32 on the pipeline's device (image_embeds in the compute dtype).
    """

    mode: str
    latents: torch.Tensor
    mask: Optional[torch.Tensor] = None
    image_embeds: Optional[torch.Tensor] = None

    def model_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The DiT input of noisy ``latents [N, z, T, h, w]`` (float32)."""
        if self.mode == "i2v":
            return torch.cat([latents, self.latents], dim=1)
        return self.finalize(latents)

    def finalize(self, latents: torch.Tensor) -> torch.Tensor:
        """``ti2v``: the first latent frame replaced by the image's latent (else unchanged)."""
        if self.mode != "ti2v":
            return latents
        return (1 - self.mask) * self.latents + self.mask * latents

    def timesteps(self, t: torch.Tensor, batch: int, patch: Sequence[int]) -> Optional[torch.Tensor]:
        """``ti2v``: per-token timesteps ``[batch, T' * H' * W']`` (0 on the image's tokens); else None."""
        if self.mode != "ti2v":
            return None
        pt, ph, pw = patch
        per_token = (self.mask[0, 0][::pt, ::ph, ::pw] * t).flatten()
        return per_token.unsqueeze(0).expand(batch, -1)


def vae_pixels(images: list, height: int, width: int, spatial: int) -> torch.Tensor:
    """PIL images -> ``[N, 3, height, width]`` float32 in ``[-1, 1]`` (diffusers' VideoProcessor:
    resized to the output size with Lanczos)."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=spatial).preprocess(images, height=height, width=width).float()


def clip_image_embeds(
    images: list, image_encoder, image_processor, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """CLIP image tokens ``[N, tokens, image_dim]`` in ``dtype`` of RGB PIL ``images`` (the
    checkpoint's image processor, then the encoder's penultimate hidden states)."""
    px = image_processor(images=images, return_tensors="pt")["pixel_values"].to(device)
    return image_encoder(px.to(image_encoder.dtype)).to(dtype)


def encode_image_condition(
    images: list,
    *,
    mode: str,
    vae,
    height: int,
    width: int,
    num_frames: int,
    temporal: int,
    spatial: int,
    device: torch.device,
    image_embeds: Optional[torch.Tensor] = None,
) -> ImageCondition:
    """The :class:`ImageCondition` of ``images`` (one RGB PIL image per sample) for an output of
    ``num_frames`` frames of ``height x width``: ``vae`` encodes (its posterior mode, normalised);
    ``image_embeds`` (:func:`clip_image_embeds`) are carried along for transformers that take them."""
    n = len(images)
    pixels = vae_pixels(images, height, width, spatial).to(device)  # [N, 3, H, W]
    video = pixels.unsqueeze(2)
    if mode == "i2v":  # the image, then black frames: [N, 3, F, H, W]
        video = torch.cat([video, video.new_zeros(n, 3, num_frames - 1, height, width)], dim=2)
    z = vae.encode(video.to(vae.dtype)).latent_dist.mode().float()
    z = normalize_latents(z, vae.config)
    T, h, w = (num_frames - 1) // temporal + 1, height // spatial, width // spatial
    if mode == "ti2v":
        mask = torch.ones(1, 1, T, h, w, device=device)
        mask[:, :, 0] = 0
        return ImageCondition(mode, z, mask, image_embeds)
    # the mask has one channel per frame of the first latent frame's temporal group (4), 1 on the image
    frame_mask = torch.zeros(n, 1, num_frames, h, w, device=device)
    frame_mask[:, :, 0] = 1
    frame_mask = torch.cat([frame_mask[:, :, :1].repeat_interleave(temporal, dim=2), frame_mask[:, :, 1:]], dim=2)
    mask = frame_mask.view(n, -1, temporal, h, w).transpose(1, 2)  # [N, temporal, T, h, w]
    return ImageCondition(mode, torch.cat([mask, z], dim=1), None, image_embeds)


def image_condition(
    images: list,
    *,
    mode: str,
    components: dict,
    placement,
    height: int,
    width: int,
    num_frames: int,
    temporal: int,
    spatial: int,
    device: torch.device,
    dtype: torch.dtype,
    clip: bool,
) -> ImageCondition:
    """The batch's :class:`ImageCondition` from a pipeline's ``components``: the CLIP tokens of the
    ``image_encoder`` / ``image_processor`` when the DiT takes them (``clip``), then the ``vae``
    latents (:func:`encode_image_condition`), each component on the device while it runs
    (``placement``: the pipeline's :class:`~ditattn.pipelines.offload.ComponentPlacement`)."""
    embeds = None
    if clip:
        with placement.use("image_encoder"):
            embeds = clip_image_embeds(
                images, components["image_encoder"], components["image_processor"], device, dtype
            )
    with placement.use("vae"):
        return encode_image_condition(
            images,
            mode=mode,
            vae=components["vae"],
            height=height,
            width=width,
            num_frames=num_frames,
            temporal=temporal,
            spatial=spatial,
            device=device,
            image_embeds=embeds,
        )
