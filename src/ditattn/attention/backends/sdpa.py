"""PyTorch SDPA backends: ``torch_sdpa`` (any platform) and ``torch_cudnn_sdpa`` (cuDNN pinned).

Both take the ``[B, S, H, D]`` layout of the backend contract and transpose to SDPA's
``[B, H, S, D]``.  LSE comes from the aten ops that return it (CPU flash, CUDA flash / cuDNN /
efficient); where none applies (an additive bias together with ``return_lse`` on CPU) the
float32 math path computes it.  Those ops index the head dim as packed, so q/k/v whose last
dimension is strided (``x[..., ::2]``, a permuted buffer) are copied to stride 1 first: the public
``F.scaled_dot_product_attention`` does this itself, the raw ops do not (they read wrong memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ditattn.attention.backends.base import AttnCall, NoKernelError, register
from ditattn.attention.kernels import last_dim_contiguous
from ditattn.attention.names import AttentionBackendEnum as B
from ditattn.attention.reference import expand_kv, reference_attention
from ditattn.attention.specs import ALL_FLOAT, NO_PACKAGE, BackendSpec
from ditattn.errors import AttentionConfigError


def _bhsd(t):
    return t.transpose(1, 2)


def _packed(q, k, v):
    """q, k, v with stride 1 in the head dim (a copy only where needed), for the raw aten LSE ops."""
    return last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)


def _lse_cpu(q, k, v, call):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, call.causal, attn_mask=None, scale=call.scale
    )
    return _bhsd(out), lse.float()


def _lse_cuda(q, k, v, call):
    if call.attn_bias is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, call.causal, False, scale=call.scale
        )
        return _bhsd(res[0]), res[1].float()
    bias, empty = call.attn_bias, None
    if bias is not None and bias.dtype == torch.bool:  # True = attend; a row with no key: zeros, LSE -inf
        empty = ~bias.expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1]).any(-1)  # [B, H, Sq]
        bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
    if bias is not None:
        bias = bias.to(q.dtype).expand(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    res = torch.ops.aten._scaled_dot_product_efficient_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), bias, True, 0.0, call.causal, scale=call.scale
    )
    out, lse = _bhsd(res[0]), res[1][..., : q.shape[1]].float()
    if empty is not None and bool(empty.any()):
        out = out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    return out, lse


@register(
    B.TORCH_SDPA,
    spec=BackendSpec(
        kind="dense",
        summary="PyTorch scaled_dot_product_attention",
        runtimes={p: NO_PACKAGE for p in ("cpu", "cuda", "rocm", "xpu", "musa", "mps", "npu")},
        upstream_platforms=("cuda", "rocm", "xpu", "musa", "mps", "npu"),
        dtypes=ALL_FLOAT,
        max_head_dim=None,
        returns_lse=True,
        accepts_bias=True,
        drop_in=True,
        notes="the most portable option; LSE through the aten flash/efficient ops",
    ),
)
def torch_sdpa(q, k, v, call: AttnCall, config: dict):
    heads = q.shape[2]
    if call.return_lse:
        if 0 in (*q.shape, *k.shape):  # the aten LSE ops divide by these (SIGFPE on the CPU)
            raise AttentionConfigError(
                f"torch_sdpa: empty q {tuple(q.shape)} or k {tuple(k.shape)}; every dimension "
                "of [batch, seq, heads, head_dim] must be at least 1"
            )
        q, k2, v2 = _packed(q, *expand_kv(k, v, heads))
        if call.attn_bias is None and q.device.type == "cpu":
            return _lse_cpu(q, k2, v2, call)
        if q.device.type == "cuda":
            return _lse_cuda(q, k2, v2, call)
        out, lse = reference_attention(q, k2, v2, causal=call.causal, scale=call.scale, attn_bias=call.attn_bias)
        return out.to(q.dtype), lse.float()
    bias = call.attn_bias
    if bias is not None and bias.dtype != torch.bool:
        bias = bias.to(q.dtype)
    gqa = k.shape[2] != heads
    out = F.scaled_dot_product_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), attn_mask=bias, is_causal=call.causal, scale=call.scale, enable_gqa=gqa
    )
    return _bhsd(out), None


def cudnn_no_kernel_reason(q, k, v, call: AttnCall) -> "str | None":
    """Why cuDNN SDPA has no kernel for this call (None: it has one), from PyTorch's own dispatch
    check (``torch.backends.cuda.can_use_cudnn_attention``); q/k/v in the ``[B, S, H, D]`` layout."""
    if q.device.type != "cuda":
        return f"cuDNN SDPA needs CUDA tensors (these are on {q.device.type})"
    if call.attn_bias is not None:
        return "torch_cudnn_sdpa does not take an additive attention bias"
    params = torch.backends.cuda.SDPAParams(_bhsd(q), _bhsd(k), _bhsd(v), None, 0.0, call.causal, False)
    if not torch.backends.cuda.can_use_cudnn_attention(params, False):
        return (
            f"cuDNN has no kernel for this call (dtype {str(q.dtype).replace('torch.', '')}, head dim "
            f"{q.shape[-1]}, seq {q.shape[1]}x{k.shape[1]}, causal {call.causal})"
        )
    return None


@register(
    B.TORCH_CUDNN_SDPA,
    spec=BackendSpec(
        kind="dense",
        summary="PyTorch SDPA pinned to the cuDNN kernel",
        runtimes={"cuda": NO_PACKAGE},
        upstream_platforms=("cuda",),
        cuda_sm_min=80,
        returns_lse=True,
        notes="fastest SDPA kernel on Hopper (about 1.6x torch's flash path at head dim 128)",
    ),
)
def torch_cudnn_sdpa(q, k, v, call: AttnCall, config: dict):
    """``torch_cudnn_sdpa``: SDPA pinned to cuDNN. Raises :class:`NoKernelError` (with PyTorch's
    reason) when cuDNN has no kernel for the call, so an automatic choice can fall back per call."""
    q, k, v = _packed(q, *expand_kv(k, v, q.shape[2]))
    why = cudnn_no_kernel_reason(q, k, v, call)
    if why is not None:
        raise NoKernelError("torch_cudnn_sdpa", [why])
    if call.return_lse:
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, call.causal, False, scale=call.scale
        )
        return _bhsd(res[0]), res[1].reshape(q.shape[0], q.shape[2], q.shape[1]).float()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=call.causal, scale=call.scale)
    return _bhsd(out), None
