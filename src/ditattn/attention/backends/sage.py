"""Quantized dense backends: ``sage_attn`` and ``sage_attn_3``.

``sage_attn`` (INT8 Q.K with smoothed K, FP16/BF16 or FP8 P.V; lossy):

* CUDA: our Triton kernel (:func:`ditattn.attention.kernels.int8_attention.int8_attention`:
  per-token Q / per-block K INT8 scales, online softmax, LSE, GQA) or the ``sageattention``
  package.  Which one is ``DITATTN_SAGE_IMPL`` (``auto`` | ``triton`` | ``package``); ``auto``
  takes the Triton kernel on SM90 (measured faster than sageattention 1.0.6 there, see
  docs/benchmarks.md), whenever the LSE is needed (the package returns none) and when the package
  is missing, else the package.  P.V precision is ``DITATTN_SAGE_PV`` (``fp16``, the default:
  about 1.3 % relative error on random inputs; ``fp8``: faster tensor-core rate, about 4 %).
  sageattention 1.0.6 subtracts the key mean from its K argument in place, so it gets a clone.
* Hopper: a call the in-tree kernel cannot serve (head dims other than 32/64/128) needs a
  sageattention build with the SM90 binding fix; with PyPI's 2.2.0 the selector runs ``fa``
  instead (the seed's fallback, recorded in the plan).
* MUSA: the ``sageattention`` package (no LSE).
* CPU: :func:`ditattn.attention.kernels.int8_attention.int8_attention_reference`, the same
  quantization in PyTorch (float32, float16 or bfloat16 inputs).

``sage_attn_3`` runs ``sageattn3.sageattn3_blackwell`` (FP4 microscaling) on Blackwell GPUs only.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
import torch

from ditattn.attention.backends.base import AttnCall, expand_kv, register
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import SAGE_SM90_FIX_INSTALL, sage_cuda_runtime, sage_lacks_sm90_fix
from ditattn.errors import AttentionConfigError, BackendUnavailableError
from ditattn.platforms import platform_for_device

log = logging.getLogger(__name__)

SAGE_IMPLS = ("auto", "triton", "package")
BLACKWELL_SMS = (100, 103, 120, 121)


@functools.lru_cache(maxsize=None)
def _load(module: str, attr: str):
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:
        log.debug("%s.%s not usable: %s", module, attr, exc)
        return None


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    val = os.environ.get(name, default).strip().lower()
    if val not in choices:
        raise AttentionConfigError(f"{name}={val!r} is not valid; accepted: {', '.join(choices)}")
    return val


def sage_cuda_impl(q: torch.Tensor, need_lse: bool) -> str:
    """Which CUDA implementation ``sage_attn`` uses for ``q``: a key of :data:`IMPLS`.

    ``auto`` is :func:`ditattn.attention.specs.sage_cuda_runtime`, the rule the selector applies
    (so the plan names what runs): the in-tree kernel on SM90 (measured faster), when the LSE is
    needed and without the package, else the package. A call nothing may serve raises with the
    reason; on Hopper with a sageattention build that lacks the SM90 fix the selector has already
    put ``fa`` on such layers, as the seed says.
    """
    choice = _env_choice("DITATTN_SAGE_IMPL", SAGE_IMPLS, "auto")
    has_pkg = _load("sageattention", "sageattn") is not None
    d = q.shape[-1]
    from ditattn.attention.kernels.int8_attention import SUPPORTED_HEAD_DIMS

    platform = platform_for_device(q.device)
    if choice == "package":
        if not has_pkg:
            raise BackendUnavailableError("sage_attn", ["DITATTN_SAGE_IMPL=package but package 'sageattention' is not installed"])
        if need_lse:
            raise AttentionConfigError("sage_attn: the sageattention package returns no LSE (needed here); "
                                       "use DITATTN_SAGE_IMPL=triton or auto")
        if platform.sm == 90 and sage_lacks_sm90_fix(platform):
            raise BackendUnavailableError("sage_attn", [
                f"DITATTN_SAGE_IMPL=package: sageattention {platform.package_version('sageattention')} lacks the "
                f"upstream SM90 binding fix on Hopper; install: {SAGE_SM90_FIX_INSTALL}, or use auto/triton"])
        return "package"
    if choice == "triton":
        if d not in SUPPORTED_HEAD_DIMS:
            raise AttentionConfigError(f"sage_attn: the in-tree INT8 kernel supports head dim {list(SUPPORTED_HEAD_DIMS)}, "
                                       f"not {d}")
        return "triton"
    impl, why = sage_cuda_runtime(platform, d, need_lse)
    if impl is None:
        raise BackendUnavailableError("sage_attn", [why])
    return impl


def _run_package(q, k, v, call: AttnCall, pv: str):
    if call.return_lse:
        raise AttentionConfigError("sage_attn: the sageattention package returns no LSE (ring attention needs it)")
    sageattn = _load("sageattention", "sageattn")
    if sageattn is None:
        raise BackendUnavailableError("sage_attn", ["needs package 'sageattention' (not installed); "
                                                    "install: pip install sageattention"])
    # sageattention 1.0.6 does `k -= k.mean(...)` on its argument: never hand it ours
    out = sageattn(q, k.clone(), v, tensor_layout="NHD", is_causal=call.causal, sm_scale=call.scale)
    return out, None


def _run_triton(q, k, v, call: AttnCall, pv: str):
    from ditattn.attention.kernels.int8_attention import int8_attention

    return int8_attention(q, k, v, scale=call.scale, causal=call.causal, return_lse=call.return_lse, pv=pv)


def _run_reference(q, k, v, call: AttnCall, pv: str):
    from ditattn.attention.kernels.int8_attention import int8_attention_reference

    return int8_attention_reference(q, k, v, scale=call.scale, causal=call.causal, return_lse=call.return_lse, pv=pv)


#: Implementations of ``sage_attn`` by key (what :func:`sage_impl_key` picks).
IMPLS = {"triton": _run_triton, "package": _run_package, "reference": _run_reference}


def sage_impl_key(device_type: str, q: torch.Tensor, need_lse: bool) -> str:
    """Key of :data:`IMPLS` for a call on ``device_type``: CUDA per :func:`sage_cuda_impl`, MUSA
    the sageattention package (the seed's MUSA support), CPU the PyTorch reference."""
    if device_type == "cuda":
        return sage_cuda_impl(q, need_lse)
    if device_type == "musa":
        return "package"
    if device_type == "cpu":
        return "reference"
    raise BackendUnavailableError("sage_attn", [f"runs on CUDA, MUSA (sageattention package) and the CPU "
                                                f"reference, not on {device_type}"])


@register(B.SAGE_ATTN)
def sage_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, config: dict):
    """``sage_attn``: q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]``; returns ``(out, lse|None)``.

    Lossy (INT8 Q.K).  No additive bias.  CUDA and MUSA: fp16/bf16; CPU: float32/float16/bfloat16.
    """
    if call.attn_bias is not None:
        raise AttentionConfigError("sage_attn: does not accept an additive attention bias/mask; accepted: no bias")
    pv = _env_choice("DITATTN_SAGE_PV", ("fp16", "fp8"), "fp16")
    if q.device.type != "cpu" and q.dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(
            f"sage_attn: dtype {str(q.dtype).replace('torch.', '')} not supported on {q.device.type} "
            "(accepts float16, bfloat16)"
        )
    return IMPLS[sage_impl_key(q.device.type, q, call.return_lse)](q, k, v, call, pv)


