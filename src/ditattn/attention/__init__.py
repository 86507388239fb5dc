"""The attention backend layer: names, capability data, selection, configuration, layers.

``ditattn.attention`` is both this package and the functional API: the package
module is callable, so ``ditattn.attention(q, k, v, ...)`` runs :func:`functional.attention`
while ``ditattn.attention.layer`` etc. stay importable submodules.  The names below load on first
use, so importing one submodule (``ditattn.attention.names``) does not import the others.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

from ditattn.lazy import lazy_getattr

_EXPORTS = {
    "AttentionBackendEnum": "ditattn.attention.names",
    "LocalAttention": "ditattn.attention.layer",
    "global_force_attn_backend": "ditattn.attention.context",
    "global_force_attn_backend_context_manager": "ditattn.attention.context",
    "parse_attention_backend_config": "ditattn.attention.config",
}

if TYPE_CHECKING:
    from ditattn.attention.config import parse_attention_backend_config
    from ditattn.attention.context import global_force_attn_backend, global_force_attn_backend_context_manager
    from ditattn.attention.layer import LocalAttention
    from ditattn.attention.names import AttentionBackendEnum


def _function():
    from ditattn.attention.functional import attention

    return attention


class _CallableModule(types.ModuleType):
    def __call__(self, q, k, v, **kwargs):
        return _function()(q, k, v, **kwargs)

    @property
    def __signature__(self):
        import inspect

        return inspect.signature(_function())

    @property
    def __doc__(self):  # the package's own text, then the function's contract
        return _DOC + "\n\n" + (_function().__doc__ or "")


__getattr__ = lazy_getattr(__name__, globals(), _EXPORTS)
_DOC = __doc__ or ""
sys.modules[__name__].__class__ = _CallableModule

__all__ = sorted(_EXPORTS)
