"""Classifier-free guidance: both halves as one batch-2 DiT forward (batched) against two batch-1
forwards (sequential), per output size — the measurement behind ``--cfg-batching auto``.

Builds the native Wan DiT (``--arch 1.3b`` by default, random weights, bf16) and times one guided
step's DiT work each way (CUDA events, warm-up first, median of ``--repeats``), with the text side
(projected text + cross-attention K/V) computed once beforehand as the denoise loop does, plus the
peak GPU memory of each.  Sizes are ``HxWxF`` (pixels, frames); the default is Wan 480p x 81 and a
small size.  The ratio sequential / batched above 1 means batching is faster; the ``auto`` rule
(``ditattn.pipelines.sampling.AUTO_SEQUENTIAL_MIN_TOKENS``) should switch where it crosses 1.

    python bench/cfg_batching.py --out $OUT/cfg_batching.json                       # H200
    python bench/cfg_batching.py --arch 14b --sizes 480x832x81 --out $OUT/cfg_14b.json
    BENCH_DEVICE=cpu python bench/cfg_batching.py --arch tiny --sizes 32x48x5 --repeats 2   # smoke (no GPU)

Prints a table last; writes every figure to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEVICE, WAN_ARCH, WAN_COMMON, env_info, fmt_table  # noqa: E402
from e2e import median_ms  # noqa: E402


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """``"480x832x81,240x416x17"`` -> ``[(480, 832, 81), (240, 416, 17)]`` (height, width, frames)."""
    out = []
    for item in text.split(","):
        h, w, f = (int(v) for v in item.lower().split("x"))
        out.append((h, w, f))
    return out


def build_dit(arch: str, backend: str, dev: torch.device, dt: torch.dtype):
    """The native Wan DiT of ``arch`` (random weights) with attention ``backend`` (``auto``: per platform)."""
    from ditattn.attention.context import AttentionSettings, attention_settings, component_scope
    from ditattn.attention.names import AttentionBackendEnum
    from ditattn.models.wan.transformer import KEEP_FP32, WanTransformer, WanTransformerConfig, cast_model

    cfg = dict(**WAN_COMMON, **WAN_ARCH[arch])
    settings = AttentionSettings(backend=None if backend == "auto" else AttentionBackendEnum.from_name(backend))
    torch.manual_seed(0)
    with attention_settings(settings), component_scope("transformer"):
        model = WanTransformer(WanTransformerConfig.from_dict(cfg), dtype=dt)
    cast_model(model, dt, KEEP_FP32)
    return model.to(dev).eval().requires_grad_(False), cfg


def measure(model, cfg: dict, size: tuple[int, int, int], *, text_len: int, repeats: int, dev, dt) -> dict:
    """One guided step at ``size``, batched and sequential: ms, peak memory, the relative difference
    of the two results (they compute the same numbers)."""
    from ditattn.attention.context import forward_context

    h, w, f = size
    lat = (1, cfg["in_channels"], (f - 1) // 4 + 1, h // 8, w // 8)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(lat, generator=g).to(dev, dt)
    cond = torch.randn(1, text_len, cfg["text_dim"], generator=g).to(dev, dt)
    uncond = torch.randn(1, text_len, cfg["text_dim"], generator=g).to(dev, dt)
    t = torch.tensor([500.0], device=dev)
    grid = model.latent_grid(*lat[2:])
    both = model.encode_text(torch.cat([cond, uncond]))
    c_cache, u_cache = model.encode_text(cond), model.encode_text(uncond)

    def batched():
        with forward_context(step=0, num_steps=1, video_shape=grid, text_len=0):
            return model(torch.cat([x, x]), t.expand(2), text_cache=both)

    def sequential():
        with forward_context(step=0, num_steps=1, video_shape=grid, text_len=0, branch="cond"):
            a = model(x, t, text_cache=c_cache)
        with forward_context(step=0, num_steps=1, video_shape=grid, text_len=0, branch="uncond"):
            b = model(x, t, text_cache=u_cache)
        return torch.cat([a, b])

    row = {"size": f"{h}x{w}x{f}", "tokens": grid[0] * grid[1] * grid[2]}
    outs = {}
    for name, fn in (("batched", batched), ("sequential", sequential)):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        outs[name] = fn()
        row[f"{name}_ms"] = median_ms(fn, repeats=repeats)
        row[f"{name}_peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    diff = (outs["sequential"].float() - outs["batched"].float()).norm() / outs["batched"].float().norm()
    row["rel_diff"] = float(diff)
    row["sequential_over_batched"] = row["sequential_ms"] / row["batched_ms"]
    row["faster"] = "batched" if row["sequential_over_batched"] > 1 else "sequential"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="1.3b", choices=sorted(WAN_ARCH))
    ap.add_argument("--sizes", default="480x832x81,240x416x17", help="comma list of HxWxF (default %(default)s)")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--attention-backend", default="auto", help="DiT attention backend (default: per platform)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dev = torch.device(DEVICE if DEVICE != "cuda" or torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and DEVICE == "cuda":
        sys.exit("no CUDA device: set BENCH_DEVICE=cpu with --arch tiny and a small --sizes for a smoke run")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, cfg = build_dit(args.arch, args.attention_backend, dev, dt)
    rows = []
    with torch.inference_mode():
        for size in parse_sizes(args.sizes):
            rows.append(measure(model, cfg, size, text_len=args.text_len, repeats=args.repeats, dev=dev, dt=dt))
    result = {
        "arch": args.arch,
        "dtype": str(dt).replace("torch.", ""),
        "device": str(dev),
        "env": env_info(),
        "attention_backend": args.attention_backend,
        "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    print(
        fmt_table(
            rows,
            [
                ("size", "size", "s"),
                ("tokens", "tokens", "d"),
                ("batched_ms", "batched ms", ".1f"),
                ("sequential_ms", "sequential ms", ".1f"),
                ("sequential_over_batched", "seq/batched", ".3f"),
                ("faster", "faster", "s"),
                ("rel_diff", "rel diff", ".1e"),
            ],
        )
    )


if __name__ == "__main__":
    main()
