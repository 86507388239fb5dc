"""The fused FP8 activation quantizer alone (``quantize_rows``, src/ditattn/models/fp8_linear.py): the
previous one-row-per-program kernel (copied below, for this comparison only) against the current one,
on the Wan DiT's activation shapes, one DiT step's worth of tokens (480p x 81 frames: 32,760).

Shapes (``--shapes``): ``1.3b`` = 32760 x 1536 (the five quantizer calls per block on the model width:
q/k/v input, attention output, cross-attention q and output, feed-forward input) and 32760 x 8960 with
the tanh-GELU (the feed-forward hidden rows); ``14b`` = 32760 x 5120 and 32760 x 13824 with the GELU.

Per shape and kernel: the median time of ``triton.testing.do_bench`` (L2 flushed between calls), the
bandwidth against the bytes a quantizer must move (one bf16 read and one e4m3 write of the rows, the
float32 scales), and the error against the float64 formula on ``--check-rows`` sampled rows:
``scale = bf16(max(absmax, eps) / 448)``, ``q = e4m3(clamp(x / scale, +-448))``, with ``x`` replaced by
the float64 tanh-GELU rounded to bf16 for the GELU shapes -- the fraction of codes that differ, the
largest difference in e4m3 steps, the scales that differ; the old and new kernels' codes are also
compared with each other on every row.  ``--sweep`` also times the new kernel at each (rows per
program, num_warps) candidate and reports the fastest.  The last lines estimate the quantizer time of
one DiT step (6 calls per block: 5 on the model width, 1 on the feed-forward hidden rows; 30 blocks
for 1.3B, 40 for 14B) for both kernels.

    python bench/fp8_quant_kernel.py --sweep --out $OUT                                 # on the H200
    BENCH_DEVICE=cpu python bench/fp8_quant_kernel.py --tokens 6 --check-rows 6 --out /tmp/q  # CPU smoke

Writes ``<out>/fp8_quant_kernel.json`` after every row (``--out``) and prints a short table last.
Without a CUDA device (and without ``BENCH_DEVICE=cpu``) it stops with one line.  On the CPU the
kernels run in Triton's interpreter (tiny ``--tokens``; the timings mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEVICE, Recorder, bench_ms, env_info, fmt_table, require_cuda  # noqa: E402

if DEVICE != "cuda":  # the kernels run in Triton's interpreter (set before triton is imported)
    import warnings

    os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # numpy's exp of the GELU's tail

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: (name, width K, GELU) per architecture, and the DiT's block count
SHAPES = {
    "1.3b": ([("x1536", 1536, False), ("ffn8960_gelu", 8960, True)], 30),
    "14b": ([("x5120", 5120, False), ("ffn13824_gelu", 13824, True)], 40),
}
EPS = 448.0 * 2.0**-126


# ------------------------------------------------------------------------------------------------
# the previous kernel (git history of src/ditattn/models/fp8_linear.py), for this comparison only: one
# program per row, an IEEE division per element, the GELU as x / (1 + exp(-2u)) computed in both passes of
# rows wider than 4096 (2048-wide chunks, read twice)

_OLD_ONE_PASS_MAX, _OLD_LOOP_BLOCK = 4096, 2048


@triton.jit
def _old_load_act(X, offs, K, GELU: tl.constexpr):
    x = tl.load(X + offs, mask=offs < K, other=0.0)
    if GELU:
        xf = x.to(tl.float32)
        u = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
        x = (xf / (1.0 + tl.exp(-2.0 * u))).to(X.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _old_store_q(Q, offs, K, xf, scale):
    q = tl.minimum(tl.maximum(tl.div_rn(xf, scale), -448.0), 448.0)
    tl.store(Q + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=offs < K)


@triton.jit
def _old_quantize_rows_kernel(
    X, Q, S, K, stride_x, eps, GELU: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    Q += row * K
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        xf = _old_load_act(X, offs, K, GELU)
        amax = tl.max(tl.abs(xf), axis=0)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            acc = tl.maximum(acc, tl.abs(_old_load_act(X, k0 + offs, K, GELU)))
        amax = tl.max(acc, axis=0)
    scale = tl.div_rn(tl.maximum(amax, eps), 448.0).to(X.dtype.element_ty).to(tl.float32)
    if ONE_PASS:
        _old_store_q(Q, offs, K, xf, scale)
    else:
        for k0 in range(0, K, BLOCK):
            _old_store_q(Q, k0 + offs, K, _old_load_act(X, k0 + offs, K, GELU), scale)
    tl.store(S + row, scale)


def old_quantize_rows(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from ditattn.attention.kernels import check_device

    check_device(x, what="old fp8 quantizer")  # on CPU: the interpreter's bf16 / fp8 conversions
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    one_pass = K <= _OLD_ONE_PASS_MAX
    block = triton.next_power_of_2(K) if one_pass else _OLD_LOOP_BLOCK
    _old_quantize_rows_kernel[(M,)](
        x,
        q,
        scale,
        K,
        x.stride(0),
        EPS,
        GELU=gelu,
        BLOCK=block,
        ONE_PASS=one_pass,
        num_warps=4 if block <= 2048 else 8,
    )
    return q, scale


# ------------------------------------------------------------------------------------------------
# the float64 formula and the error measures


def gelu64(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU in float64, as x * sigmoid(2u) (no cancellation on the negative tail)."""
    x64 = x.double()
    return x64 / (1 + torch.exp(-2 * 0.7978845608028654 * (x64 + 0.044715 * x64**3)))


