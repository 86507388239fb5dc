"""Where does a trained ``ditattn:shapes`` package fall short: the VAE, the motion words, the sampler?

    python bench/shapes_diagnose.py --package DIR vae --size 64x64x9 --n 24
    python bench/shapes_diagnose.py --package DIR contrast --size 64x64x9
    python bench/shapes_diagnose.py --package DIR sweep --size 64x64x9 --guidance 3,5,7 --steps 20,30 --shift 3

``DIR`` holds ``shapes.json`` + ``shapes.safetensors`` (a training run's output).  Three checks,
each printing a table last (and ``--out FILE`` writes the rows as JSON):

- ``vae``: real clips through encode -> decode, judged like generations: per-frame PSNR, and the
  judge's colour / motion verdicts per prompted colour and motion.  What the VAE loses no DiT can
  show, so this is the ceiling of the prompt-following figures.
- ``contrast``: the same noise (seed) under the four direction words for each colour: the mean
  centroid travel per word.  A DiT that reads its motion words moves the shape the prompted way;
  one that does not draws the same clip for all four.
- ``sweep``: prompt following of generated clips over guidance scale x steps x flow shift, on
  :func:`ditattn.train.evaluation.tuning_prompts` (every colour x motion pair, shapes rotating,
  seeds from 100), which leaves out the six prompts of ``tests/test_shapes_model.py``'s semantic
  test, so defaults chosen here are not fitted to the test.

Everything runs with ditattn's native pipeline from the package files; on a CPU use 64x64x9 (a
12-prompt sweep point takes ~30 s on one thread).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

from ditattn.train.evaluation import TUNING_SEED, generate_judged, tuning_prompts
from ditattn.train.judge import judge
from ditattn.train.scenes import COLORS, SHAPES, parse_caption, scene_batch

DIRECTIONS = ("moving left", "moving right", "moving up", "moving down")


def _size(text: str) -> tuple[int, int, int]:
    h, w, f = (int(v) for v in text.split("x"))
    return h, w, f


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",")]


def load_pipe(package: str, cache: str, flow_shift: float | None = None):
    """The native pipeline of ``package`` (CPU float32); ``flow_shift`` replaces the scheduler's."""
    from ditattn.models.shapes import shapes_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    pipe = WanPipelineNative.from_pretrained(shapes_model_path(root=cache, package=package), device="cpu",
                                             dtype=torch.float32)
    if flow_shift is not None:
        make = pipe.components["scheduler"]
        sched_cls, cfg = type(make()), dict(make().config)
        cfg["flow_shift"] = flow_shift
        pipe.components["scheduler"] = lambda: sched_cls.from_config(cfg)
    return pipe


