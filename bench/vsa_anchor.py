"""Time FastVideo's own VSA block-sparse forward (fastvideo-kernel, ThunderKittens, SM90) side by side with
ditattn's block-sparse kernels at the same block lists: an upstream anchor for docs/benchmarks.md §3 (issue 18
item 4).

It imports an already built fastvideo-kernel from ``--site`` (default ``$DITATTN_VSA_SITE`` or
/tmp/ditattn-vsa/site); it builds nothing.  The build is not in this repository: the workplace keeps fetched code
(here the ThunderKittens and CUTLASS headers the published sdist lacks) and any script that would build it out of
commits; the device command ``bash .gpu-vsa/run.sh`` builds it and then runs ``bash bench/h200_session21.sh
vsa-anchor``.

One call: the upstream kernel (and ours at the same case) against a float32 masked reference at small odd
lengths, then the timing rows of bench/block_sparse_sm90.py with the upstream kernel added — S = 32,760 and
75,600, 40 heads x 128, bf16, 64-token tiles, ratio = time / (FA4 dense time x kept fraction).  The first
sparsity is timed at every S first, the others after, so a short budget still covers both lengths.  Prints a
short table last; writes ``vsa_anchor.json`` under ``--out``.  Without a built package it stops at once: one
error line, then the build log's error lines and tail (exit status 3).

    python3 bench/vsa_anchor.py --out $OUT/vsa --budget-s 240 --build-log $OUT/vsa_build.log

Upstream's layout is [B, H, S, D] with B = 1 and S a multiple of 64; its lists are ``q2k_block_sparse_index``
int32 [1, H, S/64, max_kv] and ``q2k_block_sparse_num`` int32 [1, H, S/64] (ours, ``kv_indices`` / ``kv_counts``,
are the same arrays), and padded keys are masked through ``variable_block_sizes`` (int32 [S/64], the valid
tokens per 64-token block).  Its forward returns ``(o, l)`` with ``l = -sqrt(D) x LSE`` ([1, H, S, 1]).  It
needs at least one listed block per query block (it reads the first entry of every list), so the check has no
empty rows.  "upstream TK" is timed on [B, H, S, D] copies made outside the timed call; "upstream TK +
layout" includes the two transposes a [B, S, H, D] caller such as ditattn pays.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Deadline, Recorder, fmt_table, guarded, make_qkv, rel_err  # noqa: E402

BS = 64
UPSTREAM = ("tk", "tk_layout", "triton")
DEFAULT_SITE = "/tmp/ditattn-vsa/site"


class NotBuilt(RuntimeError):
    """fastvideo-kernel (or its SM90 block-sparse op) is not importable from ``--site``."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs") + "/vsa")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--seqs", default="32760,75600")
    ap.add_argument("--sparsities", default="0.9,0.85,0.95", help="the first is timed at every S before the others")
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--variants", default="default=", help="our SM90 kernel's configs, as bench/block_sparse_sm90.py")
    ap.add_argument("--upstream", default="tk", help=f"comma list of {', '.join(UPSTREAM)}: upstream's TK kernel on "
                    "[B,H,S,D] copies, the same with the layout copies timed, upstream's Triton fallback kernel "
                    "(autotunes 12 configs per new length)")
    ap.add_argument("--site", default=os.environ.get("DITATTN_VSA_SITE", DEFAULT_SITE),
                    help="where the (out-of-repository) build installed fastvideo-kernel")
    ap.add_argument("--build-log", default=None, help="its log, whose tail is printed when the package is missing")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    return ap


def parse_args(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.seq_list = [int(x) for x in args.seqs.split(",")]
        args.sparsity_list = [float(x) for x in args.sparsities.split(",")]
        if min(args.seq_list) < 1 or not all(0 <= s < 1 for s in args.sparsity_list) or args.heads < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--seqs takes positive integers, --sparsities numbers in [0, 1), --heads a positive integer: got "
                 f"--seqs {args.seqs!r} --sparsities {args.sparsities!r} --heads {args.heads}")
    args.upstream_list = [u for u in args.upstream.split(",") if u]
    bad = [u for u in args.upstream_list if u not in UPSTREAM]
    if bad or not args.upstream_list:
        ap.error(f"--upstream takes a comma list of {', '.join(UPSTREAM)}, got {args.upstream!r}")
    return args


