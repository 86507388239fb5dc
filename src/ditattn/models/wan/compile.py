"""torch.compile for the Wan DiT's non-attention work, with attention kept out of the graph.

Each ``WanBlock`` is compiled on its own (its norms, modulation, projections, QK-norm, RoPE and
feed-forward fuse), while every ``LocalAttention`` call stays an eager graph break, so backend
selection, per-request overrides and the forward context keep working as in eager mode.
Under compilation the per-request override and skip softmax are refused: the
caller marks ``AttentionSettings.compiled = True``.
"""

from __future__ import annotations

import torch
from torch import nn

from ditattn.attention.layer import LocalAttention

_PATCHED = False


def _keep_attention_eager() -> None:
    global _PATCHED
    if not _PATCHED:
        LocalAttention.forward = torch.compiler.disable(LocalAttention.forward, recursive=True)
        from ditattn.distributed.attention import USPAttention  # its forward (collectives) stays eager too

        USPAttention.forward = torch.compiler.disable(USPAttention.forward, recursive=True)
        _PATCHED = True


def compile_blocks(
    model: nn.Module, *, mode: str | None = None, dynamic: bool = False, backend: str = "inductor"
) -> nn.Module:
    """Compile each transformer block of ``model`` in place (attention stays eager); returns model."""
    _keep_attention_eager()
    for block in model.blocks:
        block.compile(mode=mode, dynamic=dynamic, backend=backend)
    return model
