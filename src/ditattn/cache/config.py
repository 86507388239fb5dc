"""``--cache-backend`` / ``--cache-backend-config``: parsing, validation against the method's schema,
the model's refusals and the calibration lookup, giving a :class:`~ditattn.cache.runtime.CacheSetting`.

The config text is parsed like ``--attention-backend-config`` (an existing ``.json`` / ``.yaml`` file,
a JSON object, or ``k=v`` pairs split on commas; :func:`ditattn.attention.config.parse_attention_backend_config`).
"""

from __future__ import annotations

from typing import Optional

from ditattn.cache.calibration import load_calibration, packaged_calibration
from ditattn.cache.registry import cache_method
from ditattn.cache.runtime import CacheSetting
from ditattn.errors import AttentionConfigError


def parse_cache_backend_config(value: "str | dict | None", *, files: bool = True) -> dict:
    """``--cache-backend-config`` as a dict (no schema check): None / '' -> {}, a dict, a JSON / YAML
    file, a JSON object or ``k=v,k=v``; unparsable text raises :class:`AttentionConfigError`.
    ``files=False``: inline text only (no file is read; text naming one is refused)."""
    from ditattn.attention.config import parse_attention_backend_config

    try:
        return parse_attention_backend_config(value, files=files)
    except AttentionConfigError as exc:
        raise AttentionConfigError(str(exc).replace("attention backend config", "cache backend config")) from None


def _field(name: str):
    """Errors raised inside the block carry ``field = name`` (the request field a server names)."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        try:
            yield
        except AttentionConfigError as exc:
            if not hasattr(exc, "field"):
                exc.field = name
            raise

    return scope()


def validate_cache(backend, config: "str | dict | None" = None) -> Optional[tuple]:
    """``(method, validated config)`` for ``backend`` and its raw ``config`` (None for ``none``; a
    config without a method is refused); no model checks.  Errors carry ``field``: ``cache_backend``
    or ``cache_backend_config``, the setting at fault."""
    with _field("cache_backend"):
        method = cache_method(backend)
    with _field("cache_backend_config"):
        raw = parse_cache_backend_config(config)
        return _validated(method, raw)


def _validated(method, raw: dict):
    if method is None:
        if raw:
            raise AttentionConfigError(
                "cache backend config given without a cache backend; accepted: "
                "--cache-backend teacache|magcache|first_block_cache with it"
            )
        return None
    return method, method.validate(raw)


def resolve_cache(
    backend,
    config: "str | dict | None" = None,
    *,
    model: Optional[str] = None,
    num_blocks: Optional[int] = None,
    native: bool = True,
) -> Optional[CacheSetting]:
    """The :class:`CacheSetting` of ``backend`` / ``config`` for the model called ``model`` with
    ``num_blocks`` DiT blocks (None when no cache is asked for).

    Loads ``calibration=PATH`` (checked against ``model``) or the calibration shipped for the model;
    refuses with the reason a method this model cannot take (no native transformer, a calibration-only
    method without a calibration, block counts the model does not have)."""
    found = validate_cache(backend, config)
    if found is None:
        return None
    method, cfg = found
    with _field("cache_backend_config"):
        return _for_model(method, cfg, model, num_blocks, native)


def _for_model(
    method,
    cfg: dict,
    model: Optional[str],
    num_blocks: Optional[int],
    native: bool,
    default: Optional[CacheSetting] = None,
) -> CacheSetting:
    """The setting of the validated ``cfg``; ``default``: a setting of the same method whose calibration
    is kept (the call named no ``calibration``)."""
    if not native:
        raise AttentionConfigError(
            f"cache backend {method.name} runs in ditattn's native Wan transformer; "
            "accepted: --backend native (the diffusers pipeline has no step cache here)"
        )
    calibration = None
    if default is not None:
        calibration = default.calibration
    elif "calibration" in cfg:
        path = cfg["calibration"] or packaged_calibration(model)
        if path is not None:
            calibration = load_calibration(path, model=model if cfg["calibration"] else None)
        key = {"teacache": "coefficients", "magcache": "mag_ratios"}.get(method.name)
        if key is not None and cfg["calibration"] and calibration.get(key) is None:
            raise AttentionConfigError(
                f"calibration file {cfg['calibration']} has no {method.name} {key}; accepted: a calibration "
                f"written by ditattn calibrate-cache (it holds both methods' data), or no calibration key "
                f"(the one shipped for the model)"
            )
        if method.facts.calibration == "required" and (calibration is None or calibration.get(key) is None):
            raise AttentionConfigError(
                f"cache backend {method.name} needs a calibration for model {model or '(unknown)'} and none ships "
                f"with it; accepted: calibration=FILE.json (write one with ditattn calibrate-cache)"
            )
    if num_blocks is not None:
        method.check_model(cfg, num_blocks)
    return CacheSetting(method, cfg, calibration)


def call_cache(
    default: Optional[CacheSetting], backend, config, *, model: Optional[str], num_blocks: int
) -> Optional[CacheSetting]:
    """A call's cache: ``default`` (the pipeline's or server's) when neither ``backend`` nor ``config`` is
    given; for ``default``'s method (``backend`` None or the same name), ``default``'s keys and calibration
    with the keys ``config`` names applied over them (a ``calibration`` key loads its own); another method
    starts from its own defaults (:func:`resolve_cache`)."""
    if backend is None and config in (None, "", {}):
        return default
    if backend is None:
        if default is None:
            raise AttentionConfigError(
                "cache_backend_config given without a cache backend; accepted: "
                "cache_backend teacache|magcache|first_block_cache with it"
            )
        backend = default.name
    with _field("cache_backend"):
        method = cache_method(backend)
    if default is None or method is not default.method:
        return resolve_cache(backend, config, model=model, num_blocks=num_blocks)
    with _field("cache_backend_config"):
        raw = parse_cache_backend_config(config)
        cfg = method.validate(raw, base=default.config)
        return _for_model(method, cfg, model, num_blocks, True, None if "calibration" in raw else default)
