"""Sparse-VideoGen2: semantic-aware permutation (k-means of Q and K per head) + cluster-pair sparsity.

Per (batch, head):

1. k-means (Euclidean Lloyd iterations) clusters the video queries into ``num_q_clusters`` and the
   video keys into ``num_k_clusters`` (each capped at the number of video tokens).  A *cold* start
   initialises at evenly spaced tokens and runs ``kmeans_iters`` iterations; inside a denoising
   loop (a ``state_key`` and a step are given) the next steps are *warm*: they start from the
   previous step's centroids of the same layer and run ``warm_iters`` iterations, as the method
   does (consecutive steps change Q and K little).  Centroids are the means of the final
   assignment (an empty cluster keeps its previous centroid).
2. Attention mass of query cluster ``i`` on key cluster ``j`` is estimated, with
   ``predictor="pooled_query"`` (default), from the query centroid against every key of the
   cluster, ``p_ij = softmax_j(log sum_{t in K_j} exp(scale * cq_i . k_t))`` — a key cluster
   whose keys spread (or that holds a sink key) is weighed by its largest scores, not its mean
   (:func:`pooled_query_cluster_scores`, ``2 Cq N D`` FLOPs per head, ``Cq / 2N`` of dense
   attention: 1/1000 at 480p) — or, with ``predictor="centroids"`` (upstream), from centroids,
   ``p_ij = softmax_j(scale * cq_i . ck_j + log |K_j|)`` (empty clusters excluded).  For each
   non-empty query cluster the key clusters are taken in descending ``p_ij`` until their cumulative
   mass reaches ``top_p`` (the cluster that crosses it included, at least one).
3. Tokens are permuted per head so that each cluster is contiguous (video tokens sorted by cluster,
   then the text tokens), and the permuted sequence is cut into blocks of ``block_size`` (default
   :func:`svg2_block_size`; the same padding at the end for every head, so the fused block-sparse
   kernel serves it).  Query block ``a`` attends key block ``b`` when some query cluster present in
   ``a`` selected some key cluster present in ``b`` (a block that straddles a cluster boundary
   takes the union), when ``b`` holds a text token, or when ``a`` holds a text query.  The output is
   permuted back exactly.

State (warm start, reuse): kept per ``state_key`` (the backend uses the layer's key and the calling
thread) and restarted cold at step 0, whenever the step does not advance (a new request), and when
the shapes change.  With ``recluster_every = n > 1`` only every n-th step after a cold start
clusters again; the steps between reuse the cached permutation and block lists as they are.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Optional

import torch

from ditattn.attention.sparse.block_sparse import (
    block_lists_to_dense_mask,
    block_mask_to_lists,
    block_sparse_attention,
)
from ditattn.attention.sparse.common import SparsePlan
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

SVG2_BLOCK_SIZE = 128
SVG2_PREDICTORS = ("pooled_query", "centroids")
_CHUNK_ELEMS = 1 << 24


def _assign(x: Tensor, cent: Tensor) -> Tensor:
    """Nearest centroid of every point: ``x [G, N, D]``, ``cent [G, C, D]`` -> labels ``[G, N]``."""
    d = cent.pow(2).sum(-1).unsqueeze(1) - 2.0 * (x @ cent.transpose(1, 2))
    return d.argmin(-1)


def _update(x: Tensor, labels: Tensor, cent: Tensor) -> tuple[Tensor, Tensor]:
    """Means of the assignment (one-hot matmul; an empty cluster keeps its centroid): ``(cent, sizes)``."""
    G, N, D = x.shape
    C = cent.shape[1]
    onehot = torch.zeros(G, C, N, dtype=x.dtype, device=x.device)
    onehot.scatter_(1, labels.unsqueeze(1), 1.0)
    sizes = onehot.sum(-1)
    sums = onehot @ x
    return torch.where(sizes.unsqueeze(-1) > 0, sums / sizes.clamp(min=1).unsqueeze(-1), cent), sizes


def kmeans(x: Tensor, n_clusters: int, iters: int, init: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Batched Lloyd k-means: ``x [G, N, D]`` -> ``(labels [G, N] int64, centroids [G, C, D],
    sizes [G, C])`` with ``C = min(n_clusters, N)`` (or ``init``'s C), computed in float32 (float64
    for float64 input).  ``init``: starting centroids ``[G, C, D]`` (warm start); None: evenly
    spaced points.  Each of the ``iters`` (>= 1) iterations assigns then re-centres, so the
    centroids are the means of the returned labels (an empty cluster keeps its previous centroid
    and has size 0)."""
    G, N, D = x.shape
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(dt)
    if init is None:
        C = max(1, min(int(n_clusters), N))
        cent = x[:, torch.linspace(0, N - 1, C, device=x.device).round().long()].clone()
    else:
        cent = init.to(dt)
    labels, sizes = None, None
    for _ in range(max(1, int(iters))):
        labels = _assign(x, cent)
        cent, sizes = _update(x, labels, cent)
    return labels, cent, sizes


