"""CPU accuracy of the ``sage_attn`` K scale granularities (issue 17): token / block / thread.

For each input the PyTorch reference of the INT8 quantization (``int8_attention_reference``, fp16/bf16 P.V as
the SM90 kernel computes it: per-token Q, K smoothed by its token mean, ``block_n`` 128) against exact attention
in float64: relative L2 error and cosine of the output.  Random inputs (odd lengths, GQA, head dims 128 and 64)
and the structured ones of ``bench/sage_sm90.py`` (Wan 3-D RoPE-rotated q/k, ``common.structured_qkv``).
No GPU; about a minute on one core.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/sage_kgran_cpu.py [--grans token,block,thread] [--block-n 128] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

CASES = [  # (B, Sq, Skv, H, Hkv, D, dtype, kind, seed)
    (2, 1000, 777, 6, 3, 128, torch.bfloat16, "random", 100),
    (1, 1000, 777, 4, 2, 64, torch.bfloat16, "random", 101),
    (1, 555, 1333, 4, 4, 64, torch.float16, "random", 102),
    (1, 3 * 30 * 52, 3 * 30 * 52, 4, 4, 128, torch.bfloat16, "structured", 103),
    (1, 3 * 30 * 52, 3 * 30 * 52, 4, 2, 64, torch.bfloat16, "structured", 104),
    (1, 2 * 30 * 52, 2 * 30 * 52, 4, 4, 128, torch.float16, "structured", 105),
]


def random_qkv(b, sq, skv, h, hkv, d, dtype, seed):
    """i.i.d. normal q ``[b, sq, h, d]``, k / v ``[b, skv, hkv, d]`` in ``dtype`` on the CPU (lengths may differ)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=g).to(dtype) for s, n in ((sq, h), (skv, hkv), (skv, hkv)))


def inputs(b, sq, skv, h, hkv, d, dtype, kind, seed):
    if kind == "structured":
        return common.structured_qkv(b, (sq // (30 * 52), 30, 52), h, d, hkv=hkv, dtype=dtype, seed=seed,
                                     device="cpu")
    return random_qkv(b, sq, skv, h, hkv, d, dtype, seed)


def exact(q, k, v):
    """float64 attention, one head at a time: ``[B, Sq, H, D]``."""
    H, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(H):
        qh = q[:, :, h].double()
        kh, vh = k[:, :, h // (H // Hkv)].double(), v[:, :, h // (H // Hkv)].double()
        s = (qh @ kh.transpose(-1, -2)) * D ** -0.5
        out[:, :, h] = torch.softmax(s, -1) @ vh
    return out


def main(argv=None):
    from ditattn.attention.kernels.int8_reference import int8_attention_reference

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grans", default="token,block,thread")
    ap.add_argument("--block-n", type=int, default=128, help="keys per K tile (the SM90 kernel's 128; 'thread' groups "
                    "are block_n / 4 keys)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    grans = args.grans.split(",")
    rows = []
    for b, sq, skv, h, hkv, d, dt, kind, seed in CASES:
        q, k, v = inputs(b, sq, skv, h, hkv, d, dt, kind, seed)
        ref = exact(q, k, v)
        row = {"shape": f"{b},{sq},{skv},{h},{hkv},{d}", "dtype": str(dt).replace("torch.", ""), "kind": kind}
        for gname in grans:
            out = int8_attention_reference(q, k, v, k_granularity=gname, block_n=args.block_n)[0].double()
            row[gname], row[gname + "_cos"] = common.rel_err(out, ref), common.cosine(out, ref)
        row["sdpa_dtype"] = float((torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2).float() for t in (q, k.repeat_interleave(h // hkv, 2), v.repeat_interleave(h // hkv, 2)))
        ).transpose(1, 2).to(dt).double() - ref).norm() / ref.norm())
        rows.append(row)
        print(f"{row['shape']:>24} {row['dtype']:>8} {kind:>10}  " + "  ".join(
            f"{gname} {100 * row[gname]:.2f} % / {row[gname + '_cos']:.6f}" for gname in grans)
            + f"  (sdpa in {row['dtype']}: {100 * row['sdpa_dtype']:.2f} %)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
