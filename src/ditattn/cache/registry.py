"""The step-cache methods by name: :data:`CACHE_METHODS` (derived from the method modules) and
:data:`CACHE_BACKENDS`, the names ``--cache-backend`` accepts (``none`` first)."""

from __future__ import annotations

from ditattn.cache import first_block, magcache, teacache
from ditattn.cache.base import CacheMethod
from ditattn.errors import AttentionConfigError, short_repr

CACHE_METHODS: dict[str, CacheMethod] = {m.name: m for m in (teacache.METHOD, magcache.METHOD, first_block.METHOD)}
CACHE_BACKENDS: tuple[str, ...] = ("none",) + tuple(CACHE_METHODS)


def cache_method(name) -> "CacheMethod | None":
    """The method called ``name`` (None for ``none`` / None); an unknown name raises
    :class:`AttentionConfigError` listing the accepted ones."""
    if name is None:
        return None
    key = str(name).strip().lower().replace("-", "_") if isinstance(name, str) else name
    if key == "none":
        return None
    if key == "":  # not "none": a blank field would otherwise switch a server's or pipeline's default cache off
        raise AttentionConfigError(
            f"cache backend is empty; accepted: {', '.join(CACHE_BACKENDS)} (none turns the step cache off; leave the "
            "setting out for the default)"
        )
    if key not in CACHE_METHODS:
        raise AttentionConfigError(f"unknown cache backend {short_repr(name)}; accepted: {', '.join(CACHE_BACKENDS)}")
    return CACHE_METHODS[key]
