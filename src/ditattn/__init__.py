"""ditattn: a diffusion-transformer inference runtime with pluggable attention backends.

The public names load on first use (PEP 562), so ``import ditattn`` and ``ditattn --help`` do not
import torch or diffusers::

    import ditattn
    out = ditattn.attention(q, k, v, backend="torch_sdpa")       # one attention call
    pipe = ditattn.WanPipeline.from_pretrained("ditattn:tiny-wan", attention_backend="torch_sdpa")
    frames = pipe("a red fox in fresh snow")                       # uint8 [1, F, H, W, 3]

``ditattn.attention`` is the function :func:`ditattn.attention.functional.attention` to type
checkers; at run time it is the ``ditattn.attention`` package, which is callable with the same
signature, so its submodules (``ditattn.attention.layer``, …) stay importable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ditattn.extras import quiet_third_party_import_notices
from ditattn.lazy import lazy_getattr

quiet_third_party_import_notices()

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "AttentionBackendEnum": "ditattn.attention.names",
    "AttentionConfigError": "ditattn.errors",
    "BackendInfo": "ditattn.registry",
    "LocalAttention": "ditattn.attention.layer",
    "USPAttention": "ditattn.distributed.attention",
    "UlyssesAttention": "ditattn.distributed.attention",
    "WanPipeline": "ditattn.pipelines.public",
    "global_force_attn_backend": "ditattn.attention.context",
    "global_force_attn_backend_context_manager": "ditattn.attention.context",
    "list_backends": "ditattn.registry",
    "parse_attention_backend_config": "ditattn.attention.config",
    "save_video": "ditattn.pipelines.output",
}

if TYPE_CHECKING:  # what type checkers see; the same objects are loaded lazily below
    from ditattn.attention.config import parse_attention_backend_config
    from ditattn.attention.context import global_force_attn_backend, global_force_attn_backend_context_manager
    from ditattn.attention.functional import attention
    from ditattn.attention.layer import LocalAttention
    from ditattn.attention.names import AttentionBackendEnum
    from ditattn.distributed.attention import UlyssesAttention, USPAttention
    from ditattn.errors import AttentionConfigError
    from ditattn.pipelines.output import save_video
    from ditattn.pipelines.public import WanPipeline
    from ditattn.registry import BackendInfo, list_backends


__getattr__ = lazy_getattr(__name__, globals(), {**_EXPORTS, "attention": "ditattn.attention:"})


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = sorted([*_EXPORTS, "attention"])
