"""The built-in trained model ``ditattn:shapes``: coloured shapes moving on a plain background.

A small Wan 2.1-architecture text-to-video model trained by :mod:`ditattn.train.shapes` on
procedural clips ("a red circle moving right", "a white square growing and a blue triangle moving
up"): a UMT5 text encoder over the byte tokenizer, a ``WanTransformer3DModel`` and an
``AutoencoderKLWan``.  Its weights ship inside the package (``models/packaged/``) as two files:

- ``shapes.json``: ``{"format": 1, "components": {"text_encoder": UMT5Config kwargs,
  "transformer": WanTransformer3DModel kwargs, "vae": AutoencoderKLWan kwargs (with the
  latent mean/std)}, "scheduler": UniPCMultistepScheduler kwargs, "sampling_defaults": {height,
  width, num_frames, num_inference_steps, guidance_scale}, "training": {...how it was made}}``
- ``shapes.safetensors``: every tensor as ``<component>.<parameter name>`` in float16.

:func:`shapes_model_path` materialises them once as a diffusers-format folder in the user cache
(named after the files' digest, so new weights never reuse a stale folder); nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.files import atomic_write
from ditattn.models.local import cached_folder, save_wan_pipeline

NAME = "ditattn:shapes"
FORMAT = 1
COMPONENTS = ("text_encoder", "transformer", "vae")
PACKAGED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "packaged")
META_FILE = "shapes.json"
WEIGHTS_FILE = "shapes.safetensors"
SAMPLING_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")


def package_files(folder: Optional[str] = None) -> tuple[str, str]:
    """``(shapes.json, shapes.safetensors)`` paths in ``folder`` (default: the installed package data)."""
    folder = folder or PACKAGED_DIR
    return os.path.join(folder, META_FILE), os.path.join(folder, WEIGHTS_FILE)


def read_meta(folder: Optional[str] = None) -> dict:
    """The parsed and checked ``shapes.json``; a missing or malformed file is an AttentionConfigError."""
    meta_path, weights_path = package_files(folder)
    for path in (meta_path, weights_path):
        if not os.path.isfile(path):
            raise AttentionConfigError(
                f"{NAME}: {path} is missing from this install; reinstall ditattn (pip install -e .) or train "
                "the weights with python -m ditattn.train.shapes"
            )
    with open(meta_path, encoding="utf-8") as fh:
        meta = json.load(fh)
    if meta.get("format") != FORMAT:
        raise AttentionConfigError(f"{meta_path}: format {meta.get('format')!r} is not supported (expected {FORMAT})")
    missing = [c for c in COMPONENTS if c not in meta.get("components", {})]
    missing += [k for k in SAMPLING_KEYS if k not in meta.get("sampling_defaults", {})]
    if missing or "scheduler" not in meta:
        raise AttentionConfigError(f"{meta_path}: lacks {', '.join(missing) or 'scheduler'}")
    return meta


def sampling_defaults(folder: Optional[str] = None) -> dict:
    """The generate defaults the model was trained for (height, width, num_frames, steps, guidance)."""
    d = read_meta(folder)["sampling_defaults"]
    return {k: d[k] for k in SAMPLING_KEYS}


def write_package(folder: str, meta: dict, state_dicts: dict, dtype=None) -> tuple[str, str]:
    """Write ``shapes.json`` + ``shapes.safetensors`` into ``folder`` (the training side's export).

    state_dicts: component -> ``{name: tensor}`` for every entry of :data:`COMPONENTS`; tensors are
    stored in ``dtype`` (default float16), each as its own storage.
    """
    import torch
    from safetensors.torch import save

    dtype = dtype or torch.float16
    missing = [c for c in COMPONENTS if c not in state_dicts or c not in meta.get("components", {})]
    if missing:
        raise ValueError(f"write_package: missing component(s) {', '.join(missing)}")
    tensors = {}
    for comp in COMPONENTS:
        for k, v in state_dicts[comp].items():
            t = v.detach().to("cpu")
            tensors[f"{comp}.{k}"] = (t.to(dtype) if t.is_floating_point() else t).contiguous().clone()
    os.makedirs(folder, exist_ok=True)
    meta_path, weights_path = package_files(folder)
    atomic_write(weights_path, save(tensors, metadata={"format": str(FORMAT)}))
    os.chmod(weights_path, 0o644)
    atomic_write(meta_path, json.dumps(dict(meta, format=FORMAT), indent=1, sort_keys=True) + "\n")
    return meta_path, weights_path


def build_components(meta: dict, tensors: dict) -> dict:
    """``{"text_encoder", "transformer", "vae", "scheduler"}`` modules (float32, eval) built from
    ``meta`` and loaded strictly with ``tensors`` (``<component>.<name>`` keys)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    cfg = meta["components"]
    modules = {  # built on the CPU: some buffers (RoPE tables) are not in the state dict
        "text_encoder": UMT5EncoderModel(UMT5Config(**cfg["text_encoder"])),
        "transformer": WanTransformer3DModel.from_config(cfg["transformer"]),
        "vae": AutoencoderKLWan.from_config(cfg["vae"]),
    }
    for comp, module in modules.items():
        prefix = comp + "."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise AttentionConfigError(
                f"{NAME}: the packaged {comp} weights do not match its config: {str(exc).splitlines()[0]}"
            ) from None
        module.eval().requires_grad_(False)
    modules["scheduler"] = UniPCMultistepScheduler(**meta["scheduler"])
    return modules


def package_digest(folder: Optional[str] = None) -> str:
    """The first 12 hex digits of the SHA-256 of the package files (``shapes.json`` + weights)."""
    h = hashlib.sha256()
    for p in package_files(folder):
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def shapes_model_path(root: Optional[str] = None, package: Optional[str] = None) -> str:
    """The diffusers-format folder of ``ditattn:shapes``, materialised from the package data (or from
    ``package``, a folder holding ``shapes.json`` + ``shapes.safetensors``) on first use."""
    from safetensors.torch import load_file

    meta = read_meta(package)
    files = package_files(package)

    def build(out_dir: str) -> None:
        mods = build_components(meta, load_file(files[1]))
        save_wan_pipeline(out_dir, **mods)

    return cached_folder(f"shapes-{package_digest(package)}", build, root)
