"""Wan DiT weights in the layouts people download, brought to the native model's keys and dtypes.

Key layouts (:func:`key_layout`):

* ``diffusers``: ``WanTransformer3DModel`` names (``blocks.0.attn1.to_q.weight``), as loaded
  from a diffusers folder;
* ``wan``: the original Wan repository's names (``blocks.0.self_attn.q.weight``, ``head.head``,
  optionally under ``model.diffusion_model.`` as ComfyUI saves them), renamed with diffusers' own
  converter (``convert_wan_transformer_to_diffusers``).

8-bit weights with their scales in the state dict (:func:`dequantize_8bit`), the common
single-file FP8 / INT8 Wan checkpoints:

* ComfyUI / Kijai ``*_fp8_scaled.safetensors``: ``<layer>.weight`` float8_e4m3fn with a float32
  per-tensor ``<layer>.scale_weight`` (and a ``scaled_fp8`` marker tensor);
* Kijai ``*_fp8_e4m3fn.safetensors``: float8_e4m3fn weights without scales (a plain cast: scale 1);
* LightX2V FP8 / INT8: ``<layer>.weight`` float8_e4m3fn or int8 with ``<layer>.weight_scale``,
  one float32 scale per output channel (``[out, 1]``), or per tensor.

Each 8-bit weight is dequantized (``weight * scale`` in float32) into the model's parameter dtype
when it is loaded; ``--dit-quantization fp8|int8`` then quantizes the selected linears again, per
output channel, once (:mod:`ditattn.models.quantization`), so an FP8 checkpoint and a
bf16 checkpoint quantized at load time run the same kernels.  Static activation scales
(``input_scale``) are not used: activations are quantized per token on every call.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ditattn.errors import AttentionConfigError

log = logging.getLogger("ditattn.pipeline")

#: names of the scale stored next to an 8-bit ``<layer>.weight``: ComfyUI/Kijai, LightX2V
SCALE_KEYS = ("scale_weight", "weight_scale")
#: tensors that describe the format rather than hold weights (dropped after reading)
MARKER_KEYS = ("scaled_fp8",)
#: per-layer tensors this loader reads but does not use (dropped with a log line)
UNUSED_SUFFIXES = (".input_scale", ".comfy_quant")
EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
ORIGINAL_PREFIX = "model.diffusion_model."


@dataclasses.dataclass
class CheckpointReport:
    """What :func:`to_native_state` found: the key ``layout``, how many 8-bit weights were
    dequantized and with which ``scales`` (``per-tensor``, ``per-channel``, ``none``), the tensors
    ``dropped`` (markers, static activation scales)."""

    layout: str = "diffusers"
    eight_bit: int = 0
    scales: set = dataclasses.field(default_factory=set)
    dropped: list = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if not self.eight_bit:
            return f"{self.layout} key names"
        return (
            f"{self.layout} key names, {self.eight_bit} 8-bit weights dequantized "
            f"({', '.join(sorted(self.scales))} scales)"
        )


def is_scale_key(name: str) -> bool:
    """True for a tensor that holds the scale of an 8-bit weight (kept float32 while loading)."""
    return name.rsplit(".", 1)[-1] in SCALE_KEYS


def key_layout(keys) -> str:
    """``"wan"`` when the keys use the original Wan names (or ComfyUI's prefix), else ``"diffusers"``."""
    for k in keys:
        if k.startswith(ORIGINAL_PREFIX) or ".self_attn." in k or ".cross_attn." in k or k.startswith("head.head"):
            return "wan"
    return "diffusers"


def _scale_kind(scale: torch.Tensor, out_features: int, key: str) -> tuple[str, torch.Tensor]:
    """``(kind, scale broadcastable to [out, ...])`` of a stored scale."""
    s = scale.float()
    if s.numel() == 1:
        return "per-tensor", s.reshape(())
    if s.numel() == out_features and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
        return "per-channel", s.reshape(out_features, 1)
    raise AttentionConfigError(
        f"{key}: scale of shape {tuple(scale.shape)} for a weight with {out_features} output "
        "channels; accepted: one scale per tensor or per output channel"
    )


def dequantize_8bit(state: dict, dtype_of: Callable[[str], torch.dtype], report: CheckpointReport) -> dict:
    """``state`` with every 8-bit weight replaced by ``weight * scale`` in ``dtype_of(name)`` (scale
    tensors, markers and static activation scales removed).  Raises :class:`AttentionConfigError`
    for 4-bit packed weights, an int8 weight without a scale, or a scale of an unknown shape."""
    out = {}
    for k in [k for k in state if k in MARKER_KEYS or k.endswith(UNUSED_SUFFIXES)]:
        state.pop(k)
        report.dropped.append(k)
    for key, t in state.items():
        if is_scale_key(key):
            continue
        if t.dtype == torch.uint8 and key.endswith(".weight"):
            raise AttentionConfigError(
                f"{key} is a packed 4-bit weight (uint8, NVFP4/MXFP4 checkpoints); accepted: "
                "bf16/fp16/fp32 weights or 8-bit weights (float8_e4m3fn, int8) with scales"
            )
        if t.dtype not in EIGHT_BIT:
            out[key] = t
            continue
        base = key[: -len("weight")] if key.endswith(".weight") else None
        scale = next((state[base + s] for s in SCALE_KEYS if base is not None and base + s in state), None)
        if scale is None and t.dtype == torch.int8:
            raise AttentionConfigError(
                f"{key} is an int8 weight without a scale ({base or key}.weight_scale); "
                "an int8 checkpoint needs its scales"
            )
        kind, s = ("none", None) if scale is None else _scale_kind(scale, t.shape[0], key)
        w = t.float() if s is None else t.float() * s
        out[key] = w.to(dtype_of(key))
        report.eight_bit += 1
        report.scales.add(kind)
    orphans = [k for k in state if is_scale_key(k) and k.rsplit(".", 1)[0] + ".weight" not in out]
    if orphans:
        raise AttentionConfigError(f"scale tensor(s) without an 8-bit weight, e.g. {orphans[0]}")
    return out


def to_native_state(state: dict, dtype_of: Callable[[str], torch.dtype]) -> tuple[dict, CheckpointReport]:
    """A Wan DiT state dict in either key layout, bf16/fp16/fp32 or 8-bit with scales, as the
    native model's state dict (``dtype_of(name)``: the dtype each dequantized weight gets) and a
    :class:`CheckpointReport` of what was found."""
    report = CheckpointReport(layout=key_layout(state))
    if report.layout == "wan":
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        state = convert_wan_transformer_to_diffusers(dict(state))
    state = dequantize_8bit(dict(state), dtype_of, report)
    if report.dropped:
        log.info(
            "DiT checkpoint: %d tensor(s) not used (format markers, static activation scales: activations are "
            "quantized per token): e.g. %s",
            len(report.dropped),
            report.dropped[0],
        )
    return state, report


def check_weights_file(path: str) -> str:
    """``path`` when it names an existing ``.safetensors`` file; AttentionConfigError otherwise."""
    import os

    if not str(path).endswith(".safetensors"):
        raise AttentionConfigError(f"DiT weights file {path!r}: accepted: a .safetensors file")
    if not os.path.isfile(path):
        raise AttentionConfigError(f"DiT weights file {path!r} does not exist")
    return path


def load_weights_file(path: str) -> dict:
    """The tensors of one ``.safetensors`` DiT file (CPU, stored dtypes)."""
    check_weights_file(path)
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:  # a truncated or foreign file
        raise AttentionConfigError(f"cannot read DiT weights file {path}: {exc}") from None
