"""Training bookkeeping: the loss log (JSON + PNG curve), the step budget, EMA weights, progress.

The loss curve is drawn with Pillow (a hard dependency of ditattn), so a training machine needs
nothing else to write it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Iterable, Optional

import torch


class LossLog:
    """Per-stage loss records ``{stage: [[step, seconds, loss], ...]}`` plus free-form ``info``.

    :meth:`write` saves ``loss.json`` and ``loss.png`` (one panel per stage, raw loss in light grey
    and its running mean in colour, log-scale y) into ``out_dir``.
    """

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.stages: dict[str, list[list[float]]] = {}
        self.info: dict[str, dict] = {}
        path = os.path.join(out_dir, "loss.json")
        if os.path.isfile(path):  # a later stage of the same run (or a resumed one) appends
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            self.stages = {k: v for k, v in data.get("stages", {}).items()}
            self.info = data.get("info", {})

    def start(self, stage: str, **info) -> None:
        self.stages[stage] = []
        self.info[stage] = dict(info)

    def add(self, stage: str, step: int, seconds: float, loss: float) -> None:
        self.stages[stage].append([int(step), round(float(seconds), 3), float(loss)])

    def write(self) -> tuple[str, str]:
        os.makedirs(self.out_dir, exist_ok=True)
        jpath = os.path.join(self.out_dir, "loss.json")
        with open(jpath, "w", encoding="utf-8") as fh:
            json.dump({"stages": self.stages, "info": self.info}, fh)
        ppath = os.path.join(self.out_dir, "loss.png")
        plot_losses(self.stages, ppath)
        return jpath, ppath


def running_mean(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_losses(stages: dict[str, list], path: str, size: tuple[int, int] = (560, 300)) -> None:
    """One panel per stage: loss against step on a log-scale y axis (PNG at ``path``)."""
    from PIL import Image, ImageDraw

    names = [s for s in stages if stages[s]]
    W, H = size
    img = Image.new("RGB", (W, H * max(1, len(names))), "white")
    draw = ImageDraw.Draw(img)
    colors = [(31, 119, 180), (214, 39, 40), (44, 160, 44)]
    for row, name in enumerate(names):
        recs = stages[name]
        steps = [r[0] for r in recs]
        loss = [max(r[2], 1e-8) for r in recs]
        smooth = running_mean(loss, max(1, len(loss) // 50))
        top = row * H
        left, right, y0, y1 = 60, W - 12, top + 24, top + H - 30
        lo, hi = math.log10(min(loss)), math.log10(max(loss))
        if hi - lo < 1e-6:
            hi = lo + 1
        s0, s1 = min(steps), max(max(steps), min(steps) + 1)

        def xy(s, v):
            return (left + (right - left) * (s - s0) / (s1 - s0), y1 - (y1 - y0) * (math.log10(v) - lo) / (hi - lo))

        draw.rectangle([left, y0, right, y1], outline=(0, 0, 0))
        for frac in (0.0, 0.5, 1.0):
            v = 10 ** (lo + (hi - lo) * frac)
            y = y1 - (y1 - y0) * frac
            draw.line([left - 4, y, left, y], fill=(0, 0, 0))
            draw.text((4, y - 6), f"{v:.3g}", fill=(0, 0, 0))
        for frac in (0.0, 0.5, 1.0):
            s = s0 + (s1 - s0) * frac
            x = left + (right - left) * frac
            draw.text((x - 12, y1 + 4), f"{int(s)}", fill=(0, 0, 0))
        if len(steps) > 1:
            draw.line([xy(s, v) for s, v in zip(steps, loss)], fill=(200, 200, 200))
            draw.line([xy(s, v) for s, v in zip(steps, smooth)], fill=colors[row % len(colors)], width=2)
        draw.text((left, top + 6), f"{name}: loss vs step (last {smooth[-1]:.4g})", fill=(0, 0, 0))
    img.save(path)


class Budget:
    """Stop after ``steps`` steps or ``seconds`` of wall time, whichever comes first (None = no limit)."""

    def __init__(self, seconds: Optional[float] = None, steps: Optional[int] = None):
        if seconds is None and steps is None:
            raise ValueError("give a time budget or a number of steps")
        self.seconds, self.steps = seconds, steps
        self.t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def done(self, step: int) -> bool:
        return (self.steps is not None and step >= self.steps) or (
            self.seconds is not None and self.elapsed >= self.seconds
        )

    def fraction(self, step: int) -> float:
        """How far along the budget is, in [0, 1]."""
        parts = []
        if self.steps is not None:
            parts.append(step / max(self.steps, 1))
        if self.seconds is not None:
            parts.append(self.elapsed / max(self.seconds, 1e-9))
        return min(1.0, max(parts))


class EMA:
    """Exponential moving average of parameters: ``ema = d * ema + (1 - d) * p`` with the decay
    warmed up as ``min(decay, (1 + n) / (10 + n))`` so short runs are not dominated by the init."""

    def __init__(self, params: Iterable[torch.nn.Parameter], decay: float):
        self.params = [p for p in params if p.requires_grad]
        self.shadow = [p.detach().clone().float() for p in self.params]
        self.decay = decay
        self.n = 0

    @torch.no_grad()
    def update(self) -> None:
        self.n += 1
        d = min(self.decay, (1 + self.n) / (10 + self.n))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1 - d)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange the live parameters and the averages (call twice to restore)."""
        for p, s in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.copy_(s.to(p.dtype))
            s.copy_(tmp.float())


def progress(total_steps: Optional[int], desc: str):
    """A tqdm bar on stderr (sparse updates when stderr is not a terminal)."""
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    return tqdm(
        total=total_steps,
        desc=desc,
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5 if tty else 20.0,
        leave=True,
    )
