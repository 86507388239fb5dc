"""Judging a trained ``ditattn:shapes`` package: sample grid, prompt following, guidance tuning.

Everything here generates with ditattn's native pipeline from the package files a training run
wrote (``shapes.json`` + ``shapes.safetensors`` in a folder) and judges the clips with
:func:`ditattn.train.judge.judge`.

Two prompt sets:

- :func:`evaluate`'s: every colour x motion in turn with random shapes (the figures logged since
  the first GPU run, comparable across runs);
- :func:`tuning_prompts`: the same grid *minus* :data:`HELD_OUT`, the six prompts of the semantic
  test in ``tests/models/test_shapes_model.py``.  Sampling defaults chosen on this set
  (:func:`tune_guidance`) are not fitted to the test that judges them.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Optional, Sequence

import numpy as np
import torch

from ditattn.train.judge import judge
from ditattn.train.recipe import Recipe
from ditattn.train.scenes import COLORS, MOTIONS, SHAPES, parse_caption

# the semantic test's prompts (tests/models/test_shapes_model.py::SEMANTIC, checked equal by a test): never tuned on
HELD_OUT = (
    ("red", "circle", "moving right"),
    ("blue", "square", "moving up"),
    ("yellow", "triangle", "growing"),
    ("green", "circle", "moving down"),
    ("white", "square", "moving left"),
    ("red", "triangle", "shrinking"),
)
TUNING_SEED = 100  # tuning prompt i gets seed TUNING_SEED + i (the semantic test uses 1..6)
TUNING_N = 24  # prompts the guidance scale is tuned on
SHAPE_EVAL_SEED = 1000  # held-out prompt i gets seed SHAPE_EVAL_SEED + i; also seeds the prompt draw


def tuning_prompts(n: int) -> list[tuple[str, str, str]]:
    """``n`` single-shape ``(colour, shape, motion)`` triples: colour x motion pairs in turn, shapes
    rotating, leaving out :data:`HELD_OUT`."""
    if n < 0:
        raise ValueError(f"tuning_prompts: n must be >= 0, got {n}")
    out: list[tuple[str, str, str]] = []
    colors = list(COLORS)
    for i in itertools.count():
        if len(out) == n:
            return out
        c, m = colors[i % len(colors)], MOTIONS[(i // len(colors)) % len(MOTIONS)]
        s = SHAPES[(i + i // (len(colors) * len(MOTIONS))) % len(SHAPES)]
        if (c, s, m) not in HELD_OUT:
            out.append((c, s, m))
    raise AssertionError("unreachable")


def held_out_prompts(n: int = 30, seed: int = SHAPE_EVAL_SEED) -> list[tuple[str, str, str]]:
    """``n`` single-shape ``(colour, shape, motion)`` triples that neither the semantic test
    (:data:`HELD_OUT`) nor guidance tuning (``tuning_prompts(TUNING_N)``) uses: shapes in turn, each
    shape's colour x motion pairs in a seeded random order (deterministic; at most 60 exist)."""
    used = set(HELD_OUT) | set(tuning_prompts(TUNING_N))
    g = torch.Generator().manual_seed(seed)
    pools = []
    for s in SHAPES:
        free = [(c, s, m) for c in COLORS for m in MOTIONS if (c, s, m) not in used]
        pools.append([free[int(i)] for i in torch.randperm(len(free), generator=g)])
    out = [p for row in itertools.zip_longest(*pools) for p in row if p is not None]
    if not 0 <= n <= len(out):
        raise ValueError(f"held_out_prompts: n must be in 0..{len(out)}, got {n}")
    return out[:n]


def load_pipeline(package: str, cache: str, device: torch.device):
    """ditattn's native pipeline for the package files in ``package`` (materialised under ``cache``)."""
    from ditattn.models.shapes import shapes_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    return WanPipelineNative.from_pretrained(shapes_model_path(root=cache, package=package), device=device)


