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
HELD_OUT = (("red", "circle", "moving right"), ("blue", "square", "moving up"), ("yellow", "triangle", "growing"),
            ("green", "circle", "moving down"), ("white", "square", "moving left"), ("red", "triangle", "shrinking"))
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


def _pipeline(package: str, cache: str, device: torch.device):
    from ditattn.models.shapes import shapes_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    return WanPipelineNative.from_pretrained(shapes_model_path(root=cache, package=package), device=device)


def _verdict_row(prompt: str, frames: np.ndarray) -> dict:
    parsed = parse_caption(prompt) or []
    v = judge(frames, parsed[0][0], parsed[0][2]) if len(parsed) == 1 else None
    return {"prompt": prompt, "ok": None if v is None else v.ok, "color_ok": None if v is None else v.color_ok,
            "motion_ok": None if v is None else v.motion_ok, "dominant": None if v is None else v.dominant,
            "dx": None if v is None else round(v.dx, 3), "dy": None if v is None else round(v.dy, 3),
            "growth": None if v is None else round(v.growth, 3)}


def sample_prompts_grid(out: str, recipe: Recipe, device: torch.device, prompts, seed: int = 0,
                        frames_shown: int = 5, sampling: Optional[dict] = None) -> list[dict]:
    """Generate ``prompts`` from the package files in ``out`` at the sampling defaults (``sampling``
    overrides the recipe's); save ``samples.png`` (one row per prompt) and return the judge's verdicts."""
    from PIL import Image, ImageDraw

    d = dict(recipe.sampling_defaults, **(sampling or {}))
    with tempfile.TemporaryDirectory() as cache:
        pipe = _pipeline(out, cache, device)
        res = pipe.generate(list(prompts), seed=seed, height=d["height"], width=d["width"],
                            num_frames=d["num_frames"], num_inference_steps=d["num_inference_steps"],
                            guidance_scale=d["guidance_scale"], progress=False)
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
        verdicts.append({k: row[k] for k in ("prompt", "ok", "dominant", "dx", "dy", "growth")})
        y = i * (H + label_h)
        mark = "" if row["ok"] is None else ("  [ok]" if row["ok"] else "  [wrong]")
        draw.text((2, y + 1), prompt + mark, fill=(0, 0, 0))
        for j, f in enumerate(picks):
            grid.paste(Image.fromarray(np.ascontiguousarray(frames[i, f])), (j * W, y + label_h))
    grid.save(os.path.join(out, "samples.png"))
    return verdicts


def generate_judged(pipe, items: Sequence[tuple[str, str, str]], seed: int, size: tuple[int, int, int], steps: int,
                    guidance: float, chunk: int = 8) -> list[dict]:
    """Generate ``"a {colour} {shape} {motion}"`` for each item (item ``i`` with seed ``seed + i``,
    whatever the chunking) at ``size = (height, width, frames)``; the judge's verdict rows."""
    h, w, f = size
    rows = []
    for start in range(0, len(items), chunk):
        part = [f"a {c} {s} {m}" for c, s, m in items[start:start + chunk]]
        res = pipe.generate(part, seed=[seed + start + i for i in range(len(part))], height=h, width=w, num_frames=f,
                            num_inference_steps=steps, guidance_scale=guidance, progress=False)
        rows += [_verdict_row(p, fr) for p, fr in zip(part, res.frames)]
    return rows


def evaluate(out: str, recipe: Recipe, device: torch.device, n: int, seed: int = 1234, size: int = 64,
             frames: int = 9, guidance: Optional[float] = None) -> dict:
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
        pipe = _pipeline(out, cache, device)
        # chunks of 8 with seed + start for the whole chunk, as since the first GPU run (comparable figures)
        results = []
        for start in range(0, n, 8):
            chunk = items[start:start + 8]
            res = pipe.generate([f"a {c} {s} {m}" for c, s, m in chunk], seed=seed + start, height=size, width=size,
                                num_frames=frames, num_inference_steps=d["num_inference_steps"],
                                guidance_scale=guidance, progress=False)
            for (c, s, m), fr in zip(chunk, res.frames):
                v = judge(fr, c, m)
                results.append({"prompt": f"a {c} {s} {m}", "color_ok": v.color_ok, "motion_ok": v.motion_ok})
    acc = {k: sum(r[k] for r in results) / max(len(results), 1) for k in ("color_ok", "motion_ok")}
    return {"size": [size, size, frames], "n": n, "guidance": guidance, "color_accuracy": acc["color_ok"],
            "motion_accuracy": acc["motion_ok"], "results": results}


def tune_guidance(out: str, recipe: Recipe, device: torch.device, grid: Sequence[float], n: int = TUNING_N,
                  sampling: Optional[dict] = None) -> dict:
    """Prompt following on :func:`tuning_prompts` (``n`` of them) at the sampling default size for
    each guidance scale in ``grid``; picks the scale with the most clips right in colour *and*
    motion (ties: the one nearest the recipe's default).  Returns ``{"best": scale, "n": n,
    "rows": [{"guidance", "color", "motion", "both"}, ...], "size": [h, w, f]}``."""
    if not grid:
        raise ValueError("tune_guidance: the guidance grid is empty")
    d = dict(recipe.sampling_defaults, **(sampling or {}))
    items = tuning_prompts(n)
    size = (d["height"], d["width"], d["num_frames"])
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        pipe = _pipeline(out, cache, device)
        for scale in grid:
            verdicts = generate_judged(pipe, items, TUNING_SEED, size, d["num_inference_steps"], float(scale))
            rows.append({"guidance": float(scale), "color": sum(bool(v["color_ok"]) for v in verdicts),
                         "motion": sum(bool(v["motion_ok"]) for v in verdicts),
                         "both": sum(bool(v["ok"]) for v in verdicts)})
    default = recipe.sampling_defaults["guidance_scale"]
    best = max(rows, key=lambda r: (r["both"], -abs(r["guidance"] - default)))
    return {"best": best["guidance"], "n": n, "size": list(size), "rows": rows}
