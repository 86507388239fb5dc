"""The built-in models, usable as ``--model-path ditattn:<name>``: names, folders, sampling defaults.

``ditattn:shapes`` is a small trained Wan model (coloured shapes moving on a plain background;
weights ship in the package); ``ditattn:tiny-wan`` / ``ditattn:tiny-wan2.2`` and the image-to-video
layouts ``ditattn:tiny-wan-i2v`` / ``ditattn:tiny-wan2.2-ti2v`` / ``ditattn:tiny-wan2.2-i2v`` have
random weights and exist for fast tests.  Each resolves to a diffusers-format folder built locally on first use;
nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ditattn.errors import AttentionConfigError


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """name: ``ditattn:...``; summary: one line for help texts; path: ``root -> folder`` (builds on
    first use); defaults: ``() -> {height, width, num_frames, num_inference_steps, guidance_scale}``."""

    name: str
    summary: str
    path: Callable[[Optional[str]], str]
    defaults: Callable[[], dict]


# the random tiny models default to a small clip so that a CPU run takes seconds
TINY_DEFAULTS = dict(height=128, width=128, num_frames=9, num_inference_steps=8, guidance_scale=5.0)


def _tiny(name: str) -> BuiltinModel:
    from ditattn.models import tiny

    return BuiltinModel(
        name,
        "random weights, its video is noise; for fast tests",
        lambda root: tiny.tiny_model_path(name, root),
        lambda: dict(TINY_DEFAULTS),
    )


def _tiny_i2v(name: str) -> BuiltinModel:
    from ditattn.models import tiny_i2v

    return BuiltinModel(
        name,
        "random weights, image-to-video layout; for fast tests",
        lambda root: tiny_i2v.i2v_model_path(name, root),
        lambda: dict(TINY_DEFAULTS),
    )


def _shapes() -> BuiltinModel:
    from ditattn.models import shapes

    return BuiltinModel(
        shapes.NAME,
        "trained: coloured shapes moving on a plain background",
        lambda root: shapes.shapes_model_path(root),
        shapes.sampling_defaults,
    )


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        _shapes(),
        _tiny("ditattn:tiny-wan"),
        _tiny("ditattn:tiny-wan2.2"),
        _tiny_i2v("ditattn:tiny-wan-i2v"),
        _tiny_i2v("ditattn:tiny-wan2.2-ti2v"),
        _tiny_i2v("ditattn:tiny-wan2.2-i2v"),
    )
}
DEFAULT_MODEL = "ditattn:shapes"


def builtin_model(name: str) -> BuiltinModel:
    """The registry entry of ``name``; an unknown ``ditattn:`` name is an AttentionConfigError."""
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise AttentionConfigError(
            f"unknown built-in model '{name}'; built-in models: {', '.join(BUILTIN_MODELS)}"
        ) from None


def builtin_model_path(name: str, root: Optional[str] = None) -> str:
    """The diffusers-format folder of built-in model ``name`` (built on first use)."""
    return builtin_model(name).path(root)
