"""ditattn: a diffusion-transformer inference runtime with pluggable attention backends."""
from ditattn import attention  # the callable package: ditattn.attention(q, k, v, ...)
from ditattn.attention import (
    AttentionBackendEnum,
    LocalAttention,
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
    parse_attention_backend_config,
)
from ditattn.errors import AttentionConfigError
from ditattn.registry import BackendInfo, list_backends

__version__ = "0.1.0"


def __getattr__(name):  # sequence-parallel modules load torch.distributed lazily
    if name in ("UlyssesAttention", "USPAttention"):
        from ditattn.distributed import attention as _sp

        return getattr(_sp, name)
    raise AttributeError(f"module 'ditattn' has no attribute {name!r}")


__all__ = [
    "AttentionBackendEnum",
    "AttentionConfigError",
    "BackendInfo",
    "LocalAttention",
    "USPAttention",
    "UlyssesAttention",
    "attention",
    "global_force_attn_backend",
    "global_force_attn_backend_context_manager",
    "list_backends",
    "parse_attention_backend_config",
]
