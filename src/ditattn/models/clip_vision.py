"""Native CLIP vision encoder (the ``image_encoder`` of Wan 2.1 image-to-video checkpoints),
state-dict compatible with transformers' ``CLIPVisionModel``.

Wan conditions on the *penultimate* hidden states of the vision tower (``hidden_states[-2]``: every
token, before the last layer and without the post-norm), so the native encoder builds only the
layers it needs (``num_hidden_layers - 1``) and the loader skips the last layer's and the
post-norm's weights.  Each layer's self-attention is a
:class:`~ditattn.attention.layer.LocalAttention` (role ``self``, prefix
``encoder.layers.{i}.self_attn``) built inside the ``image_encoder`` component scope, so
``--component-attention-backends image_encoder=...`` reaches it and ``plan`` lists it.

Tensor layout: ``pixel_values [B, 3, image_size, image_size]`` (normalised by the checkpoint's
``CLIPImageProcessor``) -> ``[B, 1 + (image_size // patch_size) ** 2, hidden_size]``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch
from torch import nn

from ditattn.attention.layer import LocalAttention
from ditattn.errors import AttentionConfigError
from ditattn.models.activations import activation


@dataclasses.dataclass
class CLIPVisionConfig:
    """The fields of a transformers ``CLIPVisionConfig`` the encoder uses (same names and defaults)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, data: dict) -> "CLIPVisionConfig":
        """From a ``config.json`` (a ``CLIPVisionModel``'s, or a full CLIP config's ``vision_config``)."""
        data = data.get("vision_config", data)
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in data.items() if k in names})
        if cfg.hidden_size % cfg.num_attention_heads:
            raise AttentionConfigError(
                f"CLIP vision config: hidden_size {cfg.hidden_size} is not divisible by "
                f"num_attention_heads {cfg.num_attention_heads}"
            )
        if cfg.num_hidden_layers < 2:
            raise AttentionConfigError(
                "CLIP vision config: Wan uses the penultimate layer, so the encoder needs "
                f"at least 2 layers (has {cfg.num_hidden_layers})"
            )
        return cfg

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1


class CLIPVisionEmbeddings(nn.Module):
    """Class token + non-overlapping patch embedding + learned positions."""

    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(cfg.num_positions, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.to(dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight.unsqueeze(0)


class CLIPSelfAttention(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig, idx: int, dtype):
        super().__init__()
        d, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.attn = LocalAttention(
            self.heads,
            d // self.heads,
            role="self",
            prefix=f"encoder.layers.{idx}.self_attn",
            layer_idx=idx,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(2, (self.heads, -1)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(self.attn(q, k, v).flatten(2, 3))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act, "CLIP image encoder")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """Pre-norm transformer layer: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: CLIPVisionConfig, idx: int, dtype):
        super().__init__()
        self.self_attn = CLIPSelfAttention(cfg, idx, dtype)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Layers(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig, n: int, dtype):
        super().__init__()
        self.layers = nn.ModuleList([CLIPEncoderLayer(cfg, i, dtype) for i in range(n)])


class CLIPVisionEncoder(nn.Module):
    """``forward(pixel_values [B, 3, S, S]) -> penultimate hidden states [B, 1 + P, hidden_size]``.

    Construct inside ``component_scope("image_encoder")``; weights load from a transformers
    ``CLIPVisionModel`` checkpoint (keys with or without the ``vision_model.`` prefix)."""

    def __init__(self, config: CLIPVisionConfig, *, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = _Layers(config, config.num_hidden_layers - 1, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_layrnorm.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


def image_processor_class():
    """transformers' CLIP image processor class for this install: ``CLIPImageProcessor`` (torchvision
    backend) where torchvision is installed, else ``CLIPImageProcessorPil`` (what
    ``CLIPImageProcessor`` falls back to there, without its warning)."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("torchvision") is None and hasattr(transformers, "CLIPImageProcessorPil"):
        return transformers.CLIPImageProcessorPil
    return transformers.CLIPImageProcessor


def load_image_processor(folder: str):
    """The checkpoint's CLIP image preprocessing (``preprocessor_config.json`` in ``folder``): resize,
    centre crop and normalise a PIL image into ``pixel_values [1, 3, S, S]``."""
    try:
        return image_processor_class().from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise AttentionConfigError(f"cannot load the image processor from {folder}: {exc}") from None


def load_clip_vision_encoder(
    folder: str,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    variant: Optional[str] = None,
    load_weights: bool = True,
) -> CLIPVisionEncoder:
    """Build a :class:`CLIPVisionEncoder` from a transformers ``CLIPVisionModel`` folder in ``dtype``
    on ``device`` (eval, no gradients); ``load_weights=False`` builds it on the meta device."""
    from ditattn.models.weights import assign_state_dict, load_state_dict, read_json

    cfg = CLIPVisionConfig.from_dict(read_json(os.path.join(folder, "config.json")))
    with torch.device("meta"):
        model = CLIPVisionEncoder(cfg, dtype=dtype)
    if load_weights:
        state = load_state_dict(folder, variant, dtype=dtype)
        state = {k.removeprefix("vision_model."): v for k, v in state.items()}
        last = f"encoder.layers.{cfg.num_hidden_layers - 1}."
        assign_state_dict(model, state, where=folder, ignore_unexpected=(last, "post_layernorm.", "position_ids"))
        model.to(device)
    model.eval().requires_grad_(False)
    return model
