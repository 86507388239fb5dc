"""Procedural clips for ``ditattn:shapes``: one or two coloured shapes moving on a plain background.

A scene holds ``K = 2`` shape slots (the second may be absent).  Each shape has a kind
(:data:`SHAPES`), a colour (:data:`COLORS`) and a motion (:data:`MOTIONS`); its caption reads
``"a red circle moving right"``, a two-shape scene ``"a red circle moving right and a blue square
growing"``.  Over a clip a moving shape travels :data:`TRAVEL` of the frame along its axis, a
growing one scales from ``SCALE_RANGE[0]`` to ``SCALE_RANGE[1]`` (shrinking: the reverse), whatever
the number of frames; every shape stays inside the frame (a margin of 2 % or 1.5 pixels).

:func:`sample_scenes` draws scenes from a CPU ``torch.Generator`` (deterministic from its seed) and
:func:`render` draws them on any device as clips ``[B, 3, F, H, W]`` in ``[-1, 1]`` (the VAE's
range), with one pixel of anti-aliasing from signed distance functions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.12),
    "green": (0.15, 0.75, 0.20),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.85, 0.10),
    "white": (0.95, 0.95, 0.95),
}
SHAPES = ("circle", "square", "triangle")
MOTIONS = ("moving left", "moving right", "moving up", "moving down", "growing", "shrinking")
# unit displacement (x right, y down) of each motion over a clip; growing/shrinking stay in place
MOTION_DIRECTION = {
    "moving left": (-1, 0),
    "moving right": (1, 0),
    "moving up": (0, -1),
    "moving down": (0, 1),
    "growing": (0, 0),
    "shrinking": (0, 0),
}
BACKGROUND = (0.12, 0.12, 0.12)
TRAVEL = 0.4  # fraction of the frame a moving shape crosses over the clip
SCALE_RANGE = (0.6, 1.4)  # growing: radius x0.6 -> x1.4 over the clip
MAX_SHAPES = 2
MARGIN = 0.02
# half-extent of each kind in units of its radius R (circle: R, square: half side, triangle: circumradius)
_EXTENT = {"circle": 1.0, "square": 0.85, "triangle": 1.16}


@dataclasses.dataclass
class Scenes:
    """A batch of ``B`` scenes with ``K`` shape slots (float fields in fractions of the frame).

    kind/color/motion: long ``[B, K]`` indices into SHAPES / COLORS / MOTIONS; present: bool
    ``[B, K]`` (slot 0 always present); x0/y0: start centres as fractions of width/height; dx/dy:
    total displacement over the clip (fractions of width/height); radius: base radius as a fraction
    of ``min(H, W)``; scale0/scale1: radius multipliers at the first and last frame.
    """

    kind: torch.Tensor
    color: torch.Tensor
    motion: torch.Tensor
    present: torch.Tensor
    x0: torch.Tensor
    y0: torch.Tensor
    dx: torch.Tensor
    dy: torch.Tensor
    radius: torch.Tensor
    scale0: torch.Tensor
    scale1: torch.Tensor

    def __len__(self) -> int:
        return int(self.kind.shape[0])

    def captions(self) -> list[str]:
        """One caption per scene, shapes in slot order joined with ``" and "``."""
        names = list(COLORS)
        out = []
        for b in range(len(self)):
            parts = [
                f"a {names[int(self.color[b, k])]} {SHAPES[int(self.kind[b, k])]} {MOTIONS[int(self.motion[b, k])]}"
                for k in range(self.kind.shape[1])
                if bool(self.present[b, k])
            ]
            out.append(" and ".join(parts))
        return out


def caption(color: str, shape: str, motion: str) -> str:
    """``"a {color} {shape} {motion}"`` after checking each word against the vocabulary."""
    for value, allowed, what in ((color, COLORS, "colour"), (shape, SHAPES, "shape"), (motion, MOTIONS, "motion")):
        if value not in allowed:
            raise ValueError(f"unknown {what} {value!r}; accepted: {', '.join(allowed)}")
    return f"a {color} {shape} {motion}"


def sample_scenes(
    n: int,
    height: int,
    width: int,
    generator: torch.Generator,
    p_two: float = 0.35,
    shape_weights: Optional[Sequence[float]] = None,
) -> Scenes:
    """``n`` random scenes for frames of ``height x width`` (a CPU generator: deterministic).

    Shape radius: 0.12-0.20 of the short side with one shape, 0.09-0.15 with two; start positions
    are uniform over the places where the whole motion stays ``MARGIN`` inside the frame.  Each
    slot's shape is drawn with the odds ``shape_weights`` (one per :data:`SHAPES` entry, >= 0, not
    all 0; None: equal odds).
    """
    g = generator
    K = MAX_SHAPES

    def uniform(lo, hi, shape=(n, K)):
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    if shape_weights is None:
        kind = torch.randint(0, len(SHAPES), (n, K), generator=g)
    else:
        w = torch.as_tensor(shape_weights, dtype=torch.float64)
        if w.shape != (len(SHAPES),) or bool((w < 0).any()) or float(w.sum()) <= 0:
            raise ValueError(f"shape_weights: {len(SHAPES)} odds >= 0 (not all 0) for {SHAPES}, got {shape_weights}")
        kind = torch.multinomial(w, n * K, replacement=True, generator=g).view(n, K)
    color = torch.randint(0, len(COLORS), (n, K), generator=g)
    motion = torch.randint(0, len(MOTIONS), (n, K), generator=g)
    two = torch.rand(n, generator=g) < p_two
    present = torch.stack([torch.ones(n, dtype=torch.bool), two], dim=1)
    radius = torch.where(present[:, 1:2], uniform(0.09, 0.15), uniform(0.12, 0.20))
    growing = motion == MOTIONS.index("growing")
    shrinking = motion == MOTIONS.index("shrinking")
    lo, hi = SCALE_RANGE
    scale0 = torch.where(
        growing,
        torch.full_like(radius, lo),
        torch.where(shrinking, torch.full_like(radius, hi), torch.ones_like(radius)),
    )
    scale1 = torch.where(
        growing,
        torch.full_like(radius, hi),
        torch.where(shrinking, torch.full_like(radius, lo), torch.ones_like(radius)),
    )
    direction = torch.tensor([MOTION_DIRECTION[m] for m in MOTIONS], dtype=torch.float32)[motion]  # [n, K, 2]
    dx, dy = direction[..., 0] * TRAVEL, direction[..., 1] * TRAVEL
    extent = torch.tensor([_EXTENT[s] for s in SHAPES])[kind] * radius * torch.maximum(scale0, scale1)
    short = min(height, width)
    # half-extents in fractions of width / height, plus the margin (at least 1.5 pixels: anti-aliasing)
    ex = extent * short / width + max(MARGIN, 1.5 / width)
    ey = extent * short / height + max(MARGIN, 1.5 / height)
    # start centre: the whole path [x0, x0 + dx] stays within [ex, 1 - ex]
    x_lo, x_hi = ex - torch.clamp(dx, max=0), 1 - ex - torch.clamp(dx, min=0)
    y_lo, y_hi = ey - torch.clamp(dy, max=0), 1 - ey - torch.clamp(dy, min=0)
    x0 = x_lo + (x_hi - x_lo).clamp(min=0) * torch.rand((n, K), generator=g)
    y0 = y_lo + (y_hi - y_lo).clamp(min=0) * torch.rand((n, K), generator=g)
    return Scenes(kind, color, motion, present, x0, y0, dx, dy, radius, scale0, scale1)


def _sdf(kind: torch.Tensor, px: torch.Tensor, py: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Signed distance in pixels (negative inside) of shape ``kind`` [B,1,1,1] of radius ``R``
    [B,F,1,1] at offsets ``px`` [B,F,1,W], ``py`` [B,F,H,1] (y down)."""
    circle = torch.sqrt(px * px + py * py) - R
    a = R * _EXTENT["square"]
    qx, qy = px.abs() - a, py.abs() - a
    square = torch.sqrt(qx.clamp(min=0) ** 2 + qy.clamp(min=0) ** 2) + torch.maximum(qx, qy).clamp(max=0)
    # equilateral triangle pointing up, circumradius _EXTENT["triangle"] * R, centroid at the centre
    r = R * _EXTENT["triangle"] * math.sqrt(3) / 2  # half side
    k = math.sqrt(3.0)
    tx = px.abs() - r
    ty = -py + r / k
    fold = (tx + k * ty) > 0
    tx, ty = torch.where(fold, (tx - k * ty) / 2, tx), torch.where(fold, (-k * tx - ty) / 2, ty)
    tx = tx - torch.maximum(torch.minimum(tx, torch.zeros_like(tx)), -2 * r)
    triangle = -torch.sqrt(tx * tx + ty * ty) * torch.sign(ty)
    return torch.where(kind == 0, circle, torch.where(kind == 1, square, triangle))