def _verdict_row(prompt: str, frames: np.ndarray) -> dict:
    parsed = parse_caption(prompt) or []
    v = judge(frames, parsed[0][0], parsed[0][2], parsed[0][1]) if len(parsed) == 1 else None
    row = {
        "prompt": prompt,
        "ok": None,
        "color_ok": None,
        "motion_ok": None,
        "dominant": None,
        "dx": None,
        "dy": None,
        "growth": None,
        "shape_ok": None,
        "shape": None,
        "fill": None,
    }
    if v is not None:
        row.update(
            ok=v.ok,
            color_ok=v.color_ok,
            motion_ok=v.motion_ok,
            dominant=v.dominant,
            dx=round(v.dx, 3),
            dy=round(v.dy, 3),
            growth=round(v.growth, 3),
            shape_ok=v.shape_ok,
            shape=v.shape,
            fill=None if np.isnan(v.fill) else round(v.fill, 3),
        )
    return row


def sample_prompts_grid(
    out: str,
    recipe: Recipe,
    device: torch.device,
    prompts,
    seed: int = 0,
    frames_shown: int = 5,
    sampling: Optional[dict] = None,
) -> list[dict]:
    """Generate ``prompts`` from the package files in ``out`` at the sampling defaults (``sampling``
    overrides the recipe's); save ``samples.png`` (one row per prompt) and return the judge's verdicts."""
    from PIL import Image, ImageDraw

    d = dict(recipe.sampling_defaults, **(sampling or {}))
    with tempfile.TemporaryDirectory() as cache:
        pipe = load_pipeline(out, cache, device)
        res = pipe.generate(
            list(prompts),
            seed=seed,
            height=d["height"],
            width=d["width"],
            num_frames=d["num_frames"],
            num_inference_steps=d["num_inference_steps"],
            guidance_scale=d["guidance_scale"],
            progress=False,
        )
    frames = res.frames  # [N, F, H, W, 3]
    F_ = frames.shape[1]
    picks = sorted({round(i * (F_ - 1) / max(frames_shown - 1, 1)) for i in range(frames_shown)})
    H, W = frames.shape[2:4]
    label_h = 14
    grid = Image.new("RGB", (W * len(picks), (H + label_h) * len(prompts)), "white")
    draw = ImageDraw.Draw(grid)
    verdicts = []
    for i, prompt in enumerate(prompts):
        row = _verdict_row(prompt, frames[i])
        verdicts.append({k: row[k] for k in ("prompt", "ok", "dominant", "dx", "dy", "growth", "shape_ok", "shape")})
        y = i * (H + label_h)
        mark = "" if row["ok"] is None else ("  [ok]" if row["ok"] else "  [wrong]")
        draw.text((2, y + 1), prompt + mark, fill=(0, 0, 0))
        for j, f in enumerate(picks):
            grid.paste(Image.fromarray(np.ascontiguousarray(frames[i, f])), (j * W, y + label_h))
    grid.save(os.path.join(out, "samples.png"))
    return verdicts


def generate_judged(
    pipe,
    items: Sequence[tuple[str, str, str]],
    seed: int,
    size: tuple[int, int, int],
    steps: int,
    guidance: float,
    chunk: int = 8,
    flow_shift: Optional[float] = None,
    sampler: Optional[dict] = None,
) -> list[dict]:
    """Generate ``"a {colour} {shape} {motion}"`` for each item (item ``i`` with seed ``seed + i``,
    whatever the chunking) at ``size = (height, width, frames)`` (``flow_shift``: the sampler's, None
    = the package's; ``sampler``: more keyword arguments of the pipeline's ``generate``, e.g.
    ``{"scheduler": "flow_euler", "cfg_interval": "0.1:1"}``); the judge's verdict rows."""
    h, w, f = size
    rows = []
    for start in range(0, len(items), chunk):
        part = [f"a {c} {s} {m}" for c, s, m in items[start : start + chunk]]
        res = pipe.generate(
            part,
            seed=[seed + start + i for i in range(len(part))],
            height=h,
            width=w,
            num_frames=f,
            num_inference_steps=steps,
            guidance_scale=guidance,
            flow_shift=flow_shift,
            progress=False,
            **(sampler or {}),
        )
        rows += [_verdict_row(p, fr) for p, fr in zip(part, res.frames)]
    return rows


