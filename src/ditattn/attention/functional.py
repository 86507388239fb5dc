"""``ditattn.attention``: one attention call through a named (or automatically chosen) backend."""

from __future__ import annotations

import math
import numbers
from functools import lru_cache
from typing import Optional

import torch

from ditattn.attention.backends.base import AttnCall
from ditattn.attention.config import parse_attention_backend_config, validate_backend_config
from ditattn.attention.context import get_forced_backend
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.schemas import schema_for
from ditattn.attention.selector import Decision, LayerSpec, bind_impl, select_backend
from ditattn.attention.specs import DTYPE_NAMES
from ditattn.errors import AttentionConfigError, as_integer, short_repr
from ditattn.platforms import platform_for_device

Tensor = torch.Tensor


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Validate the ``[batch, seq, heads, head_dim]`` layout; raise AttentionConfigError if wrong."""
    for n, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise AttentionConfigError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionConfigError(f"{n} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise AttentionConfigError(f"{n} must be a floating-point tensor, got {t.dtype}")
    for n, t in (("q", q), ("k", k)):
        empty = [name for name, size in zip(("batch", "seq", "heads", "head_dim"), t.shape) if size == 0]
        if empty:
            raise AttentionConfigError(
                f"{n} has an empty {' and '.join(empty)} dimension (shape {tuple(t.shape)}); every dimension of "
                "[batch, seq, heads, head_dim] must be at least 1"
            )
    if k.shape != v.shape:
        raise AttentionConfigError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise AttentionConfigError(f"q and k batch sizes differ: {q.shape[0]} vs {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise AttentionConfigError(f"q and k head dims differ: {q.shape[3]} vs {k.shape[3]}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise AttentionConfigError(
            f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]}) for grouped-query "
            f"attention"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionConfigError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise AttentionConfigError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def _is_int(x) -> bool:
    """An integer: Python's, NumPy's (``np.int64``) or another ``operator.index`` type, not a bool
    (:func:`~ditattn.errors.as_integer`, the run configuration's rule too)."""
    return as_integer(x) is not None


def check_scale(scale, dtype: torch.dtype) -> None:
    """``scale`` None, or a real number with ``0 < scale <= torch.finfo(dtype).max`` (see :func:`attention`)."""
    if scale is None:
        return
    what = "scale must be None (1/sqrt(head_dim)) or a finite number > 0"
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise AttentionConfigError(f"{what}, got {short_repr(scale)}")
    try:
        value = float(scale)
    except OverflowError:  # an integer past any float (10**400): finite, but too large for every dtype
        value = math.inf if scale > 0 else -math.inf
    else:
        if not math.isfinite(value):
            raise AttentionConfigError(f"{what}, got {short_repr(scale)}")
    if value <= 0:
        raise AttentionConfigError(f"{what}, got {short_repr(scale)}")
    top = torch.finfo(dtype).max
    if value > top:  # the scores would be inf, the output NaN
        raise AttentionConfigError(
            f"{what} that {DTYPE_NAMES.get(dtype, dtype)} inputs can hold (at most {top:.6g}), got {short_repr(scale)}"
        )


def check_call_args(q: Tensor, k: Tensor, *, causal, scale, attn_bias, text_len, step, layer_idx, return_lse) -> None:
    """Validate :func:`attention`'s per-call arguments (q/k already checked by :func:`check_qkv`):
    ``causal`` and ``return_lse`` are bools; ``scale`` None or a finite number ``0 < scale <=
    torch.finfo(q.dtype).max``; ``attn_bias`` None or a bool / floating tensor on q's device
    broadcastable to ``[batch, heads, seq_q, seq_kv]``; ``text_len`` an int >= 0; ``step`` /
    ``layer_idx`` None or ints >= 0 (NumPy integers too).  Raises :class:`AttentionConfigError`
    naming the argument and what is accepted."""
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):
            raise AttentionConfigError(f"{name} must be True or False, got {flag!r}")
    check_scale(scale, q.dtype)
    if not _is_int(text_len) or text_len < 0:
        raise AttentionConfigError(f"text_len must be an integer >= 0, got {text_len!r}")
    if text_len > q.shape[1]:
        raise AttentionConfigError(f"text_len {text_len} is longer than the sequence ({q.shape[1]} tokens)")
    for name, val in (("step", step), ("layer_idx", layer_idx)):
        if val is not None and (not _is_int(val) or val < 0):
            raise AttentionConfigError(f"{name} must be None or an integer >= 0, got {val!r}")
    if attn_bias is None:
        return
    if not isinstance(attn_bias, torch.Tensor):
        raise AttentionConfigError(f"attn_bias must be None or a torch.Tensor, got {type(attn_bias).__name__}")
    if not (attn_bias.is_floating_point() or attn_bias.dtype == torch.bool):
        raise AttentionConfigError(f"attn_bias must be a floating-point bias or a bool mask, got {attn_bias.dtype}")
    if attn_bias.device != q.device:
        raise AttentionConfigError(f"attn_bias is on {attn_bias.device}, q on {q.device}; put them on one device")
    target = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    shape = tuple(attn_bias.shape)
    if len(shape) > 4 or any(s not in (1, t) for s, t in zip(shape[::-1], target[::-1])):
        raise AttentionConfigError(
            f"attn_bias of shape {shape} does not broadcast to [batch, heads, seq_q, seq_kv] = {list(target)}"
        )


