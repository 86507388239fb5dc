"""In-tree Triton attention kernels (CUDA; also runnable in the Triton interpreter on CPU).

Modules (import them lazily: importing one compiles nothing, but imports ``triton``):

* :mod:`.block_sparse_triton` -- fused block-sparse flash-attention forward over per-query-block
  key-block lists (the GPU engine of the sparse video backends).
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

import os
from typing import Optional

import torch

from ditattn.errors import AttentionConfigError

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


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
