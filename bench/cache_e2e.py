"""Step cache end to end on a GPU: a Wan2.1 DiT (1.3B architecture by default, random weights) through the
pipeline's 50-step denoise loop at 480p x 81 frames with classifier-free guidance (the conditional and
unconditional halves batched), without and with a cache, for each attention backend given.

    python bench/cache_e2e.py --out $OUT/cache_e2e.json                                   # H200: auto and sol_attn
    python bench/cache_e2e.py --arch tiny --res tiny --frames 5 --steps 6 --attention auto  # CPU smoke run

Random weights make the adaptive methods' decisions meaningless, so the default caches are fixed
schedules through teacache with an unreachable threshold (every forward reusable, at most
``max_consecutive_skips`` in a row): ``max_consecutive_skips=1`` computes about every other forward,
``=2`` every third.  Per row: wall time of the loop (CUDA-synchronised), forwards computed of all,
the forward ratio, the measured speed-up against the uncached loop of the same attention backend and
its efficiency (speed-up / forward ratio: 1.0 when a reused forward costs nothing); per attention
backend the speed-up of the stack against the uncached default backend and the product of the two
separate speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import WAN_ARCH as ARCH  # noqa: E402
from common import WAN_COMMON, add_wan_args
from common import WAN_RES as RES

DEFAULT_CACHES = "none;teacache:threshold=1e6,max_consecutive_skips=1;teacache:threshold=1e6,max_consecutive_skips=2"


def build(cfg: dict, spec: str, dt, dev):
    """The native DiT of config ``cfg`` with random weights and attention ``spec`` (``auto`` or
    ``name[:k=v;k=v]``)."""
    from ditattn.attention.config import parse_attention_backend_config
    from ditattn.attention.context import AttentionSettings, attention_settings, component_scope
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.models.wan.transformer import KEEP_FP32, WanTransformer, WanTransformerConfig, cast_model

    name, _, cfg_txt = spec.partition(":")
    settings = AttentionSettings(
        backend=None if name == "auto" else B.from_name(name),
        config=parse_attention_backend_config(cfg_txt.replace(";", ",")),
    )
    torch.manual_seed(0)
    with attention_settings(settings), component_scope("transformer"):
        model = WanTransformer(WanTransformerConfig.from_dict(cfg), dtype=dt)
    return cast_model(model, dt, KEEP_FP32).to(dev).eval().requires_grad_(False), settings


def loop(model, settings, cache_spec: str, args, cfg, dev, dt) -> dict:
    """One denoise loop; returns its wall time and the cache report."""
    from diffusers import UniPCMultistepScheduler

    from ditattn.attention.context import attention_settings
    from ditattn.cache.config import resolve_cache
    from ditattn.pipelines.denoise import denoise
    from ditattn.pipelines.offload import ComponentPlacement

    name, _, keys = cache_spec.partition(":")
    setting = resolve_cache(name, keys, num_blocks=len(model.blocks))
    h, w = RES[args.res]
    g = torch.Generator(device="cpu").manual_seed(1)
    latents = torch.randn(1, cfg["in_channels"], (args.frames - 1) // 4 + 1, h // 8, w // 8, generator=g).to(dev)
    text = torch.randn(2, args.text_len, cfg["text_dim"], generator=g).to(dev, dt)  # conditional, unconditional
    sched = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    sched.set_timesteps(args.steps, device=dev)
    run = setting.new_run() if setting is not None else None
    placement = ComponentPlacement({"transformer": model}, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode(), attention_settings(settings):
        denoise(
            latents,
            sched,
            {"transformer": model, "transformer_2": None},
            context=text,
            condition=None,
            guidance=5.0,
            guidance_2=5.0,
            boundary_ratio=None,
            expand_timesteps=False,
            placement=placement,
            dtype=dt,
            cache=run,
            progress=False,
        )
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    stats = run.stats() if run is not None else {"forwards": args.steps, "computed": args.steps, "reused": 0}
    return {"wall_s": wall, **stats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_wan_args(ap)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--attention", default="auto,sol_attn", help="comma list of attention specs (name[:k=v;k=v])")
    ap.add_argument("--caches", default=DEFAULT_CACHES, help="';'-separated cache specs METHOD[:k=v,k=v] or none")
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed whole loops first (kernel compilation, autotune: a sparse backend's first sparse step, after "
        "its dense_steps, compiles its kernels)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = dict(**WAN_COMMON, **ARCH[args.arch])
    if args.arch == "tiny":
        args.text_len = min(args.text_len, 16)
    rows = []
    base = None  # the uncached loop of the first attention backend
    for spec in args.attention.split(","):
        model, settings = build(cfg, spec, dt, dev)
        for _ in range(args.warmup):  # whole loops: a backend's schedule (Sol's dense_steps) reaches its kernels late
            loop(model, settings, "none", args, cfg, dev, dt)
        plain = None
        for cache in args.caches.split(";"):
            r = loop(model, settings, cache, args, cfg, dev, dt)
            r.update(attention=spec, cache=cache, forward_ratio=r["forwards"] / max(r["computed"], 1))
            plain = plain or (r["wall_s"] if cache == "none" else None)
            base = base or plain
            if plain:
                r["speedup"] = plain / r["wall_s"]
                r["efficiency"] = r["speedup"] / r["forward_ratio"]
                # what a reused forward costs, as a share of a computed one
                per = plain / r["forwards"]
                r["reuse_cost_frac"] = ((r["wall_s"] - per * r["computed"]) / max(r["reused"], 1)) / per
            if base:
                r["speedup_vs_base"] = base / r["wall_s"]
            rows.append(r)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    att_speed = {r["attention"]: base / r["wall_s"] for r in rows if r["cache"] == "none" and base}
    print(
        f"{'attention':<16} {'cache':<48} {'wall s':>8} {'fwd':>7} {'fwd x':>6} {'speed x':>7} {'eff':>5} "
        f"{'reuse%':>6} {'vs base':>7} {'product':>7}"
    )
    for r in rows:
        cache_speed = next(
            (
                x["speedup"]
                for x in rows
                if x["attention"] == rows[0]["attention"] and x["cache"] == r["cache"] and "speedup" in x
            ),
            None,
        )
        product = att_speed.get(r["attention"], 1.0) * cache_speed if cache_speed else None
        r["product_of_speedups"] = product
        print(
            f"{r['attention']:<16} {r['cache']:<48} {r['wall_s']:8.2f} {r['computed']:>3}/{r['forwards']:<3} "
            f"{r['forward_ratio']:6.2f} {r.get('speedup', 0):7.2f} {r.get('efficiency', 0):5.2f} "
            f"{100 * r.get('reuse_cost_frac', 0):6.2f} {r.get('speedup_vs_base', 0):7.2f} "
            f"{product if product else 0:7.2f}"
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(
                {
                    "arch": args.arch,
                    "res": args.res,
                    "frames": args.frames,
                    "steps": args.steps,
                    "device": str(dev),
                    "rows": rows,
                },
                fh,
                indent=1,
            )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
