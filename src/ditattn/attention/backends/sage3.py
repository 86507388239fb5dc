"""``sage_attn_3``: SageAttention3 (``sageattn3.sageattn3_blackwell``, FP4 microscaling) on NVIDIA
Blackwell GPUs only; no LSE, no bias, fp16/bf16."""

from __future__ import annotations

import torch

from ditattn.attention.backends.base import AttnCall, register
from ditattn.attention.backends.sage import _load
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.reference import expand_kv
from ditattn.attention.specs import BackendSpec, Runtime
from ditattn.errors import AttentionConfigError, BackendUnavailableError

BLACKWELL_SMS = (100, 103, 120, 121)


def sage3_unavailable_reasons(device: torch.device) -> list[str]:
    """Why ``sage_attn_3`` cannot run on ``device`` (empty: it can)."""
    reasons = []
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        reasons.append(
            f"needs an NVIDIA Blackwell GPU (SM{'/'.join(map(str, BLACKWELL_SMS))}); tensors are on {device.type}"
        )
    else:
        major, minor = torch.cuda.get_device_capability(device)
        sm = major * 10 + minor
        if sm not in BLACKWELL_SMS:
            reasons.append(
                f"needs an NVIDIA Blackwell GPU (SM{'/'.join(map(str, BLACKWELL_SMS))}); this GPU is SM{sm}"
            )
    if _load("sageattn3", "sageattn3_blackwell") is None:
        reasons.append("needs package 'sageattn3' (not installed); build SageAttention3 from its upstream repository")
    return reasons


@register(
    B.SAGE_ATTN_3,
    spec=BackendSpec(
        kind="quantized",
        summary="SageAttention3 (FP4 microscaling), Blackwell only",
        runtimes={"cuda": (Runtime(("sageattn3",), "SageAttention3"),)},
        upstream_platforms=("cuda",),
        cuda_sm=(100, 103, 120, 121),
        lossy=True,
        drop_in=True,
        install_hint="build SageAttention3 from its upstream repository (Blackwell GPUs only)",
    ),
)
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
