"""Upstream SageAttention2 (CUDA, SM90 build) as an anchor for issue 17, on the H200.

SageAttention2 publishes about 900 TOPS on an H100 for its Hopper kernel (INT8 Q.K, FP8 P.V with FP32
accumulation; README plot ``H100_hd128``, head dim 128, non-causal), and its README notes that those TOPS
count the attention kernel only, without quantization and smoothing.  This measures that kernel on OUR
H200 next to FA4 (``fa``) and our ``sage_attn`` (impl sm90, P.V fp16 and fp8), so the 1.3x-FA4 target of
issue 17 can be judged against what the upstream kernel reaches here, and at what error.

It imports an already built upstream package from ``--sage2-dir`` (a folder holding ``sageattention/``
with its ``_qattn_sm90`` and ``_fused`` extensions); it builds nothing.  Without that build it stops with
one line (and the tail of ``--build-log``), exit status 3.

One device call: first a check of the upstream call on small odd-size cases (GQA, 1000x777 and 555x1333
tokens, head dims 128 / 64, and a structured Wan grid) against float32 exact attention (relative L2
error, cosine, LSE), then per shape ``B,H,S,D`` (bf16, NHD layout): time (median of do_bench) of

* ``fa4``: ditattn's ``fa`` backend (FlashAttention-4 when installed; its runtime is recorded);
* ``ours_fp16`` / ``ours_fp8``: ``sage_attention_sm90`` with pv_dtype fp16 / fp8 (quantization included);
* ``sage2``: upstream ``sageattn`` with its defaults (on SM90 it dispatches to
  ``sageattn_qk_int8_pv_fp8_cuda_sm90``: per-thread INT8 Q.K, smoothed K, FP8 P.V, pv_accum_dtype
  ``fp32+fp32``), quantization included;
* ``sage2_warp``: the same with ``qk_quant_gran="per_warp"``;
* ``sage2_kernel``: the upstream attention kernel alone on inputs quantized beforehand by upstream's own
  quantizers (what the README's TOPS count), checked to give the same output as ``sage2``;
* ``pkg``: ``sage_attn impl=package`` through ditattn (this build behind ditattn's backend);

TFLOP/s-equivalent = 4*B*H*S^2*D / time, and the error against float32 on sampled query rows, on random
and on structured inputs (:func:`common.structured_qkv` on the Wan grid of S).  Prints a short table last;
writes ``sage2_anchor.json`` under ``--out``.

    python3 bench/sage2_anchor.py --sage2-dir /tmp/sage2/pkg --out $OUT/sage2 --budget-s 300
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Deadline, Recorder, attn_flops, bench_ms, cosine, fmt_table, guarded, rel_err  # noqa: E402

DEFAULT_DIR = os.environ.get("SAGE2_DIR", "/tmp/sage2/pkg")
# the 40-head 480p shape first: it is the one issue 17 is judged on, and a budget cut keeps it
SHAPES = "1,40,32760,128;1,40,75600,128;1,40,16384,128;1,40,4096,128;1,12,32760,128"
CANDIDATES = ("fa4", "ours_fp16", "ours_fp8", "sage2", "sage2_warp", "sage2_kernel", "pkg")
#: latent token grids (T, H, W) of the structured inputs per sequence length (as bench/attention.py)
GRIDS = {4096: (4, 32, 32), 16384: (16, 32, 32), 32760: (21, 30, 52), 75600: (21, 45, 80)}
CHECKS = [  # (B, Sq, Skv, H, Hkv, D, dtype name, kind): odd lengths, GQA, both head dims, a Wan grid
    (2, 1000, 777, 6, 3, 128, "bfloat16", "random"),
    (1, 555, 1333, 4, 4, 64, "float16", "random"),
    (1, 4 * 30 * 52, 4 * 30 * 52, 4, 4, 128, "bfloat16", "structured"),
]
ERR_ROWS = 256  # sampled query rows of the float32 reference at the timed shapes
#: pass bounds of the small check (FP8 P.V: our kernel measured 3.5-3.9 % on random inputs)
CHECK_MAX_ERR, CHECK_MIN_COS = 0.08, 0.995


class NotBuilt(RuntimeError):
    """The upstream build is missing or cannot be imported."""


def _shapes(spec: str) -> list[tuple[int, int, int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        vals = tuple(int(x) for x in part.split(","))
        if len(vals) != 4 or min(vals) < 1:
            raise ValueError(part)
        out.append(vals)
    if not out:
        raise ValueError(spec)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sage2-dir", default=DEFAULT_DIR,
                    help=f"folder holding the built upstream package sageattention/ (default $SAGE2_DIR or {DEFAULT_DIR})")
    ap.add_argument("--build-log", default=None, help="the build's log: its tail is printed when the build is missing")
    ap.add_argument("--out", default="outputs/sage2")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--shapes", default=SHAPES, help="'B,H,S,D;...' timed shapes (bf16)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma list of {', '.join(CANDIDATES)}")
    ap.add_argument("--no-check", action="store_true", help="skip the small-case check")
    ap.add_argument("--no-structured", action="store_true", help="error on random inputs only")
    args = ap.parse_args(argv)
    try:
        args.shape_list = _shapes(args.shapes)
    except ValueError:
        ap.error(f"--shapes takes 'B,H,S,D;...' (positive integers), got {args.shapes!r}")
    args.cand_list = [c.strip() for c in args.candidates.split(",") if c.strip()]
    bad = [c for c in args.cand_list if c not in CANDIDATES]
    if bad or not args.cand_list:
        ap.error(f"--candidates takes a comma list of {', '.join(CANDIDATES)}; unknown: {', '.join(bad) or '(empty)'}")
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be positive, got {args.budget_s}")
    return args


def build_problem(sage2_dir: str) -> str | None:
    """Why ``sage2_dir`` holds no usable build (None: the files are there)."""
    pkg = os.path.join(sage2_dir, "sageattention")
    if not os.path.isfile(os.path.join(pkg, "__init__.py")):
        return f"no upstream package at {pkg} (the build did not run or did not finish)"
    missing = [name for name in ("_qattn_sm90", "_fused") if not glob.glob(os.path.join(pkg, name + "*.so"))]
    if missing:
        return f"{pkg} lacks the compiled extension(s) {', '.join(missing)} (the build failed)"
    return None


def log_tail(path: str | None, n: int = 40) -> list[str]:
    if not path or not os.path.isfile(path):
        return [f"(no build log at {path})"] if path else []
    with open(path, errors="replace") as f:
        return [line.rstrip("\n") for line in f.readlines()[-n:]]


def fail_not_built(why: str, build_log: str | None) -> None:
    """One line on stderr (then the build log's tail), exit status 3."""
    print(f"error: upstream SageAttention2 is not built: {why}", file=sys.stderr)
    tail = log_tail(build_log)
    if tail:
        print(f"--- last {len(tail)} lines of {build_log} ---", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
    sys.exit(3)


def load_upstream(sage2_dir: str):
    """Import the upstream package from ``sage2_dir`` (ahead of any other ``sageattention`` on the path,
    e.g. the staged 1.0.6) and check that its SM90 extension loaded; returns ``(package, info)``."""
    import importlib
    import importlib.metadata

    sage2_dir = os.path.abspath(sage2_dir)
    loaded = sys.modules.get("sageattention")
    if loaded is not None and not os.path.abspath(loaded.__file__).startswith(sage2_dir + os.sep):
        raise NotBuilt(f"another sageattention ({loaded.__file__}) was imported first")
    if sys.path[:1] != [sage2_dir]:
        sys.path.insert(0, sage2_dir)
    try:
        sa = importlib.import_module("sageattention")
        core = importlib.import_module("sageattention.core")
    except Exception as exc:
        raise NotBuilt(f"import sageattention from {sage2_dir} failed: {type(exc).__name__}: {exc}") from exc
    if not os.path.abspath(sa.__file__).startswith(sage2_dir + os.sep):
        raise NotBuilt(f"sageattention was imported from {sa.__file__}, not {sage2_dir}")
    if not getattr(core, "SM90_ENABLED", False):
        try:  # the package swallows this error: name it
            importlib.import_module("sageattention._qattn_sm90")
            why = "SM90_ENABLED is false"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        raise NotBuilt(f"the SM90 extension does not load: {why}")
    info = {"path": os.path.dirname(sa.__file__)}
    try:
        info["version"] = importlib.metadata.version("sageattention")
    except Exception:
        info["version"] = None
    bi = os.path.join(sage2_dir, "BUILD_INFO.json")
    if os.path.isfile(bi):
        with open(bi) as f:
            info["build"] = json.load(f)
    return sa, info


def upstream_kernel_only(sa, q, k, v, gran: str = "per_thread"):
    """``(run, out)``: ``run()`` launches only upstream's SM90 attention kernel (the one its
    ``sageattn_qk_int8_pv_fp8_cuda_sm90`` uses with pv_accum_dtype fp32+fp32) on Q/K/V quantized once
    beforehand by upstream's own quantizers with the block sizes that call uses (NHD layout, K smoothed
    by its mean, V padded to a multiple of 128 keys, per-channel FP8 V); ``out`` is its output buffer."""
    import torch
    from sageattention import sm90_compile
    from sageattention.quant import per_channel_fp8, per_warp_int8
    from sageattention.triton.quant_per_thread import per_thread_int8

    b, skv, hkv, d = k.shape
    km = k.mean(dim=1, keepdim=True)
    if gran == "per_thread":
        q8, qs, k8, ks = per_thread_int8(q, k, km, tensor_layout="NHD", BLKQ=64, WARPQ=16, BLKK=128, WARPK=128)
    else:
        q8, qs, k8, ks = per_warp_int8(q, k, km, tensor_layout="NHD", BLKQ=64, WARPQ=16, BLKK=128)
    pad = -skv % 128
    vp = torch.cat([v, v.new_zeros(b, pad, hkv, d)], dim=1) if pad else v
    v8, vs, _ = per_channel_fp8(vp, tensor_layout="NHD", smooth_v=False)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    gran_code = 3 if gran == "per_thread" else 2
    scale = d ** -0.5

    def run():
        sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
            q8, k8, v8, out, qs, ks, vs, 0, 0, gran_code, scale, 0)
        return out
    return run, out


def candidates(rec, sa, q, k, v, names):
    """name -> zero-argument callable returning out ``[B, S, H, D]``; the kernel-only candidate runs
    its quantization once here (a failure there is recorded and drops that candidate only)."""
    from ditattn.attention.backends.base import AttnCall, get_impl
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90
    from ditattn.attention.names import AttentionBackendEnum as B

    c = {}
    for name in names:
        if name == "fa4":
            c[name] = lambda: get_impl(B.FA)(q, k, v, AttnCall(), {})[0]
        elif name == "ours_fp16":
            c[name] = lambda: sage_attention_sm90(q, k, v)[0]
        elif name == "ours_fp8":
            c[name] = lambda: sage_attention_sm90(q, k, v, config={"pv_dtype": "fp8"})[0]
        elif name == "sage2":
            c[name] = lambda: sa.sageattn(q, k, v, tensor_layout="NHD", is_causal=False)
        elif name == "sage2_warp":
            c[name] = lambda: sa.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="NHD",
                                                                  qk_quant_gran="per_warp")
        elif name == "sage2_kernel":
            prepared = guarded(rec, "sage2_kernel quantization", lambda: upstream_kernel_only(sa, q, k, v))
            if prepared is not None:
                c[name] = prepared[0]
        elif name == "pkg":
            c[name] = lambda: get_impl(B.SAGE_ATTN)(q, k, v, AttnCall(), {"impl": "package"})[0]
    return c


