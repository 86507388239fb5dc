"""CPU accuracy of ``sage_attn``'s per-channel Q/K balance (``qk_balance``, issue 17) for K scales per token and per block.

For each input the PyTorch reference of the INT8 quantization (``int8_attention_reference``, fp16/bf16 P.V as the
SM90 kernel computes it: per-token Q, K smoothed by its token mean, ``block_n`` 128) without and with the balance
(``Q * c``, ``(K - mean) / c`` per channel, ``c = amax|K~|^alpha / amax|Q|^(1 - alpha)`` per batch and K/V head;
``int8_reference.qk_balance_factors``) against exact attention in float64: relative L2 error and cosine of the
output.  Inputs: random (odd lengths, GQA, head dims 128 and 64, fp16 and bf16), the structured ones of
``bench/sage_sm90.py`` (Wan 3-D RoPE-rotated q/k, ``common.structured_qkv``) at several sizes, head counts, GQA
ratios, content norms and seeds, and with ``--activations FILE`` (repeatable, ``bench/capture_qkv.py``) the captured
q/k/v of a real model (in bf16).  No GPU; about 25 minutes on one core for everything (``--only`` picks cases).

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/sage_balance_cpu.py [--alphas 0.5,0.75,1] [--grans token,block]
        [--only random,structured,S1,...] [--activations qkv.safetensors] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from sage_kgran_cpu import exact, random_qkv  # noqa: E402

# (name, B, (T, Hs, Ws) grid or (Sq, Skv), H, Hkv, D, dtype, kind, seed, content norm range)
CASES = [
    ("R1", 2, (1000, 777), 6, 3, 128, torch.bfloat16, "random", 100, None),
    ("R2", 1, (1000, 777), 4, 2, 64, torch.bfloat16, "random", 101, None),
    ("R3", 1, (555, 1333), 4, 4, 64, torch.float16, "random", 102, None),
    ("R4", 1, (999, 1777), 8, 2, 128, torch.float16, "random", 110, None),
    ("S1", 1, (3, 30, 52), 4, 4, 128, torch.bfloat16, "structured", 103, (10.0, 16.0)),
    ("S2", 1, (3, 30, 52), 4, 2, 64, torch.bfloat16, "structured", 104, (10.0, 16.0)),
    ("S3", 1, (2, 30, 52), 4, 4, 128, torch.float16, "structured", 105, (10.0, 16.0)),
    ("S4", 1, (3, 30, 52), 12, 12, 128, torch.bfloat16, "structured", 111, (10.0, 16.0)),
    ("S5", 1, (3, 30, 52), 12, 4, 128, torch.bfloat16, "structured", 112, (10.0, 16.0)),
    ("S6", 1, (6, 30, 52), 4, 4, 128, torch.bfloat16, "structured", 113, (10.0, 16.0)),
    ("S7", 1, (6, 30, 52), 8, 2, 64, torch.float16, "structured", 114, (10.0, 16.0)),
    ("S8", 1, (3, 30, 52), 4, 4, 128, torch.bfloat16, "structured", 115, (4.0, 8.0)),
    ("S9", 1, (3, 30, 52), 4, 4, 128, torch.bfloat16, "structured", 116, (16.0, 24.0)),
]


def case_inputs(case):
    name, b, dims, h, hkv, d, dtype, kind, seed, norms = case
    if kind == "structured":
        return common.structured_qkv(b, dims, h, d, hkv=hkv, dtype=dtype, seed=seed, device="cpu", norm_range=norms)
    return random_qkv(b, *dims, h, hkv, d, dtype, seed)


def measure(q, k, v, grans, alphas):
    from ditattn.attention.kernels.int8_reference import int8_attention_reference

    ref = exact(q, k, v)
    res = {}
    for gran in grans:
        for a in alphas:
            out = int8_attention_reference(q, k, v, k_granularity=gran, block_n=128, qk_balance=a or None)[0].double()
            key = f"{gran}@{a:g}"
            res[key] = (common.rel_err(out, ref), common.cosine(out, ref))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grans", default="token,block")
    ap.add_argument("--alphas", default="0,0.5,0.75,1", help="balance exponents; 0 = off")
    ap.add_argument("--only", default=None, help="comma-separated case names or kinds (random, structured)")
    ap.add_argument("--activations", action="append", default=[], metavar="FILE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    grans, alphas = args.grans.split(","), [float(a) for a in args.alphas.split(",")]
    only = set(args.only.split(",")) if args.only else None
    inputs = []
    for c in CASES:
        if only is None or c[0] in only or c[7] in only:
            inputs.append((c[0], c[7], lambda c=c: case_inputs(c)))
    for path in args.activations:
        from ditattn.evaluation.capture import load_qkv

        for e, q, k, v in load_qkv(path):
            inputs.append((f"{os.path.basename(path)}:{e['name']}", "activations",
                           lambda q=q, k=k, v=v: tuple(t.to(torch.bfloat16) for t in (q, k, v))))
    cols = [f"{g}@{a:g}" for g in grans for a in alphas]
    label = [f"{g} " + (f"a={a:g}" if a else "off") for g in grans for a in alphas]
    print("case | kind | shape B,Sq,Skv,H,Hkv,D dtype | " + " | ".join(label) + " | s", flush=True)
    rows = []
    for name, kind, make in inputs:
        t0 = time.time()
        q, k, v = make()
        res = measure(q, k, v, grans, alphas)
        shape = f"{q.shape[0]},{q.shape[1]},{k.shape[1]},{q.shape[2]},{k.shape[2]},{q.shape[3]} " \
                f"{str(q.dtype).replace('torch.', '')}"
        rows.append({"case": name, "kind": kind, "shape": shape, **{c: res[c] for c in cols}})
        print(f"{name} | {kind} | {shape} | " + " | ".join(f"{100 * res[c][0]:.2f} % / {res[c][1]:.6f}" for c in cols)
              + f" | {time.time() - t0:.0f}", flush=True)
    for kind in ("random", "structured", "activations"):
        sel = [r for r in rows if r["kind"] == kind]
        if sel:
            print(f"max over {kind} ({len(sel)}): " + " | ".join(
                f"{c} {100 * max(r[c][0] for r in sel):.2f} % / {min(r[c][1] for r in sel):.6f}" for c in cols))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
