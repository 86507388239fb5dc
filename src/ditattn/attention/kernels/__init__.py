"""In-tree Triton attention kernels (CUDA; also runnable in the Triton interpreter on CPU).

Modules (import them lazily: importing one compiles nothing, but imports ``triton``):

* :mod:`.block_sparse_triton` -- fused block-sparse flash-attention forward over per-query-block
  key-block lists (the GPU engine of the sparse video backends).
* :mod:`.block_sparse_fa4` -- the same lists through FlashAttention-4's block-sparse forward (128-token blocks
  by default; key blocks that hold padding through FA4's ``mask_mod``), with the one-launch list split it needs.
* :mod:`.int8_attention` -- quantized dense attention (SageAttention-style): INT8 Q.K with smoothed
  K and per-block scales, P.V in FP16/BF16 or FP8 e4m3, online softmax, LSE, GQA; plus the PyTorch
  reference of the same quantization (runs anywhere, used on CPU).
* :mod:`.skip_softmax` -- BLASST skip-softmax flash kernel and its dense path.
* :mod:`.block_centroid` -- Sol's block-centroid virtual keys, continuing a block-sparse pass's
  online softmax (fused LSE merge).
* :mod:`.block_quant` -- one-pass per-block INT8 quantize-dequantize (SageSLA's emulated INT8 Q/K).
* :mod:`.block_select` -- the top-k planners' selection stage: pooling of q and k per block in one
  launch, and a per-row top-k that writes the int32 block lists (ties to the lower block id).
* :mod:`.interpreter_dtypes` -- correct bf16/fp8 arithmetic for the CPU path in Triton's interpreter.

Every public kernel takes q/k/v in the backend layout ``[batch, seq, heads, head_dim]`` (k/v may
have fewer heads: grouped-query attention) and returns ``(out, lse | None)`` with ``lse``
``[batch, heads, seq_q]`` float32 natural log.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Optional

import torch

from ditattn.errors import AttentionConfigError

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# which kernel the block-sparse engine's ``impl="auto"`` takes on CUDA (kept here, free of Triton imports, so that
# the plan can name it): FlashAttention-4's block-sparse forward at these block sizes where installed (measured;
# at 64 ours is 0-14 % faster), and the SM90 Gluon kernel at 64-token tiles from this many query tokens on (H200,
# docs/benchmarks.md: at 75,600 tokens it is 1.28-1.51x ideal against Triton's 1.49-1.56; at 32,760 no faster)
FA4_AUTO_BLOCK_SIZES = (128,)
SM90_AUTO_MIN_TOKENS = 60_000


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def check_device(*tensors: torch.Tensor, what: str) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter."""
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise AttentionConfigError(f"{what}: all tensors must be on one device, got {t.device} and {dev}")
    if dev.type == "cuda":
        return
    if dev.type == "cpu" and interpreting():
        from ditattn.attention.kernels.interpreter_dtypes import enable

        narrow = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
        if not enable() and any(t.dtype in narrow for t in tensors):
            raise AttentionConfigError(
                f"{what}: this Triton's CPU interpreter cannot compute in {tensors[0].dtype} (bit-level bf16/fp8 "
                "arithmetic); use float16, or the PyTorch path (the default on CPU)"
            )
        return
    raise AttentionConfigError(
        f"{what}: needs CUDA tensors (got {dev.type}); CPU tensors run only under TRITON_INTERPRET=1"
    )


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    what: str,
    dtypes=(torch.float16, torch.bfloat16),
    head_dims=None,
) -> tuple[int, int, int, int, int, int]:
    """Validate ``[B, S, H, D]`` q/k/v for a kernel; returns ``(B, Sq, Skv, H, Hkv, D)``.

    Raises :class:`AttentionConfigError` naming what was wrong and what is accepted.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise AttentionConfigError(
            f"{what}: q, k, v must be 4-D [batch, seq, heads, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, Sq, H, D = q.shape
    Bk, Skv, Hkv, Dk = k.shape
    if Bk != B or tuple(v.shape) != tuple(k.shape) or Dk != D:
        raise AttentionConfigError(
            f"{what}: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(k and v must be [B, S_kv, H_kv, D] with q's batch and head dim)"
        )
    if Hkv == 0 or H % Hkv:
        raise AttentionConfigError(f"{what}: query heads {H} must be a multiple of key/value heads {Hkv}")
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise AttentionConfigError(
            f"{what}: dtype {str(q.dtype).replace('torch.', '')}/{str(k.dtype).replace('torch.', '')}/"
            f"{str(v.dtype).replace('torch.', '')} not supported (q, k, v must share one of: {names})"
        )
    if head_dims is not None and D not in head_dims:
        raise AttentionConfigError(f"{what}: head dim {D} not supported (accepts {sorted(head_dims)})")
    if Sq == 0 or Skv == 0 or B == 0:
        raise AttentionConfigError(f"{what}: empty input (batch {B}, seq_q {Sq}, seq_kv {Skv})")
    return B, Sq, Skv, H, Hkv, D


def launch_config(defaults: dict, config: Optional[dict], *, what: str) -> dict:
    """``defaults`` updated with the caller's ``config``; an unknown key raises
    :class:`AttentionConfigError` naming the accepted keys."""
    cfg = dict(defaults)
    if config:
        unknown = set(config) - set(cfg)
        if unknown:
            raise AttentionConfigError(f"{what}: unknown config keys {sorted(unknown)}; accepted: {sorted(cfg)}")
        cfg.update(config)
    return cfg


def num_sms(device: torch.device) -> int:
    """CTAs of a persistent schedule (the SM90 kernels' config ``persistent``): one per SM (their shared
    memory admits one CTA per SM).  Each kernel module calls it through its own name, so that the GPU
    tests can shrink one kernel's grid (monkeypatch) and run many tiles per CTA."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` with stride 1 in its last dimension (a copy only when needed)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _drop_entry(cache: dict, key: tuple, token: object, _ref) -> None:
    """Weak-reference callback of :func:`identity_cached`: a key tensor died, so its entry (if it is still the
    one stored under ``key``, recognised by ``token``) can never hit again; drop it and what it holds."""
    got = cache.get(key)
    if got is not None and got[2] is token:
        cache.pop(key, None)


