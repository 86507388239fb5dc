"""The contract between the selector and a backend implementation.

An implementation is a function::

    impl(q, k, v, call: AttnCall, config: dict) -> tuple[Tensor, Tensor | None]

q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, kv_heads, head_dim]`` with
``heads % kv_heads == 0`` (grouped-query attention). It returns the output ``[batch, seq_q, heads,
head_dim]`` in q's dtype, and, when ``call.return_lse`` is true, the natural-log sum-exp of each
query row's scaled scores, ``[batch, heads, seq_q]`` float32 (else None).  ``config`` is the
backend's validated parameters (``config.validate_backend_config``).

A backend is declared in one module: :func:`register` takes its capability row
(:class:`~ditattn.attention.specs.BackendSpec`) and its parameter schema together with the
implementation; :func:`declare` records a backend this build has no kernel for (its spec's
``missing_kernel`` says why).  ``ditattn.attention.backends`` imports every backend module, so the
tables (``specs.SPECS``, ``schemas.SCHEMAS``, the implementations) are complete once it is imported;
they load it on first use.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from ditattn.attention import schemas, specs
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.reference import expand_kv, reference_attention  # noqa: F401  (re-exported)
from ditattn.attention.schemas import Param
from ditattn.attention.specs import BackendSpec
from ditattn.errors import BackendUnavailableError

Tensor = torch.Tensor


class NoKernelError(BackendUnavailableError):
    """The backend runs on this platform but has no kernel for this particular call (shape, dtype,
    head dim); an automatic choice with a per-call fallback (SM100 cuDNN -> FA) catches it."""


@dataclasses.dataclass(slots=True)
class AttnCall:
    """Per-call metadata handed to a backend.

    video_shape: latent token grid ``(T, H, W)`` of the video part of the sequence (video tokens
    come first, in T-major order); text_len: text tokens that follow the video tokens in the same
    sequence (joint attention); step: denoising step index; num_steps: total steps of the run;
    layer_idx: DiT block index; layer_key: a stable name of the calling layer (for per-layer state
    such as STA search statistics); head_offset: global index of q's first head when the call sees
    a head shard (Ulysses), so per-head schedules (STA windows) pick the right heads.
    """

    causal: bool = False
    scale: Optional[float] = None
    attn_bias: Optional[Tensor] = None
    video_shape: Optional[tuple[int, int, int]] = None
    text_len: int = 0
    step: Optional[int] = None
    num_steps: Optional[int] = None
    layer_idx: Optional[int] = None
    return_lse: bool = False
    layer_key: Optional[str] = None
    head_offset: int = 0  # index of this call's first head in the layer's full head set (Ulysses shards)


Impl = Callable[[Tensor, Tensor, Tensor, AttnCall, dict], "tuple[Tensor, Optional[Tensor]]"]

_REGISTRY: dict[B, Impl] = {}


def declare(backend: B, *, spec: BackendSpec, schema: Sequence[Param] = ()) -> BackendSpec:
    """Record ``backend``'s capability row and parameter schema (``schema``: its
    :class:`~ditattn.attention.schemas.Param` rows, stored under ``spec.config_schema`` or, when that
    is unset, the backend's name).  Without :func:`register` the backend has no implementation in this
    build, and ``spec.missing_kernel`` must say why."""
    if spec.backend is not None and spec.backend is not backend:
        raise ValueError(f"spec of {spec.backend.value} declared for {backend.value}")
    key = spec.config_schema or (backend.value if schema else None)
    spec = dataclasses.replace(spec, backend=backend, config_schema=key)
    if backend in specs.TABLE:
        raise ValueError(f"attention backend {backend.value} declared twice")
    if schema:
        known = schemas.TABLE.setdefault(key, tuple(schema))
        if known != tuple(schema):
            raise ValueError(f"schema '{key}' declared twice with different parameters")
    specs.TABLE[backend] = spec
    return spec


def register(backend: B, *, spec: BackendSpec, schema: Sequence[Param] = ()):
    """Decorator: ``fn`` implements ``backend``, whose capability row is ``spec`` and whose
    parameters are ``schema`` (see :func:`declare`)."""

    def deco(fn: Impl) -> Impl:
        declare(backend, spec=spec, schema=schema)
        _REGISTRY[backend] = fn
        return fn

    return deco


def get_impl(backend: B) -> Impl:
    """The implementation of ``backend``; raises ``LookupError`` if this build has none."""
    specs.load_backends()
    try:
        return _REGISTRY[backend]
    except KeyError:
        raise LookupError(f"no implementation of attention backend '{backend.value}' in this build") from None


def has_impl(backend: B) -> bool:
    """Whether this build has an implementation of ``backend``."""
    specs.load_backends()
    return backend in _REGISTRY