def sage3_unavailable_reasons(device: torch.device) -> list[str]:
    """Why ``sage_attn_3`` cannot run on ``device`` (empty: it can)."""
    reasons = []
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        reasons.append(f"needs an NVIDIA Blackwell GPU (SM{'/'.join(map(str, BLACKWELL_SMS))}); tensors are on {device.type}")
    else:
        major, minor = torch.cuda.get_device_capability(device)
        sm = major * 10 + minor
        if sm not in BLACKWELL_SMS:
            reasons.append(f"needs an NVIDIA Blackwell GPU (SM{'/'.join(map(str, BLACKWELL_SMS))}); this GPU is SM{sm}")
    if _load("sageattn3", "sageattn3_blackwell") is None:
        reasons.append("needs package 'sageattn3' (not installed); build SageAttention3 from its upstream repository")
    return reasons


@register(B.SAGE_ATTN_3)
def sage_attention_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, config: dict):
    """``sage_attn_3``: SageAttention3 FP4 attention on Blackwell; no LSE, no bias.

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` fp16/bf16; returns ``(out, None)``.
    """
    reasons = sage3_unavailable_reasons(q.device)
    if reasons:
        raise BackendUnavailableError("sage_attn_3", reasons)
    if call.attn_bias is not None:
        raise AttentionConfigError("sage_attn_3: does not accept an additive attention bias/mask; accepted: no bias")
    if call.return_lse:
        raise AttentionConfigError("sage_attn_3: does not return the softmax LSE (ring attention needs it)")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise AttentionConfigError(f"sage_attn_3: dtype {q.dtype} not supported (accepts float16, bfloat16)")
    fn = _load("sageattn3", "sageattn3_blackwell")
    k, v = expand_kv(k, v, q.shape[2])
    out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=call.causal)
    return out.transpose(1, 2), None

