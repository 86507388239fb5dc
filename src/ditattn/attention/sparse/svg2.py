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
   mass reaches ``top_p`` (the cluster that crosses it included, at least one); ``top_p = 1`` takes
   every non-empty key cluster (exact dense attention, however peaked the logits).  Non-finite
   coordinates are clustered as 0, so one ``-inf`` or NaN token changes no other token's output.
3. Tokens are permuted per head so that each cluster is contiguous (video tokens sorted by cluster,
   then the text tokens), and the permuted sequence is cut into blocks of ``block_size`` (default
   :func:`svg2_block_size`; the same padding at the end for every head, so the fused block-sparse
   kernel serves it).  Query block ``a`` attends key block ``b`` when some query cluster present in
   ``a`` selected some key cluster present in ``b`` (a block that straddles a cluster boundary
   takes the union), when ``b`` holds a text token, or when ``a`` holds a text query.  The output is
   permuted back exactly.

Cost of a warm step: per k-means iteration one fused
float32 product ``|c|^2 - 2 x . c`` and its argmin (``2 N C D`` FLOPs per head), then the cluster
sums as the product of the labels' one-hot ``[C, N]`` with the points — in bf16 for bf16 inputs
(0/1 and bf16 operands are exact, the accumulation float32, the sums rounded to bf16) —; the
pooled-query masses as the row-relative exponentials of the ``[Cq, N]`` logits times the key
one-hot (no scatter atomics).  Nothing is read back to the host: the block lists have a fixed
width off the CPU (:func:`~ditattn.attention.sparse.block_sparse.list_width`), the kernel is told
that no query block is empty, and the kept fraction is a device scalar until it is read.

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
    list_width,
)
from ditattn.attention.sparse.common import SparsePlan
from ditattn.errors import AttentionConfigError

Tensor = torch.Tensor

SVG2_BLOCK_SIZE = 128
SVG2_PREDICTORS = ("pooled_query", "centroids")
_CHUNK_ELEMS = 1 << 26


def _product_dtype(x: Tensor) -> torch.dtype:
    """dtype of the products with 0/1 (one-hot) matrices: bfloat16 for bfloat16 points (exact operands,
    float32 accumulation, the result rounded to bfloat16: 2^-9 relative), else the float32/float64
    compute dtype (fp16 sums could overflow)."""
    return (
        torch.bfloat16 if x.dtype == torch.bfloat16 else (torch.float64 if x.dtype == torch.float64 else torch.float32)
    )


def _assign(x: Tensor, cent: Tensor) -> Tensor:
    """Nearest centroid of every point: ``x [G, N, D]``, ``cent [G, C, D]`` (same float dtype) ->
    labels ``[G, N]`` (one fused ``|c|^2 - 2 x . c`` product, then the argmin)."""
    d = torch.baddbmm((cent * cent).sum(-1).unsqueeze(1), x, cent.transpose(1, 2), alpha=-2.0)
    return d.argmin(-1)


