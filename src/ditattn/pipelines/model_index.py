"""Resolving ``--model-path`` (built-in name, local folder or Hugging Face repo id) and reading a
diffusers ``model_index.json``."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

from ditattn.errors import AttentionConfigError
from ditattn.models.builtin import BUILTIN_MODELS, DEFAULT_MODEL, builtin_model, builtin_model_path
from ditattn.models.weights import read_json
from ditattn.settings import CACHE

SUPPORTED_PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
log = logging.getLogger("ditattn.pipeline")


@dataclasses.dataclass
class ModelIndex:
    """A parsed ``model_index.json``.

    path: the checkpoint folder; name: what the user passed (``ditattn:shapes`` or the path);
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

    @property
    def builtin_defaults(self) -> Optional[dict]:
        """The sampling defaults of a built-in model (None for a user checkpoint)."""
        return builtin_model(self.name).defaults() if self.is_builtin else None


def resolve_model_path(
    model_path: Optional[str],
    *,
    revision: Optional[str] = None,
    local_files_only: bool = False,
    cache_dir: Optional[str] = None,
    variant: Optional[str] = None,
) -> tuple[str, str]:
    """``(folder, name)`` for ``--model-path`` (None = the built-in default :data:`DEFAULT_MODEL`).

    Accepts, in this order: a built-in name (``ditattn:shapes``, ``ditattn:tiny-wan``,
    ``ditattn:tiny-wan2.2``: built locally on first use); a local diffusers-format folder
    containing ``model_index.json``; a Hugging Face repo id ``org/name``, resolved by
    :func:`ditattn.pipelines.hub.resolve_repo_id` (the local cache
    first, a download unless ``local_files_only`` or ``HF_HUB_OFFLINE``; ``revision``: branch, tag
    or commit; ``cache_dir``: instead of ``HF_HOME``'s hub cache, a warning for a built-in model, which
    it does not move; ``variant``: the weights variant to download).  ``name`` is what the user passed.
    Raises :class:`AttentionConfigError`.
    """
    from ditattn.pipelines.hub import looks_like_repo_id, resolve_repo_id

    name = model_path or DEFAULT_MODEL
    if not isinstance(name, str) or not name.strip():
        raise AttentionConfigError(f"--model-path must be a non-empty string, got {model_path!r}")
    local = os.path.expanduser(name)
    is_repo = not os.path.isdir(local) and looks_like_repo_id(name)
    if revision is not None and not is_repo:
        raise AttentionConfigError(
            f"--revision applies to Hugging Face repo ids (org/name) only; '{name}' is "
            f"{'a built-in model' if name.startswith('ditattn:') else 'a local folder'}"
        )
    if name.startswith("ditattn:"):
        if cache_dir is not None:  # given, but it would do nothing: said, not dropped silently
            log.warning(
                "cache_dir acts only for Hugging Face repo ids; built-in ditattn: models are local (%s is built "
                "under %s, default ~/.cache/ditattn)",
                name,
                CACHE.name,
            )
        return builtin_model_path(name), name
    if is_repo:
        return resolve_repo_id(
            name, revision=revision, local_files_only=local_files_only, cache_dir=cache_dir, variant=variant
        ), name
    accepted = (
        f"a diffusers-format Wan checkpoint folder (with model_index.json), a Hugging Face repo id "
        f"(org/name, e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers) or a built-in model: {', '.join(BUILTIN_MODELS)}"
    )
    if not os.path.isdir(local):
        raise AttentionConfigError(f"--model-path '{name}' is not a local directory; accepted: {accepted}")
    if not os.path.isfile(os.path.join(local, "model_index.json")):
        raise AttentionConfigError(f"--model-path '{name}' has no model_index.json; accepted: {accepted}")
    return os.path.abspath(local), name


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
