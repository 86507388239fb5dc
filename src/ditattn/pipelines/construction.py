"""Loading a Wan pipeline's components: resolve the model, check the load options, build every
component inside its attention scope, then LoRA, placement (offload), VAE tiling, 8-bit linears and
compilation, in that order.  :meth:`ditattn.pipelines.wan.WanPipelineNative.from_pretrained` is the
public entry point and documents every option; this module holds its steps."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from ditattn.attention.config import check_backend_config
from ditattn.attention.context import AttentionSettings, ComponentScope, attention_settings
from ditattn.attention.selector import check_overrides_used
from ditattn.errors import AttentionConfigError
from ditattn.models.lora import Adapter, load_loras
from ditattn.pipelines.loading import (
    DIT,
    build_components,
    check_load_options,
    parse_device,
    parse_dit_weights,
    parse_dtype,
)
from ditattn.pipelines.model_index import ModelIndex, read_model_index, resolve_model_path
from ditattn.pipelines.offload import ComponentPlacement
from ditattn.platforms import Platform, platform_for_device, use_platform


@dataclasses.dataclass
class LoadedComponents:
    """What :func:`load_components` built: the checkpoint's model index, its components and their
    attention scopes, the settings and platform they were resolved under, the device and compute
    dtype, the LoRA adapters and the placement (None with ``load_weights=False``)."""

    model_index: ModelIndex
    components: dict[str, Any]
    scopes: dict[str, ComponentScope]
    settings: AttentionSettings
    platform: Platform
    device: torch.device
    dtype: torch.dtype
    adapters: list[Adapter]
    placement: Optional[ComponentPlacement]


def load_components(
    path: Optional[str],
    settings: AttentionSettings,
    device,
    dtype,
    *,
    variant: Optional[str],
    load_weights: bool,
    revision: Optional[str],
    local_files_only: bool,
    cache_dir: Optional[str],
    offload: str,
    offload_group_blocks: int,
    vae_tiling: bool,
    vae_slicing: bool,
    lora: Sequence,
    lora_fuse: bool,
    dit_quantization: str,
    dit_weights,
    vae_parallel: bool,
) -> LoadedComponents:
    """The components of the pipeline at ``path`` with every option of
    :meth:`~ditattn.pipelines.wan.WanPipelineNative.from_pretrained` applied (AttentionConfigError for a
    bad option, path, checkpoint, refused backend or unused override)."""
    from ditattn.models.quantization import check_mode, check_something_quantized, plan_linears, quantize_linears

    check_backend_config(settings.config, settings.named_backends(), complete=False)  # before dtype checks
    dit_quantization = check_mode(dit_quantization)
    folder, name = resolve_model_path(
        path, revision=revision, local_files_only=local_files_only, cache_dir=cache_dir, variant=variant
    )
    mi = read_model_index(folder, name)
    dev = parse_device(device)
    platform = platform_for_device(dev)
    dt = parse_dtype(dtype, platform)
    check_load_options(
        settings,
        offload=offload,
        lora=lora,
        lora_fuse=lora_fuse,
        dit_quantization=dit_quantization,
        platform=platform,
        dtype=dt,
    )
    weights = parse_dit_weights(dit_weights, mi)
    home = torch.device("cpu") if offload != "none" and load_weights else dev
    with use_platform(platform), attention_settings(settings):
        components, scopes = build_components(
            mi, home, dt, variant=variant, load_weights=load_weights, dit_weights=weights
        )
        check_overrides_used(settings.component_overrides, scopes, mi.components.keys())
        used = [d.backend for s in scopes.values() for d in s.decisions]
        check_backend_config(settings.config, used)
    if settings.cuda_graphs and dev.type != "cuda":
        raise AttentionConfigError(f"--enable-cuda-graph needs a CUDA device (this run is on {dev.type})")
    adapters, placement = [], None
    if vae_parallel and load_weights:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise AttentionConfigError(
                "vae_parallel spreads the VAE decode over the ranks of a torch.distributed "
                "job; run it on several ranks (--num-gpus N) or leave it off"
            )
    if load_weights:
        adapters = load_loras(components, lora, fuse=lora_fuse)
        placement = ComponentPlacement(components, dev, offload, offload_group_blocks)
        vae = components.get("vae")
        if vae is not None and vae_tiling:
            vae.enable_tiling()  # diffusers' tiles: 256-pixel tiles, 192-pixel stride, blended seams
        if vae is not None and vae_slicing:
            vae.enable_slicing()  # one sample of the batch at a time
    for comp in DIT:  # after LoRA fusion and placement (the DiT on its device), before compilation
        if components.get(comp) is not None:
            model = components[comp]
            model.linear_quantization = (
                quantize_linears(model, dit_quantization) if load_weights else plan_linears(model, dit_quantization)
            )
    check_something_quantized([components[c].linear_quantization for c in DIT if components.get(c) is not None])
    if settings.compiled and load_weights:
        from ditattn.models.wan.compile import compile_blocks

        for comp in DIT:
            if components.get(comp) is not None:
                compile_blocks(components[comp], mode="reduce-overhead" if settings.cuda_graphs else None)
    return LoadedComponents(mi, components, scopes, settings, platform, dev, dt, adapters, placement)


def pretrained_kwargs(config, *, load_weights: bool, cache_dir: Optional[str], lora_fuse: Optional[bool]) -> dict:
    """``WanPipelineNative.from_pretrained``'s keyword arguments for a :class:`~ditattn.runconfig.RunConfig`:
    its model section, attention settings, ``vae_parallel`` and step cache; ``lora_fuse``: the command's
    default when the config leaves it unset."""
    m = config.model
    return dict(
        path=m.model_path,
        settings=config.attention_settings(),
        device=m.device,
        dtype=m.dtype,
        variant=m.model_variant,
        load_weights=load_weights,
        revision=m.revision,
        local_files_only=m.local_files_only,
        cache_dir=cache_dir,
        offload=m.offload,
        offload_group_blocks=m.offload_group_blocks,
        vae_tiling=m.vae_tiling,
        vae_slicing=m.vae_slicing,
        lora=m.lora_path,
        lora_fuse=m.lora_fuse if m.lora_fuse is not None else bool(lora_fuse),
        dit_quantization=m.dit_quantization,
        dit_weights=m.dit_weights,
        vae_parallel=config.parallel.vae_parallel,
        cache_backend=config.cache.cache_backend,
        cache_backend_config=config.cache.cache_backend_config,
    )
