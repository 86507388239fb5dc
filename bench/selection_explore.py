"""Exploration of block-selection predictors on structured inputs: error against kept blocks (CPU, no kernels).

    OMP_NUM_THREADS=1 python bench/selection_explore.py --grid 21,30,52 --preds pooled,hp,hpv --kept 0.4,0.5,0.6

For a grid and head count (``ditattn.evaluation.structured``, bf16), every predictor scores (query
block, key block) pairs of a tile layout (``--tile``, ``--edge``); each keeps the same number of
key blocks per query block (``--alloc topk``; ``head``/``all``: the best row-normalised pairs per
head / over all heads; ``cdf`` or ``cdf:CAP``: the fewest blocks reaching the ``--kept`` values as
cumulative predicted mass, at most ``CAP`` of them); the error of the resulting mask is computed
exactly on sampled query rows (masked float32 attention; ``--sol``: unselected blocks enter as
Sol's centroid virtual keys, ``--sol-variance`` with the key-variance term).  Prints the relative
error per head and overall.  Predictors (``local+`` / ``sol+`` prefixes force each query block's
3x3x3 neighbour blocks / Sol's tile-order neighbours):

* ``pooled``: q-mean . k-mean (upstream Sparge/VSA); ``oracle``: the true summed attention mass;
* ``hp``: pooled query against every key, log-sum-exp per block (the backends' ``pooled_query``);
  ``hpv``: with the query variance term; ``hpmax``: max instead of log-sum-exp; ``hpbf``: bf16
  product; ``hpgN``: N query groups per block; ``gap``: the mass a block's centroid misses;
* ``subN`` / ``subNn``: N sub-groups per block on both sides (``n``: row-normalised);
* ``adS``: XAttention-style antidiagonal scores with stride S; ``pkr``: every query row against
  pooled keys, row-normalised.

``--svg2 JSON`` instead plans ``sparse_video_gen_2_attn`` for each config of a JSON list over ``--steps``
steps (cold, then warm k-means; the kernel skipped) and prints each plan's kept fraction and mask error.
``--sparge JSON`` plans ``sparge_attn`` for each config (keys of ``sparge_attention``: ``topk``,
``cdfthreshd``, ``predictor``, ...) with the library's own selection (``sparge_block_mask``: the plan of
``quantize=false``) and prints its kept fraction and mask error, overall and per head type — the error of
``bench/fidelity.py --error-only`` for the exact kept blocks, without running their kernel on every row.

This is how the defaults of docs/attention.md "Block predictors" were chosen (docs/benchmarks.md §11).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import reference_rows, sample_rows  # noqa: E402

from ditattn.attention.sparse.tiling import make_tile_layout, pooled_blocks, tile  # noqa: E402
from ditattn.evaluation.structured import StructuredSpec, structured_qkv  # noqa: E402


def masked_rows(q, k, v, rows, allowed, scale):
    """Attention of ``rows`` under ``allowed`` bool [B, H, R, S]."""
    qs = q[:, rows].float().transpose(1, 2)
    kk = k.float().transpose(1, 2)
    vv = v.float().transpose(1, 2)
    s = (qs @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1)
    return (p @ vv).transpose(1, 2)


def sol_rows(q, k, v, rows, allowed_tok, exact_blocks, qt, kt, vt, layout, blk_rows, scale):
    """Sol: exact tokens of the exact blocks plus one virtual key (block mean, log size) per other block."""
    nv = layout.n_video_blocks
    s_tok = (q[:, rows].float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) * scale
    s_tok = s_tok.masked_fill(~allowed_tok, float("-inf"))
    kc = pooled_blocks(kt, layout)[:, :, :nv]
    vc = pooled_blocks(vt, layout)[:, :, :nv]
    logw = layout.block_count[:nv].float().log()
    s_c = (q[:, rows].float().transpose(1, 2) @ kc.transpose(-1, -2)) * scale + logw
    if SOL_VARIANCE:
        B, P, H, D = kt.shape
        k2 = kt[:, : nv * layout.block_size].float().view(B, nv, layout.block_size, H, D).pow(2).sum(2).permute(0, 2, 1, 3)
        vk = (k2 / layout.block_count[:nv].float().view(1, 1, -1, 1) - kc.pow(2)).clamp(min=0)
        s_c = s_c + 0.5 * scale * scale * (q[:, rows].float().transpose(1, 2).pow(2) @ vk.transpose(-1, -2))
    approx = ~exact_blocks[:, :, blk_rows]  # B,H,R,nv
    s_c = s_c.masked_fill(~approx, float("-inf"))
    s = torch.cat([s_tok, s_c], -1)
    p = torch.softmax(s, -1)
    vv = torch.cat([v.float().transpose(1, 2), vc], 2)
    return (p @ vv).transpose(1, 2)


SOL_VARIANCE = False


def oracle_scores(qt, kt, layout, scale):
    """log of the summed normalised attention mass of each query block's rows on each key block."""
    B, P, H, D = qt.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    valid = layout.valid[: nv * bs]
    out = torch.empty(B, H, nv, nv)
    kk = kt[:, : nv * bs].float().transpose(1, 2)  # B,H,N,D
    step = max(1, (1 << 24) // (B * H * bs * nv * bs))
    for i0 in range(0, nv, step):
        i1 = min(nv, i0 + step)
        qq = qt[:, i0 * bs:i1 * bs].float().transpose(1, 2)
        s = (qq @ kk.transpose(-1, -2)) * scale
        s = s.masked_fill(~valid, float("-inf"))
        lse = torch.logsumexp(s, -1, keepdim=True)
        p = torch.exp(s - lse)  # B,H,c*bs,N
        p = p.view(B, H, i1 - i0, bs, nv, bs).sum((3, 5))
        out[:, :, i0:i1] = p.clamp(min=1e-30).log()
    return out


def pooled(qt, kt, layout, scale):
    nv = layout.n_video_blocks
    pq = pooled_blocks(qt, layout)[:, :, :nv]
    pk = pooled_blocks(kt, layout)[:, :, :nv]
    return (pq @ pk.transpose(-1, -2)) * scale


def subpooled(qt, kt, layout, scale, sub):
    """Blocks split into ``sub`` groups of consecutive tokens (in tile order); block score =
    logsumexp over group pairs of scale*mean_q.mean_k + log(group sizes)."""
    B, P, H, D = qt.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    g = bs // sub
    cnt = layout.valid[: nv * bs].view(nv, sub, g).sum(-1).float()  # nv, sub
    qs = qt[:, : nv * bs].float().view(B, nv, sub, g, H, D).sum(3) / cnt.clamp(min=1).view(1, nv, sub, 1, 1)
    ks = kt[:, : nv * bs].float().view(B, nv, sub, g, H, D).sum(3) / cnt.clamp(min=1).view(1, nv, sub, 1, 1)
    qs = qs.permute(0, 3, 1, 2, 4).reshape(B, H, nv * sub, D)
    ks = ks.permute(0, 3, 1, 2, 4).reshape(B, H, nv * sub, D)
    s = (qs @ ks.transpose(-1, -2)) * scale  # B,H,nv*sub,nv*sub
    logw = cnt.clamp(min=1e-30).log().view(1, 1, 1, nv * sub)
    s = (s + logw).masked_fill(cnt.view(1, 1, 1, -1) == 0, float("-inf"))
    s = s.view(B, H, nv, sub, nv, sub)
    # mass per query group normalised? use plain lse over both
    return torch.logsumexp(s.permute(0, 1, 2, 4, 3, 5).reshape(B, H, nv, nv, sub * sub), -1)


def subpooled_norm(qt, kt, layout, scale, sub):
    """As subpooled, but each query group's row is softmax-normalised over all key groups first
    (the estimated mass of each query group), then summed per block pair."""
    B, P, H, D = qt.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    g = bs // sub
    cnt = layout.valid[: nv * bs].view(nv, sub, g).sum(-1).float()
    qs = qt[:, : nv * bs].float().view(B, nv, sub, g, H, D).sum(3) / cnt.clamp(min=1).view(1, nv, sub, 1, 1)
    ks = kt[:, : nv * bs].float().view(B, nv, sub, g, H, D).sum(3) / cnt.clamp(min=1).view(1, nv, sub, 1, 1)
    qs = qs.permute(0, 3, 1, 2, 4).reshape(B, H, nv * sub, D)
    ks = ks.permute(0, 3, 1, 2, 4).reshape(B, H, nv * sub, D)
    s = (qs @ ks.transpose(-1, -2)) * scale
    logw = cnt.clamp(min=1e-30).log().view(1, 1, 1, nv * sub)
    s = (s + logw).masked_fill(cnt.view(1, 1, 1, -1) == 0, float("-inf"))
    p = torch.softmax(s, -1).view(B, H, nv, sub, nv, sub).sum((3, 5))
    return p.clamp(min=1e-30).log()


def antidiag(qt, kt, layout, scale, stride):
    """XAttention-style: groups of ``stride`` consecutive tokens; score of (query group, key group)
    = mean over the anti-diagonal pairs (i, stride-1-i) of q_i.k_j; softmax over key groups per
    query group; summed per block pair."""
    B, P, H, D = qt.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    N = nv * bs
    qg = qt[:, :N].float().view(B, N // stride, stride, H, D)
    kg = kt[:, :N].float().view(B, N // stride, stride, H, D).flip(2)
    qr = qg.permute(0, 3, 1, 2, 4).reshape(B, H, N // stride, stride * D)
    kr = kg.permute(0, 3, 1, 2, 4).reshape(B, H, N // stride, stride * D)
    s = (qr @ kr.transpose(-1, -2)) * scale / stride
    valid = layout.valid[:N].view(N // stride, stride).all(-1)
    s = s.masked_fill(~valid, float("-inf"))
    per = bs // stride
    p = torch.softmax(s, -1).view(B, H, nv, per, nv, per).sum((3, 5))
    return p.clamp(min=1e-30).log()


def half_pooled(qt, kt, layout, scale, var=False, rownorm=False, reduce="lse", groups=1, dtype=torch.float32):
    """Pooled query of each query block against every individual key: block score = logsumexp over
    the key block's keys of scale * qbar_I . k_j (+ 0.5 * scale^2 * sum_d var_I,d k_jd^2 with var)."""
    B, P, H, D = qt.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    N = nv * bs
    pq = pooled_blocks(qt, layout)[:, :, :nv]  # B,H,nv,D
    kk = kt[:, :N].float().transpose(1, 2)  # B,H,N,D
    if groups > 1:
        g = bs // groups
        cnt = layout.valid[:N].view(nv, groups, g).sum(-1).float()
        qg = qt[:, :N].float().view(B, nv, groups, g, H, D).sum(3) / cnt.clamp(min=1).view(1, nv, groups, 1, 1)
        qg = qg.permute(0, 3, 1, 2, 4).reshape(B, H, nv * groups, D)
        s = ((qg.to(dtype) @ kk.to(dtype).transpose(-1, -2)).float() * scale).masked_fill(~layout.valid[:N], float("-inf"))
        s = s.view(B, H, nv, groups, nv, bs)
        lw = cnt.clamp(min=1e-30).log().view(1, 1, nv, groups, 1, 1)
        s = torch.logsumexp(s + lw, 3)  # B,H,nv,nv,bs... approximate block mass
        return torch.logsumexp(s, -1)
    s = (pq.to(dtype) @ kk.to(dtype).transpose(-1, -2)).float() * scale
    if var:
        cnt = layout.block_count[:nv].float().clamp(min=1).view(1, 1, nv, 1)
        q2 = qt[:, :N].float().view(B, nv, bs, H, D).pow(2).sum(2).permute(0, 2, 1, 3) / cnt
        vq = (q2 - pq.pow(2)).clamp(min=0)
        s = s + 0.5 * scale * scale * (vq @ kk.pow(2).transpose(-1, -2))
    valid = layout.valid[:N]
    s = s.masked_fill(~valid, float("-inf"))
    if rownorm:
        s = torch.log_softmax(s, -1)
    if reduce == "max":
        return s.view(B, H, nv, nv, bs).amax(-1)
    return torch.logsumexp(s.view(B, H, nv, nv, bs), -1)


def pooled_keys_rows(qt, kt, layout, scale):
    """Every query row against pooled keys (+log block size), softmax per row, summed per query block."""
    B, P, H, D = qt.shape
    nv, bs = layout.n_video_blocks, layout.block_size
    N = nv * bs
    pk = pooled_blocks(kt, layout)[:, :, :nv]
    qq = qt[:, :N].float().transpose(1, 2)
    logw = layout.block_count[:nv].float().clamp(min=1e-30).log()
    s = (qq @ pk.transpose(-1, -2)) * scale + logw
    p = torch.softmax(s, -1).view(B, H, nv, bs, nv).sum(3)
    return p.clamp(min=1e-30).log()


def neighbours(layout, radius=(1, 1, 1)):
    c = layout.block_coords if layout.edge_tiles == "padded" else layout.block_centroid
    d = (c[:, None, :] - c[None, :, :]).abs()
    r = torch.tensor(radius)
    return (d <= r).all(-1)


def select(scores, kk, forced=None, alloc="topk", tau=None):
    if forced is not None:
        scores = scores.masked_fill(forced, float("inf"))
    if alloc != "topk":
        B, H, nq, nk = scores.shape
        p = torch.softmax(scores, -1)
        if alloc.startswith("cdf"):
            sv, si = p.sort(-1, descending=True)
            take = (sv.cumsum(-1) - sv) < tau
            if ":" in alloc:
                cap = math.ceil(float(alloc.split(":")[1]) * nk)
                take[..., cap:] = False
            return torch.zeros_like(take).scatter_(-1, si, take)
        flat = p.reshape(B, H, -1) if alloc == "head" else p.reshape(B, -1)
        n = kk * nq * (1 if alloc == "head" else H)
        idx = flat.topk(n, -1).indices
        m = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
        m = m.view(B, H, nq, nk)
        own = scores.argmax(-1, keepdim=True)
        return m.scatter_(-1, own, True)
    idx = scores.topk(kk, -1).indices
    m = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    return m


def svg2_rows(q, k, v, grid, rows, exact, cfg: dict, steps: int) -> list[dict]:
    """``sparse_video_gen_2_attn``'s plans over ``steps`` steps (cold, then warm k-means), the kernel
    skipped: per step the kept fraction and the error of exact attention under the plan's token mask on
    the sampled ``rows`` (overall and per head)."""
    import json

    from ditattn.attention.sparse import svg2
    from ditattn.attention.sparse.block_sparse import lists_to_block_mask

    B, S, H, _ = q.shape
    out_rows = []
    kernel = svg2.block_sparse_attention
    svg2.block_sparse_attention = lambda qp, *a, **kw: (torch.zeros_like(qp), None)  # plans only
    try:
        key = f"selection_explore:{json.dumps(cfg, sort_keys=True)}"
        svg2.reset_svg2_state(key)
        for step in range(steps):
            t0 = time.perf_counter()
            _, _, plan = svg2.svg2_attention(q, k, v, video_shape=grid, state_key=key, step=step, **cfg)
            secs = time.perf_counter() - t0
            bs, nb = plan.extra["block_size"], plan.kv_counts.shape[-1]
            bm = lists_to_block_mask(plan.kv_indices, plan.kv_counts, nb)[0]  # [H, nb, nb] (batch 1)
            blocks = []
            for perm in (plan.extra["q_perm"][0], plan.extra["k_perm"][0]):  # token -> block of its position
                inv = torch.empty_like(perm).scatter_(1, perm, torch.arange(S).expand(H, S))
                blocks.append(inv // bs)
            qb, kb = blocks[0][:, rows], blocks[1]

            def mask_fn(_rows, hs, bm=bm, qb=qb, kb=kb):
                m = bm[hs].gather(1, qb[hs].unsqueeze(-1).expand(-1, -1, nb))
                return m.gather(2, kb[hs].unsqueeze(1).expand(-1, m.shape[1], -1)).unsqueeze(0)

            out, _ = reference_rows(q, k, v, rows, mask_fn=mask_fn)
            err = out.double() - exact.double()
            out_rows.append({"step": step, "mode": plan.extra["mode"], "kept": plan.kept_fraction,
                             "err": float(err.norm() / exact.double().norm()), "plan_s": secs,
                             "per_head": [float(err[:, :, h].norm() / exact[:, :, h].double().norm())
                                          for h in range(H)]})
        svg2.reset_svg2_state(key)
    finally:
        svg2.block_sparse_attention = kernel
    return out_rows


def sparge_rows(q, k, v, grid, rows, exact, cfg: dict) -> dict:
    """``sparge_attn``'s plan for ``cfg`` (no text tokens), the kernel skipped: the kept fraction and, on the
    sampled ``rows``, the squared error and squared norm per head of exact attention under its block mask."""
    from ditattn.attention.sparse.sparge import sparge_block_mask, sparge_tile_size

    layout = make_tile_layout(grid, sparge_tile_size(cfg.get("block_size", 64)),
                              edge_tiles=cfg.get("edge_tiles", "packed"))
    t0 = time.perf_counter()
    mask, _ = sparge_block_mask(tile(q, layout), tile(k, layout), layout, cfg.get("topk", 0.5), q.shape[-1] ** -0.5,
                                predictor=cfg.get("predictor", "pooled_query"), simthreshd1=cfg.get("simthreshd1", -0.1),
                                cdfthreshd=cfg.get("cdfthreshd"), impl="reference")
    secs = time.perf_counter() - t0
    blk = layout.position // layout.block_size  # original token -> block
    qb = blk[rows]
    out, _ = reference_rows(q, k, v, rows, mask_fn=lambda _r, hs: mask[:, hs][:, :, qb][..., blk])
    err2 = (out.double() - exact.double()).pow(2).sum((0, 1, 3))
    return {"kept": float(mask.float().mean()), "kept_head": mask.float().mean((0, 2, 3)), "err2": err2,
            "ref2": exact.double().pow(2).sum((0, 1, 3)), "plan_s": secs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="12,16,28")
    ap.add_argument("--heads", type=int, default=5)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--kept", default="0.3,0.4,0.5,0.6")
    ap.add_argument("--preds", default="pooled,oracle,local+pooled,sub8,sub8n,ad8,ad16,local+sub8n")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alloc", default="topk")
    ap.add_argument("--tile", default="4,4,4")
    ap.add_argument("--edge", default="packed")
    ap.add_argument("--sol", action="store_true", help="evaluate Sol-style: unselected blocks as centroid keys")
    ap.add_argument("--sol-variance", action="store_true", help="with --sol: the centroid key-variance term")
    ap.add_argument("--svg2", default=None, metavar="JSON",
                    help="instead of predictors: sparse_video_gen_2_attn plans for a JSON list of configs, e.g. "
                         "'[{}, {\"top_p\": 0.95}]' (kernel skipped; error of each plan's mask per step)")
    ap.add_argument("--steps", type=int, default=3, help="--svg2: steps per config (cold, then warm)")
    ap.add_argument("--sparge", default=None, metavar="JSON",
                    help="instead of predictors: sparge_attn plans for a JSON list of configs, e.g. "
                         "'[{\"topk\": 0.4}, {\"cdfthreshd\": 0.95, \"topk\": 0.3}]' (kernel skipped)")
    args = ap.parse_args()
    global SOL_VARIANCE
    SOL_VARIANCE = args.sol_variance
    grid = tuple(int(x) for x in args.grid.split(","))
    spec = StructuredSpec(video_shape=grid, heads=args.heads, seed=args.seed)
    q, k, v, info = structured_qkv(spec)
    S, D = q.shape[1], q.shape[-1]
    scale = D ** -0.5
    layout = make_tile_layout(grid, tuple(int(x) for x in args.tile.split(",")), edge_tiles=args.edge)
    qt, kt = tile(q, layout), tile(k, layout)
    nv, bs = layout.n_video_blocks, layout.block_size
    rows = sample_rows(S, args.rows, device="cpu")
    exact, _ = reference_rows(q, k, v, rows)
    blk = layout.position // bs  # original token -> block
    near = neighbours(layout)
    print(f"grid {grid} S={S} tiles {nv} heads {info['head_types']} local window {near.float().mean():.3f}")
    types = info["head_types"]
    if args.svg2:
        import json

        for cfg in json.loads(args.svg2):
            for r in svg2_rows(q, k, v, grid, rows, exact, cfg, args.steps):
                print(f"svg2 {json.dumps(cfg)} step {r['step']} {r['mode']}: kept {r['kept']:.3f} err {r['err']:.4f} "
                      f"({r['plan_s']:.1f} s) per head " + " ".join(f"{t[:4]}{h}={e:.3f}" for h, (t, e) in
                                                                  enumerate(zip(types, r["per_head"]))), flush=True)
        return
    if args.sparge:
        import json

        kinds = sorted(set(types))
        print(f"{'sparge config':<44} {'kept':>6} {'err':>7}  " + "  ".join(f"{t} kept/err" for t in kinds)
              + "  worst heads")
        for cfg in json.loads(args.sparge):
            r = sparge_rows(q, k, v, grid, rows, exact, cfg)
            e2, r2, kh = r["err2"], r["ref2"], r["kept_head"]
            per = []
            for t in kinds:
                sel = torch.tensor([x == t for x in types])
                per.append(f"{float(kh[sel].mean()):.3f}/{float((e2[sel].sum() / r2[sel].sum()).sqrt()):.3f}")
            worst = torch.argsort(e2 / r2, descending=True)[:3].tolist()
            print(f"{json.dumps(cfg):<44} {r['kept']:6.3f} {float((e2.sum() / r2.sum()).sqrt()):7.4f}  "
                  + "  ".join(f"{p:>14}" for p in per) + "  "
                  + " ".join(f"{types[h][:4]}{h}={float((e2[h] / r2[h]).sqrt()):.3f}" for h in worst)
                  + f"  (plan {r['plan_s']:.1f} s)", flush=True)
        return
    cache = {}

    def scores_of(name):
        if name in cache:
            return cache[name]
        t0 = time.perf_counter()
        base = name.split("+")[-1]
        if base == "pooled":
            s = pooled(qt, kt, layout, scale)
        elif base == "oracle":
            s = oracle_scores(qt, kt, layout, scale)
        elif base.startswith("sub") and base.endswith("n"):
            s = subpooled_norm(qt, kt, layout, scale, int(base[3:-1]))
        elif base.startswith("sub"):
            s = subpooled(qt, kt, layout, scale, int(base[3:]))
        elif base == "hp":
            s = half_pooled(qt, kt, layout, scale)
        elif base == "gap":
            hp_ = half_pooled(qt, kt, layout, scale)
            c_ = pooled(qt, kt, layout, scale) + layout.block_count[:nv].float().log()
            s = hp_ + torch.log1p(-torch.exp((c_ - hp_).clamp(max=-1e-6)))
        elif base == "hpmax":
            s = half_pooled(qt, kt, layout, scale, reduce="max")
        elif base == "hpbf":
            s = half_pooled(qt, kt, layout, scale, dtype=torch.bfloat16)
        elif base.startswith("hpg"):
            s = half_pooled(qt, kt, layout, scale, groups=int(base[3:]))
        elif base == "hpv":
            s = half_pooled(qt, kt, layout, scale, var=True)
        elif base == "pkr":
            s = pooled_keys_rows(qt, kt, layout, scale)
        elif base.startswith("ad"):
            s = antidiag(qt, kt, layout, scale, int(base[2:]))
        else:
            raise SystemExit(f"unknown predictor {name}")
        cache[name] = s
        print(f"  [{name}: {time.perf_counter() - t0:.2f} s]", flush=True)
        return s

    header = f"{'predictor':<18} {'kept':>5} " + " ".join(f"{t[:4]}{h:<2}" for h, t in enumerate(types)) + "   all"
    print(header)
    for name in args.preds.split(","):
        s = scores_of(name)
        forced = near if name.startswith("local+") else None
        if name.startswith("sol+"):
            bt = layout.block_tile[:nv]
            forced = (bt.view(-1, 1) - bt.view(1, -1)).abs() <= 1
        for f in (float(x) for x in args.kept.split(",")):
            kk = max(1, min(nv, math.ceil(f * nv))) if f < 1 else nv
            m = select(s, kk, forced, args.alloc, f)
            allowed = m[:, :, blk[rows]][..., blk]  # B,H,R,S
            if args.sol:
                out = sol_rows(q, k, v, rows, allowed, m, qt, kt, tile(v, layout), layout, blk[rows], scale)
            else:
                out = masked_rows(q, k, v, rows, allowed, scale)
            per = [float((out[:, :, h] - exact[:, :, h]).norm() / exact[:, :, h].norm()) for h in range(q.shape[2])]
            tot = float((out - exact).norm() / exact.norm())
            print(f"{name:<18} {m.float().mean():5.3f} " + " ".join(f"{e:6.3f}" for e in per) + f" {tot:6.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
