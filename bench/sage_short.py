"""Short-sequence timing of the sage SM90 kernel: wall (do_bench median) and GPU kernel time (torch.profiler
sum of the call's kernels, prologue included) for FA4 and each sage config, measured twice in alternating
order, so host-launch gaps and warm-up drift show apart from the kernels' own time.  Prints a table last.

    python3 bench/sage_short.py --shapes "1,24,4096,128;1,40,4096,64" --variants "default=;persist=persistent:true"
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import attn_flops, bench_ms, kernel_ms  # noqa: E402
from sage_sm90 import _inputs, _variants  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1,24,4096,128;1,40,4096,64;1,40,4096,128;1,40,32760,128")
    ap.add_argument("--variants", default="default=;persist=persistent:true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("sage_short.py: needs an SM90 (Hopper) GPU (the sage SM90 kernel and FA4)", file=sys.stderr)
        return 2
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as exc:
        print(f"sage_short.py: needs FlashAttention-4 (flash_attn.cute): {exc}", file=sys.stderr)
        return 2

    from ditattn.attention.kernels.sage_sm90 import sage_attention_sm90

    variants = _variants(args.variants)
    lines = ["| B,H,S,D | impl | pass | wall ms | kernel ms | TFLOP/s wall | TFLOP/s kernel |", "|---|---|---|---|---|---|---|"]
    for spec in args.shapes.split(";"):
        b, h, s, d = (int(x) for x in spec.split(","))
        q, k, v = _inputs(b, s, s, h, h, d, torch.bfloat16, "random", seed=7)
        fl = attn_flops(b, h, s, s, d)
        fns = {"fa4": lambda: flash_attn_func(q, k, v)}
        for name, cfg in variants.items():
            fns[name] = (lambda c: (lambda: sage_attention_sm90(q, k, v, config=c)))(cfg)
        for rep in range(2):
            for name in (list(fns) if rep == 0 else list(fns)[::-1]):
                w, kt = bench_ms(fns[name]), kernel_ms(fns[name], iters=20)
                lines.append(f"| {spec} | {name} | {rep} | {w:.3f} | {kt:.3f} | {fl / w / 1e9:.0f} | {fl / kt / 1e9:.0f} |")
                print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
