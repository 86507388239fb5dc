"""Loading a Wan pipeline's components: device and dtype, each component built inside its
attention scope, the VAE and a fresh-scheduler factory.

:func:`build_components` constructs the ``model_index.json`` components under the attention
settings active in the caller's context (:func:`ditattn.attention.context.attention_settings`),
so that every attention layer resolves its backend once, in its component's scope.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

import torch

from ditattn.attention.context import ComponentScope, component_scope
from ditattn.attention.names import DIT_COMPONENTS
from ditattn.errors import AttentionConfigError
from ditattn.models.clip_vision import load_clip_vision_encoder, load_image_processor
from ditattn.models.umt5 import load_umt5_encoder
from ditattn.models.wan.transformer import load_wan_transformer
from ditattn.pipelines.model_index import ModelIndex
from ditattn.pipelines.text import PromptTokenizer
from ditattn.platforms import Platform

log = logging.getLogger("ditattn.pipeline")

DIT = DIT_COMPONENTS
# component -> (the diffusers class it must be, what it is, its native loader)
NATIVE_MODELS = {
    "text_encoder": ("UMT5EncoderModel", "text encoder", load_umt5_encoder),
    "image_encoder": ("CLIPVisionModel", "image encoder", load_clip_vision_encoder),
    "transformer": ("WanTransformer3DModel", "transformer", load_wan_transformer),
}

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def parse_dtype(value: "str | torch.dtype | None", platform: Platform) -> torch.dtype:
    """``float32``/``bfloat16``/``float16`` (or a torch dtype); None = float32 on CPU, bfloat16 elsewhere."""
    if value is None:
        return torch.float32 if platform.name == "cpu" else torch.bfloat16
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            raise AttentionConfigError(f"unsupported dtype {value}; accepted: float32, bfloat16, float16")
        return value
    try:
        return DTYPES[str(value).lower()]
    except KeyError:
        raise AttentionConfigError(f"unknown dtype '{value}'; accepted: float32, bfloat16, float16") from None


def parse_device(value: "str | torch.device | None") -> torch.device:
    """A usable torch device (None = ``cuda`` when available, else ``cpu``); unusable → error."""
    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise AttentionConfigError(f"unknown device '{value}'; accepted: cpu, cuda, cuda:N, mps, xpu, ...") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise AttentionConfigError(f"device '{value}' requested but CUDA is not available here; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise AttentionConfigError(
                f"device '{value}' does not exist; this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        mod = getattr(torch, dev.type, None) if dev.type != "mps" else getattr(torch.backends, "mps", None)
        if mod is None or not getattr(mod, "is_available", lambda: False)():
            raise AttentionConfigError(f"device '{value}' is not available here; use --device cpu")
    return dev


def check_load_options(
    settings, *, offload: str, lora, lora_fuse: bool, dit_quantization: str, platform: Platform, dtype: torch.dtype
) -> None:
    """Refuse, before any weights are read, the load options that cannot run together: an unknown
    ``offload`` mode, block streaming (``group``) or unfused LoRAs under torch.compile (``settings``:
    the run's :class:`~ditattn.attention.context.AttentionSettings`), a ``dit_quantization`` mode that
    ``platform`` / ``dtype`` / torchao cannot run, 8-bit linears with a weight-moving offload.  Raises
    :class:`AttentionConfigError` naming the flags and what to change."""
    from ditattn.models.quantization import check_supported
    from ditattn.pipelines.offload import check_offload_mode

    check_offload_mode(offload)
    if offload == "group" and settings.compiled:
        raise AttentionConfigError(
            "--offload group streams the DiT's weights during the forward, which compiled "
            "blocks cannot follow; use --offload model, or drop --enable-torch-compile"
        )
    if lora and not lora_fuse and settings.compiled:
        raise AttentionConfigError(
            "unfused LoRA adapters (switchable per request) cannot run inside compiled "
            "blocks; add --lora-fuse, or drop --enable-torch-compile"
        )
    check_supported(dit_quantization, platform, dtype)
    if dit_quantization != "none" and offload in ("model", "group"):
        raise AttentionConfigError(
            f"--dit-quantization {dit_quantization} with --offload {offload}: the offload keeps plain CPU master "
            "copies of the weights and moves them by tensor data, which torchao's quantized weights do not "
            "support; use --offload text_encoder (an 8-bit DiT is half the size of a bf16 one) or no offload"
        )


def parse_dit_weights(spec: "str | Mapping[str, str] | None", mi: ModelIndex) -> dict[str, str]:
    """``--dit-weights``: ``PATH`` (the model's one DiT), ``transformer=PATH,transformer_2=PATH`` or a
    mapping -> ``{component: path}``; AttentionConfigError for an unknown component or a bare path
    given to a model with two DiTs, and a path that is not an existing ``.safetensors`` file (checked
    here, before any weights are read)."""
    from ditattn.models.wan.checkpoint import check_weights_file

    if spec is None or spec == "":
        return {}
    dits = [c for c in DIT if c in mi.components]
    if isinstance(spec, str) and (os.path.exists(spec) or "=" not in spec):
        if len(dits) != 1:
            raise AttentionConfigError(
                f"--dit-weights {spec!r}: this model has {len(dits)} DiTs ({', '.join(dits)}); "
                "accepted: transformer=PATH,transformer_2=PATH"
            )
        return {dits[0]: check_weights_file(spec)}
    pairs = (
        spec.items() if isinstance(spec, Mapping) else (p.partition("=")[::2] for p in spec.split(",") if p.strip())
    )
    out = {str(k).strip(): str(v).strip() for k, v in pairs}
    bad = [k for k in out if k not in dits]
    if bad or not all(out.values()):
        raise AttentionConfigError(
            f"--dit-weights: unknown DiT component {bad[0] if bad else ''!r} or empty path; "
            f"accepted: {', '.join(f'{c}=PATH' for c in dits)}"
        )
    return {k: check_weights_file(v) for k, v in out.items()}


def build_components(
    mi: ModelIndex,
    dev: torch.device,
    dt: torch.dtype,
    *,
    variant: Optional[str] = None,
    load_weights: bool = True,
    dit_weights: Optional[Mapping[str, str]] = None,
) -> tuple[dict[str, Any], dict[str, ComponentScope]]:
    """The components of ``mi`` on ``dev`` in compute dtype ``dt`` (the VAE in float32) and the
    attention scope of each selectable / fixed one.  ``load_weights=False``: models on the meta
    device, no VAE, tokenizer or scheduler (enough for the attention plan).  The DiTs take their
    weights from ``dit_weights[component]`` when given (a single ``.safetensors`` file).  Raises
    :class:`AttentionConfigError` for a missing or unsupported component."""
    missing = [c for c in ("text_encoder", "tokenizer", "vae", "scheduler") if c not in mi.components]
    if not any(c in mi.components for c in DIT):
        missing.append("transformer")
    if missing:
        raise AttentionConfigError(f"{mi.path}: model_index.json lacks component(s) {', '.join(missing)}")
    components: dict[str, Any] = {}
    scopes: dict[str, ComponentScope] = {}
    # a bar on stderr, like the denoising one, but only on a terminal (logs and pipes stay clean)
    bar = progress_bar(total=len(mi.components), desc="loading", unit="component", enabled=load_weights)
    for comp in mi.components:
        bar.set_postfix_str(comp, refresh=False)
        bar.update(0)
        lib, klass = mi.components[comp]
        sub = mi.folder(comp)
        native = NATIVE_MODELS.get("transformer" if comp in DIT else comp)
        if native is not None:  # a selectable native model: built inside its attention scope
            expected, what, load = native
            if klass != expected:
                raise AttentionConfigError(
                    f"{sub}: {what} class '{klass}' is not supported; the native Wan pipeline runs {expected}"
                )
            weights_file = (dit_weights or {}).get(comp) if comp in DIT else None
            dit = {"weights_file": weights_file} if weights_file else {}
            with component_scope(comp, selectable=True) as scope:
                components[comp] = load(sub, dtype=dt, device=dev, variant=variant, load_weights=load_weights, **dit)
            scopes[comp] = scope
        elif comp == "vae":
            with component_scope(comp, selectable=False) as scope:
                components[comp] = _load_vae(sub, dev, variant) if load_weights else None
            scopes[comp] = scope
        elif comp == "tokenizer":
            components[comp] = PromptTokenizer(sub) if load_weights else None
        elif comp == "image_processor":
            components[comp] = load_image_processor(sub) if load_weights else None
        elif comp == "scheduler":
            components[comp] = _scheduler_factory(sub, klass) if load_weights else None
        else:
            log.info("ignoring component %s (%s.%s)", comp, lib, klass)
        bar.update(1)
    bar.close()
    return components, scopes


def progress_bar(*, total: Optional[int], desc: str, unit: str, enabled: bool = True):
    """A tqdm bar on stderr for a slow stage (loading, decoding), shown only when ``enabled`` and
    stderr is a terminal."""
    import sys

    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=None if enabled else True,
        dynamic_ncols=True,
        leave=False,
    )


def _load_vae(folder: str, device: torch.device, variant: Optional[str]):
    from diffusers import AutoencoderKLWan

    kw = {"variant": variant} if variant else {}
    try:
        vae = AutoencoderKLWan.from_pretrained(folder, dtype=torch.float32, **kw)
    except (OSError, ValueError) as exc:
        raise AttentionConfigError(f"cannot load the VAE from {folder}: {exc}") from None
    return vae.to(device).eval().requires_grad_(False)


def _scheduler_factory(folder: str, klass: str):
    """A zero-argument callable that returns a fresh scheduler (schedulers keep per-run state)."""
    import diffusers

    from ditattn.models.weights import read_json

    cls = getattr(diffusers, klass, None)
    if cls is None:
        raise AttentionConfigError(
            f"{folder}: unknown scheduler class '{klass}' (not in diffusers {diffusers.__version__})"
        )
    config = read_json(os.path.join(folder, "scheduler_config.json"))
    template = cls.from_config(config)
    frozen = template.config

    def make():
        return cls.from_config(frozen)

    make.config = frozen
    make.cls = cls
    return make