def _update(xp: Tensor, labels: Tensor, cent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Means of the assignment (one-hot product; an empty cluster keeps its centroid): ``(cent,
    sizes, onehot [G, C, N] in xp's dtype)``; ``xp`` the points in :func:`_product_dtype`."""
    G, N, _ = xp.shape
    C = cent.shape[1]
    onehot = torch.zeros(G, C, N, dtype=xp.dtype, device=xp.device).scatter_(1, labels.unsqueeze(1), 1.0)
    sizes = onehot.sum(-1, dtype=cent.dtype)
    sums = torch.bmm(onehot, xp).to(cent.dtype)
    cent = torch.where(sizes.unsqueeze(-1) > 0, sums / sizes.clamp(min=1).unsqueeze(-1), cent)
    return cent, sizes, onehot


def _lloyd(
    x: Tensor, n_clusters: int, iters: int, init: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`kmeans` plus ``(onehot [G, C, N] of the final labels, points in the compute dtype)``."""
    G, N, D = x.shape
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    # a non-finite coordinate (one -inf or NaN token) is clustered as 0: left in, it turns every distance
    # to its centroid into NaN and the argmin then sends the head's other tokens to that cluster too
    xc = torch.nan_to_num(x.to(dt), nan=0.0, posinf=0.0, neginf=0.0)
    xp = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) if x.dtype == _product_dtype(x) else xc
    if init is None:
        C = max(1, min(int(n_clusters), N))
        cent = xc[:, torch.linspace(0, N - 1, C, device=x.device).round().long()].clone()
    else:
        cent = init.to(dt)
    labels = sizes = onehot = None
    for _ in range(max(1, int(iters))):
        labels = _assign(xc, cent)
        cent, sizes, onehot = _update(xp, labels, cent)
    return labels, cent, sizes, onehot, xc


def kmeans(x: Tensor, n_clusters: int, iters: int, init: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Batched Lloyd k-means: ``x [G, N, D]`` -> ``(labels [G, N] int64, centroids [G, C, D],
    sizes [G, C])`` with ``C = min(n_clusters, N)`` (or ``init``'s C); distances in float32
    (float64 for float64 input), cluster sums as one-hot products in :func:`_product_dtype`.
    ``init``: starting centroids ``[G, C, D]`` (warm start); None: evenly spaced points.  Each of
    the ``iters`` (>= 1) iterations assigns then re-centres, so the centroids are the means of the
    returned labels (an empty cluster keeps its previous centroid and has size 0).  No device
    synchronisation."""
    labels, cent, sizes, _, _ = _lloyd(x, n_clusters, iters, init)
    return labels, cent, sizes


def pooled_query_cluster_scores(
    cq: Tensor, keys: Tensor, k_labels: Tensor, n_k_clusters: int, scale: float, onehot: Optional[Tensor] = None
) -> Tensor:
    """``log sum_{t in key cluster j} exp(scale * cq_i . k_t)``: float ``[G, Cq, Ck]`` from query
    centroids ``cq [G, Cq, D]``, keys ``[G, N, D]`` and their labels ``[G, N]`` (``-inf`` for an empty
    key cluster).  ``onehot``: the labels' one-hot ``[G, Ck, N]`` (as :func:`kmeans` builds it;
    built here when None).  Per (batch, head): the logits ``[Cq, N]`` (``2 Cq N D`` FLOPs, in cq's
    dtype), each row's exponentials relative to its maximum, and their sums per cluster as one
    product with the one-hot (``2 Cq N Ck`` FLOPs) — a cluster whose every logit lies more than
    ~87 below the row's maximum gets ``-inf`` (its share of the row is below 1e-38).  In chunks of
    ``_CHUNK_ELEMS`` logits; no device synchronisation."""
    G, Cq, _ = cq.shape
    N = keys.shape[1]
    if onehot is None:
        onehot = torch.zeros(G, n_k_clusters, N, dtype=_product_dtype(keys), device=keys.device).scatter_(
            1, k_labels.unsqueeze(1), 1.0
        )
    out = torch.empty(G, Cq, n_k_clusters, dtype=cq.dtype, device=cq.device)
    step = max(1, _CHUNK_ELEMS // max(1, Cq * N))
    for g0 in range(0, G, step):
        g1 = min(G, g0 + step)
        s = torch.bmm(cq[g0:g1], keys[g0:g1].to(cq.dtype).transpose(1, 2)).mul_(scale)  # [g, Cq, N]
        m = s.amax(-1, keepdim=True)
        mass = torch.bmm(s.sub_(m).exp_().to(onehot.dtype), onehot[g0:g1].transpose(1, 2))
        out[g0:g1] = mass.to(cq.dtype).log_().add_(m)
    return out


def cluster_pair_selection(
    cq: Tensor,
    ck: Tensor,
    k_sizes: Tensor,
    scale: float,
    top_p: float,
    q_sizes: Optional[Tensor] = None,
    scores: Optional[Tensor] = None,
) -> Tensor:
    """Selected (query cluster, key cluster) pairs: bool ``[G, Cq, Ck]`` (see module docstring);
    rows of empty query clusters (``q_sizes`` 0) select nothing.  ``scores``: the pooled-query log
    masses of :func:`pooled_query_cluster_scores` instead of the centroid estimate."""
    if float(top_p) >= 1.0:  # all the mass: every key cluster, whatever the masses round to (dense-exact)
        sel = torch.ones(cq.shape[0], cq.shape[1], ck.shape[1], dtype=torch.bool, device=cq.device)
    else:
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


def _pair_block_mask(sel: Tensor, q_range, k_range, q_special: Tensor, k_special: Tensor) -> Tensor:
    """bool ``[G, nb, nb]``: any selected cluster pair inside the two blocks' cluster ranges (2-D
    prefix sums of ``sel``), or a special (text) query / key block."""
    G, Cq, Ck = sel.shape
    cs = torch.zeros(G, Cq + 1, Ck + 1, dtype=torch.int32, device=sel.device)
    cs[:, 1:, 1:] = sel.to(torch.int32).cumsum(1).cumsum(2)
    qa, qb = q_range
    ka, kb = k_range
    nb = qa.shape[1]
    rows = cs.gather(1, (qb + 1).unsqueeze(-1).expand(G, nb, Ck + 1)) - cs.gather(
        1, qa.unsqueeze(-1).expand(G, nb, Ck + 1)
    )  # [G, nb, Ck+1]
    nk = ka.shape[1]
    cnt = rows.gather(2, (kb + 1).unsqueeze(1).expand(G, nb, nk)) - rows.gather(2, ka.unsqueeze(1).expand(G, nb, nk))
    return (cnt > 0) | q_special.view(1, -1, 1) | k_special.view(1, 1, -1)


def _gather_tokens(x: Tensor, perm: Tensor, length: int) -> Tensor:
    """``x [B, S, H, D]`` permuted per head (``perm [B, H, S]``: original index at each position) and
    zero-padded to ``[B, length, H, D]`` (contiguous)."""
    B, S, H, D = x.shape
    out = x.new_empty(B, length, H, D)
    out[:, S:].zero_()
    idx = perm.transpose(1, 2).unsqueeze(-1).expand(B, S, H, D)
    head = out[:, :S]
    # B == 1: gather straight into the padded buffer (out= is not differentiable: not under autograd)
    if head.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled()):
        torch.gather(x, 1, idx, out=head)
    else:
        head.copy_(x.gather(1, idx))
    return out


def _scatter_tokens(y: Tensor, perm: Tensor) -> Tensor:
    """Inverse of :func:`_gather_tokens`: ``y [B, P, H, D]`` -> ``[B, S, H, D]`` in original order."""
    B, S, H = perm.shape[0], perm.shape[2], perm.shape[1]
    D = y.shape[-1]
    out = torch.empty(B, S, H, D, dtype=y.dtype, device=y.device)
    out.scatter_(1, perm.transpose(1, 2).unsqueeze(-1).expand(B, S, H, D), y[:, :S])
    return out


def _video_rows(x: Tensor, n_video: int) -> Tensor:
    """The video tokens of ``x [B, S, H, D]`` as ``[B*H, N, D]`` (a strided view for B == 1, no copy)."""
    B, _, H, D = x.shape
    return x[:, :n_video].transpose(1, 2).reshape(B * H, n_video, D)


def _plan(
    q: Tensor,
    n_video: int,
    cq,
    ck,
    qs,
    ks,
    ql,
    kl,
    scale: float,
    top_p: float,
    bs: int,
    predictor: str = "pooled_query",
    keys: Optional[Tensor] = None,
    k_onehot: Optional[Tensor] = None,
) -> tuple:
    """Permutations, block lists and kept fraction (a 0-dim tensor) of one clustering (module
    docstring); ``keys [G, N, D]`` (float) and ``k_onehot`` (of ``kl``) for ``predictor="pooled_query"``.
    No device synchronisation off the CPU (lists of a fixed width: one slot per key block)."""
    B, S, H, D = q.shape
    G, N = B * H, n_video
    scores = None
    if predictor not in SVG2_PREDICTORS:
        raise AttentionConfigError(
            f"sparse_video_gen_2_attn: predictor must be one of {list(SVG2_PREDICTORS)}, got {predictor!r}"
        )
    if predictor == "pooled_query" and top_p < 1.0:  # top_p 1 takes every cluster: no estimate needed
        scores = pooled_query_cluster_scores(cq, keys, kl, ck.shape[1], scale, onehot=k_onehot)
    sel = cluster_pair_selection(cq, ck, ks, scale, top_p, q_sizes=qs, scores=scores)
    nb = -(-S // bs)  # every block holds a real token
    dev = q.device
    qord = torch.sort(ql, dim=1, stable=True)
    kord = torch.sort(kl, dim=1, stable=True)
    if S > N:
        tail = torch.arange(N, S, device=dev).expand(G, S - N)
        q_perm = torch.cat([qord.indices, tail], 1).view(B, H, S)
        k_perm = torch.cat([kord.indices, tail], 1).view(B, H, S)
    else:
        q_perm, k_perm = qord.indices.view(B, H, S), kord.indices.view(B, H, S)
    pos = torch.arange(nb, device=dev) * bs
    special = (pos + bs > N) & (S > N)  # blocks holding a text token
    mask = _pair_block_mask(
        sel, _block_ranges(qord.values, N, nb, bs), _block_ranges(kord.values, N, nb, bs), special, special
    )
    idx, cnt = block_mask_to_lists(mask.view(B, H, nb, nb), width=list_width(dev, nb))
    kept = mask.sum(dtype=torch.float32) / float(G * nb * nb)  # a 0-dim tensor: read lazily
    extra = {"q_labels": ql.view(B, H, N), "k_labels": kl.view(B, H, N), "selection": sel.view(B, H, *sel.shape[1:])}
    return q_perm, k_perm, idx, cnt, kept, extra


@functools.lru_cache(maxsize=32)
def _kv_valid(B: int, P: int, S: int, device: torch.device) -> Tensor:
    """bool ``[B, P]``: the first ``S`` positions are real (cached, and an ordinary tensor even when
    first built under inference mode, so the kernel's per-plan facts are computed once)."""
    with torch.inference_mode(False):
        return (torch.arange(P, device=device) < S).expand(B, P)


def svg2_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    video_shape,
    text_len: int = 0,
    num_q_clusters: int = 64,
    num_k_clusters: int = 128,
    kmeans_iters: int = 5,
    top_p: float = 0.9,
    warm_iters: int = 1,
    recluster_every: int = 1,
    state_key: Optional[str] = None,
    step: Optional[int] = None,
    block_size: Optional[int] = None,
    predictor: str = "pooled_query",
    scale: Optional[float] = None,
    return_lse: bool = False,
    impl: str = "auto",
    dense_above: Optional[float] = None,
) -> tuple[Tensor, Optional[Tensor], SparsePlan]:
    """SVG2 over ``[B, T*H*W + text_len, heads, D]`` q/k/v (k/v with q's head count).

    ``state_key`` and ``step`` (both given) enable the warm start and ``recluster_every`` (module
    docstring).  Returns ``(out, lse or None, plan)``; ``plan.layout`` is None (per-head
    permutations) and ``plan.extra`` holds ``q_labels``/``k_labels`` ``[B, H, N]``, ``selection
    [B, H, Cq, Ck]``, ``q_perm``/``k_perm`` ``[B, H, S]`` (original token at each permuted
    position), ``kv_valid [B, P]``, ``block_size`` and ``mode`` (``cold``/``warm``/``reused``);
    ``plan.kept_fraction`` is counted on the device and read (one sync) when first asked for.
    On CUDA the call itself never synchronises with the host, unless ``dense_above`` is given: then a plan
    that keeps more than that fraction of the blocks (1: every block) is not run (one sync) — the dense kernel computes
    the
    call and ``plan.extra`` says ``dense_fallback`` (``kept_planned``: the plan's fraction).
    """
    B, S, H, D = q.shape
    N = int(math.prod(video_shape))
    if S != N + text_len:
        raise ValueError(f"sequence {S} != video tokens {N} + text_len {text_len}")
    if predictor not in SVG2_PREDICTORS:
        raise AttentionConfigError(
            f"sparse_video_gen_2_attn: predictor must be one of {list(SVG2_PREDICTORS)}, got {predictor!r}"
        )
    scale = D**-0.5 if scale is None else float(scale)
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
        mode = "cold" if st is None else "warm"
        iters = kmeans_iters if st is None else warm_iters
        ql, cq, qs, _, _ = _lloyd(_video_rows(q, N), num_q_clusters, iters, None if st is None else st.q_cent)
        kl, ck, ks, k_onehot, keys = _lloyd(
            _video_rows(k, N), num_k_clusters, iters, None if st is None else st.k_cent
        )
        q_perm, k_perm, idx, cnt, kept, extra = _plan(
            q, N, cq, ck, qs, ks, ql, kl, scale, top_p, bs, predictor, keys=keys, k_onehot=k_onehot
        )
        del k_onehot, keys
        if state_key is not None and step is not None:
            # the plan is kept only when later steps reuse it (it is ~50 MB per layer at 480p x 40 heads)
            cached = (q_perm, k_perm, idx, cnt, kept, extra) if recluster_every > 1 else ()
            with _states_lock:
                _states[state_key] = _LayerState(sig, step, step, cq, ck, cached)
    if dense_above is not None and float(kept) > min(float(dense_above), 1 - 1e-6):  # slower than dense
        from ditattn.attention.sparse.block_sparse import dense_attention

        out, lse = dense_attention(q, k, v, scale=scale, return_lse=return_lse)
        return (
            out,
            lse,
            SparsePlan(
                None, idx, cnt, 1.0, dict(extra, block_size=bs, mode=mode, dense_fallback=True, kept_planned=kept)
            ),
        )
    nb = -(-S // bs)
    P = nb * bs
    kv_valid = _kv_valid(B, P, S, q.device)
    qp, kp, vp = _gather_tokens(q, q_perm, P), _gather_tokens(k, k_perm, P), _gather_tokens(v, k_perm, P)
    # every query cluster selects a key cluster and text rows attend everything: no query block is empty
    out_p, lse_p = block_sparse_attention(
        qp,
        kp,
        vp,
        idx,
        cnt,
        block_size=bs,
        scale=scale,
        kv_valid=kv_valid,
        return_lse=return_lse,
        impl=impl,
        nonempty_rows=True,
    )
    out = _scatter_tokens(out_p, q_perm)
    lse = None
    if lse_p is not None:
        lse = torch.empty(B, H, S, dtype=lse_p.dtype, device=lse_p.device).scatter_(2, q_perm, lse_p[:, :, :S])
    plan = SparsePlan(
        None, idx, cnt, kept, dict(extra, q_perm=q_perm, k_perm=k_perm, kv_valid=kv_valid, block_size=bs, mode=mode)
    )
    return out, lse, plan


def svg2_token_mask(plan: SparsePlan) -> Tensor:
    """Explicit token mask ``[B, H, S, S]`` (original order) of an SVG2 plan, from its block lists."""
    bs = plan.extra["block_size"]
    kv_valid = plan.extra["kv_valid"]
    q_perm, k_perm = plan.extra["q_perm"], plan.extra["k_perm"]
    B, H, S = q_perm.shape
    P = kv_valid.shape[-1]
    dense = block_lists_to_dense_mask(
        plan.kv_indices.expand(B, H, -1, -1),
        plan.kv_counts.expand(B, H, -1),
        block_size=bs,
        seq_len_kv=P,
        kv_valid=kv_valid,
    )[:, :, :S, :S]
    inv_q = torch.empty_like(q_perm).scatter_(2, q_perm, torch.arange(S, device=q_perm.device).expand(B, H, S))
    inv_k = torch.empty_like(k_perm).scatter_(2, k_perm, torch.arange(S, device=k_perm.device).expand(B, H, S))
    rows = dense.gather(2, inv_q.unsqueeze(-1).expand(B, H, S, S))
    return rows.gather(3, inv_k.unsqueeze(2).expand(B, H, S, S))