@lru_cache(maxsize=1)
def _any_backend_keys() -> frozenset:
    """Every config key of some backend's schema (built once)."""
    return frozenset(p.name for x in B for p in schema_for(x))


@lru_cache(maxsize=None)
def _default_config(backend: B) -> dict:
    """Validated defaults of ``backend`` (raises, uncached, when a parameter is required)."""
    return validate_backend_config(backend, {}, strict_unknown=False)


@lru_cache(maxsize=4096)
def _decide(
    backend: Optional[B],
    forced: Optional[B],
    platform,
    role,
    head_dim,
    dtype,
    heads,
    kv_heads,
    causal,
    needs_bias,
    needs_lse,
) -> Decision:
    layer = LayerSpec(
        prefix="attention()",
        role=role,
        head_dim=head_dim,
        dtype=dtype,
        num_heads=heads,
        num_kv_heads=kv_heads,
        causal=causal,
        needs_bias=needs_bias,
        needs_lse=needs_lse,
    )
    from ditattn.attention.context import AttentionSettings

    return select_backend(layer, explicit=backend, component=None, settings=AttentionSettings(), platform=platform)


def _auto_dense_decision(q: Tensor, k: Tensor, causal: bool, return_lse: bool) -> Decision:
    return _auto_dense_for(
        "self" if q.shape[1] == k.shape[1] else "cross",
        q.shape[-1],
        q.dtype,
        q.shape[2],
        k.shape[2],
        causal,
        return_lse,
        platform_for_device(q.device),
    )


@lru_cache(maxsize=1024)
def _auto_dense_for(role, head_dim, dtype, heads, kv_heads, causal, return_lse, platform) -> Decision:
    """The dense phase's decision per call shape and platform, made once (a sparse backend's dense fallback
    runs it at every call: the selection is not redone per call)."""
    from ditattn.attention.selector import _auto
    from ditattn.attention.specs import LayerRequest
    from ditattn.platforms.policy import runtime_fallback

    req = LayerRequest(
        role=role,
        head_dim=head_dim,
        dtype=dtype,
        num_heads=heads,
        num_kv_heads=kv_heads,
        causal=causal,
        needs_lse=return_lse,
    )
    b = _auto(req, platform, None, [])
    return Decision("dense phase", req.role, b, "auto", runtime_fallback=runtime_fallback(b, req, platform))


def auto_dense_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None, return_lse: bool = False
) -> tuple[Tensor, Optional[Tensor]]:
    """Dense non-causal attention through the platform's automatic choice, ignoring any global force
    and with the automatic choice's per-call fallback (SM100: cuDNN, then FA). ``[B, S, H, D]`` in
    and out; returns ``(out, lse [B, H, S] float32 or None)``."""
    check_qkv(q, k, v)
    dec = _auto_dense_decision(q, k, False, return_lse)
    call = AttnCall(scale=scale, return_lse=return_lse)
    return bind_impl(dec)(q, k, v, call, dict(_default_config(dec.backend)))


