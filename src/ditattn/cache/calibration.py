"""Per-model calibration of the step-cache methods: what ``ditattn calibrate-cache`` records, how it is
fitted and written, and how ``calibration=PATH`` loads and checks it.

A calibration file is a small JSON object::

    {"format": "ditattn-cache-calibration", "version": 1, "model": "ditattn:shapes", "num_steps": 20,
     "guidance_scale": 5.0, "scheduler": "flow_euler", "size": [128, 128, 17], "prompts": ["..."],
     "teacache": {"coefficients": [c4, c3, c2, c1, c0],       # numpy.polyval order: output change from input change
                  "input_range": [lo, hi]},                     # the input changes it was fitted on
     "magcache": {"mag_ratios": [1.0, r1, ..., r19]},           # one per step
     "samples": {"input_change": [[...]], "output_change": [[...]], "mag_ratio": [[...]]}}   # per prompt, per step

:class:`Recorder` collects the per-step signals of uncached runs (it is a cache method that always
computes); :func:`fit` turns them into the file's content.  Built-in models ship theirs under
``ditattn/cache/data`` (:func:`packaged_calibration`).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from ditattn.cache.base import BranchState, CacheFacts, CacheMethod, Outcome, StepView
from ditattn.errors import AttentionConfigError

FORMAT = "ditattn-cache-calibration"
VERSION = 1
POLY_DEGREE = 4
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
#: built-in model -> calibration file shipped in the package
PACKAGED = {"ditattn:shapes": "ditattn_shapes.json"}


def packaged_calibration(model: Optional[str]) -> Optional[str]:
    """The calibration file shipped for ``model`` (a built-in model name), or None."""
    name = PACKAGED.get(model or "")
    path = os.path.join(DATA_DIR, name) if name else None
    return path if path and os.path.isfile(path) else None


def _numbers(v, what: str, path: str, length: Optional[int] = None, positive: bool = False) -> list[float]:
    if (
        not isinstance(v, list)
        or not v
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) for x in v)
        or (positive and not all(x > 0 for x in v))
    ):
        kind = "positive finite numbers" if positive else "finite numbers"
        raise AttentionConfigError(f"calibration file {path}: {what} must be a non-empty list of {kind}")
    if length is not None and len(v) != length:
        raise AttentionConfigError(
            f"calibration file {path}: {what} has {len(v)} values for num_steps={length}; "
            "accepted: one per step (re-run ditattn calibrate-cache)"
        )
    return [float(x) for x in v]


def load_calibration(path: str, *, model: Optional[str] = None) -> dict:
    """The checked content of calibration file ``path``: ``{"model", "num_steps", "guidance_scale",
    "scheduler", "coefficients", "input_range", "mag_ratios", "path"}`` (``coefficients`` / ``input_range`` /
    ``mag_ratios`` None when the file lacks that method's data, ``guidance_scale`` / ``scheduler`` when it
    does not record them; ``input_range``: the span of input changes the polynomial was fitted on).  A file
    that is not one, malformed data (a curve whose length is not ``num_steps`` or with a ratio <= 0, a
    polynomial of the wrong size, a reversed input range) or a calibration of another ``model`` raise
    :class:`AttentionConfigError`."""
    from ditattn.attention.config import load_mapping_file

    data = load_mapping_file(path, what="calibration file", accepted="a JSON file written by ditattn calibrate-cache")
    if data.get("format") != FORMAT:
        raise AttentionConfigError(
            f"calibration file {path} is not a ditattn cache calibration (format "
            f"{data.get('format')!r}); accepted: a JSON file written by ditattn "
            "calibrate-cache"
        )
    if data.get("version") != VERSION:
        raise AttentionConfigError(f"calibration file {path}: version {data.get('version')!r}; accepted: {VERSION}")
    steps = data.get("num_steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise AttentionConfigError(f"calibration file {path}: num_steps must be an integer >= 2, got {steps!r}")
    if model is not None and data.get("model") != model:
        raise AttentionConfigError(
            f"calibration file {path} was made for model {data.get('model')!r}, not {model!r}; "
            f"accepted: a calibration of {model} (ditattn calibrate-cache --model-path "
            f"{model})"
        )
    coefficients = mag = span = None
    if "teacache" in data:
        coefficients = _numbers((data["teacache"] or {}).get("coefficients"), "teacache.coefficients", path)
        if (data["teacache"] or {}).get("input_range") is not None:
            span = _numbers(data["teacache"]["input_range"], "teacache.input_range", path, 2)
            if not 0 <= span[0] <= span[1]:
                raise AttentionConfigError(
                    f"calibration file {path}: teacache.input_range {span} is not a range of relative changes; "
                    "accepted: [lo, hi] with 0 <= lo <= hi"
                )
        if len(coefficients) > 8:
            raise AttentionConfigError(
                f"calibration file {path}: teacache.coefficients has {len(coefficients)} "
                "values; accepted: at most 8 (a polynomial of degree <= 7)"
            )
    if "magcache" in data:
        mag = _numbers((data["magcache"] or {}).get("mag_ratios"), "magcache.mag_ratios", path, steps, True)
    guidance, scheduler = data.get("guidance_scale"), data.get("scheduler")
    return {
        "model": data.get("model"),
        "num_steps": steps,
        # what it was recorded with, for the run's warning (CacheSetting.check_steps); None: not recorded
        "guidance_scale": float(guidance)
        if isinstance(guidance, (int, float)) and not isinstance(guidance, bool) and np.isfinite(guidance)
        else None,
        "scheduler": scheduler if isinstance(scheduler, str) else None,
        "coefficients": coefficients,
        "input_range": span,
        "mag_ratios": mag,
        "path": path,
    }


class Recorder(CacheMethod):
    """Computes every forward and records, per forward, the first block's modulated-input relative
    change, the stack residual's relative change and its mean per-token norm ratio (the signals
    TeaCache and MagCache are calibrated on)."""

    name = "record"
    facts = CacheFacts(reuses="nothing", signal="records", calibration=None, sequence_parallel="one process")

    def __init__(self):
        self.input_change: list[float] = []
        self.output_change: list[float] = []
        self.mag_ratio: list[float] = []

    def forward(self, view: StepView, state: BranchState, config: dict) -> Outcome:
        m = view.modulated()
        out = view.run(0, view.num_blocks, view.x)
        r = (out - view.x).float()
        if state.prev is None:
            self.input_change.append(float("nan"))
            self.output_change.append(float("nan"))
            self.mag_ratio.append(1.0)
        else:
            prev_m, prev_r = state.prev, state.extra["r"]
            self.input_change.append(view.rel_l1(m, prev_m))
            self.output_change.append(view.rel_l1(r, prev_r))
            ratio = r.norm(dim=-1) / prev_r.norm(dim=-1).clamp_min(1e-12)
            self.mag_ratio.append(float(ratio.mean()))
        state.prev, state.extra["r"] = m, r
        return Outcome(out, False, view.num_blocks)


def fit(
    runs: list[Recorder],
    *,
    model: str,
    num_steps: int,
    guidance_scale: float,
    size,
    prompts,
    scheduler: Optional[str] = None,
) -> dict:
    """The calibration file's content from one :class:`Recorder` per calibration run (each
    ``num_steps`` forwards): the TeaCache polynomial (:func:`numpy.polyfit` of degree
    :data:`POLY_DEGREE` of output change on input change over every step after the first) and the
    MagCache curve (the mean magnitude ratio per step).  Signals that are not finite (a state that started
    after the first step records none) raise :class:`AttentionConfigError`."""
    for r in runs:
        if len(r.mag_ratio) != num_steps:
            raise AttentionConfigError(
                f"calibration recorded {len(r.mag_ratio)} forwards for {num_steps} steps "
                "(two-expert models and split guidance are calibrated per forward: not "
                "supported)"
            )
    x = np.array([v for r in runs for v in r.input_change[1:]], dtype=np.float64)
    y = np.array([v for r in runs for v in r.output_change[1:]], dtype=np.float64)
    mags = np.array([r.mag_ratio for r in runs], dtype=np.float64)
    bad = int((~np.isfinite(x)).sum() + (~np.isfinite(y)).sum() + (~np.isfinite(mags)).sum())
    if bad:
        raise AttentionConfigError(
            f"calibration recorded {bad} signal value(s) that are not numbers (NaN or infinite: a cache state "
            "that started after the first step, or a run that overflowed); accepted: runs with one forward per "
            "step from the first (one expert, guidance on every step or none, batched)"
        )
    degree = min(POLY_DEGREE, max(len(x) // 10, 1))  # ten samples per coefficient: no wild fits of few points
    coefficients = np.polyfit(x, y, degree).tolist()
    mag = np.mean(mags, axis=0).tolist()
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "num_steps": num_steps,
        "guidance_scale": guidance_scale,
        **({"scheduler": scheduler} if scheduler is not None else {}),
        "size": list(size),
        "prompts": list(prompts),
        "teacache": {"coefficients": coefficients, "input_range": [float(x.min()), float(x.max())]},
        "magcache": {"mag_ratios": mag},
        "samples": {
            "input_change": [r.input_change for r in runs],
            "output_change": [r.output_change for r in runs],
            "mag_ratio": [r.mag_ratio for r in runs],
        },
    }


def write_calibration(data: dict, path: str) -> None:
    """Write ``data`` (:func:`fit`) as JSON (NaN, the first step's missing changes, as null)."""

    def clean(v):
        if isinstance(v, float) and not np.isfinite(v):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    from ditattn.files import atomic_write

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    atomic_write(path, json.dumps(clean(data), indent=1) + "\n")  # a full disk leaves the old file, not a cut one


__all__ = ["load_calibration", "packaged_calibration", "Recorder", "fit", "write_calibration"]
