"""Native Wan models: the video DiT (:mod:`.transformer`) and its checkpoint loader."""

from ditattn.models.wan.config import WanTransformerConfig
from ditattn.models.wan.transformer import WanTransformer, load_wan_transformer

__all__ = ["WanTransformer", "WanTransformerConfig", "load_wan_transformer"]