def auto_dense_backend(q: Tensor, k: Tensor, return_lse: bool = False) -> str:
    """The name of the backend :func:`auto_dense_attention` runs for this call (its decision is cached per
    call shape and platform)."""
    return _auto_dense_decision(q, k, False, return_lse).backend.value


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _cause(exc: BaseException) -> str:
    return short_repr(f"{type(exc).__name__}: {exc}".strip(), 160)[1:-1]


def call_backend(dec: Decision, q: Tensor, k: Tensor, v: Tensor, call: AttnCall, cfg: dict):
    """Run ``dec``'s implementation on one call and return ``(out, lse)``, so that the input classes
    some backends cannot serve end as :class:`AttentionConfigError` naming the class and what is
    accepted, never as a bare ``RuntimeError`` from inside a kernel:

    * inputs that need autograd (grad mode on and q, k, v or the bias require grad): a backend that
      fails on them where the same call succeeds under ``torch.no_grad()``, or that returns an output
      cut off from the graph (its gradients would be silently zero), cannot serve them;
    * meta tensors (shapes without values): a backend whose planning reads values fails on them.

    A failure outside these classes (a bug) propagates unchanged; ``torch.OutOfMemoryError`` too."""
    impl = bind_impl(dec)
    name = dec.backend.value
    grad = _needs_grad(q, k, v, call.attn_bias)
    try:
        out, lse = impl(q, k, v, call, cfg)
    except (AttentionConfigError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        if q.device.type == "meta":
            raise AttentionConfigError(
                f"attention backend '{name}' cannot run on meta tensors (they hold no values, and it reads them "
                f"to plan the call: {_cause(exc)}); accepted: tensors on a real device, or a dense backend such "
                "as torch_sdpa for shape-only runs"
            ) from exc
        if grad:
            try:
                with torch.no_grad():
                    impl(q, k, v, call, cfg)
            except Exception:
                raise exc from None  # fails without autograd too: not an autograd limitation
            raise AttentionConfigError(
                f"attention backend '{name}' does not support autograd (q, k, v or attn_bias require grad: "
                f"{_cause(exc)}); accepted: call it under torch.no_grad() or torch.inference_mode(), or use "
                "torch_sdpa for a differentiable call"
            ) from exc
        raise
    if grad and not out.requires_grad:
        raise AttentionConfigError(
            f"attention backend '{name}' does not support autograd: its output is not connected to q, k, v "
            "(gradients would be silently zero); accepted: call it under torch.no_grad() or "
            "torch.inference_mode(), or use torch_sdpa for a differentiable call"
        )
    return out, lse


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: "str | B | None" = None,
    config: "str | dict | None" = None,
    causal: bool = False,
    scale: Optional[float] = None,
    attn_bias: Optional[Tensor] = None,
    video_shape: Optional[tuple[int, int, int]] = None,
    text_len: int = 0,
    step: Optional[int] = None,
    layer_idx: Optional[int] = None,
    return_lse: bool = False,
):
    """Scaled dot-product attention through one backend.

    q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, kv_heads, head_dim]`` with
    ``heads % kv_heads == 0`` (GQA). backend: a name of ``AttentionBackendEnum`` (aliases allowed)
    or None for the platform's automatic choice (a global force applies). config: backend
    parameters (dict, JSON, ``k=v`` pairs or a file path); with ``backend`` None (or a global force) keys of
    other backends may be present, but each must belong to some backend. attn_bias: additive float bias (or
    boolean mask, True = keep; a query row with no key kept gives zeros and LSE ``-inf``) broadcastable to
    ``[batch, heads, seq_q, seq_kv]``. causal: query ``i`` attends keys ``0..i`` (top-left aligned, as
    PyTorch's SDPA, also when ``seq_q != seq_kv``).
    scale: the factor of ``q @ k^T`` before the softmax; None: ``1/sqrt(head_dim)``. Otherwise a finite
    real number with ``0 < scale <= torch.finfo(q.dtype).max`` (65504 for float16, about 3.4e38 for
    float32 / bfloat16): a larger one turns the scores into ``inf`` and the output into NaN, so it is
    refused. 0 and negative scales are refused too: SDPA and the reference would compute them (0 gives
    every key the same weight, the plain mean of v), but neither is attention, and the sparse backends
    rank blocks by the scaled scores. Scores that overflow although the scale fits (a scale near the
    dtype's maximum with ``|q . k| > 1``) still give NaN: choose a scale for the data.
    video_shape: latent grid ``(T, H, W)`` of the video tokens, which come first in the sequence;
    text_len: text tokens that follow them (joint attention); step / layer_idx: denoising step and
    DiT block index (sparse schedules use them).

    Returns the output ``[batch, seq_q, heads, head_dim]`` in q's dtype, and with
    ``return_lse=True`` also the log-sum-exp ``[batch, heads, seq_q]`` (float32).
    Raises :class:`AttentionConfigError` (or its subclass ``BackendUnavailableError``) for bad inputs
    or a backend that cannot serve the call, including inputs that need autograd or meta tensors a
    backend cannot serve (:func:`call_backend`); ``torch.OutOfMemoryError`` when the device runs out
    of memory.  No other error type is expected.
    """
    check_qkv(q, k, v)
    check_call_args(
        q,
        k,
        causal=causal,
        scale=scale,
        attn_bias=attn_bias,
        text_len=text_len,
        step=step,
        layer_idx=layer_idx,
        return_lse=return_lse,
    )
    scale = None if scale is None else float(scale)
    text_len, step, layer_idx = (None if x is None else as_integer(x) for x in (text_len, step, layer_idx))
    if attn_bias is not None and attn_bias.dim() < 4:  # backends take a 4-D [batch, heads, seq_q, seq_kv] bias
        attn_bias = attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))
    if video_shape is not None:
        if (
            not isinstance(video_shape, (tuple, list))
            or len(video_shape) != 3
            or any(not _is_int(x) or x <= 0 for x in video_shape)
        ):
            raise AttentionConfigError(f"video_shape must be three positive integers (T, H, W), got {video_shape!r}")
        video_shape = tuple(as_integer(x) for x in video_shape)
        if video_shape[0] * video_shape[1] * video_shape[2] + text_len != q.shape[1]:
            raise AttentionConfigError(
                f"video_shape {tuple(video_shape)} ({video_shape[0] * video_shape[1] * video_shape[2]} tokens) "
                f"+ text_len {text_len} does not match the sequence length {q.shape[1]}"
            )
    b = None if backend is None else B.from_name(backend)
    platform = platform_for_device(q.device)
    role = "self" if q.shape[1] == k.shape[1] else "cross"
    dec = _decide(
        b,
        get_forced_backend(),
        platform,
        role,
        q.shape[-1],
        q.dtype,
        q.shape[2],
        k.shape[2],
        causal,
        attn_bias is not None,
        return_lse,
    )
    if config is None:
        cfg = dict(_default_config(dec.backend))
    else:
        raw = parse_attention_backend_config(config)
        if dec.backend != b:  # chosen for the caller: keys of other backends may be there, but each of some backend
            unknown = [key for key in raw if key not in _any_backend_keys()]
            if unknown:
                raise AttentionConfigError(
                    f"config key(s) {', '.join(map(repr, unknown[:5]))} belong to no attention backend; "
                    "'ditattn backends NAME' lists a backend's keys"
                )
        cfg = validate_backend_config(dec.backend, raw, strict_unknown=(dec.backend == b))
    call = AttnCall(
        causal=causal,
        scale=scale,
        attn_bias=attn_bias,
        video_shape=video_shape,
        text_len=text_len,
        step=step,
        layer_idx=layer_idx,
        return_lse=return_lse,
        layer_key=None,
    )
    out, lse = call_backend(dec, q, k, v, call, cfg)
    return (out, lse) if return_lse else out