def load_upstream(site: str):
    """``(ops, info)``: the compiled ``fastvideo_kernel_ops`` module (with ``block_sparse_fwd``) and the package
    version / file, imported from ``site``; raises :class:`NotBuilt` with the reason."""
    if not os.path.isdir(os.path.join(site, "fastvideo_kernel")):
        raise NotBuilt(f"no fastvideo_kernel package under {site}")
    if site not in sys.path:
        sys.path.insert(0, site)
    try:
        import fastvideo_kernel
        from fastvideo_kernel._C import fastvideo_kernel_ops as ops
    except Exception as exc:
        raise NotBuilt(f"import from {site} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if not hasattr(ops, "block_sparse_fwd"):
        raise NotBuilt(f"{ops.__file__} has no block_sparse_fwd (built without the ThunderKittens kernels: sm_90a "
                       "and FASTVIDEO_KERNEL_BUILD_TK=ON are needed)")
    return ops, {"version": getattr(fastvideo_kernel, "__version__", "?"), "ops_file": ops.__file__}


def log_tail(path, n: int = 30, first_errors: int = 8) -> str:
    """The last ``n`` lines of the build log, after its first ``first_errors`` error lines when those are
    further up (pip's trailer follows the compiler's message)."""
    if not path:
        return "(no --build-log given)"
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        return f"(build log {path}: {exc.strerror})"
    tail = lines[-n:]
    errs = [ln for ln in lines[:-n] if re.search(r"\berror\b|FAILED:|CMake Error|fatal", ln, re.I)][:first_errors]
    return "\n".join((["first error lines:"] + errs + ["last lines:"] if errs else []) + tail)


def variable_block_sizes(s_real: int, s_pad: int, device=None) -> torch.Tensor:
    """Upstream's padding mask: the valid tokens of each 64-token block of a length padded from ``s_real`` to
    ``s_pad`` (int32 [s_pad / 64]; 64 each, fewer at the end)."""
    starts = torch.arange(0, s_pad, BS)
    return (s_real - starts).clamp(0, BS).to(torch.int32).to(device or common.DEVICE)


def lse_from_upstream(l_vec: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Upstream's ``l`` ([B, H, S, 1], ``-sqrt(D) x LSE``) as a natural-log LSE [B, H, S]."""
    return -l_vec[..., 0].float() / math.sqrt(head_dim)


def upstream_fns(ops, kinds, q, k, v, idx, cnt, s_real):
    """Candidates for block_sparse_sm90.timing's ``extra``: name -> fn returning ``[B, S, H, D]``."""
    vbs = variable_block_sizes(s_real, q.shape[1], q.device)
    idx, cnt = idx.contiguous(), cnt.contiguous()
    out = {}
    if "tk" in kinds:
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out["upstream TK"] = lambda: ops.block_sparse_fwd(qh, kh, vh, idx, cnt, vbs)[0].transpose(1, 2)
    if "tk_layout" in kinds:
        out["upstream TK + layout"] = lambda: ops.block_sparse_fwd(
            *(t.transpose(1, 2).contiguous() for t in (q, k, v)), idx, cnt, vbs)[0].transpose(1, 2).contiguous()
    if "triton" in kinds and k.shape[2] == q.shape[2]:  # strided; no GQA
        from fastvideo_kernel.triton_kernels.block_sparse_attn_triton import triton_block_sparse_attn_forward

        out["upstream Triton"] = lambda: triton_block_sparse_attn_forward(
            *(t.transpose(1, 2) for t in (q, k, v)), idx, cnt, vbs)[0].transpose(1, 2)
    return out


#: (H, H_kv, D, real length) of the correctness check: odd lengths (padded keys masked), GQA, head dims 64 and 128
CHECK_CASES = ((6, 3, 128, 1064), (4, 4, 64, 777), (3, 1, 128, 200), (4, 4, 128, 1000))


def check(rec, ops, kinds, variants, cases=CHECK_CASES, ours=True):
    """Upstream's kernel (and, with ``ours``, ours on the same inputs) against a float32 reference with the
    same mask; one row per (kernel, case)."""
    from ditattn.attention.backends.base import reference_attention
    from ditattn.attention.kernels.block_sparse_triton import block_sparse_attention_triton
    from ditattn.attention.sparse.block_sparse import block_lists_to_dense_mask
    from sparse import random_lists

    rows = []
    on_sm90 = common.DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    for H, Hkv, D, s_real in cases:
        S = math.ceil(s_real / BS) * BS
        q, k, v = make_qkv(1, S, H, D, hkv=Hkv, seed=s_real)
        nq = S // BS
        idx, cnt = random_lists(1, H, nq, nq, max(1, nq // 3), seed=s_real, device=q.device)
        cnt[0, 0, 1] = 1  # shorter lists too (never empty: upstream reads each list's first entry)
        valid = torch.arange(S, device=q.device)[None, :] < s_real
        ref, ref_lse = reference_attention(q, k, v, mask=block_lists_to_dense_mask(idx, cnt, block_size=BS,
                                                                                  kv_valid=valid))
        shape = f"1,{S},{H},{Hkv},{D} (real {s_real})"
        cands = {"upstream TK": lambda: ops.block_sparse_fwd(*(t.transpose(1, 2).contiguous() for t in (q, k, v)),
                                                             idx, cnt, variable_block_sizes(s_real, S, q.device))}
        if "triton" in kinds and H == Hkv:
            cands["upstream Triton"] = upstream_fns(ops, ["triton"], q, k, v, idx, cnt, s_real)["upstream Triton"]
        if ours:
            cands["ours triton (kv_valid)"] = lambda: block_sparse_attention_triton(
                q, k, v, idx, cnt, impl="triton", block_size=BS, kv_valid=valid, return_lse=True)
        if ours and on_sm90:
            for name, cfg in variants.items():
                cands[f"ours sm90 {name}"] = (lambda cfg=cfg: block_sparse_attention_triton(
                    q, k, v, idx, cnt, impl="sm90", block_size=BS, kv_valid=valid, return_lse=True, config=cfg))
        for name, fn in cands.items():
            def run(name=name, fn=fn):
                res = fn()
                common.sync()
                if name == "upstream TK":
                    o, lse = res[0].transpose(1, 2), lse_from_upstream(res[1], D)
                elif name == "upstream Triton":
                    o, lse = res, None
                else:
                    o, lse = res
                fin = torch.isfinite(ref_lse)
                return rec.add(section="check", impl=name, shape=shape, rel_err=rel_err(o, ref),
                               lse_max_err=float((lse[fin] - ref_lse[fin]).abs().max()) if lse is not None else None,
                               finite=bool(torch.isfinite(o).all()))
            r = guarded(rec, f"check {name} {shape}", run)
            if r:
                rows.append(r)
    return rows


def main(argv=None):
    args = parse_args(argv)
    try:
        ops, info = load_upstream(args.site)
    except NotBuilt as exc:
        print(f"error: fastvideo-kernel is not built ({exc}); tail of the build log {args.build_log or ''}:", flush=True)
        print(log_tail(args.build_log))
        return 3
    common.require_cuda("the upstream kernel needs the SM90 GPU")
    from block_sparse_sm90 import timing
    from sage_sm90 import _variants

    variants = _variants(args.variants)
    dl = Deadline(args.budget_s)
    rec = Recorder(args.out, "vsa_anchor", {"env": common.env_info(), "argv": sys.argv, "fastvideo_kernel": info})
    print(f"fastvideo-kernel {info['version']} from {info['ops_file']}", flush=True)
    checks = [] if args.no_check else check(rec, ops, args.upstream_list, variants)

    def extra(q, k, v, idx, cnt, s_real):
        print(f"timing S={s_real} kept {int(cnt.flatten()[0])}/{idx.shape[2]} blocks ({dl.left():.0f} s left)", flush=True)
        return upstream_fns(ops, args.upstream_list, q, k, v, idx, cnt, s_real)

    times = []
    for sps in (args.sparsity_list[:1], args.sparsity_list[1:]):
        if sps and dl.left() > 30:
            times += timing(rec, dl, args.seq_list, sps, args.heads, variants, extra=extra)
    print()
    print(fmt_table(checks, [("impl", "kernel", ""), ("shape", "B,S,H,Hkv,D", ""), ("rel_err", "err vs fp32", ".2e"),
                             ("lse_max_err", "lse max", ".1e"), ("finite", "finite", "")]))
    names = ["upstream TK", "upstream TK + layout", "upstream Triton", "triton (kv_valid)"]
    names += [f"sm90 {n}" for n in variants] + ["fa4 block-sparse"]
    names = [n for n in names if any(n in r for r in times)]
    times.sort(key=lambda r: (r["seq"], r["sparsity"]))
    key = [("seq", "S", ""), ("sparsity", "sparsity", "")]
    diffs = [(n + " diff", f"{n} diff", ".1e") for n in names if n.startswith("upstream")]
    print(fmt_table(times, key + [("fa_dense_ms", "FA4 dense", ".2f")] + [(n + " ms", n, ".2f") for n in names] + diffs))
    print("(milliseconds per call, do_bench median; diff = relative difference of the output from ours, triton auto)")
    cols = list(key)
    for n in names:
        cols += [(n, f"{n} (x ideal)", ".2f"), (n + " kernel", "kernel", ".2f")]
    print(fmt_table(times, cols))
    print("ratio = time / (FA4 dense time x kept fraction); 'kernel' = the same with GPU kernel time (profiler)")
    for n in rec.data["notes"]:
        print("note:", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
