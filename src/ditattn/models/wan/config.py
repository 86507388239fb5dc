"""The configuration of the native Wan DiT (:class:`WanTransformerConfig`): a diffusers
``WanTransformer3DModel`` ``config.json`` with the same field names and defaults, checked on load."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ditattn.errors import AttentionConfigError


@dataclasses.dataclass
class WanTransformerConfig:
    """The ``config.json`` of a diffusers ``WanTransformer3DModel`` (same field names and defaults)."""

    patch_size: tuple = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: Optional[int] = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: Optional[str] = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: Optional[int] = None
    added_kv_proj_dim: Optional[int] = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: Optional[int] = None

    @classmethod
    def from_dict(cls, data: dict) -> "WanTransformerConfig":
        """Build from a ``config.json`` dict; private keys (``_class_name`` …) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in data.items() if k in names})
        cfg.patch_size = tuple(int(p) for p in cfg.patch_size)
        if cfg.out_channels is None:
            cfg.out_channels = cfg.in_channels
        if (cfg.image_dim is None) != (cfg.added_kv_proj_dim is None):
            raise AttentionConfigError(
                f"Wan transformer config has image_dim={cfg.image_dim} but added_kv_proj_dim={cfg.added_kv_proj_dim}; "
                "an image-to-video transformer needs both (the image embedder and the image K/V projections)"
            )
        if cfg.added_kv_proj_dim is not None and cfg.added_kv_proj_dim != cfg.inner_dim:
            raise AttentionConfigError(
                f"Wan transformer config: added_kv_proj_dim {cfg.added_kv_proj_dim} must equal the model width "
                f"num_attention_heads x attention_head_dim = {cfg.inner_dim} (it projects the embedded image tokens)"
            )
        if len(cfg.patch_size) != 3:
            raise AttentionConfigError(f"Wan transformer patch_size must have 3 entries, got {cfg.patch_size}")
        return cfg

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def has_image_input(self) -> bool:
        """True for Wan 2.1 image-to-video transformers (CLIP image tokens through added K/V)."""
        return self.image_dim is not None
