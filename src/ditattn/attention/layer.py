"""``LocalAttention``: the attention module models build (single device).

The backend is resolved once, at construction, through the selector (so the selector costs
nothing per call); the decision is recorded in the component being built (the plan).  Per call
the layer only reads the request override table and the forward context (step, latent grid).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import nn

from ditattn.attention.backends.base import AttnCall, get_impl
from ditattn.attention.config import validate_backend_config
from ditattn.attention.context import current_component, current_forward, current_request, current_settings
from ditattn.attention.names import ROLES
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.selector import Decision, LayerSpec, bind_impl, select_backend
from ditattn.attention.specs import DTYPE_NAMES, SPECS
from ditattn.errors import AttentionConfigError, as_integer, short_repr
from ditattn.platforms import current_platform


def _autotune():
    from ditattn.attention import autotune

    return autotune


def _check_layer_args(num_heads, head_dim, num_kv_heads, causal, scale, dtype) -> tuple:
    """``(num_heads, head_dim, num_kv_heads)`` as plain ints, checked: positive integers, ``num_kv_heads``
    (None: ``num_heads``) dividing ``num_heads``; ``causal`` a bool; ``scale`` None or a finite number > 0
    that ``dtype`` (None: torch's default dtype) can hold.  Raises AttentionConfigError."""
    from ditattn.attention.functional import check_scale

    sizes = []
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
        if value is None and name == "num_kv_heads":
            sizes.append(sizes[0])
            continue
        n = as_integer(value)
        if n is None or n < 1:
            raise AttentionConfigError(f"LocalAttention {name} must be a positive integer, got {short_repr(value)}")
        sizes.append(n)
    if sizes[0] % sizes[2]:
        raise AttentionConfigError(
            f"LocalAttention num_kv_heads ({sizes[2]}) must divide num_heads ({sizes[0]}) for grouped-query attention"
        )
    if not isinstance(causal, bool):
        raise AttentionConfigError(f"LocalAttention causal must be True or False, got {short_repr(causal)}")
    try:
        check_scale(scale, dtype or torch.get_default_dtype())
    except AttentionConfigError as exc:
        raise AttentionConfigError(f"LocalAttention {exc}") from None
    return tuple(sizes)


def _as_backend(x):
    return None if x is None else B.from_name(x)


class LocalAttention(nn.Module):
    """Attention over ``[batch, seq, heads, head_dim]`` tensors through the selected backend.

    Args:
        num_heads, head_dim: query heads and head size; num_kv_heads: K/V heads (GQA), default
            num_heads.
        role: ``"self"``, ``"cross"`` (to text) or ``"cross_image"`` (to image tokens); causal: causal mask; scale:
        softmax scale (default
            head_dim ** -0.5).
        prefix: the module path inside its component (for the plan), layer_idx: DiT block index.
        needs_bias: the layer passes an additive bias (only bias-capable backends qualify).
        default_backend / required_backend / supported_backends: see :class:`LayerSpec`.
        dtype: the dtype the layer will run in (for the capability check; default: the
            component's parameters' dtype is unknown at construction, so torch's default dtype).

    ``forward(q, k, v, attn_bias=None, return_lse=False)`` returns ``[batch, seq_q, heads,
    head_dim]`` (and the LSE ``[batch, heads, seq_q]`` when asked).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: Optional[int] = None,
        *,
        role: str = "self",
        causal: bool = False,
        scale: Optional[float] = None,
        prefix: str = "",
        layer_idx: Optional[int] = None,
        needs_bias: bool = False,
        needs_lse: bool = False,
        default_backend=None,
        required_backend=None,
        supported_backends: Optional[Sequence] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if role not in ROLES:
            raise AttentionConfigError(f"attention role must be one of {', '.join(ROLES)}, got {role!r}")
        num_heads, head_dim, num_kv_heads = _check_layer_args(num_heads, head_dim, num_kv_heads, causal, scale, dtype)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_kv_heads
        self._tails = ((num_heads, head_dim), (num_kv_heads, head_dim))  # forward's shape check: q's, k/v's
        self.role, self.causal, self.scale = role, causal, scale
        self.prefix, self.layer_idx = prefix, layer_idx
        self.spec = LayerSpec(
            prefix=prefix,
            role=role,
            head_dim=head_dim,
            num_heads=num_heads,
            num_kv_heads=self.num_kv_heads,
            dtype=dtype or torch.get_default_dtype(),
            causal=causal,
            needs_bias=needs_bias,
            needs_lse=needs_lse,
            default_backend=_as_backend(default_backend),
            required_backend=_as_backend(required_backend),
            supported_backends=tuple(B.from_name(b) for b in supported_backends) if supported_backends else None,
        )
        component = current_component()
        self.component = component.name if component else None
        self.is_dit = component.is_dit if component else True
        self.layer_key = f"{self.component}.{prefix}" if self.component else prefix
        self._platform = current_platform()
        settings = current_settings()
        self.decision: Decision = select_backend(self.spec, component=component, settings=settings)
        # autotune only replaces automatic choices, never explicit/forced/required/CLI/component ones
        self._autotune_pending = bool(settings.autotune) and self.decision.source == "auto"
        if component is not None:
            component.decisions.append(self.decision)
        self._bind(self.decision.backend)

    # -- the bound backend ---------------------------------------------------------------------
    def _bind(self, backend: B) -> None:
        self.backend = backend
        self.config = validate_backend_config(backend, current_settings().config, strict_unknown=False)
        self._impl = None
        self._ok_dtypes = {self.spec.dtype}

    @property
    def impl(self):
        if self._impl is None:
            fallback = self.decision.runtime_fallback is not None and self.decision.backend == self.backend
            self._impl = bind_impl(self.decision) if fallback else get_impl(self.backend)
        return self._impl

    def rebind(self, backend: B, source: str, reason: Optional[str] = None) -> None:
        """Switch this layer to ``backend`` (autotune, or a permanent server default change)."""
        self.decision.backend, self.decision.source = backend, source
        self.decision.runtime_fallback = None  # the per-call fallback belonged to the automatic choice
        if reason:
            self.decision.fallback_reason = reason
        self._bind(backend)

    def _check_dtype(self, dtype: torch.dtype, backend: B) -> None:
        req = dataclasses.replace(self.spec.request(), dtype=dtype)
        reasons = [r for r in SPECS[backend].reasons(req, self._platform) if "dtype" in r]
        if reasons:
            raise AttentionConfigError(
                f"{self.component or ''}{'.' if self.component else ''}{self.prefix}: backend {backend.value} "
                f"was chosen for {DTYPE_NAMES.get(self.spec.dtype)} but is called with "
                f"{DTYPE_NAMES.get(dtype, dtype)}: {'; '.join(reasons)}"
            )
        self._ok_dtypes.add(dtype)

    def _request_binding(self):
        """``(backend, impl, config)`` this call runs: the current request's override entry for this
        layer, else the layer's own backend and config with ``impl`` None (the bound one)."""
        req = current_request()
        if req is not None and req.override_table is not None:
            entry = req.override_table.get(id(self))
            if entry is not None:
                return entry
        return self.backend, None, self.config

    def forward(self, q, k, v, attn_bias=None, return_lse: bool = False):
        if q.shape[2:] != self._tails[0] or k.shape[2:] != self._tails[1] or v.shape != k.shape:
            self._check_shapes(q, k, v)
        backend, impl, config = self._request_binding()
        if impl is None:
            if self._autotune_pending and q.numel() >= _autotune().MIN_QUERY_ELEMENTS:
                self._run_autotune(q, k, v, attn_bias)
            impl = self.impl
        if q.dtype not in self._ok_dtypes:
            self._check_dtype(q.dtype, backend)
        fwd = current_forward()
        call = AttnCall(
            causal=self.causal,
            scale=self.scale,
            attn_bias=attn_bias,
            video_shape=fwd.video_shape if self.role == "self" else None,
            text_len=fwd.text_len if self.role == "self" else 0,
            step=fwd.step,
            num_steps=fwd.num_steps,
            layer_idx=self.layer_idx,
            return_lse=return_lse,
            layer_key=self.layer_key,
        )
        out, lse = impl(q, k, v, call, config)
        return (out, lse) if return_lse else out

    def _check_shapes(self, q, k, v) -> None:
        """Why q/k/v do not fit this layer (raises AttentionConfigError): 4-D ``[batch, seq, heads, head_dim]``
        tensors with the layer's ``num_heads`` (q) and ``num_kv_heads`` (k, v) of ``head_dim``, k and v alike
        (the rest as :func:`ditattn.attention.check_qkv`)."""
        from ditattn.attention.functional import check_qkv

        check_qkv(q, k, v)
        (h, d), (hkv, _) = self._tails
        for name, t, heads in (("q", q, h), ("k", k, hkv), ("v", v, hkv)):
            if tuple(t.shape[2:]) != (heads, d):
                raise AttentionConfigError(
                    f"{self.layer_key or type(self).__name__}: {name} has {t.shape[2]} heads of size {t.shape[3]} "
                    f"(shape {tuple(t.shape)}), but the layer was built for {heads} heads of size {d} "
                    "([batch, seq, heads, head_dim])"
                )

    def _run_autotune(self, q, k, v, attn_bias) -> None:
        self._autotune_pending = False
        at = _autotune()
        req = dataclasses.replace(self.spec.request(), dtype=q.dtype, needs_bias=attn_bias is not None)
        call = AttnCall(causal=self.causal, scale=self.scale, attn_bias=attn_bias)
        with torch.no_grad():
            res = at.tune(self.backend, req, self._platform, q, k, v, call)
        at.log.info("%s.%s: %s", self.component, self.prefix, res.reason)
        self.autotune_result = res
        if res.chosen != self.backend:
            self.rebind(res.chosen, "autotune", res.reason)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, role={self.role}, backend={self.backend.value}"