def _dtype(name):
    import torch

    return getattr(torch, name)


def check(rec, sa) -> list[dict]:
    """Upstream ``sageattn`` (and its per-warp variant, and the kernel-only path) on small odd cases
    against float32 exact attention; LSE against the reference's."""
    import torch

    rows = []
    for i, (b, sq, skv, h, hkv, d, dt, kind) in enumerate(CHECKS):
        if kind == "structured":
            q, k, v = common.structured_qkv(b, (sq // (30 * 52), 30, 52), h, d, hkv=hkv, dtype=_dtype(dt), seed=200 + i)
        else:
            g = torch.Generator(device="cuda").manual_seed(200 + i)
            q = torch.randn(b, sq, h, d, generator=g, device="cuda", dtype=_dtype(dt))
            k = torch.randn(b, skv, hkv, d, generator=g, device="cuda", dtype=_dtype(dt))
            v = torch.randn(b, skv, hkv, d, generator=g, device="cuda", dtype=_dtype(dt))
        ref_o, ref_l = common.reference_rows(q, k, v, torch.arange(sq, device="cuda"))
        shape = f"{b},{sq},{skv},{h},{hkv},{d}"

        def cos(out):
            return cosine(out, ref_o)

        def full():
            out, lse = sa.sageattn(q, k, v, tensor_layout="NHD", is_causal=False, return_lse=True)
            torch.cuda.synchronize()
            e, c = rel_err(out, ref_o), cos(out)
            return rec.add(section="check", what="sage2 (sageattn defaults)", shape=shape, dtype=dt, kind=kind,
                           err=e, cos=c, lse_max_abs=float((lse.float() - ref_l).abs().max()),
                           finite=bool(torch.isfinite(out).all()), ok=bool(e < CHECK_MAX_ERR and c > CHECK_MIN_COS))

        def warp():
            out = sa.sageattn_qk_int8_pv_fp8_cuda_sm90(q, k, v, tensor_layout="NHD", qk_quant_gran="per_warp")
            e, c = rel_err(out, ref_o), cos(out)
            return rec.add(section="check", what="sage2 per_warp", shape=shape, dtype=dt, kind=kind, err=e, cos=c,
                           finite=bool(torch.isfinite(out).all()), ok=bool(e < CHECK_MAX_ERR and c > CHECK_MIN_COS))

        def kernel_only():
            full_out = sa.sageattn(q, k, v, tensor_layout="NHD", is_causal=False)
            run, _ = upstream_kernel_only(sa, q, k, v)
            out = run()
            torch.cuda.synchronize()
            diff = float((out.float() - full_out.float()).abs().max())
            return rec.add(section="check", what="sage2 kernel-only path", shape=shape, dtype=dt, kind=kind,
                           err=rel_err(out, ref_o), cos=cos(out), max_abs_vs_sageattn=diff, ok=bool(diff == 0.0))

        for fn, label in ((full, "sageattn"), (warp, "per_warp"), (kernel_only, "kernel-only")):
            r = guarded(rec, f"check {label} {shape}", fn)
            if r:
                rows.append(r)
        del q, k, v, ref_o, ref_l
        torch.cuda.empty_cache()
    return rows


def _inputs(kind, b, s, h, d, seed):
    import torch

    if kind == "structured":
        return common.structured_qkv(b, GRIDS[s], h, d, dtype=torch.bfloat16, seed=seed)
    return common.make_qkv(b, s, h, d, dtype=torch.bfloat16, seed=seed)


def measure(rec, dl, shapes, names, sa, structured=True) -> tuple[list[dict], list[dict]]:
    """Per shape: TFLOP/s of each candidate (random inputs) and its error against float32 on
    ``ERR_ROWS`` sampled query rows (random, and structured where the shape has a Wan grid)."""
    import torch

    times, errs = [], []
    for b, h, s, d in shapes:
        if dl.left() < 25:
            rec.note(f"budget: skipped {b},{h},{s},{d}")
            continue
        fl = attn_flops(b, h, s, s, d)
        row = {"section": "time", "shape": f"{b},{h},{s},{d}"}
        kinds = ["random"] + (["structured"] if structured and s in GRIDS else [])
        for kind in kinds:
            if kind == "structured" and dl.left() < 40:
                rec.note(f"budget: structured error skipped at {b},{h},{s},{d}")
                continue
            q, k, v = _inputs(kind, b, s, h, d, seed=7)
            idx = common.sample_rows(s, ERR_ROWS)
            ref, _ = common.reference_rows(q, k, v, idx)
            fns = candidates(rec, sa, q, k, v, names)
            for name, fn in fns.items():
                if dl.left() < 8:
                    rec.note(f"budget: {name} skipped at {row['shape']} ({kind})")
                    continue
                out = guarded(rec, f"{name} {row['shape']} {kind}", fn)
                if out is None:
                    continue
                sel = out[:, idx]
                e = rel_err(sel, ref)
                c = cosine(sel, ref)
                errs.append(rec.add(section="error", shape=row["shape"], kind=kind, candidate=name, err=e, cos=c))
                if kind == "random":
                    ms = guarded(rec, f"time {name} {row['shape']}", lambda fn=fn: bench_ms(fn))
                    if ms:
                        row[name] = fl / ms / 1e9
                        row[name + "_ms"] = ms
                del out, sel
            del q, k, v, ref, fns
            torch.cuda.empty_cache()
        base = row.get("fa4")
        for name in ("ours_fp16", "ours_fp8", "sage2", "sage2_kernel"):
            if base and row.get(name):
                row[name + "_vs_fa4"] = row[name] / base
        times.append(rec.add(**row))
    return times, errs


def main(argv=None):
    args = parse_args(argv)
    why = build_problem(args.sage2_dir)
    if why:
        fail_not_built(why, args.build_log)
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device (upstream SageAttention2's SM90 kernel needs an SM90 GPU)")
    if torch.cuda.get_device_capability() != (9, 0):
        sys.exit(f"error: the upstream SM90 kernel needs compute capability 9.0, this GPU is "
                 f"{'.'.join(map(str, torch.cuda.get_device_capability()))}")
    try:
        sa, info = load_upstream(args.sage2_dir)
    except NotBuilt as exc:
        fail_not_built(str(exc), args.build_log)
    dl = Deadline(args.budget_s)
    env = common.env_info()
    env["sageattention"] = info.get("version")  # the one imported here, not the staged 1.0.6
    from ditattn.attention.backends.flash import fa_runtime_label

    rec = Recorder(args.out, "sage2_anchor", {"env": env, "upstream": info, "argv": sys.argv,
                                               "fa_runtime": fa_runtime_label()})
    print(f"upstream sageattention {info.get('version')} from {info['path']}; fa runs {fa_runtime_label()}",
          flush=True)
    checks = [] if args.no_check else check(rec, sa)
    times, errs = measure(rec, dl, args.shape_list, args.cand_list, sa, structured=not args.no_structured)
    if checks:
        print()
        print(fmt_table(checks, [("what", "check", ""), ("shape", "B,Sq,Skv,H,Hkv,D", ""), ("dtype", "dtype", ""),
                                 ("kind", "input", ""), ("err", "err vs fp32", ".2e"), ("cos", "cos", ".6f"),
                                 ("lse_max_abs", "lse max abs", ".1e"),
                                 ("max_abs_vs_sageattn", "vs sageattn", ".1e"), ("ok", "ok", "")]))
    if errs:
        print()
        piv = {}
        for r in errs:
            piv.setdefault((r["shape"], r["kind"]), {"shape": r["shape"], "kind": r["kind"]})[r["candidate"]] = r["err"]
        print(fmt_table(list(piv.values()), [("shape", "B,H,S,D", ""), ("kind", "input", "")]
                        + [(n, n, ".2e") for n in args.cand_list]))
        print("relative L2 error vs float32 on", ERR_ROWS, "sampled query rows")
    print()
    cols = [("shape", "B,H,S,D", "")] + [(n, n, ".0f") for n in args.cand_list]
    cols += [(n + "_vs_fa4", n + "/FA4", ".3f") for n in ("ours_fp16", "sage2", "sage2_kernel") if n in args.cand_list]
    print(fmt_table(times, cols))
    print("TFLOP/s-equivalent (4*B*H*S^2*D / median time); sage2_kernel excludes quantization (as upstream's "
          "TOPS), every other column includes it")


if __name__ == "__main__":
    main()
