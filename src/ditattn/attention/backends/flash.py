"""FlashAttention backends: ``fa`` (FlashAttention-4 / -3 / -2, whichever is installed) and ``aiter``.

``fa`` picks the first importable runtime in this order:

* FlashAttention-4, ``flash_attn.cute.flash_attn_func`` (CuTe DSL; SM90 and SM100; returns
  ``(out, lse)`` with ``return_lse=True``) -- the fastest dense kernel measured on the H200;
* FlashAttention-3, ``flash_attn_interface.flash_attn_func`` (Hopper);
* FlashAttention-2, ``flash_attn.flash_attn_func``.

All three take the backend layout ``[B, S, H, D]`` directly, support grouped-query attention
natively and return the LSE ``[B, H, S_q]`` float32.  Without a runtime (or off CUDA) ``fa`` runs
``torch_sdpa`` instead, logged once; the selector records the substitution in the plan
(:func:`fa_fallback_reason`) and refuses it where a rule forbids substitution.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable, Optional

import torch

from ditattn.attention.backends.base import AttnCall, get_impl, register
from ditattn.attention.kernels import last_dim_contiguous
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import BackendSpec, Runtime
from ditattn.errors import AttentionConfigError, BackendUnavailableError

log = logging.getLogger(__name__)

#: (runtime key, import name, attribute, label) in order of preference
FA_RUNTIMES = (
    ("fa4", "flash_attn.cute", "flash_attn_func", "FlashAttention-4"),
    ("fa3", "flash_attn_interface", "flash_attn_func", "FlashAttention-3"),
    ("fa2", "flash_attn", "flash_attn_func", "FlashAttention-2"),
)
_LABELS = {key: label for key, _, _, label in FA_RUNTIMES}
_warned: set[str] = set()


@functools.lru_cache(maxsize=None)
def _load(module: str, attr: str) -> Optional[Callable]:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a runtime that fails to initialise (no CUDA, bad build)
        log.debug("FlashAttention runtime %s not usable: %s", module, exc)
        return None
    return getattr(mod, attr, None)


@functools.lru_cache(maxsize=None)
def fa_runtime() -> Optional[str]:
    """Key of the FlashAttention runtime ``fa`` uses here (``"fa4"``, ``"fa3"``, ``"fa2"``) or None."""
    for key, module, attr, _ in FA_RUNTIMES:
        if _load(module, attr) is not None:
            return key
    return None


def fa_runtime_label() -> Optional[str]:
    """Human-readable name of :func:`fa_runtime` (e.g. ``"FlashAttention-4"``), or None."""
    rt = fa_runtime()
    return _LABELS[rt] if rt else None


def fa_fallback_reason(device: "torch.device | str") -> Optional[str]:
    """Why ``fa`` would run ``torch_sdpa`` for tensors on ``device`` (None: it runs FlashAttention)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"no FlashAttention runtime on {dev.type}; fa runs torch_sdpa"
    if getattr(torch.version, "hip", None):
        if fa_runtime() in ("fa2",):
            return None
        return "no FlashAttention runtime for ROCm installed (flash-attn); fa runs torch_sdpa"
    if fa_runtime() is None:
        return (
            "no FlashAttention runtime installed (flash-attn-4, FlashAttention-3 flash_attn_interface, "
            "or flash-attn); fa runs torch_sdpa"
        )
    return None


@functools.lru_cache(maxsize=None)
def _fa_target(device: torch.device) -> tuple:
    """What ``fa`` runs for tensors on ``device``, resolved once per device (the per-call path then does no
    imports, runtime scans or capability queries): ``(runtime key, kernel, SM major)``, or
    ``(fallback reason, None, None)`` where it runs ``torch_sdpa``."""
    reason = fa_fallback_reason(device)
    if reason is not None:
        return reason, None, None
    rt = fa_runtime()
    _, module, attr, _ = next(x for x in FA_RUNTIMES if x[0] == rt)
    major = torch.cuda.get_device_capability(device)[0] if rt == "fa4" else None
    return rt, _load(module, attr), major


def _fa_check(spec, req, platform):
    if platform.name == "xpu" and req.head_dim is not None and req.head_dim not in (64, 96, 128, 192, 256):
        return [f"XPU flash attention supports head sizes 64/96/128/192/256, not {req.head_dim}"]
    return []


_NO_FA_KERNEL = "ditattn has no FlashAttention kernel for {p} ({what} is not integrated)"


def _check_inputs(name: str, q, k, v, call: AttnCall) -> None:
    if call.attn_bias is not None:
        raise AttentionConfigError(
            f"{name}: does not accept an additive attention bias/mask; accepted: no bias "
            "(use torch_sdpa for biased attention)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionConfigError(
            f"{name}: dtype {str(q.dtype).replace('torch.', '')} not supported (accepts float16, bfloat16; "
            "q, k, v must share it)"
        )
    d = q.shape[-1]
    if d % 8 or d > 256:
        raise AttentionConfigError(f"{name}: head dim {d} not supported (accepts multiples of 8 up to 256)")
    if q.shape[2] % k.shape[2]:
        raise AttentionConfigError(
            f"{name}: query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}"
        )


def _sm100_head_dim_ok(d: int) -> bool:
    return d <= 128 or d == 256


