"""Per-platform automatic choice and platform substitutions (DESIGN 2.2).

``auto_candidates(req, platform)`` lists dense backends in preference order; the selector takes
the first one whose capability check passes.  ``substitute(backend, req, platform)`` says when the
platform runs another backend for a requested one (the seed's fallbacks), with the reason.
"""
from __future__ import annotations

import torch

from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import SPECS, LayerRequest
from ditattn.platforms import Platform

_HALF = (torch.float16, torch.bfloat16)


def _fa_fast_runtime(platform: Platform) -> bool:
    """FA4/FA3 are faster than cuDNN on Hopper/Blackwell; FA2 is slower than cuDNN (PERF.md)."""
    return platform.has_any(("flash_attn.cute", "flash_attn_interface")) is not None


def auto_candidates(req: LayerRequest, platform: Platform) -> list[B]:
    """Dense backends in preference order for ``req`` on ``platform``."""
    name = platform.name
    if name == "cuda":
        sm = platform.sm or 0
        dense_half = req.dtype in _HALF and not req.causal and not req.needs_bias
        if sm in (100, 103) and dense_half:
            # SM100/B200: cuDNN SDPA first for dense non-causal fp16/bf16, FA when cuDNN has no kernel
            return [B.TORCH_CUDNN_SDPA, B.FA, B.TORCH_SDPA]
        # Measured on H200 (PERF.md): FA4 > cuDNN SDPA > torch flash (FA2 path)
        if _fa_fast_runtime(platform):
            return [B.FA, B.TORCH_CUDNN_SDPA, B.TORCH_SDPA]
        return [B.TORCH_CUDNN_SDPA, B.FA, B.TORCH_SDPA]
    if name in ("rocm", "xpu", "npu"):
        if name == "npu" and not req.needs_lse:
            return [B.TORCH_SDPA]  # NPU: FA for ring attention, SDPA otherwise
        return [B.FA, B.TORCH_SDPA]
    if name == "musa":
        return [B.FA, B.SAGE_ATTN, B.TORCH_SDPA]
    return [B.TORCH_SDPA]  # cpu, mps


def substitute(backend: B, req: LayerRequest, platform: Platform) -> "tuple[B, str] | None":
    """The backend the platform runs instead of ``backend`` and why, or None (no substitution).

    Only the seed's fallbacks substitute: ``fa`` without an installed FlashAttention runtime (or on
    a platform without one) → ``torch_sdpa``; ``sage_attn`` on Hopper with a sageattention build
    that lacks the SM90 fix and no in-tree kernel → ``fa``; ``fp8_fa_sm120`` off SM120 or on an
    unsupported call → ``torch_cudnn_sdpa``.
    """
    spec = SPECS[backend]
    if backend is B.FA:
        if platform.name in ("cpu", "mps"):
            return B.TORCH_SDPA, f"no FlashAttention runtime on {platform.name}; {platform.name} uses torch_sdpa"
        if platform.name in spec.runtimes and spec.runtime_on(platform) is None:
            mods = [m for rt in spec.runtimes[platform.name] for m in rt.modules]
            return B.TORCH_SDPA, (
                f"no FlashAttention runtime installed ({' / '.join(mods)} not found); "
                f"install: {spec.install_hint}"
            )
        return None
    if backend is B.SAGE_ATTN and platform.name == "cuda" and platform.sm == 90:
        rt = spec.runtime_on(platform)
        if rt is not None and rt.modules == ("sageattention",) and _sage_without_sm90_fix():
            return B.FA, "sageattention from PyPI lacks the SM90 binding fix on Hopper; using fa"
        return None
    if backend is B.FP8_FA_SM120 and platform.name == "cuda":
        if platform.sm != 120:
            return B.TORCH_CUDNN_SDPA, f"fp8_fa_sm120 runs on SM120 only (this GPU is SM{platform.sm})"
        reasons = spec.reasons(req, platform)
        if reasons:
            return B.TORCH_CUDNN_SDPA, "fp8_fa_sm120 cannot serve this call (" + "; ".join(reasons) + ")"
    return None


def _sage_without_sm90_fix() -> bool:
    try:
        from importlib.metadata import version

        return version("sageattention") == "2.2.0"
    except Exception:
        return False

