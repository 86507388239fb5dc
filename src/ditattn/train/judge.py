"""Judging a generated clip against its prompt: which colour dominates, where it moves.

Every pixel is classified to the nearest of the background and the palette colours
(:data:`ditattn.train.scenes.COLORS`), or to none when it is farther than ``tolerance`` from all of
them (anti-aliased edges, artefacts).  A prompted shape is then followed through its colour's mask:
area and centroid per frame.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ditattn.train.scenes import BACKGROUND, COLORS, MOTION_DIRECTION

MIN_TRAVEL = 0.1  # a moving shape's centroid must travel at least this fraction of the frame
MIN_GROWTH = 1.3  # growing: last/first area above this; shrinking: below its inverse


@dataclasses.dataclass
class Verdict:
    """color_ok: the prompted colour covers the most pixels (mean over frames) of all palette
    colours; motion_ok: its centroid moved the prompted way (or its area grew / shrank);
    dominant: the colour covering most pixels; area: mean fraction of the frame in the prompted
    colour; dx/dy: centroid travel first -> last frame in fractions of width / height (y down);
    growth: last / first frame area."""

    color_ok: bool
    motion_ok: bool
    dominant: Optional[str]
    area: float
    dx: float
    dy: float
    growth: float

    @property
    def ok(self) -> bool:
        return self.color_ok and self.motion_ok


def color_masks(frames: np.ndarray, tolerance: float = 0.3) -> dict[str, np.ndarray]:
    """``{colour: bool [F, H, W]}`` for every palette colour (background excluded).

    frames: uint8 ``[F, H, W, 3]`` (or float in [0, 1]).
    """
    x = frames.astype(np.float32) / (255.0 if frames.dtype == np.uint8 else 1.0)
    names = ["background"] + list(COLORS)
    refs = np.array([BACKGROUND] + list(COLORS.values()), dtype=np.float32)  # [C, 3]
    dist = np.linalg.norm(x[..., None, :] - refs, axis=-1)  # [F, H, W, C]
    nearest = dist.argmin(axis=-1)
    close = dist.min(axis=-1) < tolerance
    return {name: (nearest == i) & close for i, name in enumerate(names) if i > 0}


def judge(frames: np.ndarray, color: str, motion: str) -> Verdict:
    """How well a clip ``uint8 [F, H, W, 3]`` shows one ``color`` shape doing ``motion``."""
    if color not in COLORS or motion not in MOTION_DIRECTION:
        raise ValueError(f"unknown colour {color!r} or motion {motion!r}")
    masks = color_masks(frames)
    F_, H, W = frames.shape[:3]
    areas = {c: float(m.mean()) for c, m in masks.items()}
    dominant = max(areas, key=areas.get) if max(areas.values()) > 0 else None
    m = masks[color]
    per_frame = m.reshape(F_, -1).sum(axis=1).astype(np.float64)
    first, last = per_frame[0], per_frame[-1]
    growth = float(last / first) if first > 0 else float("inf") if last > 0 else 1.0
    dx = dy = 0.0
    if first > 0 and last > 0:
        ys, xs = np.mgrid[0:H, 0:W]
        c0 = (float((xs * m[0]).sum() / first), float((ys * m[0]).sum() / first))
        c1 = (float((xs * m[-1]).sum() / last), float((ys * m[-1]).sum() / last))
        dx, dy = (c1[0] - c0[0]) / W, (c1[1] - c0[1]) / H
    ux, uy = MOTION_DIRECTION[motion]
    if motion == "growing":
        motion_ok = growth > MIN_GROWTH
    elif motion == "shrinking":
        motion_ok = growth < 1 / MIN_GROWTH
    else:
        along = dx * ux + dy * uy
        across = abs(dx * uy) + abs(dy * ux)
        motion_ok = along > MIN_TRAVEL and across < along
    return Verdict(dominant == color, bool(motion_ok), dominant, areas[color], dx, dy, growth)
