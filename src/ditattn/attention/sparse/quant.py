"""Per-block INT8 quantization of tile-ordered Q and K for the quantized sparse backends.

SageAttention-style: K is first *smoothed* (its mean over the real tokens of the sequence,
per batch, head and channel, is subtracted: every score of a query row shifts by the same amount,
so the softmax is unchanged), then Q and K are quantized symmetrically to INT8 with one scale
``max|x| / 127`` per (batch, block, head).  The block-sparse kernel then computes the scores of
the kept blocks from the de-quantized values, which is the INT8 product ``(Q8 K8^T) sQ sK`` up to
the rounding of the de-quantized values to the input dtype (bf16: relative 2^-9, far below the
quantization step 1/127).  On CUDA (and under ``TRITON_INTERPRET=1``) one Triton pass per tensor
(:mod:`ditattn.attention.kernels.block_quant`), elsewhere PyTorch; the two round a value exactly
half-way between two levels differently (away from zero / to even), nothing else.
"""

from __future__ import annotations

import torch

from ditattn.attention.sparse.common import triton_path
from ditattn.attention.sparse.tiling import TileLayout

Tensor = torch.Tensor


def quantize_blocks_int8(
    x_tiled: Tensor, layout: TileLayout, *, smooth: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Symmetric INT8 per (batch, block, head): ``x [B, P, H, D]`` -> ``(int8 values [B, P, H, D],
    scales [B, n_blocks, H] float32, de-quantized float32 [B, P, H, D])``.  ``smooth`` first
    subtracts the mean over the real tokens of the sequence per (batch, head, channel)."""
    B, P, H, D = x_tiled.shape
    valid = layout.on(x_tiled.device).valid.view(1, P, 1, 1)
    x = x_tiled.float()
    if smooth:
        mean = (x * valid).sum(1, keepdim=True) / valid.sum().clamp(min=1)
        x = (x - mean) * valid
    xb = x.view(B, layout.n_blocks, layout.block_size, H, D)
    amax = xb.abs().amax(dim=(2, 4))  # [B,nb,H]
    sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    qi = torch.round(xb / sc.view(B, -1, 1, H, 1)).clamp(-127, 127)
    deq = (qi * sc.view(B, -1, 1, H, 1)).view(B, P, H, D)
    return qi.to(torch.int8).view(B, P, H, D), sc, deq


def quantize_qk_blocks(
    q_tiled: Tensor, k_tiled: Tensor, layout: TileLayout, *, impl: str = "auto"
) -> tuple[Tensor, Tensor]:
    """De-quantized INT8 Q and smoothed K (module docstring), tiled ``[B, P, H, D]`` in q's dtype
    (so the block-sparse core keeps its fused fp16/bf16 kernel)."""
    if triton_path(q_tiled, impl):
        from ditattn.attention.kernels.block_quant import fake_quant_int8_blocks

        valid = layout.on(q_tiled.device).valid
        return (
            fake_quant_int8_blocks(q_tiled, valid, block_size=layout.block_size),
            fake_quant_int8_blocks(k_tiled, valid, block_size=layout.block_size, smooth=True),
        )
    return (
        quantize_blocks_int8(q_tiled, layout)[2].to(q_tiled.dtype),
        quantize_blocks_int8(k_tiled, layout, smooth=True)[2].to(q_tiled.dtype),
    )