def identity_cached(cache: dict, tensors: tuple, extra: tuple, compute):
    """``compute()``, memoised on the identity and in-place version of ``tensors`` (None allowed).

    A layer reuses its plan's tensors across calls; keying on the objects (held by weak reference,
    so a freed tensor whose id is recycled never hits) avoids recomputing per-plan facts that cost
    a device sync or a few small kernels.  An in-place change of a tensor bumps its version and
    misses.  An entry goes as soon as one of its tensors is freed (a planner that builds new lists every
    step leaves no device memory behind in the cache).  Tensors created under ``torch.inference_mode`` have
    no version counter: for them the result is recomputed on every call."""
    if any(t is not None and t.is_inference() for t in tensors):
        return compute()  # inference tensors carry no version counter: an in-place change would go unseen
    key = tuple(id(t) for t in tensors) + extra
    hit = cache.get(key)
    if hit is not None:
        refs, result, _ = hit
        if all(
            (r is None and t is None) or (r is not None and t is not None and r[0]() is t and r[1] == t._version)
            for r, t in zip(refs, tensors)
        ):
            return result
    result = compute()
    if len(cache) >= 64:  # drop entries whose tensors are gone (a callback may not have run yet)
        snapshot = cache.copy()  # a callback may pop entries while this loop runs
        for k in [k for k, (refs, _, _) in snapshot.items() if any(r is not None and r[0]() is None for r in refs)]:
            cache.pop(k, None)
        if len(cache) >= 256:
            cache.clear()
    token = object()
    drop = functools.partial(_drop_entry, cache, key, token)
    refs = tuple(None if t is None else (weakref.ref(t, drop), t._version) for t in tensors)
    cache[key] = (refs, result, token)
    return result