def formula64(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of the quantizer's formula in float64, rounded where it rounds."""
    x64 = gelu64(x).to(torch.bfloat16).double() if gelu else x.double()
    scale = (x64.abs().amax(-1, keepdim=True).clamp(min=EPS) / 448).to(torch.bfloat16).double()
    return (x64 / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.float()


def _order(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) as integers ordered like their values (+0 and -0 equal)."""
    c = codes.to(torch.int32)
    return torch.where(c >= 128, -(c - 128), c)


def code_errors(q: torch.Tensor, scale: torch.Tensor, q64: torch.Tensor, s64: torch.Tensor) -> dict:
    steps = (_order(q) - _order(q64)).abs()
    return {
        "codes_differ": float((steps > 0).float().mean()),
        "max_e4m3_steps": int(steps.max()),
        "scales_differ": int((scale != s64).sum()),
    }


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Normal rows with a per-row spread of magnitudes (1e-2 .. 1e2) and a few outliers, bf16, on DEVICE."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    spread = torch.logspace(-2, 2, m, device=DEVICE)[torch.randperm(m, generator=g, device=DEVICE)]
    x = torch.randn(m, k, generator=g, device=DEVICE).mul_(spread[:, None])
    n = max(1, m // 100)
    x[torch.randint(0, m, (n,), generator=g, device=DEVICE), torch.randint(0, k, (n,), generator=g, device=DEVICE)] = (
        80.0
    )
    return x.to(torch.bfloat16)


def candidates(m: int, k: int) -> list[dict]:
    """(rows per program, num_warps) of the new kernel to sweep."""
    from ditattn.models.fp8_linear import ONE_PASS_MAX, row_tiles

    width = sum(row_tiles(k)) if k <= ONE_PASS_MAX else k
    return [
        {"rows": r, "num_warps": w}
        for r in (1, 2, 4, 8, 16)
        for w in (4, 8, 16)
        if r * width <= 32768 and (r == 1 or r < m) and not (k > ONE_PASS_MAX and r > 1)
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1.3b,14b", help="comma list of 1.3b, 14b")
    ap.add_argument("--tokens", type=int, default=32760, help="rows per call (Wan 480p x 81: 32760)")
    ap.add_argument("--check-rows", type=int, default=2048, help="rows sampled for the float64 check")
    ap.add_argument("--sweep", action="store_true", help="also time the new kernel's (rows, num_warps) candidates")
    ap.add_argument("--out", default=None, help="folder for fp8_quant_kernel.json (default: print only)")
    args = ap.parse_args(argv)
    arches = [a for a in args.shapes.split(",") if a]
    bad = [a for a in arches if a not in SHAPES]
    if bad or not arches:
        ap.error(f"--shapes takes a comma list of {', '.join(SHAPES)}, got {args.shapes!r}")
    if args.tokens < 1 or args.check_rows < 1:
        ap.error("--tokens and --check-rows must be positive")
    require_cuda("set BENCH_DEVICE=cpu with a small --tokens for a smoke run in Triton's interpreter")

    from ditattn.models.fp8_linear import _quantize_rows_triton, launch_config

    rec = Recorder(args.out, "fp8_quant_kernel", {"env": env_info(), "tokens": args.tokens}) if args.out else None
    rows_out, per_step = [], {}
    for arch in arches:
        shapes, blocks = SHAPES[arch]
        for name, k, gelu in shapes:
            m = args.tokens
            x = activations(m, k, seed=k)
            moved = m * k * 3 + m * 4  # one bf16 read, one e4m3 write, the float32 scales
            sample = torch.randperm(m, generator=torch.Generator().manual_seed(1))[: args.check_rows].sort().values
            sample = sample.to(x.device)
            q64, s64 = formula64(x[sample], gelu)
            default = launch_config(m, k)
            runs = [
                ("old", {}, lambda x=x, gelu=gelu: old_quantize_rows(x, gelu)),
                ("new", default, lambda x=x, gelu=gelu: _quantize_rows_triton(x, gelu, EPS)),
            ]
            if args.sweep:
                runs += [
                    ("new", c, lambda x=x, gelu=gelu, c=c: _quantize_rows_triton(x, gelu, EPS, **c))
                    for c in candidates(m, k)
                    if c != default
                ]
            outs, ms_of = {}, {}
            for kernel, cfg, fn in runs:
                ms = bench_ms(fn)
                q, scale = fn()
                row = {
                    "arch": arch,
                    "shape": name,
                    "m": m,
                    "k": k,
                    "gelu": gelu,
                    "kernel": kernel,
                    "config": "-" if kernel == "old" else f"rows={cfg['rows']} warps={cfg['num_warps']}",
                    "default": kernel == "old" or cfg == default,
                    "ms": ms,
                    "gbps": moved / ms / 1e6,
                    **code_errors(q.view(torch.uint8)[sample], scale[sample], q64.view(torch.uint8), s64),
                }
                if kernel == "new" and row["default"]:
                    outs["new"] = (q, scale)
                elif kernel == "old":
                    outs["old"] = (q, scale)
                ms_of.setdefault(kernel, []).append(ms)
                print(
                    f"{name:14s} {kernel} {row['config']:18s} {ms:8.4f} ms {row['gbps']:7.0f} GB/s  codes differ "
                    f"{row['codes_differ']:.2e} (max {row['max_e4m3_steps']} step) "
                    f"scales differ {row['scales_differ']}",
                    flush=True,
                )
                rows_out.append(row)
            (qo, so_), (qn, sn) = outs["old"], outs["new"]
            agree = {
                "old_vs_new_codes_differ": float((qo.view(torch.uint8) != qn.view(torch.uint8)).float().mean()),
                "old_vs_new_scales_differ": int((so_ != sn).sum()),
            }
            print(
                f"{name:14s} old vs new: codes differ {agree['old_vs_new_codes_differ']:.2e}, scales differ "
                f"{agree['old_vs_new_scales_differ']}",
                flush=True,
            )
            best = min((r for r in rows_out if r["shape"] == name and r["kernel"] == "new"), key=lambda r: r["ms"])
            for r in rows_out:
                if r["shape"] == name:
                    r.update(agree, speedup_vs_old=min(ms_of["old"]) / r["ms"])
            if rec:
                rec.data["rows"] = rows_out
                rec.note(
                    f"{name}: fastest new config {best['config']} {best['ms']:.4f} ms (default "
                    f"{default['rows']} rows, {default['num_warps']} warps)"
                )
            calls = 5 if not gelu else 1
            for kernel in ("old", "new"):
                dflt = next(r["ms"] for r in rows_out if r["shape"] == name and r["kernel"] == kernel and r["default"])
                per_step.setdefault((arch, kernel), 0.0)
                per_step[(arch, kernel)] += calls * blocks * dflt
            del x, outs
    if rec:
        rec.data["per_step_ms"] = {f"{a}/{k}": v for (a, k), v in per_step.items()}
        rec.flush()
    print()
    print(
        fmt_table(
            rows_out,
            [
                ("shape", "shape", ""),
                ("kernel", "kernel", ""),
                ("config", "config", ""),
                ("ms", "ms", ".4f"),
                ("gbps", "GB/s", ".0f"),
                ("speedup_vs_old", "x old", ".2f"),
                ("codes_differ", "codes != f64", ".1e"),
                ("max_e4m3_steps", "max steps", "d"),
                ("scales_differ", "scales != f64", "d"),
            ],
        )
    )
    for arch in arches:
        old, new = per_step[(arch, "old")], per_step[(arch, "new")]
        print(
            f"{arch}: quantizer per DiT step (6 calls x {SHAPES[arch][1]} blocks, default configs): old {old:.2f} ms, "
            f"new {new:.2f} ms ({old / new:.2f}x)"
        )


if __name__ == "__main__":
    main()
