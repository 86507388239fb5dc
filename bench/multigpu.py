"""Sequence-parallel scaling of one Wan DiT step: 1..N GPUs with Ulysses, ring and USP.

Every rank builds the same random-weight Wan DiT directly on its GPU (same seed), runs one bf16
forward under ``--ulysses-degree U --ring-degree R`` through ``ditattn.distributed`` (NCCL), and
rank 0 returns the step time and the output; each configuration is compared with the 1-GPU output.

    python bench/multigpu.py --arch 14b --res 720p --gpus 1,2,4,8 --backends fa,video_sparse_attn:sparsity=0.9 \
        --out $OUT/multigpu.json

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc. are set below if the environment lacks them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import WAN_ARCH as ARCH  # noqa: E402
from common import WAN_COMMON, add_wan_args
from common import WAN_RES as RES


def _layouts(n: int, heads: int) -> list[tuple[str, int, int]]:
    """(mode, U, R) for n GPUs: pure Ulysses (if heads divide), pure ring, and a balanced USP."""
    out = []
    if n == 1:
        return [("single", 1, 1)]
    if heads % n == 0:
        out.append(("ulysses", n, 1))
    out.append(("ring", 1, n))
    for u in range(2, n):
        if n % u == 0 and heads % u == 0 and n // u > 1:
            out.append(("usp", u, n // u))
            break
    return out


def _step(groups, arch: str, res: str, frames: int, text_len: int, backend: str, repeats: int):
    from ditattn.attention.config import parse_attention_backend_config
    from ditattn.attention.context import AttentionSettings, attention_settings, component_scope, forward_context
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.models.wan.transformer import WanTransformer, WanTransformerConfig

    name, _, cfg_txt = backend.partition(":")
    settings = AttentionSettings(
        backend=None if name == "auto" else B.from_name(name),
        config=parse_attention_backend_config(cfg_txt.replace(";", ",")),
        ulysses_degree=groups.ulysses_degree,
        ring_degree=groups.ring_degree,
    )
    cfg = WanTransformerConfig.from_dict({**WAN_COMMON, **ARCH[arch]})
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    with torch.device(dev), attention_settings(settings), component_scope("transformer"):
        model = WanTransformer(cfg, dtype=torch.bfloat16)
    model = model.to(torch.bfloat16).eval()
    h, w = RES[res]
    lat_f = (frames - 1) // 4 + 1
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, 16, lat_f, h // 8, w // 8, device=dev, generator=g, dtype=torch.bfloat16)
    t = torch.tensor([500.0], device=dev)
    txt = torch.randn(1, text_len, 4096, device=dev, generator=g, dtype=torch.bfloat16)
    times = []
    with torch.no_grad(), forward_context(step=10**6, num_steps=10**6):
        for i in range(repeats + 1):
            torch.distributed.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = model(x, t, txt)
            b.record()
            torch.cuda.synchronize()
            if i:
                times.append(a.elapsed_time(b))
    times.sort()
    if torch.distributed.get_rank() != 0:
        return None
    return {"ms": times[len(times) // 2], "out": out.float().cpu()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_wan_args(ap)
    ap.add_argument("--gpus", default="1,2,4,8")
    ap.add_argument("--backends", default="fa")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from ditattn.distributed.launch import spawn_ranks

    avail = torch.cuda.device_count()
    heads = ARCH[args.arch]["num_attention_heads"]
    rows = []
    for backend in args.backends.split(","):
        base = None
        for n in [int(x) for x in args.gpus.split(",")]:
            if n > avail:
                print(f"skip {n} GPUs: only {avail} here", flush=True)
                continue
            for mode, u, r in _layouts(n, heads):
                if r > 1 and not backend.startswith(("fa", "auto", "torch")):
                    continue  # sparse backends refuse ring attention
                res = spawn_ranks(
                    _step,
                    n,
                    args=(args.arch, args.res, args.frames, args.text_len, backend, args.repeats),
                    ulysses_degree=u,
                    ring_degree=r,
                    device="cuda",
                    timeout_s=600,
                )[0]
                if base is None:
                    base = res
                err = ((res["out"] - base["out"]).norm() / base["out"].norm()).item()
                row = {
                    "backend": backend,
                    "gpus": n,
                    "mode": mode,
                    "ulysses": u,
                    "ring": r,
                    "ms": res["ms"],
                    "speedup": base["ms"] / res["ms"],
                    "efficiency": base["ms"] / res["ms"] / n,
                    "rel_err_vs_1gpu": err,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"arch": args.arch, "res": args.res, "frames": args.frames, "rows": rows}, fh, indent=2)
    print(
        f"\n{'backend':<28} {'gpus':>4} {'mode':<8} {'U':>2} {'R':>2} {'ms':>9} {'speedup':>8} {'eff':>6} {'err':>9}"
    )
    for r in rows:
        print(
            f"{r['backend']:<28} {r['gpus']:>4} {r['mode']:<8} {r['ulysses']:>2} {r['ring']:>2} {r['ms']:9.1f} "
            f"{r['speedup']:8.2f} {r['efficiency']:6.2f} {r['rel_err_vs_1gpu']:9.2e}"
        )


if __name__ == "__main__":
    main()