def check_vae(args) -> list[dict]:
    from ditattn.train.shapes import load_package_vae

    vae, _ = load_package_vae(args.package, torch.device("cpu"))
    h, w, f = args.size
    clips, caps, _ = scene_batch(args.n, f, h, w, torch.Generator().manual_seed(args.seed), p_two=0.0)
    t0 = time.perf_counter()
    with torch.no_grad():
        rec = vae.decode(vae.encode(clips).latent_dist.mode()).sample.clamp(-1, 1)
    mse = ((rec - clips) / 2).pow(2).mean(dim=(0, 1, 3, 4))
    psnr = [round(float(10 * torch.log10(1 / m)), 1) for m in mse]
    frames = ((rec + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 4, 1).numpy()
    rows = []
    for cap, fr in zip(caps, frames):
        (c, s, m), = parse_caption(cap)
        v = judge(fr, c, m)
        rows.append(dict(prompt=cap, color=c, motion=m, color_ok=v.color_ok, motion_ok=v.motion_ok,
                         dominant=v.dominant, dx=round(v.dx, 3), dy=round(v.dy, 3), growth=round(v.growth, 3)))
    print(f"encode + decode of {args.n} clips at {h}x{w}x{f}: {time.perf_counter() - t0:.1f} s")
    print("PSNR per frame (dB):", " ".join(f"{p:.1f}" for p in psnr))
    _table(rows, "color")
    _table(rows, "motion")
    return [dict(psnr_per_frame=psnr)] + rows


def check_contrast(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        pipe = load_pipe(args.package, cache)
        colors = list(COLORS)
        for k, c in enumerate(colors):
            s = SHAPES[k % len(SHAPES)]
            prompts = [f"a {c} {s} {m}" for m in DIRECTIONS]
            res = pipe.generate(prompts, seed=[args.seed + k] * len(prompts), height=args.size[0],
                                width=args.size[1], num_frames=args.size[2], num_inference_steps=args.steps[0],
                                guidance_scale=args.guidance[0], progress=False)
            for m, fr in zip(DIRECTIONS, res.frames):
                v = judge(fr, c, m)
                rows.append(dict(prompt=f"a {c} {s} {m}", motion=m, seed=args.seed + k, dx=round(v.dx, 3),
                                 dy=round(v.dy, 3), motion_ok=v.motion_ok, color_ok=v.color_ok))
    print(f"{'prompt':34s} {'seed':>4s} {'dx':>6s} {'dy':>6s} ok")
    for r in rows:
        print(f"{r['prompt']:34s} {r['seed']:4d} {r['dx']:6.2f} {r['dy']:6.2f} {'yes' if r['motion_ok'] else 'no'}")
    print(f"\n{'word':14s} {'mean dx':>8s} {'mean dy':>8s} {'motion ok':>9s}")
    for m in DIRECTIONS:
        sel = [r for r in rows if r["motion"] == m]
        print(f"{m:14s} {np.mean([r['dx'] for r in sel]):8.3f} {np.mean([r['dy'] for r in sel]):8.3f} "
              f"{sum(r['motion_ok'] for r in sel):4d}/{len(sel)}")
    return rows


def check_sweep(args) -> list[dict]:
    from ditattn.models.shapes import read_meta

    items = tuning_prompts(args.n)
    shifts = [read_meta(args.package)["scheduler"]["flow_shift"] if s is None else s for s in args.shift]
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for shift in shifts:
            pipe = load_pipe(args.package, cache, flow_shift=shift)
            for guidance, steps in itertools.product(args.guidance, args.steps):
                t0 = time.perf_counter()
                details = generate_judged(pipe, items, args.seed, args.size, int(steps), guidance, chunk=12)
                row = dict(shift=shift, guidance=guidance, steps=int(steps), n=len(items),
                           color=sum(bool(d["color_ok"]) for d in details),
                           motion=sum(bool(d["motion_ok"]) for d in details),
                           both=sum(bool(d["ok"]) for d in details), seconds=round(time.perf_counter() - t0, 1),
                           details=details)
                rows.append(row)
                print(f"shift {shift:g} guidance {guidance:g} steps {steps:g}: colour {row['color']}/{row['n']} "
                      f"motion {row['motion']}/{row['n']} both {row['both']}/{row['n']} ({row['seconds']} s)",
                      flush=True)
    print(f"\n{'shift':>5s} {'guid.':>5s} {'steps':>5s} {'colour':>7s} {'motion':>7s} {'both':>7s}")
    for r in rows:
        print(f"{r['shift']:5g} {r['guidance']:5g} {r['steps']:5d} {r['color']:3d}/{r['n']:<3d} "
              f"{r['motion']:3d}/{r['n']:<3d} {r['both']:3d}/{r['n']:<3d}")
    return rows


def _table(rows: list[dict], key: str) -> None:
    print(f"\n{key:14s} {'colour ok':>9s} {'motion ok':>9s}")
    for value in sorted({r[key] for r in rows}):
        sel = [r for r in rows if r[key] == value]
        ok_c, ok_m = sum(r["color_ok"] for r in sel), sum(r["motion_ok"] for r in sel)
        print(f"{value:14s} {ok_c:4d}/{len(sel):<4d} {ok_m:4d}/{len(sel)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--package", required=True, help="folder with shapes.json + shapes.safetensors")
    p.add_argument("check", choices=("vae", "contrast", "sweep"))
    p.add_argument("--size", type=_size, default=(64, 64, 9), help="HxWxF (default 64x64x9)")
    p.add_argument("--n", type=int, default=12, help="clips (vae) or prompts (sweep); default 12")
    p.add_argument("--seed", type=int, default=TUNING_SEED)
    p.add_argument("--guidance", type=_floats, default=[5.0], help="comma-separated (contrast: the first)")
    p.add_argument("--steps", type=_floats, default=[20], help="comma-separated (contrast: the first)")
    p.add_argument("--shift", type=_floats, default=[None], help="comma-separated flow shifts (default: the package's)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    for path in ("shapes.json", "shapes.safetensors"):
        if not os.path.isfile(os.path.join(args.package, path)):
            p.error(f"--package {args.package}: no {path} there")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {"vae": check_vae, "contrast": check_contrast, "sweep": check_sweep}[args.check](args)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