def evaluate(
    out: str,
    recipe: Recipe,
    device: torch.device,
    n: int,
    seed: int = 1234,
    size: int = 64,
    frames: int = 9,
    guidance: Optional[float] = None,
) -> dict:
    """Prompt-following of the exported model: ``n`` single-shape prompts (every colour and motion
    in turn, random shapes), judged for colour and motion. Returns accuracies and the details."""
    g = torch.Generator().manual_seed(seed)
    colors = list(COLORS)
    items = []
    for i in range(n):
        c, m = colors[i % len(colors)], MOTIONS[(i // len(colors)) % len(MOTIONS)]
        items.append((c, SHAPES[int(torch.randint(0, len(SHAPES), (1,), generator=g))], m))
    d = recipe.sampling_defaults
    guidance = d["guidance_scale"] if guidance is None else guidance
    with tempfile.TemporaryDirectory() as cache:
        pipe = load_pipeline(out, cache, device)
        # chunks of 8 with seed + start for the whole chunk, as since the first GPU run (comparable figures)
        results = []
        for start in range(0, n, 8):
            chunk = items[start : start + 8]
            res = pipe.generate(
                [f"a {c} {s} {m}" for c, s, m in chunk],
                seed=seed + start,
                height=size,
                width=size,
                num_frames=frames,
                num_inference_steps=d["num_inference_steps"],
                guidance_scale=guidance,
                progress=False,
            )
            for (c, s, m), fr in zip(chunk, res.frames):
                v = judge(fr, c, m, s)
                results.append(
                    {
                        "prompt": f"a {c} {s} {m}",
                        "color_ok": v.color_ok,
                        "motion_ok": v.motion_ok,
                        "shape_ok": v.shape_ok,
                        "shape": v.shape,
                    }
                )
    acc = {k: sum(bool(r[k]) for r in results) / max(len(results), 1) for k in ("color_ok", "motion_ok", "shape_ok")}
    return {
        "size": [size, size, frames],
        "n": n,
        "guidance": guidance,
        "color_accuracy": acc["color_ok"],
        "motion_accuracy": acc["motion_ok"],
        "shape_accuracy": acc["shape_ok"],
        "results": results,
    }


def evaluate_held_out(
    pipe,
    sizes: Sequence[tuple[int, int, int]],
    n: int = 30,
    steps: int = 20,
    guidance: float = 7.0,
    seed: int = SHAPE_EVAL_SEED,
    flow_shift: Optional[float] = None,
    first: int = 0,
    sampler: Optional[dict] = None,
) -> list[dict]:
    """Prompt following on :func:`held_out_prompts` ``first .. first + n - 1`` (prompt ``i`` with seed
    ``seed + i``, so a prompt keeps its seed whatever ``first``: settings picked on the first 30 can be
    checked on prompts 30-59) at each ``(height, width, frames)`` of ``sizes`` (``flow_shift``: the
    sampler's, None = the package's; ``sampler``: as :func:`generate_judged`): per size ``{"size", "n", "first",
    "seed", "guidance", "steps", "flow_shift", "sampler", "shape_accuracy", "color_accuracy", "motion_accuracy",
    "results"}`` (the judge's rows; shape judged as in :func:`ditattn.train.judge.judge_shape`)."""
    if first < 0:
        raise ValueError(f"evaluate_held_out: first must be >= 0, got {first}")
    items = held_out_prompts(first + n)[first:]
    out = []
    for size in sizes:
        rows = generate_judged(
            pipe, items, seed + first, tuple(size), steps, guidance, flow_shift=flow_shift, sampler=sampler
        )
        acc = {k: sum(bool(r[k]) for r in rows) / max(len(rows), 1) for k in ("shape_ok", "color_ok", "motion_ok")}
        out.append(
            {
                "size": list(size),
                "n": n,
                "first": first,
                "seed": seed,
                "guidance": guidance,
                "steps": steps,
                "flow_shift": flow_shift,
                "sampler": dict(sampler or {}),
                "shape_accuracy": acc["shape_ok"],
                "color_accuracy": acc["color_ok"],
                "motion_accuracy": acc["motion_ok"],
                "results": rows,
            }
        )
    return out


def format_held_out(ev: dict) -> str:
    """One line for an :func:`evaluate_held_out` entry."""
    shift = "" if ev.get("flow_shift") is None else f", flow shift {ev['flow_shift']:g}"
    shift += "".join(f", {k.replace('_', ' ')} {v}" for k, v in (ev.get("sampler") or {}).items())
    first = ev.get("first", 0)
    which = f"{ev['n']}" if not first else f"{first}-{first + ev['n'] - 1}"
    if ev.get("seed", SHAPE_EVAL_SEED) != SHAPE_EVAL_SEED:
        which += f", seeds from {ev['seed']}"
    return (
        f"held-out prompts ({which} at {'x'.join(map(str, ev['size']))}, {ev['steps']} steps, guidance "
        f"{ev['guidance']:g}{shift}): shape {100 * ev['shape_accuracy']:.0f} %, "
        f"colour {100 * ev['color_accuracy']:.0f} %, motion {100 * ev['motion_accuracy']:.0f} %"
    )


def tune_guidance(
    out: str,
    recipe: Recipe,
    device: torch.device,
    grid: Sequence[float],
    n: int = TUNING_N,
    sampling: Optional[dict] = None,
) -> dict:
    """Prompt following on :func:`tuning_prompts` (``n`` of them) at the sampling default size for
    each guidance scale in ``grid``; picks the scale with the most clips right in colour *and*
    motion (ties: the most with the right shape, then the one nearest the recipe's default).  Returns
    ``{"best": scale, "n": n, "rows": [{"guidance", "color", "motion", "both", "shape"}, ...],
    "size": [h, w, f]}``."""
    if not grid:
        raise ValueError("tune_guidance: the guidance grid is empty")
    d = dict(recipe.sampling_defaults, **(sampling or {}))
    items = tuning_prompts(n)
    size = (d["height"], d["width"], d["num_frames"])
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        pipe = load_pipeline(out, cache, device)
        for scale in grid:
            verdicts = generate_judged(pipe, items, TUNING_SEED, size, d["num_inference_steps"], float(scale))
            rows.append(
                {
                    "guidance": float(scale),
                    "color": sum(bool(v["color_ok"]) for v in verdicts),
                    "motion": sum(bool(v["motion_ok"]) for v in verdicts),
                    "both": sum(bool(v["ok"]) for v in verdicts),
                    "shape": sum(bool(v["shape_ok"]) for v in verdicts),
                }
            )
    default = recipe.sampling_defaults["guidance_scale"]
    best = max(rows, key=lambda r: (r["both"], r["shape"], -abs(r["guidance"] - default)))
    return {"best": best["guidance"], "n": n, "size": list(size), "rows": rows}


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    """``"128x128x17,256x256x33"`` -> ``[(128, 128, 17), (256, 256, 33)]`` (height, width: positive
    multiples of 16; frames 1 + 4k)."""
    out = []
    for item in text.split(","):
        try:
            h, w, f = (int(v) for v in item.strip().split("x"))
        except ValueError:
            raise ValueError(f"bad size {item!r}; expected HxWxF, e.g. 128x128x17") from None
        if h <= 0 or w <= 0 or h % 16 or w % 16 or f < 1 or (f - 1) % 4:
            raise ValueError(f"size {item!r}: height/width must be positive multiples of 16, frames 1 + 4k")
        out.append((h, w, f))
    return out


def main(argv=None) -> int:
    """``python -m ditattn.train.evaluation``: a package's shape / colour / motion accuracy on held-out prompts."""
    import argparse
    import json
    import sys

    from ditattn.runconfig.sampling import SCHEDULERS

    p = argparse.ArgumentParser(
        prog="python -m ditattn.train.evaluation",
        description="Judge a ditattn:shapes package on single-shape prompts that neither the semantic test nor "
        "guidance tuning uses: shape, colour and motion accuracy per size.",
    )
    p.add_argument(
        "--package",
        default=None,
        metavar="DIR",
        help="folder with shapes.json + shapes.safetensors (default: the weights in the package)",
    )
    p.add_argument(
        "--sizes",
        default="128x128x17,256x256x33",
        metavar="HxWxF,...",
        help="sizes to generate at (default 128x128x17,256x256x33)",
    )
    p.add_argument("--prompts", type=int, default=30, help="held-out prompts per size (1-60, default 30)")
    p.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        metavar="K",
        help=f"start at held-out prompt K (default 0; prompt i always has seed {SHAPE_EVAL_SEED} + i): "
        "--first-prompt 30 --prompts 30 checks on fresh prompts a setting chosen on the first 30",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=SHAPE_EVAL_SEED,
        help=f"noise seed of held-out prompt 0 (prompt i gets SEED + i; default {SHAPE_EVAL_SEED}): another "
        "seed draws fresh clips of the same prompts, to check on unseen clips a setting chosen on these",
    )
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the package's)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the package's)")
    p.add_argument(
        "--flow-shift",
        type=float,
        default=None,
        metavar="X",
        help="the sampler's timestep shift (default: the package's scheduler, 3.0)",
    )
    p.add_argument(
        "--scheduler",
        default=None,
        choices=SCHEDULERS,
        help="the sampler (default: the package's, unipc)",
    )
    p.add_argument(
        "--cfg-interval",
        default=None,
        metavar="START:END",
        help="guide only the steps i of n with START <= i/n < END (default: every step), as generate's flag",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default cuda when available)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results (every prompt's verdict)")
    args = p.parse_args(argv)
    from ditattn.models.shapes import PACKAGED_DIR, read_meta
    from ditattn.pipelines.loading import parse_device

    package = args.package or PACKAGED_DIR
    try:
        sizes = parse_sizes(args.sizes)
        if not 1 <= args.prompts <= 60:
            raise ValueError(f"--prompts must be in 1..60, got {args.prompts}")
        if not 0 <= args.first_prompt <= 60 - args.prompts:
            raise ValueError(
                f"--first-prompt must be in 0..{60 - args.prompts} with --prompts {args.prompts} (60 held-out "
                f"prompts exist), got {args.first_prompt}"
            )
        if args.flow_shift is not None and not args.flow_shift > 0:
            raise ValueError(f"--flow-shift must be > 0, got {args.flow_shift}")
        sampler = {k: v for k, v in (("scheduler", args.scheduler), ("cfg_interval", args.cfg_interval)) if v}
        if args.cfg_interval:
            from ditattn.runconfig.checks import fraction_interval

            sampler["cfg_interval"] = fraction_interval(args.cfg_interval)
        device = parse_device(args.device)
        d = read_meta(package)["sampling_defaults"]
    except ValueError as exc:  # AttentionConfigError included: says what was wrong and what is accepted
        print(f"error: {exc}", file=sys.stderr)
        return 2
    steps = args.steps or d["num_inference_steps"]
    guidance = d["guidance_scale"] if args.guidance is None else args.guidance
    with tempfile.TemporaryDirectory() as cache:
        pipe = load_pipeline(package, cache, device)
        evals = []
        for size in sizes:
            ev = evaluate_held_out(
                pipe,
                [size],
                args.prompts,
                steps,
                guidance,
                seed=args.seed,
                flow_shift=args.flow_shift,
                first=args.first_prompt,
                sampler=sampler,
            )[0]
            print(format_held_out(ev), flush=True)
            evals.append(ev)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"package": package, "evaluations": evals}, fh, indent=1)
    return 0


