"""Block-importance predictors shared by the training-free planners (pooled and pooled-query scores).

A planner ranks, per (batch, head, query block ``I``), key groups ``J`` (key blocks, V-MoBA chunks,
SVG2 key clusters) by how much attention mass the queries of ``I`` put on the keys of ``J``.

* **pooled** (SpargeAttention's and VSA's predictor): ``scale * mean_I(q) . mean_J(k)``.  Exactly
  the mean logit over the ``|I| x |J|`` pairs, but the mass is dominated by the largest logits:
  keys that stand out inside their block (attention sinks) and RoPE channels that rotate within a
  tile (fast frequencies average to ~0 over 4 positions) are invisible to it.
* **pooled query** (this module's addition): every key is kept exact and only the query side is
  pooled, ``log sum_{j in J} exp(scale * mean_I(q) . k_j)`` — the log of the block's mass seen from
  the query block's mean.  A single sink key, or a key block whose keys line up with the query's
  phase, scores as it should.  ``variance=True`` adds the second-order (Jensen) term of the
  query spread, ``0.5 * scale^2 * sum_d var_I(q_d) * k_jd^2`` inside the exponent: the log of
  ``E_i exp(scale q_i . k_j)`` for Gaussian queries with the block's per-channel variance.

Cost of the pooled-query scores per (batch, head), with ``N`` video tokens, ``n = N / b`` blocks of
``b`` tokens and head dim ``D``: one ``[n, D] x [D, N]`` product (``2 n N D = 2 N^2 D / b`` FLOPs;
twice that with ``variance``) and a log-sum-exp over ``n N`` logits, against ``4 N^2 D`` FLOPs and
``N^2`` exponentials for dense attention: ``1 / (2 b)`` of the dense FLOPs (1/128 at ``b = 64``,
1/64 with ``variance``) and ``1 / b`` of its exponentials.  No ``[N, N]`` matrix is formed: on CUDA
one Triton program per (query chunk, key block) keeps its logits in registers
(:mod:`ditattn.attention.kernels.block_scores`); the PyTorch path (CPU, other dtypes) works in
chunks of at most ``_CHUNK_ELEMS`` logits.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ditattn.attention.sparse.tiling import TileLayout, pooled_blocks

Tensor = torch.Tensor

_CHUNK_ELEMS = 1 << 24


def pooled_query_features(
    q_tiled: Tensor, layout: TileLayout, n_blocks: int, *, variance: bool, mean: Optional[Tensor] = None
) -> tuple[Tensor, Optional[Tensor]]:
    """``(mean [B, H, n, D], per-channel variance [B, H, n, D] or None)`` over the real tokens of the
    first ``n_blocks`` blocks of a tiled ``[B, padded_len, H, D]`` tensor (float32; float64 input:
    float64).  ``mean``: that mean when the caller has it (``pooled_blocks(q_tiled, layout, n_blocks)``),
    so it is not pooled twice."""
    mean = pooled_blocks(q_tiled, layout, n_blocks) if mean is None else mean
    if not variance:
        return mean, None
    dt = mean.dtype
    cnt = layout.on(q_tiled.device).count_as(dt)[:, :n_blocks].view(1, 1, -1, 1)  # cached on the device, >= 1
    sq = torch.cat([x.to(dt).pow(2).sum(2).transpose(1, 2) for x in _head_chunks(q_tiled, layout, n_blocks)], 1)
    return mean, (sq / cnt - mean.pow(2)).clamp(min=0)  # padding is zero: sums over real tokens


def pooled_query_block_scores(
    q_tiled: Tensor,
    k_tiled: Tensor,
    layout: TileLayout,
    scale: float,
    *,
    variance: bool = False,
    impl: str = "auto",
    q_mean: Optional[Tensor] = None,
) -> Tensor:
    """Pooled-query log-mass of every (video query block, video key block) pair (module docstring).

    q_tiled / k_tiled: ``[B, padded_len, H, D]`` in the layout's tile order (k with q's head count).
    Returns float32 ``[B, H, nv, nv]`` with ``nv = layout.n_video_blocks``: entry ``[b, h, I, J]`` is
    ``log sum_{j in J, real} exp(scale * qbar_I . k_j (+ 0.5 scale^2 var_I . k_j^2))``; ``-inf``
    for a key block without real tokens.  ``impl``: ``"auto"`` (the Triton kernel on CUDA for
    fp16/bf16 and a power-of-two head dim 16..256, else PyTorch), ``"triton"`` or ``"reference"``.
    ``q_mean``: the caller's ``pooled_blocks(q_tiled, layout, nv)``, reused instead of pooled again.
    """
    nv, bs = layout.n_video_blocks, layout.block_size
    mean, var = pooled_query_features(q_tiled, layout, nv, variance=variance, mean=q_mean)
    valid = layout.on(k_tiled.device).valid[: nv * bs]
    if _use_triton(k_tiled, impl):
        from ditattn.attention.kernels.block_scores import pooled_query_lse

        return pooled_query_lse(mean, var, k_tiled[:, : nv * bs], valid, block_size=bs, scale=scale)
    return pooled_query_lse_torch(
        mean, var, k_tiled[:, : nv * bs], valid if _video_padding(layout) else None, block_size=bs, scale=scale
    )


@functools.lru_cache(maxsize=256)
def _video_padding(layout: TileLayout) -> bool:
    """Whether some video block of ``layout`` holds padding (host arithmetic, once per layout)."""
    return not bool(layout.valid[: layout.n_video_blocks * layout.block_size].all())


def _use_triton(k: Tensor, impl: str) -> bool:
    if impl == "triton":
        return True
    if impl != "auto" or not k.is_cuda or k.dtype not in (torch.float16, torch.bfloat16):
        return False
    return k.shape[-1] in (16, 32, 64, 128, 256)


def pooled_query_lse_torch(
    mean: Tensor, var: Optional[Tensor], k: Tensor, valid: Optional[Tensor], *, block_size: int, scale: float
) -> Tensor:
    """PyTorch path of the pooled-query scores: ``mean``/``var`` ``[B, H, M, D]`` float, ``k``
    ``[B, n * block_size, H, D]``, ``valid`` bool ``[n * block_size]`` (None: every key is real) ->
    float32 ``[B, H, M, n]`` (float64 for float64 keys), computed in chunks of at most
    ``_CHUNK_ELEMS`` logits; no host synchronisation."""
    B, N, H, D = k.shape
    M = mean.shape[2]
    n = N // block_size
    dt = torch.float64 if k.dtype == torch.float64 else torch.float32
    out = torch.empty(B, H, M, n, dtype=dt, device=k.device)
    invalid = None if valid is None else ~valid.to(k.device)
    rows = max(1, min(M, _CHUNK_ELEMS // max(1, B * N)))
    heads = max(1, min(H, _CHUNK_ELEMS // max(1, B * N * rows)))
    for h0 in range(0, H, heads):
        h1 = min(H, h0 + heads)
        kh = k[:, :, h0:h1].transpose(1, 2).to(dt)  # [B, h, N, D]
        k2 = kh.pow(2) if var is not None else None
        for m0 in range(0, M, rows):
            m1 = min(M, m0 + rows)
            s = mean[:, h0:h1, m0:m1].to(dt) @ kh.transpose(-1, -2)
            s.mul_(scale)
            if var is not None:
                s.add_(var[:, h0:h1, m0:m1].to(dt) @ k2.transpose(-1, -2), alpha=0.5 * scale * scale)
            if invalid is not None:
                s.masked_fill_(invalid, float("-inf"))
            out[:, h0:h1, m0:m1] = torch.logsumexp(s.view(B, h1 - h0, m1 - m0, n, block_size), dim=-1)
    return out


def block_self_similarity(x_tiled: Tensor, layout: TileLayout, n_blocks: int) -> Tensor:
    """SpargeAttention's self-similarity of each block: the mean pairwise cosine similarity of its
    real tokens (self-pairs included), i.e. ``|mean_i x_i / |x_i| |^2``, in ``[0, 1]``.
    ``x_tiled [B, padded_len, H, D]`` -> float32 ``[B, H, n_blocks]``."""
    cnt = layout.on(x_tiled.device).count_as(torch.float32)[:, :n_blocks].view(1, 1, -1, 1)
    parts = []
    for x in _head_chunks(x_tiled, layout, n_blocks):  # [B, n, b, h, D]
        x = x.float()
        unit = x / x.norm(dim=-1, keepdim=True).clamp(min=1e-12)  # padding rows stay zero
        parts.append(unit.sum(2).transpose(1, 2))
    mean = torch.cat(parts, 1) / cnt
    return mean.pow(2).sum(-1)


def _head_chunks(x_tiled: Tensor, layout: TileLayout, n_blocks: int):
    """The first ``n_blocks`` blocks of ``x_tiled [B, padded_len, H, D]`` as views ``[B, n_blocks,
    block_size, h, D]`` over consecutive head ranges of at most ``_CHUNK_ELEMS`` elements each."""
    B, _, H, D = x_tiled.shape
    bs = layout.block_size
    x = x_tiled[:, : n_blocks * bs].reshape(B, n_blocks, bs, H, D)
    step = max(1, min(H, _CHUNK_ELEMS // max(1, B * n_blocks * bs * D)))
    return [x[:, :, :, h0 : h0 + step] for h0 in range(0, H, step)]
