"""Check and time the SM90 Gluon kernel of ``sage_attn`` (ditattn.attention.kernels.sage_sm90).

One run: correctness first (random and structured inputs, V with channel offsets, odd lengths,
GQA, head dims 64/128, fp16/bf16, LSE; against the PyTorch reference of the same quantization — FP8 P.V
variants against its FP8 mode — and against float32 exact attention; plus a long sequence, S = 32,760,
on sampled rows against float32, where direct FP8 accumulation would show), then the timing table
(median of do_bench, the quantization prologue — for FP8 P.V also V's statistics and transposed FP8
copy — included) next to cuDNN SDPA, FA4 (``fa``, if installed) and the Triton INT8 kernel, for each
kernel config in ``--variants``.  Prints a short table last; writes ``sage_sm90.json`` under ``--out``.

    python3 bench/sage_sm90.py --out $OUT/sage --budget-s 400 \
        --variants "fp16=;fp8=pv_dtype:fp8;fp8_direct=pv_dtype:fp8/pv_accum:direct"

(``qk_balance:0.5``: the per-channel Q/K balance, a prologue option; its statistics passes are inside
the timed call like the rest of the prologue.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Deadline, Recorder, attn_flops, bench_ms, cosine, fmt_table, guarded, rel_err  # noqa: E402

SHAPES = "1,40,32760,128;1,12,32760,128;1,40,16384,128;1,24,4096,128;1,40,75600,128;1,24,4096,64"
CHECKS = [  # (B, Sq, Skv, H, Hkv, D, dtype, kind)
    (2, 1000, 777, 6, 3, 128, torch.bfloat16, "random"),
    (1, 555, 1333, 4, 4, 64, torch.float16, "random"),
    (1, 4096, 4096, 8, 8, 128, torch.bfloat16, "random"),
    (1, 3 * 30 * 52, 3 * 30 * 52, 4, 4, 128, torch.bfloat16, "structured"),
    (1, 1, 300, 2, 1, 128, torch.bfloat16, "random"),
    (1, 700, 900, 4, 2, 128, torch.bfloat16, "vbias"),
]
LONG_CHECK = (1, 32760, 4, 128, 256)  # B, S, H, D, sampled query rows: accumulation over 256 key tiles


def _variants(spec: str) -> dict[str, dict]:
    """``name=k:v/k:v;name2=...`` -> {name: config}; ``default`` = the module's defaults."""
    out = {}
    for part in filter(None, spec.split(";")):
        name, _, cfg = part.partition("=")
        conf = {}
        for kv in filter(None, cfg.split("/")):
            k, _, v = kv.partition(":")
            conf[k] = (v.lower() == "true") if v.lower() in ("true", "false") else int(v) if v.isdigit() else _num(v)
        out[name] = conf
    return out


def _num(v: str):
    """``v`` as a float when it reads as one (``qk_balance:0.5``), else the string."""
    try:
        return float(v)
    except ValueError:
        return v


