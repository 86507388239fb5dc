"""Step-cache frontier on the trained embedded model: forward ratio against quality, per method and threshold.

    python bench/cache_frontier.py --prompts 30                       # default size (128x128x17), CPU or GPU
    python bench/cache_frontier.py --prompts 30 --size 256x256x33 --device cuda --output frontier_256.json
    python bench/cache_frontier.py --prompt-set tuning --first-prompt 4 --prompts 6 --steps 50 --variant ...

Prompts are "a COLOUR SHAPE MOTION" captions of the embedded model's scenes, minus every prompt of the
shipped calibration, in a fixed shuffled order, split in two disjoint sets (``--prompt-set``): ``tuning``
(the first 54: choose thresholds and keys on these) and ``heldout`` (the last 30: report on these only,
never tune on them).  Each prompt runs once uncached (the reference) and once per variant with the same
seed; per variant the table gives the forward ratio (DiT forwards / forwards computed; ``blocks`` the
same for block work, which differs for first_block_cache), mean and minimum paired PSNR, mean SSIM
against the uncached clip, and the semantic judge's colour / motion verdicts (how many clips are judged
right, and how many verdicts differ from the uncached clip's).  Writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

#: variants measured by default: per method a quality setting (about 2x at 50 steps) and a fast one (3x or more:
#: the first 20 % of the steps computed, long runs of reuse in the middle), chosen on the tuning prompts
DEFAULT_VARIANTS = [
    "teacache:threshold=0.2",
    "magcache:threshold=0.16,max_consecutive_skips=3",
    "first_block_cache:threshold=0.3,bn_blocks=1",
    "teacache:threshold=0.5,max_consecutive_skips=8",
    "magcache:threshold=0.8,max_consecutive_skips=12",
    "first_block_cache:threshold=0.5,bn_blocks=1,max_consecutive_skips=8",
]


#: prompts of the held-out set (the last ones of the shuffled order); the rest are the tuning set
HELDOUT_SIZE = 30
PROMPT_SETS = ("tuning", "heldout")


def prompt_sets(exclude) -> dict[str, list[str]]:
    """``{"tuning": [...], "heldout": [...]}``: every scene caption not in ``exclude`` (the calibration's
    prompts), in a fixed shuffled order, split so the last :data:`HELDOUT_SIZE` are held out."""
    from ditattn.train.scenes import COLORS, MOTIONS, SHAPES

    every = [f"a {c} {s} {m}" for c in COLORS for s in SHAPES for m in MOTIONS if f"a {c} {s} {m}" not in exclude]
    random.Random(1234).shuffle(every)
    return {"tuning": every[:-HELDOUT_SIZE], "heldout": every[-HELDOUT_SIZE:]}


def select_prompts(name: str, n: int, exclude, first: int = 0) -> list[str]:
    """``n`` prompts of set ``name`` (``tuning`` or ``heldout``) from its ``first``-th on."""
    chosen = prompt_sets(exclude)[name]
    if first + n > len(chosen):
        raise SystemExit(f"only {len(chosen)} {name} prompts exist")
    return chosen[first : first + n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="ditattn:shapes")
    ap.add_argument("--prompts", type=int, default=30, help="prompts of the set (default 30)")
    ap.add_argument(
        "--prompt-set",
        choices=PROMPT_SETS,
        default="heldout",
        help="tuning: prompts to choose settings on; heldout (default): prompts to report on only",
    )
    ap.add_argument("--first-prompt", type=int, default=0, help="start at this index of the set (default 0)")
    ap.add_argument("--size", default=None, help="HxWxF (default: the model's)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument(
        "--variant", action="append", help="METHOD:k=v,... (repeat; default: every method at 2-3 thresholds)"
    )
    ap.add_argument("--output", default="cache_frontier.json")
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="start no new prompt after this many seconds (the table then covers the prompts run)",
    )
    args = ap.parse_args(argv)

    import numpy as np

    from ditattn.attention.context import AttentionSettings
    from ditattn.attention.names import AttentionBackendEnum
    from ditattn.cache.calibration import load_calibration, packaged_calibration
    from ditattn.evaluation.metrics import psnr, ssim
    from ditattn.pipelines.wan import WanPipelineNative
    from ditattn.train.judge import judge
    from ditattn.train.scenes import parse_caption

    settings = AttentionSettings(
        backend=AttentionBackendEnum.from_name(args.attention_backend) if args.attention_backend else None
    )
    pipe = WanPipelineNative.from_pretrained(args.model_path, settings, device=args.device, dtype=args.dtype)
    cal = packaged_calibration(pipe.model_index.name)
    exclude = set(json.load(open(cal))["prompts"]) if cal else set()
    load_calibration(cal) if cal else None
    prompts = select_prompts(args.prompt_set, args.prompts, exclude, args.first_prompt)
    kw = dict(progress=False, seed=args.seed, num_inference_steps=args.steps)
    if args.size:
        h, w, f = (int(v) for v in args.size.lower().split("x"))
        kw.update(height=h, width=w, num_frames=f)
    variants = args.variant or DEFAULT_VARIANTS
    specs = [(v.partition(":")[0], v.partition(":")[2]) for v in variants]
    for name, cfg in specs:  # refuse a bad variant before the first run
        pipe.prepare_cache(name, cfg)

    def verdict(clip, prompt):
        parsed = parse_caption(prompt)
        color, _shape, motion = parsed[0]
        v = judge(clip, color, motion)
        return bool(v.color_ok), bool(v.motion_ok)

    rows = {
        v: {
            "variant": v,
            "psnr": [],
            "ssim": [],
            "forwards": 0,
            "computed": 0,
            "blocks": 0,
            "blocks_done": 0,
            "color_ok": 0,
            "motion_ok": 0,
            "lost": 0,
            "time_s": 0.0,
        }
        for v in ["uncached"] + variants
    }
    t_all = time.perf_counter()
    done = 0
    for i, prompt in enumerate(prompts):
        if args.time_budget_s is not None and time.perf_counter() - t_all > args.time_budget_s:
            print(f"time budget reached after {done} prompts", file=sys.stderr, flush=True)
            break
        done += 1
        t0 = time.perf_counter()
        ref = pipe.generate(prompt, cache_backend="none", **kw)
        ref_clip, r = ref.frames[0], rows["uncached"]
        r["time_s"] += time.perf_counter() - t0
        ref_v = verdict(ref_clip, prompt)
        r["color_ok"] += ref_v[0]
        r["motion_ok"] += ref_v[1]
        for v, (name, cfg) in zip(variants, specs):
            t0 = time.perf_counter()
            res = pipe.generate(prompt, cache_backend=name, cache_backend_config=cfg, **kw)
            row = rows[v]
            row["time_s"] += time.perf_counter() - t0
            row["psnr"].append(min(psnr(res.frames[0], ref_clip), 99.0))  # (no MS-SSIM: it costs more than PSNR)
            row["ssim"].append(ssim(res.frames[0], ref_clip))
            c = res.cache
            row["forwards"] += c["forwards"]
            row["computed"] += c["computed"]
            row["blocks"] += c["blocks_total"]
            row["blocks_done"] += c["blocks_computed"]
            row.setdefault("trace", c["trace"])  # the first prompt's (C computed, R reused)
            got = verdict(res.frames[0], prompt)
            row["color_ok"] += got[0]
            row["motion_ok"] += got[1]
            row["lost"] += sum(a and not b for a, b in zip(ref_v, got))
        print(f"[{i + 1}/{len(prompts)}] {prompt} ({time.perf_counter() - t_all:.0f}s)", file=sys.stderr, flush=True)

    out = []
    n = done
    head = (
        f"{'variant':<52} {'fwd x':>6} {'blk x':>6} {'PSNR':>6} {'min':>6} {'SSIM':>6} {'colour':>7} "
        f"{'motion':>7} {'lost':>5} {'s/clip':>7}"
    )
    lines = [head]
    for v, row in rows.items():
        res = {
            "variant": v,
            "prompts": n,
            "time_s_per_clip": row["time_s"] / n,
            "color_ok": row["color_ok"],
            "motion_ok": row["motion_ok"],
        }
        if v != "uncached":
            res.update(
                forward_ratio=row["forwards"] / max(row["computed"], 1),
                block_ratio=row["blocks"] / max(row["blocks_done"], 1),
                psnr_mean=float(np.mean(row["psnr"])),
                psnr_min=float(np.min(row["psnr"])),
                ssim_mean=float(np.mean(row["ssim"])),
                verdicts_lost=row["lost"],
                trace=row.get("trace"),
            )
        out.append(res)

        def g(k, fmt):
            return format(res[k], fmt) if k in res else "-".rjust(int(fmt.rstrip("dfe").split(".")[0]))

        lines.append(
            f"{v:<52} {g('forward_ratio', '6.2f')} {g('block_ratio', '6.2f')} {g('psnr_mean', '6.2f')} "
            f"{g('psnr_min', '6.2f')} {g('ssim_mean', '6.4f')} {row['color_ok']:>4}/{n:<2} "
            f"{row['motion_ok']:>4}/{n:<2} {g('verdicts_lost', '5d')} {res['time_s_per_clip']:7.2f}"
        )
    print("\n".join(lines))
    meta = {
        "model": pipe.model_index.name,
        "device": str(pipe.device),
        "size": args.size or "default",
        "steps": args.steps or pipe.defaults["num_inference_steps"],
        "seed": args.seed,
        "prompt_set": args.prompt_set,
        "prompts": prompts[:done],
    }
    with open(args.output, "w") as fh:
        json.dump({"meta": meta, "rows": out}, fh, indent=1)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