def pooled_query_cluster_scores(cq: Tensor, keys: Tensor, k_labels: Tensor, n_k_clusters: int, scale: float) -> Tensor:
    """``log sum_{t in key cluster j} exp(scale * cq_i . k_t)``: float ``[G, Cq, Ck]`` from query
    centroids ``cq [G, Cq, D]``, keys ``[G, N, D]`` and their labels ``[G, N]`` (``-inf`` for an empty
    key cluster).  Cost per (batch, head): ``2 Cq N D`` FLOPs, in chunks of ``_CHUNK_ELEMS`` logits."""
    G, Cq, _ = cq.shape
    N = keys.shape[1]
    out = torch.full((G, Cq, n_k_clusters), float("-inf"), dtype=cq.dtype, device=cq.device)
    step = max(1, _CHUNK_ELEMS // max(1, Cq * N))
    for g0 in range(0, G, step):
        g1 = min(G, g0 + step)
        s = (cq[g0:g1] @ keys[g0:g1].to(cq.dtype).transpose(1, 2)).mul_(scale)  # [g, Cq, N]
        idx = k_labels[g0:g1].unsqueeze(1).expand_as(s)
        m = torch.full_like(out[g0:g1], float("-inf")).scatter_reduce_(2, idx, s, "amax")
        tot = torch.zeros_like(m).scatter_add_(2, idx, (s - m.gather(2, idx)).exp_())
        out[g0:g1] = torch.where(tot > 0, m + tot.clamp(min=1e-30).log(), m)
    return out


def cluster_pair_selection(cq: Tensor, ck: Tensor, k_sizes: Tensor, scale: float, top_p: float,
                           q_sizes: Optional[Tensor] = None, scores: Optional[Tensor] = None) -> Tensor:
    """Selected (query cluster, key cluster) pairs: bool ``[G, Cq, Ck]`` (see module docstring);
    rows of empty query clusters (``q_sizes`` 0) select nothing.  ``scores``: the pooled-query log
    masses of :func:`pooled_query_cluster_scores` instead of the centroid estimate."""
    if scores is None:
        logits = scale * (cq @ ck.transpose(1, 2))
        logw = torch.where(k_sizes > 0, k_sizes.clamp(min=1).log(), torch.full_like(k_sizes, float("-inf")))
        scores = logits + logw.unsqueeze(1)
    p = torch.softmax(scores, dim=-1)
    sv, si = p.sort(dim=-1, descending=True)
    before = sv.cumsum(-1) - sv
    take = before < float(top_p)
    take[..., 0] = True
    sel = torch.zeros_like(take)
    sel.scatter_(-1, si, take)
    sel &= (k_sizes > 0).unsqueeze(1)
    if q_sizes is not None:
        sel &= (q_sizes > 0).unsqueeze(-1)
    return sel


def svg2_block_size(n_tokens: int, n_clusters: int) -> int:
    """Block size of the permuted layout: 128, or — when the average cluster is smaller — the power
    of two >= the average cluster size (at least 16), so that blocks rarely straddle many clusters."""
    avg = -(-n_tokens // max(1, n_clusters))
    if avg >= SVG2_BLOCK_SIZE:
        return SVG2_BLOCK_SIZE
    return max(16, 1 << (avg - 1).bit_length())


# ------------------------------------------------------------------------------------------------
# state between denoising steps


@dataclasses.dataclass
class _LayerState:
    signature: tuple
    step: int
    anchor: int  # step of the last clustering
    q_cent: Tensor
    k_cent: Tensor
    cached: tuple  # (q_perm, k_perm, kv_indices, kv_counts, kept, extra) of the last clustering; () unless reused


_states: dict[str, _LayerState] = {}
_states_lock = threading.Lock()


def reset_svg2_state(key: Optional[str] = None) -> None:
    """Forget the warm-start state of one key, or of every key."""
    with _states_lock:
        if key is None:
            _states.clear()
        else:
            _states.pop(key, None)


# ------------------------------------------------------------------------------------------------
# layout


def _block_ranges(lab_sorted: Tensor, n_video: int, n_blocks: int, bs: int) -> tuple[Tensor, Tensor]:
    """First/last cluster of the video tokens in each block of a sorted sequence: ``[G, n_blocks]``
    each (an empty range ``(0, -1)`` for blocks without video tokens)."""
    starts = torch.arange(n_blocks, device=lab_sorted.device) * bs
    ends = torch.clamp(starts + bs, max=n_video) - 1
    has = starts < n_video
    first = lab_sorted[:, starts.clamp(max=n_video - 1)]
    last = lab_sorted[:, ends.clamp(min=0)]
    return torch.where(has, first, torch.zeros_like(first)), torch.where(has, last, torch.full_like(last, -1))


def _pair_block_mask(sel: Tensor, q_range, k_range, q_special: Tensor, k_special: Tensor,
                     k_real: Tensor) -> Tensor:
    """bool ``[G, nb, nb]``: any selected cluster pair inside the two blocks' cluster ranges (2-D
    prefix sums of ``sel``), or a special (text) query / key block; fully padded key blocks never."""
    G, Cq, Ck = sel.shape
    cs = torch.zeros(G, Cq + 1, Ck + 1, dtype=torch.int32, device=sel.device)
    cs[:, 1:, 1:] = sel.to(torch.int32).cumsum(1).cumsum(2)
    qa, qb = q_range
    ka, kb = k_range
    nb = qa.shape[1]
    rows = cs.gather(1, (qb + 1).unsqueeze(-1).expand(G, nb, Ck + 1)) - cs.gather(
        1, qa.unsqueeze(-1).expand(G, nb, Ck + 1))  # [G, nb, Ck+1]
    nk = ka.shape[1]
    cnt = rows.gather(2, (kb + 1).unsqueeze(1).expand(G, nb, nk)) - rows.gather(2, ka.unsqueeze(1).expand(G, nb, nk))
    mask = (cnt > 0) | q_special.view(1, -1, 1) | k_special.view(1, 1, -1)
    return mask & k_real.view(1, 1, -1)


def _gather_tokens(x: Tensor, perm: Tensor, length: int) -> Tensor:
    """``x [B, S, H, D]`` permuted per head (``perm [B, H, S]``: original index at each position) and
    zero-padded to ``[B, length, H, D]`` (contiguous)."""
    B, S, H, D = x.shape
    out = x.new_zeros(B, length, H, D)
    out[:, :S] = x.gather(1, perm.transpose(1, 2).unsqueeze(-1).expand(B, S, H, D))
    return out


def _scatter_tokens(y: Tensor, perm: Tensor) -> Tensor:
    """Inverse of :func:`_gather_tokens`: ``y [B, P, H, D]`` -> ``[B, S, H, D]`` in original order."""
    B, S, H = perm.shape[0], perm.shape[2], perm.shape[1]
    D = y.shape[-1]
    out = torch.empty(B, S, H, D, dtype=y.dtype, device=y.device)
    out.scatter_(1, perm.transpose(1, 2).unsqueeze(-1).expand(B, S, H, D), y[:, :S])
    return out


def _plan(q: Tensor, k: Tensor, n_video: int, text_len: int, cq, ck, qs, ks, ql, kl, scale: float, top_p: float,
          bs: int, predictor: str = "pooled_query") -> tuple:
    """Permutations, block lists and kept fraction of one clustering (see module docstring)."""
    B, S, H, D = q.shape
    G, N = B * H, n_video
    scores = None
    if predictor == "pooled_query":
        scores = pooled_query_cluster_scores(cq, k[:, :N].transpose(1, 2).reshape(G, N, D), kl, ck.shape[1], scale)
    elif predictor != "centroids":
        raise AttentionConfigError(
            f"sparse_video_gen_2_attn: predictor must be one of {list(SVG2_PREDICTORS)}, got {predictor!r}")
    sel = cluster_pair_selection(cq, ck, ks, scale, top_p, q_sizes=qs, scores=scores)
    nb = -(-S // bs)
    dev = q.device
    tail = torch.arange(N, S, device=dev).expand(G, S - N)
    qord = torch.sort(ql, dim=1, stable=True)
    kord = torch.sort(kl, dim=1, stable=True)
    q_perm = torch.cat([qord.indices, tail], 1).view(B, H, S)
    k_perm = torch.cat([kord.indices, tail], 1).view(B, H, S)
    pos = torch.arange(nb, device=dev) * bs
    special = (pos + bs > N) & (pos < S) & (S > N)  # blocks holding a text token
    k_real = pos < S
    mask = _pair_block_mask(sel, _block_ranges(qord.values, N, nb, bs), _block_ranges(kord.values, N, nb, bs),
                            special, special, k_real)
    idx, cnt = block_mask_to_lists(mask.view(B, H, nb, nb))
    real = int(k_real.sum())
    kept = (mask & k_real.view(1, -1, 1)).sum() / float(G * real * real)  # a 0-dim tensor: read lazily
    extra = {"q_labels": ql.view(B, H, N), "k_labels": kl.view(B, H, N), "selection": sel.view(B, H, *sel.shape[1:])}
    return q_perm, k_perm, idx, cnt, kept, extra


@functools.lru_cache(maxsize=32)
def _kv_valid(B: int, P: int, S: int, device: torch.device) -> Tensor:
    """bool ``[B, P]``: the first ``S`` positions are real (cached, and an ordinary tensor even when
    first built under inference mode, so the kernel's per-plan facts are computed once)."""
    with torch.inference_mode(False):
        return (torch.arange(P, device=device) < S).expand(B, P)


def svg2_attention(q: Tensor, k: Tensor, v: Tensor, *, video_shape, text_len: int = 0,
                   num_q_clusters: int = 64, num_k_clusters: int = 128, kmeans_iters: int = 5, top_p: float = 0.9,
                   warm_iters: int = 1, recluster_every: int = 1, state_key: Optional[str] = None,
                   step: Optional[int] = None, block_size: Optional[int] = None, predictor: str = "pooled_query",
                   scale: Optional[float] = None, return_lse: bool = False,
                   impl: str = "auto") -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """SVG2 over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count).

    ``state_key`` and ``step`` (both given) enable the warm start and ``recluster_every`` (module
    docstring).  Returns ``(out, lse or None, plan)``; ``plan.layout`` is None (per-head
    permutations) and ``plan.extra`` holds ``q_labels``/``k_labels`` ``[B, H, N]``, ``selection
    [B, H, Cq, Ck]``, ``q_perm``/``k_perm`` ``[B, H, S]`` (original token at each permuted
    position), ``kv_valid [B, P]``, ``block_size`` and ``mode`` (``cold``/``warm``/``reused``).
    """
    B, S, H, D = q.shape
    N = int(math.prod(video_shape))
    if S != N + text_len:
        raise ValueError(f"sequence {S} != video tokens {N} + text_len {text_len}")
    scale = D ** -0.5 if scale is None else float(scale)
    G = B * H
    bs = svg2_block_size(N, max(num_q_clusters, num_k_clusters)) if block_size is None else int(block_size)
    sig = (B, S, H, D, N, int(num_q_clusters), int(num_k_clusters), float(top_p), bs, predictor, q.device)
    st = None
    if state_key is not None and step is not None:
        with _states_lock:
            st = _states.get(state_key)
        if st is not None and (st.signature != sig or step <= st.step or step == 0):
            st = None  # a new request (or new shapes): cold start
    if st is not None and recluster_every > 1 and (step - st.anchor) % recluster_every:
        mode = "reused"
        q_perm, k_perm, idx, cnt, kept, extra = st.cached
        st.step = step
    else:
        qv = q[:, :N].transpose(1, 2).reshape(G, N, D)
        kv_ = k[:, :N].transpose(1, 2).reshape(G, N, D)
        if st is None:
            mode = "cold"
            ql, cq, qs = kmeans(qv, num_q_clusters, kmeans_iters)
            kl, ck, ks = kmeans(kv_, num_k_clusters, kmeans_iters)
        else:
            mode = "warm"
            ql, cq, qs = kmeans(qv, num_q_clusters, warm_iters, init=st.q_cent)
            kl, ck, ks = kmeans(kv_, num_k_clusters, warm_iters, init=st.k_cent)
        q_perm, k_perm, idx, cnt, kept, extra = _plan(q, k, N, text_len, cq, ck, qs, ks, ql, kl, scale, top_p, bs,
                                                      predictor)
        if state_key is not None and step is not None:
            # the plan is kept only when later steps reuse it (it is ~50 MB per layer at 480p x 40 heads)
            cached = (q_perm, k_perm, idx, cnt, kept, extra) if recluster_every > 1 else ()
            with _states_lock:
                _states[state_key] = _LayerState(sig, step, step, cq, ck, cached)
    nb = -(-S // bs)
    P = nb * bs
    kv_valid = _kv_valid(B, P, S, q.device)
    qp, kp, vp = _gather_tokens(q, q_perm, P), _gather_tokens(k, k_perm, P), _gather_tokens(v, k_perm, P)
    out_p, lse_p = block_sparse_attention(qp, kp, vp, idx, cnt, block_size=bs, scale=scale, kv_valid=kv_valid,
                                          return_lse=return_lse, impl=impl)
    out = _scatter_tokens(out_p, q_perm)
    lse = None
    if lse_p is not None:
        lse = torch.empty(B, H, S, dtype=lse_p.dtype, device=lse_p.device).scatter_(2, q_perm, lse_p[:, :, :S])
    plan = SparsePlan(None, idx, cnt, kept, dict(extra, q_perm=q_perm, k_perm=k_perm, kv_valid=kv_valid,
                                                   block_size=bs, mode=mode))
    return out, lse, plan


def svg2_token_mask(plan: SparsePlan) -> Tensor:
    """Explicit token mask ``[B, H, S, S]`` (original order) of an SVG2 plan, from its block lists."""
    bs = plan.extra["block_size"]
    kv_valid = plan.extra["kv_valid"]
    q_perm, k_perm = plan.extra["q_perm"], plan.extra["k_perm"]
    B, H, S = q_perm.shape
    P = kv_valid.shape[-1]
    dense = block_lists_to_dense_mask(plan.kv_indices.expand(B, H, -1, -1), plan.kv_counts.expand(B, H, -1),
                                      block_size=bs, seq_len_kv=P, kv_valid=kv_valid)[:, :, :S, :S]
    inv_q = torch.empty_like(q_perm).scatter_(2, q_perm, torch.arange(S, device=q_perm.device).expand(B, H, S))
    inv_k = torch.empty_like(k_perm).scatter_(2, k_perm, torch.arange(S, device=k_perm.device).expand(B, H, S))
    rows = dense.gather(2, inv_q.unsqueeze(-1).expand(B, H, S, S))
    return rows.gather(3, inv_k.unsqueeze(2).expand(B, H, S, S))