def _inputs(b, sq, skv, h, hkv, d, dtype, kind, seed):
    """``random``: i.i.d. normal; ``structured``: :func:`common.structured_qkv`; ``vbias``: random with
    per-channel offsets of V (std 3) — what ``v_smooth`` removes before the FP8 rounding."""
    if kind == "structured":
        grid = (sq // (30 * 52), 30, 52)
        return common.structured_qkv(b, grid, h, d, hkv=hkv, dtype=dtype, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(b, skv, hkv, d, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(b, skv, hkv, d, generator=g, device="cuda", dtype=dtype)
    if kind == "vbias":
        v = (v.float() + 3.0 * torch.randn(d, generator=g, device="cuda")).to(dtype)
    return q, k, v


def quant_reference_kwargs(cfg: dict) -> dict:
    """``int8_attention_reference`` keywords computing what the SM90 kernel computes under ``cfg``."""
    kw = {
        "block_n": int(cfg.get("block_n", 128)),
        "k_granularity": cfg.get("k_granularity", "token"),
        "qk_balance": cfg.get("qk_balance"),
    }
    if cfg.get("pv_dtype", "fp16") == "fp8":
        kw.update(pv="fp8", p_rowsum="fp32", v_smooth=bool(cfg.get("v_smooth", False)))
    return kw


def _exact(q, k, v):
    """Float32 attention over all rows (small checks): out [B, Sq, H, D], lse [B, H, Sq]."""
    rows = torch.arange(q.shape[1], device=q.device)
    return common.reference_rows(q, k, v, rows)


def check(rec, variants):
    from ditattn.attention.kernels.int8_attention import int8_attention_reference
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    rows = []
    for i, (b, sq, skv, h, hkv, d, dtype, kind) in enumerate(CHECKS):
        q, k, v = _inputs(b, sq, skv, h, hkv, d, dtype, kind, seed=100 + i)
        ref_o, ref_l = _exact(q, k, v)
        qrefs = {}
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).repeat_interleave(h // hkv, 1),
            v.transpose(1, 2).repeat_interleave(h // hkv, 1),
        ).transpose(1, 2)
        for name, cfg in variants.items():
            if cfg.get("ablate"):
                continue  # ablations leave a stage out: their output is wrong by design
            kw = quant_reference_kwargs(cfg)
            key = tuple(sorted(kw.items()))
            if key not in qrefs:
                qrefs[key] = int8_attention_reference(q, k, v, **kw)[0]
            qref = qrefs[key]

            def run():
                out, lse = sage_attention_sm90(q, k, v, return_lse=True, config=cfg)
                torch.cuda.synchronize()
                cos = cosine(out, ref_o)
                return rec.add(
                    section="check",
                    variant=name,
                    shape=f"{b},{sq},{skv},{h},{hkv},{d}",
                    dtype=str(dtype).replace("torch.", ""),
                    kind=kind,
                    finite=bool(torch.isfinite(out).all()),
                    err=rel_err(out, ref_o),
                    cos=cos,
                    err_vs_quant_ref=rel_err(out, qref),
                    sdpa_err=rel_err(sdpa, ref_o),
                    lse_max_abs=float((lse - ref_l).abs().max()),
                )

            r = guarded(rec, f"check {name} {b},{sq},{skv},{h},{hkv},{d}", run)
            if r:
                rows.append(r)
    return rows + check_long(rec, variants)


def check_long(rec, variants):
    """Error against float32 on sampled query rows of one long sequence (random inputs): the FP8
    tensor cores add with fewer mantissa bits than FP32, so direct FP8 accumulation drifts with the
    number of key tiles; two-level accumulation should not."""
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    b, s, h, d, n = LONG_CHECK
    q, k, v = _inputs(b, s, s, h, h, d, torch.bfloat16, "random", seed=11)
    idx = common.sample_rows(s, n)
    ref_o, _ = common.reference_rows(q, k, v, idx)
    rows = []
    for name, cfg in variants.items():
        if cfg.get("ablate"):
            continue

        def run():
            out = sage_attention_sm90(q, k, v, config=cfg)[0][:, idx]
            cos = cosine(out, ref_o)
            return rec.add(
                section="check",
                variant=name,
                shape=f"{b},{s},{s},{h},{h},{d}",
                dtype="bfloat16",
                kind=f"random, {n} rows",
                finite=bool(torch.isfinite(out).all()),
                err=rel_err(out, ref_o),
                cos=cos,
            )

        r = guarded(rec, f"check long {name}", run)
        if r:
            rows.append(r)
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def timing(rec, dl, shapes, variants):
    from ditattn.attention.kernels.int8_attention import int8_attention
    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        flash_attn_func = None
    rows = []
    for shp in shapes:
        if dl.left() < 20:
            rec.note(f"budget: skipped {shp}")
            continue
        b, h, s, d = shp
        q, k, v = _inputs(b, s, s, h, h, d, torch.bfloat16, "random", seed=7)
        fl = attn_flops(b, h, s, s, d)
        row = {"section": "time", "shape": f"{b},{h},{s},{d}"}
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)

        ms = guarded(rec, "cudnn", lambda: bench_ms(cudnn))
        row["cudnn"] = fl / ms / 1e9 if ms else None
        if flash_attn_func is not None:
            ms = guarded(rec, "fa4", lambda: bench_ms(lambda: flash_attn_func(q, k, v)))
            row["fa4"] = fl / ms / 1e9 if ms else None
        ms = guarded(rec, "triton int8", lambda: bench_ms(lambda: int8_attention(q, k, v)))
        row["triton_int8"] = fl / ms / 1e9 if ms else None
        if any(c.get("pv_dtype") == "fp8" for c in variants.values()):  # what impl=auto runs for pv_dtype fp8
            ms = guarded(rec, "triton int8 fp8", lambda: bench_ms(lambda: int8_attention(q, k, v, pv="fp8")))
            row["triton_fp8"] = fl / ms / 1e9 if ms else None
        for name, cfg in variants.items():
            if d not in (64, 128):
                continue
            ms = guarded(rec, f"sm90 {name}", lambda: bench_ms(lambda: sage_attention_sm90(q, k, v, config=cfg)))
            row[name] = fl / ms / 1e9 if ms else None
            if ms and name == next(iter(variants)):
                row[name + "_ms"] = ms
        base = row.get("fa4") or row.get("cudnn")
        best = max((row.get(n) or 0) for n in variants)
        row["best_vs_base"] = best / base if base and best else None
        rows.append(rec.add(**row))
        del q, k, v, qt, kt, vt
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/sage")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--shapes", default=SHAPES, help="'B,H,S,D;...' timed shapes")
    ap.add_argument(
        "--variants",
        default="fp16=;fp8=pv_dtype:fp8;fp8_direct=pv_dtype:fp8/pv_accum:direct",
        help="'name=key:val/key:val;...' kernel configs (keys of sage_sm90.default_config; empty = defaults)",
    )
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args(argv)
    dl = Deadline(args.budget_s)
    rec = Recorder(args.out, "sage_sm90", {"env": common.env_info(), "argv": sys.argv})
    variants = _variants(args.variants)
    checks = [] if args.no_check else check(rec, variants)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
    times = timing(rec, dl, shapes, variants)
    print()
    print(
        fmt_table(
            checks,
            [
                ("variant", "variant", ""),
                ("shape", "B,Sq,Skv,H,Hkv,D", ""),
                ("dtype", "dtype", ""),
                ("kind", "input", ""),
                ("err", "err vs fp32", ".2e"),
                ("cos", "cos", ".6f"),
                ("err_vs_quant_ref", "err vs quant ref", ".2e"),
                ("sdpa_err", "sdpa err", ".2e"),
                ("lse_max_abs", "lse max abs", ".1e"),
                ("finite", "finite", ""),
            ],
        )
    )
    print()
    cols = [
        ("shape", "B,H,S,D", ""),
        ("cudnn", "cuDNN", ".0f"),
        ("fa4", "FA4", ".0f"),
        ("triton_int8", "triton int8", ".0f"),
        ("triton_fp8", "triton fp8 PV", ".0f"),
    ]
    cols += [(n, n, ".0f") for n in variants] + [("best_vs_base", "best / (FA4 or cuDNN)", ".3f")]
    print(fmt_table(times, cols))
    print("TFLOP/s (dense-equivalent 4*B*H*S^2*D / time; quantization prologue included)")


if __name__ == "__main__":
    main()
