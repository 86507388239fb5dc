"""The contract between the selector and a backend implementation.

An implementation is a function::

    impl(q, k, v, call: AttnCall, config: dict) -> tuple[Tensor, Tensor | None]

q: ``[batch, seq_q, heads, head_dim]``; k, v: ``[batch, seq_kv, kv_heads, head_dim]`` with
``heads % kv_heads == 0`` (grouped-query attention). It returns the output ``[batch, seq_q, heads,
head_dim]`` in q's dtype, and, when ``call.return_lse`` is true, the natural-log sum-exp of each
query row's scaled scores, ``[batch, heads, seq_q]`` float32 (else None).  ``config`` is the
backend's validated parameters (``config.validate_backend_config``).  Implementations register
themselves with :func:`register`; modules are imported lazily on first use.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

import torch

from ditattn.attention.names import AttentionBackendEnum as B
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

# backend -> module that registers its implementation (imported on first use)
_MODULES: dict[B, str] = {
    B.TORCH_SDPA: "ditattn.attention.backends.sdpa",
    B.TORCH_CUDNN_SDPA: "ditattn.attention.backends.sdpa",
    B.FA: "ditattn.attention.backends.flash",
    B.AITER: "ditattn.attention.backends.flash",
    B.SAGE_ATTN: "ditattn.attention.backends.sage",
    B.SAGE_ATTN_3: "ditattn.attention.backends.sage",
    B.SLIDING_TILE_ATTN: "ditattn.attention.backends.sparse_video",
    B.VIDEO_SPARSE_ATTN: "ditattn.attention.backends.sparse_video",
    B.SPARGE_ATTN: "ditattn.attention.backends.sparse_video",
    B.VMOBA_ATTN: "ditattn.attention.backends.sparse_video",
    B.SPARSE_VIDEO_GEN_2_ATTN: "ditattn.attention.backends.sparse_video",
    B.SLA_ATTN: "ditattn.attention.backends.sparse_video",
    B.SAGE_SLA_ATTN: "ditattn.attention.backends.sparse_video",
    B.SOL_ATTN: "ditattn.attention.backends.sparse_video",
}


def register(*backends: B):
    """Decorator: register ``fn`` as the implementation of ``backends``."""

    def deco(fn: Impl) -> Impl:
        for b in backends:
            _REGISTRY[b] = fn
        return fn

    return deco


def get_impl(backend: B) -> Impl:
    """The implementation of ``backend``; raises ``LookupError`` if this build has none."""
    if backend not in _REGISTRY and backend in _MODULES:
        importlib.import_module(_MODULES[backend])
    try:
        return _REGISTRY[backend]
    except KeyError:
        raise LookupError(f"no implementation of attention backend '{backend.value}' in this build") from None


def expand_kv(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Repeat K/V heads for grouped-query attention: ``[B, S, Hkv, D] -> [B, S, heads, D]``."""
    hkv = k.shape[2]
    if hkv == heads:
        return k, v
    rep = heads // hkv
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def reference_attention(q, k, v, *, causal=False, scale=None, attn_bias=None, mask=None,
                        dtype=torch.float32) -> tuple[Tensor, Tensor]:
    """Plain math attention in ``dtype`` (float32 or float64): the reference for every kernel.

    ``mask``: optional boolean ``[B or 1, H or 1, Sq, Skv]``, True = attend. Rows with no allowed key
    give zeros and LSE ``-inf``. Returns ``(out [B, Sq, H, D] in dtype, lse [B, H, Sq] in dtype)``.
    """
    heads = q.shape[2]
    k, v = expand_kv(k, v, heads)
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (qf @ kf.transpose(-1, -2)) * scale
    if attn_bias is not None:
        s = s + attn_bias.to(dtype)
    if causal:
        sq, skv = s.shape[-2:]
        keep = torch.ones(sq, skv, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask.to(torch.bool), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    shift = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # fully masked rows: exp(-inf) = 0
    out = torch.exp(s - shift.unsqueeze(-1)) @ vf
    return out.transpose(1, 2), lse
