"""Per-platform automatic choice and platform substitutions.

``auto_candidates(req, platform)`` lists dense backends in preference order; the selector takes
the first one whose capability check passes.  ``substitute(backend, req, platform)`` says when the
platform runs another backend for a requested one (upstream's (SGLang) fallbacks), with the reason.
"""

from __future__ import annotations

import torch

from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.specs import SPECS, LayerRequest
from ditattn.platforms import Platform

_HALF = (torch.float16, torch.bfloat16)


def _fa_fast_runtime(platform: Platform) -> bool:
    """FA4/FA3 are faster than cuDNN on Hopper/Blackwell; FA2 is slower than cuDNN (measured on the H200)."""
    return platform.has_any(("flash_attn.cute", "flash_attn_interface")) is not None


#: SM -> (evidence, yields to FA4/FA3): where the automatic CUDA order puts cuDNN SDPA ahead of
#: FlashAttention for dense non-causal fp16/bf16 attention. Everywhere else upstream's rule applies:
#: FlashAttention when usable, else PyTorch SDPA (no unmeasured reordering).
CUDNN_FIRST: dict[int, tuple[str, bool]] = {
    90: (
        "measured on the H200: cuDNN SDPA ~1.6x torch's flash path, faster than FlashAttention-2; "
        "FlashAttention-4/-3 are faster still and stay first when installed",
        True,
    ),
    100: (
        "upstream's SM100/B200 rule (cuDNN first, FA when cuDNN has no kernel for a call); not measured by ditattn",
        False,
    ),
    103: ("upstream's SM100-family rule, as SM100; not measured by ditattn", False),
}


def auto_candidates(req: LayerRequest, platform: Platform) -> list[B]:
    """Dense backends in preference order for ``req`` on ``platform``."""
    name = platform.name
    if name == "cuda":
        dense_half = req.dtype in _HALF and not req.causal and not req.needs_bias
        rule = CUDNN_FIRST.get(platform.sm or 0)
        if rule is not None and dense_half and not (rule[1] and _fa_fast_runtime(platform)):
            return [B.TORCH_CUDNN_SDPA, B.FA, B.TORCH_SDPA]
        return [B.FA, B.TORCH_SDPA]
    if name in ("rocm", "xpu", "npu"):
        if name == "npu" and not req.needs_lse:
            return [B.TORCH_SDPA]  # NPU: FA for ring attention, SDPA otherwise
        return [B.FA, B.TORCH_SDPA]
    if name == "musa":
        return [B.FA, B.SAGE_ATTN, B.TORCH_SDPA]
    return [B.TORCH_SDPA]  # cpu, mps


def runtime_fallback(backend: B, req: LayerRequest, platform: Platform) -> "B | None":
    """The backend an automatic choice falls back to, per call, when ``backend`` has no kernel for
    that call (upstream's SM100 rule: cuDNN SDPA first, FA when cuDNN cannot serve), or None."""
    if backend is not B.TORCH_CUDNN_SDPA or platform.name != "cuda" or platform.sm not in (100, 103):
        return None
    cands = auto_candidates(req, platform)
    for b in cands[cands.index(backend) + 1 :] if backend in cands else ():
        if not SPECS[b].reasons(req, platform):
            return b
        sub = substitute(b, req, platform)
        if sub is not None and not SPECS[sub[0]].reasons(req, platform):
            return sub[0]
    return None


def fa_call_limits(spec, req: LayerRequest, platform: Platform) -> list[str]:
    """What keeps FlashAttention from a CUDA call whatever is installed: a dtype it does not take
    (float32) or a GPU below its lowest SM (SM80); empty elsewhere."""
    if platform.name != "cuda":
        return []
    out = []
    if req.dtype is not None and req.dtype not in spec.dtypes:
        out.append(
            f"dtype {str(req.dtype).replace('torch.', '')} (accepts "
            f"{', '.join(sorted(str(d).replace('torch.', '') for d in spec.dtypes))})"
        )
    if platform.sm is not None and spec.cuda_sm_min is not None and platform.sm < spec.cuda_sm_min:
        out.append(f"needs CUDA SM{spec.cuda_sm_min}+, this GPU is SM{platform.sm}")
    return out


def substitute(backend: B, req: LayerRequest, platform: Platform) -> "tuple[B, str] | None":
    """The backend the platform runs instead of ``backend`` and why, or None (no substitution).

    Only upstream's fallbacks substitute: every backend on MPS → ``torch_sdpa`` (MPS always uses
    SDPA); ``fa`` without an installed FlashAttention runtime, for a CUDA call it cannot serve
    whether or not it is installed (float32, below SM80: :func:`fa_call_limits`), or on a platform
    where this build has no FlashAttention kernel path (CPU, XPU, MUSA, NPU, ROCm without
    flash-attn) → ``torch_sdpa``; ``sage_attn`` on Hopper for a call the in-tree INT8
    kernel cannot serve when the installed sageattention lacks the SM90 fix → ``fa``;
    ``fp8_fa_sm120`` off SM120 or on a call it cannot serve → ``torch_cudnn_sdpa``.
    """
    spec = SPECS[backend]
    if platform.name == "mps" and backend is not B.TORCH_SDPA:
        # MPS always uses SDPA; an explicit backend runs it too, recorded as a substitution
        return B.TORCH_SDPA, f"mps always runs torch_sdpa ({backend.value} has no MPS kernel in this build)"
    if backend is B.FA:
        if platform.name == "cpu":
            return B.TORCH_SDPA, f"no FlashAttention runtime on {platform.name}; {platform.name} uses torch_sdpa"
        limits = fa_call_limits(spec, req, platform)
        if limits:  # one rule whether or not FlashAttention is installed: the call goes to torch_sdpa
            return B.TORCH_SDPA, f"FlashAttention cannot serve this call ({'; '.join(limits)}); fa runs torch_sdpa"
        rts = spec.runtimes.get(platform.name, ())
        why = None
        if rts and spec.runtime_on(platform) is None:
            mods = [m for rt in rts if not rt.missing for m in rt.modules]
            why = (
                spec.runtime_reason(platform)
                if not mods
                else f"no FlashAttention runtime installed ({' / '.join(mods)} not found); "
                f"install: {spec.install_hint}"
            )
        if why is not None:
            if platform.name == "rocm" and platform.has_package("aiter"):
                why += "; aiter is installed: select it with --attention-backend aiter"
            return B.TORCH_SDPA, f"{why}; fa runs torch_sdpa"
        return None
    if backend is B.SAGE_ATTN and platform.name == "cuda" and platform.sm == 90:
        from ditattn.attention.backends.sage import sage_cuda_runtime, sage_lacks_sm90_fix

        impl, why = sage_cuda_runtime(platform, req.head_dim, req.needs_lse)
        if impl is None and platform.has_package("sageattention") and sage_lacks_sm90_fix(platform):
            return B.FA, f"{why}; upstream falls back to fa on Hopper"
        return None
    if backend is B.FP8_FA_SM120 and platform.name == "cuda":
        if platform.sm != 120:
            return B.TORCH_CUDNN_SDPA, f"fp8_fa_sm120 runs on SM120 only (this GPU is SM{platform.sm})"
        call = [r for r in spec.reasons(req, platform) if r != spec.missing_kernel]
        if call:  # as upstream: calls the FP8 kernel does not serve use torch_cudnn_sdpa
            return B.TORCH_CUDNN_SDPA, "fp8_fa_sm120 cannot serve this call (" + "; ".join(call) + ")"
    return None
