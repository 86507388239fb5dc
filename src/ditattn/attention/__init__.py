"""The attention backend layer: names, capability data, selection, configuration, layers.

``ditattn.attention`` is both this package and the functional API of DESIGN 1.4: the package
module is callable, so ``ditattn.attention(q, k, v, ...)`` runs :func:`functional.attention`
while ``ditattn.attention.layer`` etc. stay importable submodules.
"""
import sys
import types

from ditattn.attention.config import parse_attention_backend_config
from ditattn.attention.context import (
    global_force_attn_backend,
    global_force_attn_backend_context_manager,
)
from ditattn.attention.functional import attention as _attention_fn
from ditattn.attention.layer import LocalAttention
from ditattn.attention.names import AttentionBackendEnum


class _CallableModule(types.ModuleType):
    def __call__(self, q, k, v, **kwargs):
        return _attention_fn(q, k, v, **kwargs)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(_attention_fn)


sys.modules[__name__].__class__ = _CallableModule
__doc__ = (__doc__ or "") + "\n\n" + (_attention_fn.__doc__ or "")

__all__ = [
    "AttentionBackendEnum",
    "LocalAttention",
    "global_force_attn_backend",
    "global_force_attn_backend_context_manager",
    "parse_attention_backend_config",
]
