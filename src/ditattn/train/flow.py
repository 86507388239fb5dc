"""Flow matching as Wan trains it, and the text context the DiT sees.

Rectified flow: ``x_t = (1 - sigma) * x_0 + sigma * noise``, the DiT predicts the velocity
``noise - x_0`` at timestep ``1000 * sigma``; sigmas are uniform samples pushed through the same
shift as the sampler's (``shift * u / (1 + (shift - 1) * u)``, diffusers' ``flow_shift``).

Text context: at inference the pipeline pads every prompt's embeddings with zero rows to
``MAX_TEXT_TOKENS`` (512) and the DiT cross-attends to all of them.  All zero rows give the same
key and value, so attending to ``P`` of them equals attending to fewer zero rows whose logits are
raised by ``log(P / rows)``.  :func:`text_context` builds that short context (the longest prompt
plus one zero row) and its additive bias, and :class:`PaddedTextAttnProcessor` applies the bias in
the DiT's cross-attention: the same function as the 512-token context at a fraction of the cost
(tested against it in ``tests/models/test_train_shapes.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

MAX_TEXT_TOKENS = 512  # the pipelines' text context length (diffusers' and ditattn's max_sequence_length)


def shift_sigmas(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Map uniform ``u`` in [0, 1] to flow sigmas with the sampler's timestep ``shift``."""
    return shift * u / (1 + (shift - 1) * u)


def flow_pair(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, velocity target)`` for latents ``x0`` / ``noise`` ``[B, ...]`` and ``sigma [B]``."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise, noise - x0


def text_context(
    hidden: torch.Tensor, mask: torch.Tensor, max_tokens: int = MAX_TEXT_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DiT's text context and its cross-attention bias.

    hidden: encoder output ``[B, L, D]``; mask: ``[B, L]`` (1 = real token, the EOS included).
    Returns ``context [B, L + 1, D]`` (padding rows zero, one extra zero row) and ``bias
    [B, 1, 1, L + 1]`` float32: 0 on real tokens, ``log((max_tokens - n_i) / (L + 1 - n_i))`` on
    the zero rows of prompt ``i`` (``n_i`` real tokens), so the zero rows weigh as much as the
    ``max_tokens - n_i`` padding rows of the pipeline's context.
    """
    B, L, D = hidden.shape
    n = mask.sum(dim=1).to(torch.float32)  # [B]
    if int(n.max()) > max_tokens - 1:
        raise ValueError(f"a prompt has {int(n.max())} tokens; at most {max_tokens - 1} fit the context")
    keep = F.pad(mask, (0, 1)).to(hidden.dtype)  # [B, L + 1]
    context = F.pad(hidden, (0, 0, 0, 1)) * keep[..., None]
    pad_bias = torch.log((max_tokens - n) / (L + 1 - n))  # [B]
    bias = torch.where(keep.bool(), torch.zeros((), device=hidden.device), pad_bias[:, None].to(hidden.device))
    return context, bias.view(B, 1, 1, L + 1).float()


class PaddedTextAttnProcessor:
    """Cross-attention processor for diffusers' ``WanAttention`` (``blocks.i.attn2``) that adds
    :attr:`bias` (``[B, 1, 1, Lc]``, set before each forward by :func:`set_text_bias`) to the
    attention logits; otherwise the computation of diffusers' ``WanAttnProcessor`` for text-only
    cross-attention."""

    def __init__(self):
        self.bias: Optional[torch.Tensor] = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is None or attn.add_k_proj is not None or rotary_emb is not None:
            raise ValueError("PaddedTextAttnProcessor serves text cross-attention only")
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        k = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        v = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        bias = None if self.bias is None else self.bias.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def install_text_bias(transformer) -> PaddedTextAttnProcessor:
    """Give every cross-attention of a diffusers ``WanTransformer3DModel`` one shared
    :class:`PaddedTextAttnProcessor`; returns it (set its ``bias`` before each forward)."""
    proc = PaddedTextAttnProcessor()
    for block in transformer.blocks:
        block.attn2.set_processor(proc)
    return proc
