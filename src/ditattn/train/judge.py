"""Judging a generated clip against its prompt: which colour dominates, where it moves, what shape it is.

Every pixel is classified to the nearest of the background and the palette colours
(:data:`ditattn.train.scenes.COLORS`), or to none when it is farther than ``tolerance`` from all of
them (anti-aliased edges, artefacts).  A prompted shape is then followed through its colour's mask:
area and centroid per frame.

Shape: on the last frames (:func:`shape_frames`) the colour's mask is split into 8-connected
pieces; the largest piece's *fill* is its pixel area over the area of its smallest enclosing
rectangle at any rotation (an ideal circle fills pi/4 = 0.785 of it, a square 1.0, a triangle
0.5).  The median fill over those frames reads as a triangle below ``FILL_SPLITS[0]``, as a
square above ``FILL_SPLITS[1]`` (:data:`FILL_SPLITS`, midway between the ideal fills), else as a
circle; the shape is right when that is the prompted one *and* the largest piece holds at least
:data:`MIN_MAIN_SHARE` of the colour's pixels (a shape split in two, or drawn twice, is wrong).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from ditattn.train.scenes import BACKGROUND, COLORS, MOTION_DIRECTION, SHAPES

MIN_TRAVEL = 0.1  # a moving shape's centroid must travel at least this fraction of the frame
MIN_GROWTH = 1.3  # growing: last/first area above this; shrinking: below its inverse
FILL_SPLITS = (0.64, 0.89)  # fill below: triangle (ideal 0.5); above: square (1.0); between: circle (0.785)
MIN_MAIN_SHARE = 0.8  # the largest piece must hold this fraction of the colour's pixels (one object)
MIN_PIECE_PIXELS = 6  # a largest piece smaller than this (pixels) has no shape
_ANGLES = np.deg2rad(np.arange(0.0, 90.0, 1.0))  # rectangle orientations tried (a rectangle repeats every 90 deg)


@dataclasses.dataclass
class Verdict:
    """color_ok: the prompted colour covers the most pixels (mean over frames) of all palette
    colours; motion_ok: its centroid moved the prompted way (or its area grew / shrank);
    dominant: the colour covering most pixels; area: mean fraction of the frame in the prompted
    colour; dx/dy: centroid travel first -> last frame in fractions of width / height (y down);
    growth: last / first frame area; shape_ok: the prompted shape is what the last frames show
    (None when no shape was asked); shape: the shape they show (None: no piece of the colour);
    fill: the median fill of the largest piece (see the module docstring); main_share: the median
    fraction of the colour's pixels in that piece."""

    color_ok: bool
    motion_ok: bool
    dominant: Optional[str]
    area: float
    dx: float
    dy: float
    growth: float
    shape_ok: Optional[bool] = None
    shape: Optional[str] = None
    fill: float = float("nan")
    main_share: float = float("nan")

    @property
    def ok(self) -> bool:
        """Colour and motion right (the shape is reported apart, in :attr:`shape_ok`)."""
        return self.color_ok and self.motion_ok

    @property
    def all_ok(self) -> bool:
        """Colour, motion and (when one was asked) shape right."""
        return self.ok and self.shape_ok is not False


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


def pieces(masks: np.ndarray) -> np.ndarray:
    """8-connected pieces of bool masks ``[N, H, W]``: int64 labels ``[N, H, W]``, 0 off the mask,
    equal positive labels within one piece (a label is the largest flat index + 1 in its piece)."""
    m = torch.from_numpy(np.ascontiguousarray(masks)).to(torch.float64)[:, None]
    n, _, H, W = m.shape
    lab = torch.arange(1, H * W + 1, dtype=torch.float64).view(1, 1, H, W) * m
    while True:  # spread the largest label over each piece (as many rounds as the longest path in a piece)
        new = F.max_pool2d(lab, 3, stride=1, padding=1) * m
        if torch.equal(new, lab):
            return lab[:, 0].to(torch.int64).numpy()
        lab = new


def rect_fill(mask: np.ndarray) -> float:
    """Pixels of bool ``mask [H, W]`` over the area of the smallest rectangle (any rotation, in
    1-degree steps) around their centres, each side one pixel longer (a pixel's mean extent); nan
    for an empty mask."""
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return float("nan")
    c, s = np.cos(_ANGLES)[:, None], np.sin(_ANGLES)[:, None]  # [A, 1]
    u, v = xs[None] * c + ys[None] * s, -xs[None] * s + ys[None] * c  # [A, N]
    boxes = (u.max(1) - u.min(1) + 1) * (v.max(1) - v.min(1) + 1)
    return float(len(xs) / boxes.min())


def shape_frames(num_frames: int) -> list[int]:
    """The frames the shape is judged on: the last third of the clip, at least 3 (or all there are)."""
    k = min(num_frames, max(3, num_frames // 3))
    return list(range(num_frames - k, num_frames))


def classify_fill(fill: float) -> Optional[str]:
    """The shape a fill ratio reads as (:data:`FILL_SPLITS`); None for nan."""
    if math.isnan(fill):
        return None
    return "triangle" if fill < FILL_SPLITS[0] else "square" if fill > FILL_SPLITS[1] else "circle"


def judge_shape(mask: np.ndarray) -> tuple[Optional[str], float, float]:
    """``(shape, fill, main_share)`` of one colour's mask ``bool [F, H, W]`` on :func:`shape_frames`:
    medians over those frames of the largest piece's :func:`rect_fill` and of its share of the
    mask's pixels; shape None when no frame has a piece of :data:`MIN_PIECE_PIXELS`."""
    sel = mask[shape_frames(mask.shape[0])]
    labels = pieces(sel)
    fills, shares = [], []
    for lab in labels:
        ids, counts = np.unique(lab[lab > 0], return_counts=True)
        if len(ids) == 0 or counts.max() < MIN_PIECE_PIXELS:
            continue
        main = ids[counts.argmax()]
        fills.append(rect_fill(lab == main))
        shares.append(counts.max() / counts.sum())
    if not fills:
        return None, float("nan"), 0.0
    fill = float(np.median(fills))
    return classify_fill(fill), fill, float(np.median(shares))


def judge(frames: np.ndarray, color: str, motion: str, shape: Optional[str] = None) -> Verdict:
    """How well a clip ``uint8 [F, H, W, 3]`` shows one ``color`` shape doing ``motion``; with
    ``shape`` (one of :data:`~ditattn.train.scenes.SHAPES`) also whether it is that shape."""
    if color not in COLORS or motion not in MOTION_DIRECTION:
        raise ValueError(f"unknown colour {color!r} or motion {motion!r}")
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; accepted: {', '.join(SHAPES)}")
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
    seen, fill, share = judge_shape(m)
    shape_ok = None if shape is None else bool(seen == shape and share >= MIN_MAIN_SHARE)
    return Verdict(
        dominant == color, bool(motion_ok), dominant, areas[color], dx, dy, growth, shape_ok, seen, fill, share
    )
