"""The attention backend layer: names, capability data, selection, configuration, layers."""
from ditattn.attention.config import parse_attention_backend_config
from ditattn.attention.context import (
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
)
from ditattn.attention.functional import attention
from ditattn.attention.layer import LocalAttention
from ditattn.attention.names import AttentionBackendEnum

__all__ = [
    "AttentionBackendEnum",
    "LocalAttention",
    "attention",
    "global_force_attn_backend",
    "global_force_attn_backend_context_manager",
    "parse_attention_backend_config",
]
