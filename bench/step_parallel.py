"""CFG-parallel denoising and parallel VAE decode: whole generations on 1..N GPUs.

Each layout runs one generation of the native pipeline on its ranks (``ditattn.distributed.launch``:
one process per GPU, NCCL) after a warm-up generation, and reports rank 0's stage times (text,
denoise, decode, total) and the largest difference of its frames from the one-process frames (the
one-process run with ``--vae-tiling`` for layouts with ``+vae``).  A layout is ``cCuUrR`` (CFG
degree 1 or 2, Ulysses, ring; ranks = C x U x R), with ``+vae`` for the decode's tiles spread over the
ranks.  The model is a built-in or diffusers-format folder, or ``random:ARCH``: a Wan 2.1 folder of
that DiT architecture with random weights and the real VAE (bench/generate.py builds it; nothing is
downloaded).

    python bench/step_parallel.py --model-path random:1.3b --res 480p --frames 81 --steps 4 \\
        --layouts c1u1r1,c2u1r1,c1u2r1,c1u1r1+vae,c1u2r1+vae,c2u2r1+vae,c2u4r1+vae --out $OUT/step_parallel.json

CPU smoke run (gloo ranks, the tiny model, small VAE tiles so the decode splits):

    python bench/step_parallel.py --smoke

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc. are set below if the environment lacks them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import WAN_RES  # noqa: E402

LAYOUT = re.compile(r"c([12])u(\d+)r(\d+)(\+vae)?$")


def parse_layout(text: str) -> tuple[int, int, int, bool]:
    """``c2u2r1+vae`` -> ``(2, 2, 1, True)``."""
    m = LAYOUT.match(text.strip())
    if not m:
        raise SystemExit(f"bad layout {text!r}; expected cCuUrR[+vae], e.g. c2u2r1+vae")
    return int(m[1]), int(m[2]), int(m[3]), bool(m[4])


def _generate(rank, spec: dict, vae_parallel: bool, tiled: bool):
    """One rank: build the pipeline, a warm-up generation, a timed one; rank 0 returns times and frames."""
    from ditattn.attention.context import AttentionSettings
    from ditattn.pipelines.wan import WanPipelineNative

    g = rank.groups if rank is not None else None
    settings = AttentionSettings(ulysses_degree=g.ulysses_degree if g else 1, ring_degree=g.ring_degree if g else 1)
    device = rank.device if rank is not None else spec["device"]
    pipe = WanPipelineNative.from_pretrained(
        spec["model"], settings, device=device, dtype=spec["dtype"], vae_parallel=vae_parallel
    )
    if tiled or vae_parallel:
        pipe.components["vae"].enable_tiling(**spec["tiles"])
    kw = dict(
        height=spec["height"],
        width=spec["width"],
        num_frames=spec["frames"],
        num_inference_steps=spec["steps"],
        guidance_scale=spec["guidance"],
        seed=0,
        output_type="float",
        progress=False,
    )
    pipe.generate(spec["prompt"], **{**kw, "num_inference_steps": 1})  # warm-up: kernels, allocator, groups
    res = pipe.generate(spec["prompt"], **kw)
    if rank is not None and rank.rank != 0:
        return None
    return {"timings": res.timings, "frames": res.frames, "peak_memory": res.peak_memory}


def run_layout(spec: dict, cfg: int, u: int, r: int, vae: bool) -> dict:
    """One layout's rank-0 result (one process for ``c1u1r1`` without ``+vae``)."""
    from ditattn.distributed.launch import launch

    n = cfg * u * r
    if n == 1:
        return _generate(None, spec, False, vae)
    return launch(
        _generate,
        n,
        args=(spec, vae, False),
        device=spec["device"],
        ulysses_degree=u,
        ring_degree=r,
        cfg_degree=cfg,
        timeout_s=1800,
    )[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-path",
        default="random:1.3b",
        help="a built-in model, a diffusers-format Wan folder, or random:ARCH (default random:1.3b)",
    )
    ap.add_argument("--res", default="480p", choices=sorted(WAN_RES))
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--layouts", default="c1u1r1,c2u1r1,c1u2r1,c1u1r1+vae,c1u2r1+vae,c2u2r1+vae")
    ap.add_argument(
        "--vae-tile",
        default="256,192",
        metavar="SIZE,STRIDE",
        help="VAE tile size and stride in pixels (diffusers' defaults: 256,192)",
    )
    ap.add_argument("--folder", default=None, help="where random:ARCH is written / reused (default: a temp dir)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check: ditattn:tiny-wan at 48x64x9, 2 steps, 32/24-pixel tiles, layouts up to 4 ranks",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    gpus = torch.cuda.device_count()
    device = "cpu" if args.smoke or not gpus else "cuda"
    h, w = WAN_RES[args.res]
    model, frames, steps, tile = args.model_path, args.frames, args.steps, args.vae_tile
    layouts = args.layouts
    if args.smoke:
        model, h, w, frames, steps, tile = "ditattn:tiny-wan", 48, 64, 9, 2, "32,24"
        layouts = "c1u1r1,c1u1r1+vae,c2u1r1,c1u2r1+vae,c2u2r1+vae"
    if model.startswith("random:"):
        from generate import build_folder

        folder = args.folder or os.path.join(tempfile.mkdtemp(), "wan-random")
        if not os.path.exists(os.path.join(folder, "model_index.json")):
            build_folder(folder, model.split(":", 1)[1])
        model = folder
    size, stride = (int(v) for v in tile.split(","))
    spec = dict(
        model=model,
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        height=h,
        width=w,
        frames=frames,
        steps=steps,
        guidance=args.guidance,
        prompt="a red fox running through fresh snow",
        tiles=dict(
            tile_sample_min_height=size,
            tile_sample_min_width=size,
            tile_sample_stride_height=stride,
            tile_sample_stride_width=stride,
        ),
    )
    rows, refs = [], {}
    for text in layouts.split(","):
        cfg, u, r, vae = parse_layout(text)
        n = cfg * u * r
        if device == "cuda" and n > gpus:
            print(f"skip {text}: {n} GPUs, this machine has {gpus}", flush=True)
            continue
        if vae not in refs:  # the one-process reference: plain decode, or tiled for +vae layouts
            refs[vae] = run_layout(spec, 1, 1, 1, vae)
        res = refs[vae] if n == 1 else run_layout(spec, cfg, u, r, vae)
        base = refs[vae]["timings"]
        t = res["timings"]
        row = {
            "layout": text,
            "ranks": n,
            **{k: round(v, 4) for k, v in t.items()},
            "speedup_total": base["total"] / t["total"],
            "speedup_denoise": base["denoise"] / t["denoise"],
            "speedup_decode": base["decode"] / t["decode"],
            "max_abs_diff_vs_1": float(np.abs(res["frames"] - refs[vae]["frames"]).max()),
            "peak_gib": None if res["peak_memory"] is None else res["peak_memory"] / 2**30,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {
                    "model": args.model_path,
                    "size": [h, w, frames],
                    "steps": steps,
                    "guidance": args.guidance,
                    "vae_tile": tile,
                    "device": device,
                    "rows": rows,
                },
                fh,
                indent=2,
            )
    print(
        f"\n{'layout':<14} {'ranks':>5} {'denoise s':>10} {'decode s':>9} {'total s':>8} {'x total':>8} "
        f"{'x decode':>9} {'max diff':>9}"
    )
    for r in rows:
        print(
            f"{r['layout']:<14} {r['ranks']:>5} {r['denoise']:10.3f} {r['decode']:9.3f} {r['total']:8.3f} "
            f"{r['speedup_total']:8.2f} {r['speedup_decode']:9.2f} {r['max_abs_diff_vs_1']:9.1e}"
        )
    if args.smoke:
        worst = max(r["max_abs_diff_vs_1"] for r in rows)
        assert worst <= 1e-5, f"a layout differs from the one-process frames by {worst}"
        print("smoke: every layout equals the one-process frames (<= 1e-5)")


if __name__ == "__main__":
    main()
