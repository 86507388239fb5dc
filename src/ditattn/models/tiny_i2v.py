"""The built-in tiny image-to-video checkpoints (random weights, built locally, no download).

Each mirrors the layout of a released Wan image-to-video checkpoint at toy size, written with the
diffusers / transformers classes of that checkpoint (``save_pretrained``), so the native pipeline is
tested against diffusers' own pipelines on them:

* ``ditattn:tiny-wan-i2v`` — Wan2.1-I2V-14B: ``WanImageToVideoPipeline`` with ``image_encoder``
  (``CLIPVisionModel``: 3 layers, width 64, 32-pixel images in 8-pixel patches, exact GELU as Wan's
  ViT-H), ``image_processor`` (``CLIPImageProcessor``, 32-pixel crop), a transformer with
  ``in_channels = 36`` (16 noise + 4 mask + 16 condition latents), ``image_dim`` and
  ``added_kv_proj_dim`` (the image cross-attention), the 16-channel VAE.
* ``ditattn:tiny-wan2.2-ti2v`` — Wan2.2-TI2V-5B: ``WanPipeline`` with ``expand_timesteps`` (per-token
  timesteps; first-frame conditioning when an image is given), the Wan 2.2 VAE (48 latent channels,
  ``patch_size 2``, 16x spatial compression, residual blocks), transformer in/out 48 channels.
* ``ditattn:tiny-wan2.2-i2v`` — Wan2.2-I2V-A14B: ``WanImageToVideoPipeline`` with two experts
  (``transformer`` for high noise, ``transformer_2`` below ``boundary_ratio = 0.9``), 36 input
  channels, no image encoder, the 16-channel VAE.
"""

from __future__ import annotations

from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.models import tiny
from ditattn.models.local import cached_folder, save_quietly

I2V_MODELS = ("ditattn:tiny-wan-i2v", "ditattn:tiny-wan2.2-ti2v", "ditattn:tiny-wan2.2-i2v")

IMAGE_ENCODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
    hidden_act="gelu",
    layer_norm_eps=1e-5,
)
IMAGE_PROCESSOR = dict(
    size={"shortest_edge": 32},
    crop_size={"height": 32, "width": 32},
    do_center_crop=True,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
)
VAE22 = dict(
    base_dim=8,
    decoder_base_dim=8,
    z_dim=48,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
    latents_mean=[round(-0.5 + i / 47, 4) for i in range(48)],
    latents_std=[round(0.8 + 0.8 * i / 47, 4) for i in range(48)],
)
I2V_BOUNDARY_RATIO = 0.9
TI2V_FLOW_SHIFT = 5.0


def i2v_model_path(name: str, root: Optional[str] = None) -> str:
    """The folder of built-in model ``name`` (one of :data:`I2V_MODELS`), built on first use."""
    if name not in I2V_MODELS:
        raise AttentionConfigError(
            f"unknown built-in model '{name}'; image-to-video built-in models: {', '.join(I2V_MODELS)}"
        )
    return cached_folder(f"{name.split(':', 1)[1]}-{tiny._VERSION}", lambda tmp: build(name, tmp), root)


def build(name: str, out_dir: str) -> None:
    """Write the checkpoint ``name`` (one of :data:`I2V_MODELS`) into ``out_dir``."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    from ditattn.models.clip_vision import image_processor_class

    z = 48 if name == "ditattn:tiny-wan2.2-ti2v" else 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        text_encoder = UMT5EncoderModel(UMT5Config(**tiny.TEXT_ENCODER)).eval()
        torch.manual_seed(12)
        vae = AutoencoderKLWan(**(VAE22 if z == 48 else tiny.VAE)).eval()
        common = dict(tokenizer=tiny.build_byte_tokenizer(), text_encoder=text_encoder, vae=vae)
        if name == "ditattn:tiny-wan2.2-ti2v":
            torch.manual_seed(13)
            transformer = WanTransformer3DModel(**{**tiny.TRANSFORMER, "in_channels": z, "out_channels": z}).eval()
            pipe = WanPipeline(
                **common,
                scheduler=UniPCMultistepScheduler(**{**tiny.SCHEDULER, "flow_shift": TI2V_FLOW_SHIFT}),
                transformer=transformer,
                expand_timesteps=True,
            )
        elif name == "ditattn:tiny-wan-i2v":
            torch.manual_seed(14)
            image_encoder = CLIPVisionModel(CLIPVisionConfig(**IMAGE_ENCODER)).eval()
            torch.manual_seed(15)
            inner = tiny.TRANSFORMER["num_attention_heads"] * tiny.TRANSFORMER["attention_head_dim"]
            transformer = WanTransformer3DModel(
                **{
                    **tiny.TRANSFORMER,
                    "in_channels": 2 * z + 4,
                    "out_channels": z,
                    "image_dim": IMAGE_ENCODER["hidden_size"],
                    "added_kv_proj_dim": inner,
                }
            ).eval()
            pipe = WanImageToVideoPipeline(
                **common,
                scheduler=UniPCMultistepScheduler(**tiny.SCHEDULER),
                image_processor=image_processor_class()(**IMAGE_PROCESSOR),
                image_encoder=image_encoder,
                transformer=transformer,
            )
        elif name == "ditattn:tiny-wan2.2-i2v":
            experts = []
            for seed in (16, 17):
                torch.manual_seed(seed)
                experts.append(
                    WanTransformer3DModel(**{**tiny.TRANSFORMER, "in_channels": 2 * z + 4, "out_channels": z}).eval()
                )
            pipe = WanImageToVideoPipeline(
                **common,
                scheduler=UniPCMultistepScheduler(**tiny.SCHEDULER),
                transformer=experts[0],
                transformer_2=experts[1],
                boundary_ratio=I2V_BOUNDARY_RATIO,
            )
        else:
            raise ValueError(f"not an image-to-video built-in model: {name}")
    save_quietly(pipe, out_dir)
