"""Check and time the SM90 Gluon block-sparse kernel (64-token tiles) against our Triton kernel, FA4's
block-sparse kernel (if installed) and the ideal time (dense ``fa`` time x kept fraction).

One run: correctness at an odd padded length (GQA, an empty query block, padded keys, LSE)
against a float32 reference with the same mask, then timing at the Wan shapes.  Prints a short
table last; writes ``block_sparse_sm90.json`` under ``--out``.

    python3 bench/block_sparse_sm90.py --out $OUT/bs --budget-s 200
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Deadline, Recorder, bench_ms, fmt_table, guarded, kernel_ms, make_qkv, rel_err  # noqa: E402
from sage_sm90 import _variants  # noqa: E402
from sparse import fa4_sparse_fn, random_lists  # noqa: E402


def check(rec, variants):
    from ditattn.attention.backends.base import reference_attention
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.attention.sparse.block_sparse import block_lists_to_dense_mask

    rows = []
    bs = 64
    for B, H, Hkv, D, s_real in ((2, 6, 3, 128, 1064), (1, 4, 4, 64, 777), (1, 3, 1, 128, 200)):
        S = math.ceil(s_real / bs) * bs
        q, k, v = make_qkv(B, S, H, D, hkv=Hkv, seed=s_real)
        nq = S // bs
        idx, cnt = random_lists(B, H, nq, nq, max(1, nq // 3), seed=s_real)
        cnt[0, 0, 1] = 0  # an empty query block
        valid = torch.arange(S, device="cuda")[None, :].expand(B, S) < s_real
        mask = block_lists_to_dense_mask(idx, cnt, block_size=bs, kv_valid=valid)
        ref, ref_lse = reference_attention(q, k, v, mask=mask)
        for name, cfg in variants.items():

            def run():
                o, lse = block_sparse_attention_triton(
                    q, k, v, idx, cnt, impl="sm90", block_size=bs, kv_valid=valid, return_lse=True, config=cfg
                )
                torch.cuda.synchronize()
                fin = torch.isfinite(ref_lse)
                return rec.add(
                    section="check",
                    variant=name,
                    shape=f"{B},{S},{H},{Hkv},{D}",
                    rel_err=rel_err(o, ref),
                    lse_max_err=float((lse[fin] - ref_lse[fin]).abs().max()),
                    empty_rows=bool(torch.equal(torch.isfinite(lse), fin)) and bool((o[0, bs : 2 * bs, 0] == 0).all()),
                    finite=bool(torch.isfinite(o).all()),
                )

            r = guarded(rec, f"check {name}", run)
            if r:
                rows.append(r)
    return rows


def timing(rec, dl, seqs, sparsities, heads, variants, extra=None):
    """Per (S, sparsity) row: each candidate's time as a ratio to ideal.  ``extra(q, k, v, idx, cnt, s_real)``
    may add candidates (name -> fn returning ``[B, S, H, D]``, e.g. an upstream kernel at the same lists)."""
    from ditattn.attention.backends.base import AttnCall, get_impl
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.attention.names import AttentionBackendEnum as B

    rows = []
    bs, D = 64, 128
    for s_real in seqs:
        S = math.ceil(s_real / 128) * 128
        q, k, v = make_qkv(1, S, heads, D, seed=50)
        qr, kr, vr = q[:, :s_real], k[:, :s_real], v[:, :s_real]
        fa_ms = guarded(rec, "fa dense", lambda: bench_ms(lambda: get_impl(B.FA)(qr, kr, vr, AttnCall(), {})[0]))
        fa_kms = guarded(
            rec, "fa dense kernel", lambda: kernel_ms(lambda: get_impl(B.FA)(qr, kr, vr, AttnCall(), {})[0], 3)
        )
        valid = torch.arange(S, device="cuda")[None, :] < s_real
        nb = S // bs
        for sp in sparsities:
            if dl.left() < 20:
                rec.note(f"budget: stopped at S={s_real} sp={sp}")
                break
            keep = max(1, round((1 - sp) * nb))
            idx, cnt = random_lists(1, heads, nb, nb, keep, seed=int(sp * 1000) + bs)
            kept = keep / nb
            cands = {
                "triton (kv_valid)": lambda: block_sparse_attention_triton(
                    q, k, v, idx, cnt, impl="triton", block_size=bs, kv_valid=valid
                )[0]
            }
            for name, cfg in variants.items():
                cands[f"sm90 {name}"] = lambda cfg=cfg: block_sparse_attention_triton(
                    q, k, v, idx, cnt, impl="sm90", block_size=bs, kv_valid=valid, config=cfg
                )[0]
            if extra is not None:
                cands.update(extra(q, k, v, idx, cnt, s_real))
            try:
                import flash_attn.cute  # noqa: F401

                cands["fa4 block-sparse"] = fa4_sparse_fn(q, k, v, idx, cnt, bs)
            except Exception:
                pass
            row = {"section": "time", "seq": s_real, "sparsity": sp, "kept": kept, "fa_dense_ms": fa_ms}
            ref = None
            for name, fn in cands.items():
                o = guarded(rec, f"{name} S={s_real} sp={sp}", fn)
                if o is None:
                    continue
                if ref is None:
                    ref = o[:, ::97].float()
                elif not name.startswith("fa4"):
                    row[f"{name} diff"] = rel_err(o[:, ::97].float(), ref)
                ms = guarded(rec, f"time {name}", lambda fn=fn: bench_ms(fn, 50, 250))
                kms = guarded(rec, f"kernel {name}", lambda fn=fn: kernel_ms(fn))
                if ms:
                    row[name] = ms / (fa_ms * kept) if fa_ms else None
                    row[name + " ms"] = ms
                if kms and fa_kms:
                    row[name + " kernel"] = kms / (fa_kms * kept)
            rows.append(rec.add(**row))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/bs")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--seqs", default="32760,75600")
    ap.add_argument("--sparsities", default="0.85,0.9,0.95")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--variants", default="default=", help="'name=key:val/key:val;...' kernel configs")
    args = ap.parse_args(argv)
    dl = Deadline(args.budget_s)
    rec = Recorder(args.out, "block_sparse_sm90", {"env": common.env_info(), "argv": sys.argv})
    variants = _variants(args.variants)
    checks = check(rec, variants)
    times = timing(
        rec,
        dl,
        [int(x) for x in args.seqs.split(",")],
        [float(x) for x in args.sparsities.split(",")],
        args.heads,
        variants,
    )
    print()
    print(
        fmt_table(
            checks,
            [
                ("variant", "variant", ""),
                ("shape", "B,S,H,Hkv,D", ""),
                ("rel_err", "err vs fp32", ".2e"),
                ("lse_max_err", "lse max", ".1e"),
                ("empty_rows", "empty rows ok", ""),
                ("finite", "finite", ""),
            ],
        )
    )
    names = ["triton (kv_valid)"] + [f"sm90 {n}" for n in variants] + ["fa4 block-sparse"]
    cols = [("seq", "S", ""), ("sparsity", "sparsity", "")]
    for n in names:
        cols += [(n, f"{n} (x ideal)", ".2f"), (n + " kernel", "kernel", ".2f")]
    print(fmt_table(times, cols))
    print("ratio = time / (fa dense time x kept fraction); 'kernel' = the same with GPU kernel time (profiler)")


if __name__ == "__main__":
    main()
