"""Where the attention of captured q/k goes, per DiT block and head, next to the structured inputs' heads.

    python bench/qkv_profile.py qkv_red.safetensors qkv_blue.safetensors --structured-heads 2,5

For every activation file entry (``bench/capture_qkv.py``) and head: :func:`ditattn.evaluation.structured.
attention_profile` on ``--rows`` evenly spaced query rows (float32 exact): the attention mass in the query's
frame (``same frame``), within Chebyshev distance 1 in (t, h, w) (``3x3x3``), at the query's (h, w) in any
frame (``same place``) and on the 1 % largest weights of the row (``top 1 %``).  Rows are averaged over the
entries of the same block and head (all steps and prompts).  ``--structured-heads`` adds the structured
inputs of the same grid (``ditattn.evaluation.structured``, seed 0) with those head counts.

``--errors BACKEND[:k=v,k=v];BACKEND...`` adds, per block and head, the relative L2 error of each named
backend's output (bf16 inputs, called through ``ditattn.attention`` at layer index 2 as bench/fidelity.py does;
stateful backends get a single call) against float32 exact attention over all rows: which heads a backend's
error sits in.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fmt_table  # noqa: E402  (also puts src/ on the path)

KEYS = ("same_frame", "near", "same_place", "top1_percent")


def head_errors(q, k, v, grid, specs) -> dict:
    """``{label: [per-head relative L2 error]}`` of each ``(label, backend, config)`` in ``specs``."""
    import torch

    import ditattn

    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    out = {}
    for label, backend, cfg in specs:
        o = ditattn.attention(q, k, v, backend=backend, config=dict(cfg), video_shape=grid, layer_idx=2).float()
        out[label] = [float((o[0, :, h] - exact[0, :, h]).norm() / exact[0, :, h].norm()) for h in range(q.shape[2])]
    return out


def parse_specs(text: str) -> list:
    from ditattn.attention.config import parse_attention_backend_config

    specs = []
    for item in filter(None, (x.strip() for x in (text or "").split(";"))):
        backend, _, cfg = item.partition(":")
        specs.append((item, backend.strip(), parse_attention_backend_config(cfg or None)))
    return specs


def profiles(paths, rows: int = 256, structured_heads=(), specs=()) -> list[dict]:
    import torch

    from ditattn.evaluation.capture import load_qkv
    from ditattn.evaluation.structured import StructuredSpec, attention_profile, structured_qkv

    acc: dict[tuple, list] = {}
    grids = set()
    for path in paths:
        for e, q, k, v in load_qkv(path):
            grid = tuple(e["video_shape"])
            grids.add(grid)
            S = q.shape[1]
            r = torch.linspace(0, S - 1, min(rows, S)).round().long()
            p = attention_profile(q, k, grid, rows=r)
            errs = head_errors(q, k, v, grid, specs) if specs else {}
            for h in range(q.shape[2]):
                acc.setdefault((e.get("model"), e["layer_idx"], h), []).append(
                    [p[x][h] for x in KEYS] + [errs[label][h] for label, *_ in specs])
    out = []
    names = list(KEYS) + [f"err {label}" for label, *_ in specs]
    for (model, block, h), vals in sorted(acc.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
        row = {"input": f"{model} block {block}", "head": h, "n": len(vals)}
        row.update({x: sum(c) / len(c) for x, c in zip(names, zip(*vals))})
        out.append(row)
    for grid in sorted(grids):
        S = grid[0] * grid[1] * grid[2]
        r = torch.linspace(0, S - 1, min(rows, S)).round().long()
        for heads in structured_heads:
            q, k, _v, _ = structured_qkv(StructuredSpec(video_shape=grid, heads=heads, seed=0), device="cpu")
            p = attention_profile(q, k, grid, rows=r)
            for h in range(heads):
                out.append({"input": f"structured {heads} heads {'x'.join(map(str, grid))}", "head": h, "n": 1,
                            **{x: p[x][h] for x in KEYS}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="activation files (bench/capture_qkv.py)")
    ap.add_argument("--rows", type=int, default=256, help="query rows per entry (evenly spaced)")
    ap.add_argument("--structured-heads", default="", help="comma list: also the structured inputs with these head "
                                                           "counts at each captured grid")
    ap.add_argument("--errors", default="", metavar="SPECS",
                    help="';'-separated BACKEND[:k=v,k=v]: also each one's per-head error on the captured entries")
    args = ap.parse_args(argv)
    heads = [int(x) for x in args.structured_heads.split(",") if x.strip()]
    specs = parse_specs(args.errors)
    rows = profiles(args.files, rows=args.rows, structured_heads=heads, specs=specs)
    print(fmt_table(rows, [("input", "input", ""), ("head", "head", ""), ("n", "entries", ""),
                           ("same_frame", "same frame", ".3f"), ("near", "3x3x3", ".3f"),
                           ("same_place", "same place", ".3f"), ("top1_percent", "top 1 %", ".3f")]
                    + [(f"err {label}", f"err {label}", ".3f") for label, *_ in specs]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
