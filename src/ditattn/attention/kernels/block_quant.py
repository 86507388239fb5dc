"""Per-block symmetric INT8 quantize-dequantize of tile-ordered Q or K in one pass (Triton).

The SageSLA emulation (``ditattn.attention.sparse.sla``) feeds INT8-quantized Q and (smoothed) K
to the block-sparse kernel as de-quantized values.  In PyTorch that is about ten float32 passes
over the sequence; here one program loads one ``[block_size, D]`` tile of one (batch, block, head),
optionally subtracts the per-(batch, head) channel mean from the real tokens, takes the tile's
``max|x|``, and writes ``round(x / s) * s`` with ``s = max|x| / 127`` back in the input dtype.

Rounding is half away from zero (``torch.round`` in the PyTorch reference rounds half to even: the
two differ only when ``x / s`` is exactly ``k + 0.5``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditattn.attention.kernels import check_device
from ditattn.errors import AttentionConfigError


@triton.jit
def block_head_program(H, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A program over one (block, batch x head) of a ``(n_blocks, B * H)`` grid: ``(block, batch x
    head, batch, head, the block's rows, the head dim's columns)``."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    return blk, bh, bh // H, bh % H, blk * BLOCK + tl.arange(0, BLOCK), tl.arange(0, HEAD_DIM)


@triton.jit
def _fake_quant_blocks(
    X,
    Valid,
    Mean,
    Out,
    stride_xb,
    stride_xs,
    stride_xh,
    H,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    SMOOTH: tl.constexpr,
):
    _, bh, b, h, offs_s, offs_d = block_head_program(H, BLOCK, HEAD_DIM)
    ptr = b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs + offs_d[None, :]
    x = tl.load(X + ptr).to(tl.float32)
    ok = tl.load(Valid + offs_s) != 0
    if SMOOTH:
        x = x - tl.load(Mean + bh * HEAD_DIM + offs_d)[None, :]
    x = tl.where(ok[:, None], x, 0.0)
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    sc = tl.where(amax > 0.0, amax / 127.0, 1.0)
    xq = x / sc
    xq = (xq + tl.where(xq >= 0.0, 0.5, -0.5)).to(tl.int32).to(tl.float32)
    tl.store(Out + ptr, (xq * sc).to(Out.dtype.element_ty))


def fake_quant_int8_blocks(
    x_tiled: torch.Tensor, valid: torch.Tensor, *, block_size: int, smooth: bool = False
) -> torch.Tensor:
    """De-quantized per-block INT8 values of ``x_tiled``.

    x_tiled ``[B, P, H, D]`` fp16/bf16/fp32 in tile order (P a multiple of ``block_size``; padding
    rows zero); valid bool ``[P]`` (real tokens); ``smooth`` first subtracts the mean over the real
    tokens per (batch, head, channel).  One scale ``max|x| / 127`` per (batch, block, head) over
    real tokens; padding rows come back zero.  Returns ``[B, P, H, D]`` in x's dtype.  Runs on
    CUDA, or on CPU under ``TRITON_INTERPRET=1``.
    """
    what = "block INT8 quantization kernel"
    check_device(x_tiled, valid, what=what)
    if x_tiled.dim() != 4:
        raise AttentionConfigError(f"{what}: x must be [B, P, H, D], got {tuple(x_tiled.shape)}")
    B, P, H, D = x_tiled.shape
    if P % block_size or tuple(valid.shape) != (P,) or D not in (16, 32, 64, 128, 256):
        raise AttentionConfigError(
            f"{what}: expects P={P} a multiple of block_size={block_size}, valid [{P}] "
            f"and D in 16..256 (power of two); got valid {tuple(valid.shape)}, D={D}"
        )
    if x_tiled.stride(-1) != 1:
        x_tiled = x_tiled.contiguous()
    validb = valid.to(torch.int8).contiguous()
    if smooth:
        n = valid.sum().clamp(min=1).to(torch.float32)
        mean = ((x_tiled * valid.view(1, P, 1, 1)).sum(1, dtype=torch.float32) / n).contiguous()  # [B, H, D]
    else:
        mean = validb  # unused placeholder
    out = torch.empty_like(x_tiled)
    _fake_quant_blocks[(P // block_size, B * H)](
        x_tiled,
        validb,
        mean,
        out,
        x_tiled.stride(0),
        x_tiled.stride(1),
        x_tiled.stride(2),
        H,
        HEAD_DIM=D,
        BLOCK=block_size,
        SMOOTH=bool(smooth),
        num_warps=4,
    )
    return out


__all__ = ["fake_quant_int8_blocks"]