def render(
    scenes: Scenes,
    num_frames: int,
    height: int,
    width: int,
    device: "torch.device | str | None" = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw ``scenes`` as clips ``[B, 3, num_frames, height, width]`` in ``[-1, 1]`` on ``device``.

    Frame ``f`` shows the scene at time ``f / (num_frames - 1)`` (a single frame: time 0); slots are
    painted in order over the background with one pixel of anti-aliasing.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    B = len(scenes)
    t = torch.linspace(0, 1, num_frames, device=dev) if num_frames > 1 else torch.zeros(1, device=dev)
    xs = torch.arange(width, device=dev, dtype=torch.float32) + 0.5
    ys = torch.arange(height, device=dev, dtype=torch.float32) + 0.5
    short = min(height, width)
    palette = torch.tensor(list(COLORS.values()), device=dev)
    img = torch.tensor(BACKGROUND, device=dev).view(1, 3, 1, 1, 1).expand(B, 3, num_frames, height, width).clone()
    for k in range(scenes.kind.shape[1]):

        def at(v):
            return v[:, k].to(dev).view(B, 1)

        cx = (at(scenes.x0) + at(scenes.dx) * t) * width  # [B, F] pixels
        cy = (at(scenes.y0) + at(scenes.dy) * t) * height
        R = at(scenes.radius) * short * (at(scenes.scale0) + (at(scenes.scale1) - at(scenes.scale0)) * t)
        px = xs.view(1, 1, 1, width) - cx[..., None, None]
        py = ys.view(1, 1, height, 1) - cy[..., None, None]
        d = _sdf(scenes.kind[:, k].to(dev).view(B, 1, 1, 1), px, py, R[..., None, None])
        alpha = (0.5 - d).clamp(0, 1) * scenes.present[:, k].to(dev).view(B, 1, 1, 1)  # [B, F, H, W]
        col = palette[scenes.color[:, k].to(dev)].view(B, 3, 1, 1, 1)
        img = img + (col - img) * alpha[:, None]
    return (img * 2 - 1).to(dtype)


def scene_batch(
    n: int,
    num_frames: int,
    height: int,
    width: int,
    generator: torch.Generator,
    device=None,
    dtype: torch.dtype = torch.float32,
    p_two: float = 0.35,
    shape_weights: Optional[Sequence[float]] = None,
) -> tuple[torch.Tensor, list[str], Scenes]:
    """``(clips [n, 3, F, H, W] in [-1, 1], captions, scenes)`` drawn from ``generator``
    (``shape_weights``: as :func:`sample_scenes`)."""
    scenes = sample_scenes(n, height, width, generator, p_two=p_two, shape_weights=shape_weights)
    return render(scenes, num_frames, height, width, device=device, dtype=dtype), scenes.captions(), scenes


def parse_caption(text: str) -> Optional[list[tuple[str, str, str]]]:
    """``[(colour, shape, motion), ...]`` for a caption in the training grammar, else None."""
    out = []
    for part in text.strip().lower().split(" and "):
        words = part.split()
        if len(words) < 4 or words[0] != "a":
            return None
        color, shape, motion = words[1], words[2], " ".join(words[3:])
        if color not in COLORS or shape not in SHAPES or motion not in MOTIONS:
            return None
        out.append((color, shape, motion))
    return out or None
