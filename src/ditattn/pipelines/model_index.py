"""Resolving ``--model-path`` and reading a diffusers ``model_index.json``."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from ditattn.errors import AttentionConfigError
from ditattn.models.tiny import DEFAULT_MODEL, TINY_MODELS, tiny_model_path
from ditattn.models.tiny_i2v import I2V_MODELS, i2v_model_path

BUILTIN_MODELS = TINY_MODELS + I2V_MODELS
from ditattn.models.weights import read_json

SUPPORTED_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")


@dataclasses.dataclass
class ModelIndex:
    """A parsed ``model_index.json``.

    path: the checkpoint folder; name: what the user passed (``ditattn:tiny-wan`` or the path);
    pipeline_class: ``_class_name``; components: module name -> (library, class) for every entry
    that is present (``[null, null]`` entries are absent components); config: the remaining
    pipeline settings (``boundary_ratio``, ``expand_timesteps``, …).
    """

    path: str
    name: str
    pipeline_class: str
    components: dict[str, tuple[str, str]]
    config: dict[str, Any]

    def folder(self, component: str) -> str:
        return os.path.join(self.path, component)

    @property
    def is_builtin(self) -> bool:
        return self.name in BUILTIN_MODELS


def resolve_model_path(model_path: Optional[str]) -> tuple[str, str]:
    """``(folder, name)`` for ``--model-path`` (None = the built-in default ``ditattn:tiny-wan``).

    Accepts a built-in ``ditattn:tiny-*`` model (built locally on first use) or a local
    diffusers-format folder containing ``model_index.json``; nothing is downloaded.
    """
    name = model_path or DEFAULT_MODEL
    if name.startswith("ditattn:"):
        if name not in BUILTIN_MODELS:
            raise AttentionConfigError(f"unknown built-in model '{name}'; built-in models: {', '.join(BUILTIN_MODELS)}")
        return (i2v_model_path(name) if name in I2V_MODELS else tiny_model_path(name)), name
    folder = os.path.expanduser(name)
    if not os.path.isdir(folder):
        raise AttentionConfigError(
            f"--model-path '{name}' is not a local directory; give a diffusers-format Wan checkpoint folder "
            f"(with model_index.json) or a built-in model: {', '.join(BUILTIN_MODELS)} (ditattn never downloads)"
        )
    if not os.path.isfile(os.path.join(folder, "model_index.json")):
        raise AttentionConfigError(
            f"--model-path '{name}' has no model_index.json; give a diffusers-format Wan checkpoint folder "
            f"or a built-in model: {', '.join(BUILTIN_MODELS)}"
        )
    return os.path.abspath(folder), name


def read_model_index(folder: str, name: Optional[str] = None) -> ModelIndex:
    """Parse ``folder/model_index.json``; unsupported pipeline classes raise AttentionConfigError."""
    data = read_json(os.path.join(folder, "model_index.json"))
    cls = data.get("_class_name", "")
    if cls not in SUPPORTED_PIPELINES:
        raise AttentionConfigError(
            f"{folder}: pipeline class '{cls}' is not supported by the native pipeline; supported: "
            f"{', '.join(SUPPORTED_PIPELINES)} (Wan 2.1 / 2.2 text-to-video, text-image-to-video and image-to-video)"
        )
    components: dict[str, tuple[str, str]] = {}
    config: dict[str, Any] = {}
    for key, value in data.items():
        if key.startswith("_"):
            continue
        if isinstance(value, (list, tuple)) and len(value) == 2:
            if value[0] is not None and value[1] is not None:
                components[key] = (str(value[0]), str(value[1]))
        else:
            config[key] = value
    return ModelIndex(folder, name or folder, cls, components, config)