def _unpack(res, need_lse: bool, name: str):
    if isinstance(res, (tuple, list)):
        out = res[0]
        lse = res[1] if len(res) > 1 else None
    else:
        out, lse = res, None
    if need_lse:
        if lse is None:
            raise AttentionConfigError(f"{name}: this FlashAttention build did not return the LSE")
        lse = lse.float()
    return out, (lse if need_lse else None)


@register(
    B.FA,
    spec=BackendSpec(
        kind="dense",
        summary="FlashAttention (FA4 CuTe DSL, FA3 or FA2, whichever is installed)",
        runtimes={
            "cuda": (
                Runtime(("flash_attn.cute",), "FlashAttention-4"),
                Runtime(("flash_attn_interface",), "FlashAttention-3"),
                Runtime(("flash_attn",), "FlashAttention-2"),
            ),
            "rocm": (Runtime(("flash_attn",), "FlashAttention (ROCm build of flash-attn)"),),
            "xpu": (
                Runtime(
                    (),
                    "XPU flash attention",
                    missing=_NO_FA_KERNEL.format(p="XPU", what="the XPU flash attention of sgl-kernel-xpu"),
                ),
            ),
            "musa": (
                Runtime(
                    ("flash_attn",),
                    "MUSA FlashAttention",
                    missing=_NO_FA_KERNEL.format(p="MUSA", what="a MUSA build of flash-attn"),
                ),
            ),
            "npu": (
                Runtime(
                    (),
                    "NPU fused attention",
                    missing=_NO_FA_KERNEL.format(p="NPU", what="torch_npu's npu_fusion_attention"),
                ),
            ),
        },
        upstream_platforms=("cuda", "rocm", "xpu", "musa", "npu"),
        cuda_sm_min=80,
        returns_lse=True,
        varlen=True,
        drop_in=True,
        install_hint="pip install flash-attn-4 (SM90/SM100), or flash-attn (FA2; its ROCm build on ROCm)",
        notes="falls back to torch_sdpa (logged, recorded in the plan) when no FlashAttention runtime "
        "is installed or this build has no kernel path for the platform (CPU, MPS, XPU, MUSA, NPU)",
        extra_check=_fa_check,
    ),
)
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, config: dict):
    """``fa``: FlashAttention through the installed runtime; ``torch_sdpa`` when there is none.

    q ``[B, S_q, H, D]``, k/v ``[B, S_kv, H_kv, D]`` fp16/bf16, D a multiple of 8 up to 256 (up to
    128, or 256, on SM100).  Returns ``(out [B, S_q, H, D], lse [B, H, S_q] float32 or None)``.
    """
    rt, fn, major = _fa_target(q.device)
    if fn is None:  # rt: why fa runs torch_sdpa here
        if rt not in _warned:
            _warned.add(rt)
            log.warning("fa: %s", rt)
        return get_impl(B.TORCH_SDPA)(q, k, v, call, config)
    _check_inputs("fa", q, k, v, call)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))  # the kernels index the head dim as packed
    if rt == "fa4":
        if major in (10, 11) and not _sm100_head_dim_ok(q.shape[-1]):
            raise AttentionConfigError(
                f"fa: FlashAttention-4 on SM100 supports head dim <= 128 or 256, not {q.shape[-1]}"
            )
        res = fn(q, k, v, softmax_scale=call.scale, causal=call.causal, return_lse=call.return_lse)
    elif rt == "fa3":
        try:
            res = fn(q, k, v, softmax_scale=call.scale, causal=call.causal, return_attn_probs=call.return_lse)
        except TypeError:  # builds without the return_attn_probs keyword return (out, lse)
            res = fn(q, k, v, softmax_scale=call.scale, causal=call.causal)
    else:
        res = fn(
            q, k, v, dropout_p=0.0, softmax_scale=call.scale, causal=call.causal, return_attn_probs=call.return_lse
        )
    return _unpack(res, call.return_lse, f"fa ({_LABELS[rt]})")


@register(
    B.AITER,
    spec=BackendSpec(
        kind="dense",
        summary="AMD aiter flash attention (ROCm only)",
        runtimes={"rocm": (Runtime(("aiter",), "aiter"),)},
        upstream_platforms=("rocm",),
        returns_lse=True,
        install_hint="pip install aiter (ROCm)",
    ),
)
def aiter_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttnCall, config: dict):
    """``aiter``: AMD aiter flash attention (ROCm GPUs), ``aiter.flash_attn_func`` in the
    ``[B, S, H, D]`` layout, with LSE.  Raises :class:`BackendUnavailableError` off ROCm or
    without the package."""
    reasons = []
    if q.device.type != "cuda" or not getattr(torch.version, "hip", None):
        reasons.append(
            f"needs a ROCm GPU (tensors are on {q.device.type}"
            f"{'' if getattr(torch.version, 'hip', None) else ', this PyTorch has no ROCm'})"
        )
    fn = _load("aiter", "flash_attn_func")
    if fn is None:
        reasons.append("needs package 'aiter' (not installed); install: pip install aiter (ROCm)")
    if reasons:
        raise BackendUnavailableError("aiter", reasons)
    _check_inputs("aiter", q, k, v, call)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    res = fn(q, k, v, dropout_p=0.0, softmax_scale=call.scale, causal=call.causal, return_lse=call.return_lse)
    return _unpack(res, call.return_lse, "aiter")
