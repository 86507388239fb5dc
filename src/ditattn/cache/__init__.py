"""Step caching: skip the DiT work that does not change between denoising steps.

One module per method — :mod:`~ditattn.cache.teacache`, :mod:`~ditattn.cache.magcache`,
:mod:`~ditattn.cache.first_block` (with the TaylorSeer option of :mod:`~ditattn.cache.base`) — each a
:class:`~ditattn.cache.base.CacheMethod` with a parameter schema; :mod:`~ditattn.cache.registry` names
them, :mod:`~ditattn.cache.config` parses and resolves ``--cache-backend`` / ``--cache-backend-config``,
:mod:`~ditattn.cache.calibration` reads and writes per-model calibrations and
:mod:`~ditattn.cache.runtime` carries the request's cache to the DiT (``docs/caching.md``).
"""

from ditattn.cache.config import parse_cache_backend_config, resolve_cache, validate_cache
from ditattn.cache.registry import CACHE_BACKENDS, CACHE_METHODS, cache_method
from ditattn.cache.runtime import CacheRun, CacheSetting, cache_scope, current_cache

__all__ = [
    "CACHE_BACKENDS",
    "CACHE_METHODS",
    "CacheRun",
    "CacheSetting",
    "cache_method",
    "cache_scope",
    "current_cache",
    "parse_cache_backend_config",
    "resolve_cache",
    "validate_cache",
]
