"""Sparse-VideoGen2: semantic-aware permutation (k-means of Q and K per head) + cluster-pair sparsity.

Per (batch, head):

1. k-means (Euclidean, ``kmeans_iters`` Lloyd iterations, deterministic init at evenly spaced
   tokens) clusters the video queries into ``num_q_clusters`` and the video keys into
   ``num_k_clusters`` (each capped at the number of video tokens).  Centroids are the means of the
   final assignment.
2. Attention mass of query cluster ``i`` on key cluster ``j`` is estimated from centroids:
   ``p_ij = softmax_j(scale * cq_i . ck_j + log |K_j|)`` (empty clusters excluded).  For each query
   cluster the key clusters are taken in descending ``p_ij`` until their cumulative mass reaches
   ``top_p`` (the cluster that crosses it included, at least one).
3. Tokens are permuted per head so that each cluster is contiguous and padded to whole blocks of
   ``block_size`` (default :func:`svg2_block_size`: 64, smaller for small clusters); special (text) tokens come first in their own blocks.  Query block of cluster
   ``i`` attends the key blocks of every selected cluster ``j`` and all text blocks; text query
   blocks attend every key.  The block-sparse core runs on this layout (per-head key validity), and
   the output is permuted back exactly.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ditattn.attention.sparse.block_sparse import (
    block_lists_to_dense_mask,
    block_mask_to_lists,
    block_sparse_attention,
)
from ditattn.attention.sparse.common import SparsePlan

Tensor = torch.Tensor

SVG2_BLOCK_SIZE = 64


def kmeans(x: Tensor, n_clusters: int, iters: int) -> tuple[Tensor, Tensor, Tensor]:
    """Batched Lloyd k-means: ``x [G, N, D]`` -> ``(labels [G, N] int64, centroids [G, C, D],
    sizes [G, C])`` with ``C = min(n_clusters, N)``; centroids are the means of the returned
    labels (an empty cluster keeps its previous centroid and has size 0)."""
    G, N, D = x.shape
    C = max(1, min(int(n_clusters), N))
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(dt)
    init = torch.linspace(0, N - 1, C, device=x.device).round().long()
    cent = x[:, init].clone()
    x2 = x.pow(2).sum(-1, keepdim=True)
    labels = torch.zeros(G, N, dtype=torch.int64, device=x.device)
    sizes = torch.zeros(G, C, dtype=dt, device=x.device)
    for _ in range(max(1, int(iters))):
        d = x2 - 2.0 * (x @ cent.transpose(1, 2)) + cent.pow(2).sum(-1).unsqueeze(1)
        labels = d.argmin(-1)
        sums = torch.zeros(G, C, D, dtype=dt, device=x.device).scatter_add_(
            1, labels.unsqueeze(-1).expand(-1, -1, D), x)
        sizes = torch.zeros(G, C, dtype=dt, device=x.device).scatter_add_(1, labels, torch.ones_like(x[..., 0]))
        cent = torch.where(sizes.unsqueeze(-1) > 0, sums / sizes.clamp(min=1).unsqueeze(-1), cent)
    return labels, cent, sizes


def cluster_pair_selection(cq: Tensor, ck: Tensor, k_sizes: Tensor, scale: float, top_p: float) -> Tensor:
    """Selected (query cluster, key cluster) pairs: bool ``[G, Cq, Ck]`` (see module docstring)."""
    logits = scale * (cq @ ck.transpose(1, 2))
    logw = torch.where(k_sizes > 0, k_sizes.clamp(min=1).log(), torch.full_like(k_sizes, float("-inf")))
    p = torch.softmax(logits + logw.unsqueeze(1), dim=-1)
    sv, si = p.sort(dim=-1, descending=True)
    before = sv.cumsum(-1) - sv
    take = before < float(top_p)
    take[..., 0] = True
    sel = torch.zeros_like(take)
    sel.scatter_(-1, si, take)
    return sel & (k_sizes > 0).unsqueeze(1)


def _cluster_layout(labels: Tensor, n_clusters: int, n_special: int, bs: int):
    """Per-group permutation: ``labels [G, N]`` -> ``(position [G, N + n_special], block_cluster
    [G, n_blocks] with C = special / C+1 = padding, n_blocks)``; special tokens (original indices
    N..N+n_special-1) first, then the clusters in order, each padded to whole blocks."""
    G, N = labels.shape
    dev = labels.device
    C = n_clusters
    counts = torch.zeros(G, C, dtype=torch.int64, device=dev).scatter_add_(1, labels, torch.ones_like(labels))
    nblk = (counts + bs - 1) // bs
    sb = -(-n_special // bs)
    first = sb + torch.cumsum(nblk, 1) - nblk  # [G,C] first block of each cluster
    key = labels * N + torch.arange(N, device=dev)
    order = key.argsort(dim=1)
    lab_sorted = labels.gather(1, order)
    tok_start = torch.cumsum(counts, 1) - counts
    rank = torch.arange(N, device=dev).expand(G, N) - tok_start.gather(1, lab_sorted)
    pos_sorted = first.gather(1, lab_sorted) * bs + rank
    position = torch.empty(G, N + n_special, dtype=torch.int64, device=dev)
    position[:, :N].scatter_(1, order, pos_sorted)
    position[:, N:] = torch.arange(n_special, device=dev)
    total = sb + nblk.sum(1)  # [G]
    n_blocks = int(total.max())
    bidx = torch.arange(n_blocks, device=dev).expand(G, n_blocks)
    ends = sb + torch.cumsum(nblk, 1)  # [G,C] exclusive end block
    bc = torch.searchsorted(ends.contiguous(), bidx.contiguous(), right=True)  # cluster index for video blocks
    bc = torch.where(bidx < sb, torch.full_like(bc, C), bc)
    bc = torch.where(bidx >= total.unsqueeze(1), torch.full_like(bc, C + 1), bc)
    return position, bc, n_blocks


def _permute(x: Tensor, position: Tensor, length: int) -> Tensor:
    """``x [B, S, H, D]`` -> ``[B, length, H, D]`` with token s of group (b, h) at position[g, s]."""
    B, S, H, D = x.shape
    xg = x.transpose(1, 2).reshape(B * H, S, D)
    out = x.new_zeros(B * H, length, D)
    out.scatter_(1, position.unsqueeze(-1).expand(-1, -1, D), xg)
    return out.view(B, H, length, D).transpose(1, 2)


def _unpermute(y: Tensor, position: Tensor) -> Tensor:
    B, P, H, D = y.shape
    yg = y.transpose(1, 2).reshape(B * H, P, D)
    out = yg.gather(1, position.unsqueeze(-1).expand(-1, -1, D))
    return out.view(B, H, -1, D).transpose(1, 2)


def svg2_block_size(n_tokens: int, n_clusters: int) -> int:
    """Block size of the permuted layout: 64, or — when the average cluster is smaller — the power
    of two >= the average cluster size (at least 16), so that per-cluster padding stays small."""
    avg = -(-n_tokens // max(1, n_clusters))
    if avg >= SVG2_BLOCK_SIZE:
        return SVG2_BLOCK_SIZE
    return max(16, 1 << (avg - 1).bit_length())


def svg2_attention(q: Tensor, k: Tensor, v: Tensor, *, video_shape, text_len: int = 0,
                   num_q_clusters: int = 32, num_k_clusters: int = 64, kmeans_iters: int = 5, top_p: float = 0.9,
                   block_size: Optional[int] = None, scale: Optional[float] = None, return_lse: bool = False,
                   impl: str = "auto") -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """SVG2 over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count).

    Returns ``(out, lse or None, plan)``; ``plan.layout`` is None (per-head layouts) and
    ``plan.extra`` holds ``q_labels``/``k_labels`` ``[B, H, N]``, ``selection [B, H, Cq, Ck]``,
    ``q_position``/``k_position`` ``[B*H, S]`` and the block clusters.
    """
    B, S, H, D = q.shape
    N = int(math.prod(video_shape))
    if S != N + text_len:
        raise ValueError(f"sequence {S} != video tokens {N} + text_len {text_len}")
    scale = D ** -0.5 if scale is None else float(scale)
    G = B * H
    qv = q[:, :N].transpose(1, 2).reshape(G, N, D)
    kv_ = k[:, :N].transpose(1, 2).reshape(G, N, D)
    ql, cq, qs = kmeans(qv, num_q_clusters, kmeans_iters)
    kl, ck, ks = kmeans(kv_, num_k_clusters, kmeans_iters)
    Cq, Ck = cq.shape[1], ck.shape[1]
    sel = cluster_pair_selection(cq, ck, ks, scale, top_p)  # [G,Cq,Ck]
    bs = svg2_block_size(N, max(Cq, Ck)) if block_size is None else int(block_size)
    qpos, qbc, nqb = _cluster_layout(ql, Cq, text_len, bs)
    kpos, kbc, nkb = _cluster_layout(kl, Ck, text_len, bs)
    ext = torch.zeros(G, Cq + 2, Ck + 2, dtype=torch.bool, device=q.device)
    ext[:, :Cq, :Ck] = sel
    ext[:, :Cq, Ck] = True
    ext[:, Cq, : Ck + 1] = True
    bm = ext.gather(1, qbc.unsqueeze(-1).expand(-1, -1, Ck + 2))
    bm = bm.gather(2, kbc.unsqueeze(1).expand(-1, nqb, -1))  # [G,nqb,nkb]
    bm = bm.view(B, H, nqb, nkb)
    qp = _permute(q, qpos, nqb * bs)
    kp = _permute(k, kpos, nkb * bs)
    vp = _permute(v, kpos, nkb * bs)
    kvalid = torch.zeros(G, nkb * bs, dtype=torch.bool, device=q.device)
    kvalid.scatter_(1, kpos, True)
    kvalid = kvalid.view(B, H, nkb * bs)
    idx, cnt = block_mask_to_lists(bm)
    out_p, lse_p = block_sparse_attention(qp, kp, vp, idx, cnt, block_size=bs, scale=scale, kv_valid=kvalid,
                                          return_lse=return_lse, impl=impl)
    out = _unpermute(out_p, qpos)
    lse = None
    if lse_p is not None:
        lse = lse_p.reshape(G, -1).gather(1, qpos).view(B, H, S)
    q_real = (qbc <= Cq).view(B, H, nqb)
    k_real = (kbc <= Ck).view(B, H, nkb)
    denom = float((q_real.sum(-1) * k_real.sum(-1)).sum())
    kept = float((cnt * q_real).sum()) / denom if denom else 0.0
    plan = SparsePlan(None, idx, cnt, kept, {
        "q_labels": ql.view(B, H, N), "k_labels": kl.view(B, H, N), "selection": sel.view(B, H, Cq, Ck),
        "q_position": qpos, "k_position": kpos, "q_block_cluster": qbc, "k_block_cluster": kbc,
        "kv_valid": kvalid, "block_size": bs,
    })
    return out, lse, plan


def svg2_token_mask(plan: SparsePlan) -> Tensor:
    """Explicit token mask ``[B, H, S, S]`` (original order) of an SVG2 plan, from its block lists."""
    bs = plan.extra["block_size"]
    kvalid = plan.extra["kv_valid"]
    B, H, Pk = kvalid.shape
    dense = block_lists_to_dense_mask(plan.kv_indices, plan.kv_counts, block_size=bs, seq_len_kv=Pk,
                                      kv_valid=kvalid)  # [B,H,Pq,Pk]
    qpos = plan.extra["q_position"].view(B, H, -1)
    kpos = plan.extra["k_position"].view(B, H, -1)
    S = qpos.shape[-1]
    rows = dense.gather(2, qpos.unsqueeze(-1).expand(-1, -1, -1, Pk))
    return rows.gather(3, kpos.unsqueeze(2).expand(-1, -1, S, -1))
