"""Reading diffusers / transformers checkpoint folders: ``config.json`` and weight files.

A component folder holds a ``config.json`` and either one weight file or an index
(``*.safetensors.index.json``) naming shards.  Variants follow the diffusers/transformers naming:
``diffusion_pytorch_model.fp16.safetensors`` and ``diffusion_pytorch_model.safetensors.index.fp16.json``.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ditattn.errors import AttentionConfigError

WEIGHT_STEMS = ("diffusion_pytorch_model", "model")


def read_json(path: str) -> dict:
    """Parse a JSON file; a missing or malformed file is an :class:`AttentionConfigError`."""
    if not os.path.isfile(path):
        raise AttentionConfigError(f"missing file {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise AttentionConfigError(f"{path} is not valid JSON: {exc}") from None


def _candidates(folder: str, variant: Optional[str]) -> Iterable[tuple[str, str]]:
    """(kind, path) in preference order: single safetensors, safetensors index, .bin, .bin index."""
    for stem in WEIGHT_STEMS:
        if variant:
            yield "file", os.path.join(folder, f"{stem}.{variant}.safetensors")
            yield "index", os.path.join(folder, f"{stem}.safetensors.index.{variant}.json")
        else:
            yield "file", os.path.join(folder, f"{stem}.safetensors")
            yield "index", os.path.join(folder, f"{stem}.safetensors.index.json")
    for stem in ("diffusion_pytorch_model", "pytorch_model"):
        if variant:
            yield "file", os.path.join(folder, f"{stem}.{variant}.bin")
            yield "index", os.path.join(folder, f"{stem}.bin.index.{variant}.json")
        else:
            yield "file", os.path.join(folder, f"{stem}.bin")
            yield "index", os.path.join(folder, f"{stem}.bin.index.json")


def _load_file(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def target_dtype(name: str, dtype: torch.dtype, keep_fp32: Optional[Callable[[str], bool]] = None) -> torch.dtype:
    """The dtype parameter ``name`` is stored in when the model runs in ``dtype``: float32 for the
    ``keep_fp32`` parameters when ``dtype`` is fp16/bf16, else ``dtype``."""
    if dtype in (torch.float16, torch.bfloat16) and keep_fp32 is not None and keep_fp32(name):
        return torch.float32
    return dtype


def _cast(tensors: dict, dtype, keep_fp32) -> dict:
    """Floating tensors to their target dtype; 8-bit floats stay as stored (an FP8 checkpoint's
    weights are dequantized with their scales by the model's loader)."""
    if dtype is None:
        return tensors
    return {
        k: (v.to(target_dtype(k, dtype, keep_fp32)) if v.is_floating_point() and v.element_size() > 1 else v)
        for k, v in tensors.items()
    }


def load_state_dict(
    folder: str,
    variant: Optional[str] = None,
    *,
    dtype: Optional[torch.dtype] = None,
    keep_fp32: Optional[Callable[[str], bool]] = None,
) -> dict[str, torch.Tensor]:
    """All tensors of the component checkpoint in ``folder`` (CPU).

    With ``dtype`` each shard's floating tensors are cast as soon as the shard is read (so a float32
    checkpoint loaded for bfloat16 never sits in memory whole in float32); ``keep_fp32(name)``
    marks tensors that stay float32 in fp16/bf16 runs.  Raises :class:`AttentionConfigError`
    naming the folder and the files looked for when none exists.
    """
    tried = []
    for kind, path in _candidates(folder, variant):
        tried.append(os.path.basename(path))
        if not os.path.isfile(path):
            continue
        if kind == "file":
            return _cast(_load_file(path), dtype, keep_fp32)
        index = read_json(path)
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not shards:
            raise AttentionConfigError(f"{path} lists no weight shards")
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(_cast(_load_file(os.path.join(folder, shard)), dtype, keep_fp32))
        return out
    what = f" for variant '{variant}'" if variant else ""
    raise AttentionConfigError(f"no weights{what} in {folder}; looked for: {', '.join(tried[:6])}, ...")


def assign_state_dict(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    *,
    where: str,
    aliases: Optional[dict[str, str]] = None,
    ignore_unexpected: Iterable[str] = (),
) -> None:
    """Load ``state`` into ``model`` (built on the meta device) by assignment, strictly.

    aliases: checkpoint key -> model key used when the model key is absent from ``state`` (tied
    weights); ignore_unexpected: substrings of checkpoint keys that may be present but unused.
    Missing or unexpected keys raise :class:`AttentionConfigError` listing a few of them.
    """
    expected = set(model.state_dict().keys())
    state = dict(state)
    for src, dst in (aliases or {}).items():
        if dst not in state and src in state:
            state[dst] = state[src]
        if src not in expected:
            state.pop(src, None)
    ignore = tuple(ignore_unexpected)
    unexpected = [k for k in state if k not in expected and not any(s in k for s in ignore)]
    for k in [k for k in state if k not in expected]:
        state.pop(k)
    missing = sorted(expected - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) e.g. {', '.join(missing[:4])}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s) e.g. {', '.join(sorted(unexpected)[:4])}")
        raise AttentionConfigError(f"{where}: checkpoint does not match the model configuration ({'; '.join(parts)})")
    model.load_state_dict(state, strict=True, assign=True)