def parse_guidance_grid(text: str):
    """``"auto"`` -> ``"auto"``, ``"off"`` -> ``()``, ``"3,5,7"`` -> ``(3.0, 5.0, 7.0)`` (each > 1)."""
    if text in ("auto", "off"):
        return text if text == "auto" else ()
    try:
        grid = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--tune-guidance: bad value {text!r}; expected auto, off or scales like 3,5,7,9") from None
    if not grid or any(g <= 1.0 for g in grid):
        raise ValueError(f"--tune-guidance: {text!r}: every scale must be above 1 (classifier-free guidance)")
    return grid


def grid_edge_note(best: float, grid) -> Optional[str]:
    """A warning when the tuned guidance scale is the smallest or largest of a grid of several: the best
    scale may lie beyond what was tried.  None when it is inside the grid (or the grid has one scale)."""
    grid = sorted(set(grid))
    if len(grid) < 2 or grid[0] < best < grid[-1]:
        return None
    side, beyond = ("smallest", {best - 1.0, best - 0.5}) if best == grid[0] else ("largest", {best + 2.0, best + 4.0})
    beyond = {g for g in beyond if g > 1.0} - set(grid)  # classifier-free guidance needs a scale above 1
    if not beyond:
        return None
    hint = ",".join(f"{g:g}" for g in sorted({*grid, *beyond}))
    return (
        f"guidance {best:g} is the {side} scale tried ({grid[0]:g}-{grid[-1]:g}); a scale beyond it may do "
        f"better: tune again with --tune-guidance {hint}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
