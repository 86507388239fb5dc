"""Paired comparison of attention settings on whole generations (``ditattn compare``).

The same prompts and seeds run under two or more *variants* (each a backend, its config and
optional component overrides).  The first variant is the reference: every other variant's clips are
paired with the reference clip of the same prompt and seed (paired per prompt and seed because the
clip-to-clip spread is larger than the differences between methods), and the report gives per run
and per variant:

* time: the DiT's denoising time and the whole generation (text, denoise, decode), both without
  the capture hooks' own work; speed-ups against the reference;
* image quality against the reference clip: PSNR, SSIM, MS-SSIM (:mod:`.metrics`);
* per-layer attention: at the capture steps, each self-attention layer's output against the
  reference run's output of the same layer and step (``rel_err``/``cosine``: includes the drift of
  the trajectories), and against the reference backend run on the layer's own inputs
  (``in_context_*``: the approximation alone; :mod:`.capture`);
* the mean kept fraction of blocks for sparse backends (dense phases count as 1), the calls a sparse
  backend ran dense by its size rule or error budget (``dense_fallback_calls``, column ``fallbk``) and
  per layer ``sparse_layers`` (calls, kept fraction, dense fallbacks, heads run dense by the budget).

The summaries, files and text table are :mod:`.report`'s.

:func:`run_compare` takes a :class:`CompareConfig` and returns the report (a JSON-ready dict; an
infinite PSNR is the string ``"inf"`` in the JSON file); with ``output_dir`` it writes
``compare.json``, ``compare.png`` (quality against speed), ``contact_sheet.png`` (first, middle and
last frame of every clip side by side) and one side-by-side MP4 per prompt and seed.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import re
import sys
from typing import Any, Optional

import torch

from ditattn.attention.config import (
    parse_attention_backend_config,
    parse_component_overrides,
    unique_keys,
    validate_backend_config,
)
from ditattn.attention.context import AttentionSettings
from ditattn.attention.names import AttentionBackendEnum
from ditattn.errors import AttentionConfigError, short_repr
from ditattn.evaluation.capture import AttentionRecorder, resolve_steps, self_attention_layers
from ditattn.evaluation.metrics import clip_metrics
from ditattn.evaluation.report import format_summary, json_ready, summarise, write_outputs  # first two: re-exported
from ditattn.models.quantization import MODES, check_mode

log = logging.getLogger("ditattn.compare")

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
VARIANT_SYNTAX = (
    "NAME=BACKEND[:k=v;k=v][@component=backend,...][+fp8|+int8][+cache:METHOD[:k=v;k=v]] or "
    "NAME={json object with backend, config, components, dit_quantization, cache}; BACKEND 'auto' = "
    "automatic choice; +fp8 / +int8: 8-bit DiT linears; +cache: a step cache (teacache, magcache, "
    "first_block_cache) and its keys"
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One attention setting: ``backend`` (None = automatic), its ``config`` (validated against the
    backend's schema), component overrides ``{component[.role]: backend}`` and the DiT's linear
    quantization (``none``, ``fp8``, ``int8``: :mod:`ditattn.models.quantization`)."""

    name: str
    backend: Optional[str] = None
    config: dict = dataclasses.field(default_factory=dict)
    components: dict = dataclasses.field(default_factory=dict)
    dit_quantization: str = "none"
    #: the step cache: ``{"backend": method, "config": {keys given}}`` or None (no cache)
    cache: Optional[dict] = None

    def settings(self, base: Optional[AttentionSettings] = None) -> AttentionSettings:
        """The run settings: ``base`` (autotune, parallel degrees, compile flags) with this
        variant's backend, config and component overrides."""
        base = base or AttentionSettings()
        return dataclasses.replace(
            base,
            backend=AttentionBackendEnum.from_name(self.backend) if self.backend else None,
            config=dict(self.config),
            component_overrides=parse_component_overrides(self.components or None),
        )

    def label(self) -> str:
        cfg = ",".join(f"{k}={v}" for k, v in self.config.items())
        comps = ",".join(f"{k}={v}" for k, v in self.components.items())
        quant = f"+{self.dit_quantization}" if self.dit_quantization != "none" else ""
        cache = ""
        if self.cache:
            keys = ";".join(f"{k}={v}" for k, v in self.cache["config"].items())
            cache = f"+cache:{self.cache['backend']}" + (f":{keys}" if keys else "")
        head = f"{self.backend or 'auto'}" + (f":{cfg}" if cfg else "") + (f"@{comps}" if comps else "")
        return head + quant + cache


def parse_variant(text: str) -> Variant:
    """Parse ``NAME=BACKEND[:k=v;k=v][@component=backend,...]`` or ``NAME={"backend": ..., "config":
    {...}, "components": {...}}``; raises :class:`AttentionConfigError` naming what is wrong.  The
    variant's config holds the keys given (validated and coerced by the backend's schema)."""
    name, eq, spec = str(text).partition("=")
    name, spec = name.strip(), spec.strip()
    if not eq or not name:
        raise AttentionConfigError(f"bad --variant {text!r}: expected {VARIANT_SYNTAX}")
    if not _NAME.match(name):
        raise AttentionConfigError(f"bad --variant name {name!r}: use letters, digits and _ . + - only")
    cache = None
    if spec.startswith("{"):
        try:
            data = json.loads(spec, object_pairs_hook=unique_keys(f"--variant {name}"))
        except json.JSONDecodeError as exc:
            raise AttentionConfigError(
                f"--variant {name}: not valid JSON ({exc}); expected {VARIANT_SYNTAX}"
            ) from None
        unknown = set(data) - {"backend", "config", "components", "dit_quantization", "cache"}
        if unknown:
            raise AttentionConfigError(
                f"--variant {name}: unknown key(s) {sorted(unknown)}; accepted: backend, "
                "config, components, dit_quantization, cache"
            )
        cache = data.get("cache")
        backend, config, comps = data.get("backend"), data.get("config") or {}, data.get("components") or {}
        quant = data.get("dit_quantization") or "none"
        if not isinstance(config, dict) or not isinstance(comps, dict):
            raise AttentionConfigError(f"--variant {name}: 'config' and 'components' must be JSON objects")
    else:
        spec, _, cache = spec.partition("+cache:")
        cache = cache or None
        head, plus, tail = spec.rpartition("+")
        spec, quant = (head, tail.strip()) if plus and tail.strip() in MODES else (spec, "none")
        spec, at, comp_text = spec.partition("@")
        backend, colon, cfg_text = spec.partition(":")
        config = _config_pieces(name, cfg_text, parse_attention_backend_config) if colon else {}
        comps = dict(p.strip().partition("=")[::2] for p in comp_text.split(",") if p.strip()) if at else {}
    backend = str(backend or "").strip()
    if backend.lower() in ("", "auto"):
        if config:
            raise AttentionConfigError(
                f"--variant {name}: a config needs a backend (got 'auto' with keys {sorted(config)})"
            )
        canon = None
    else:
        canon = AttentionBackendEnum.from_name(backend).value
        full = validate_backend_config(canon, config)
        config = {k: full[k] for k in config}
    parse_component_overrides(comps or None)  # validates component keys and backend names
    return Variant(
        name,
        canon,
        config,
        {str(k).strip(): str(v).strip() for k, v in comps.items()},
        check_mode(quant),
        _variant_cache(name, cache),
    )


def _config_pieces(name: str, text: str, parse) -> dict:
    """The keys of a variant's ``k=v;k=v`` text, each ``;`` piece read by ``parse``; a key given twice is
    refused (the last would win silently, and the variant's label would no longer say what ran)."""
    config: dict = {}
    for piece in text.split(";"):
        if piece.strip():
            keys = parse(piece)
            twice = next((k for k in keys if k in config), None)
            if twice is not None:
                raise AttentionConfigError(
                    f"--variant {name}: key {short_repr(twice)} is given twice in {short_repr(text)}; give it once"
                )
            config.update(keys)
    return config


def _variant_cache(name: str, spec) -> Optional[dict]:
    """A variant's step cache from ``METHOD[:k=v;k=v]`` or ``{"backend": ..., "config": {...}}`` (None / "none":
    no cache), checked against the method's schema."""
    from ditattn.cache.config import parse_cache_backend_config, validate_cache

    if spec is None:
        return None
    if isinstance(spec, str):
        method, _, keys = spec.strip().partition(":")
        config = _config_pieces(name, keys, parse_cache_backend_config)
    elif isinstance(spec, dict) and set(spec) <= {"backend", "config"} and isinstance(spec.get("config", {}), dict):
        method, config = spec.get("backend"), dict(spec.get("config") or {})
    else:
        raise AttentionConfigError(
            f"--variant {name}: 'cache' must be METHOD[:k=v;k=v] or an object with backend and config"
        )
    try:
        found = validate_cache(method, config)
    except AttentionConfigError as exc:
        raise AttentionConfigError(f"--variant {name}: {exc}") from None
    return None if found is None else {"backend": found[0].name, "config": config}


@dataclasses.dataclass
class CompareConfig:
    """What ``ditattn compare`` runs.

    variants: at least two, unique names; the first is the reference.  prompts: at least one;
    seeds: at least one (every prompt runs with every seed).  Sampling fields None take the
    model's defaults.  capture_steps: denoising steps whose attention outputs are compared (negative
    = from the end); capture_rows: sequence rows kept per captured output (0 = all); in_context:
    also run the reference backend on each variant layer's own inputs at the capture steps.
    warmup: untimed generations per variant before the timed ones (one-time costs such as imports and
    kernel compilation would otherwise land on the first variant).
    output_dir: where the JSON, chart, contact sheet and videos go (None: nothing written); save_clips:
    also write every clip losslessly to ``clips.npz`` there (key ``<variant>_p<prompt index>_s<seed>``).
    base: settings shared by every variant (autotune, compile flags).  dit_weights: the DiT weights
    file(s) every variant loads (``--dit-weights``; None: the checkpoint's).
    """

    variants: list
    prompts: list
    seeds: list = dataclasses.field(default_factory=lambda: [0])
    model_path: Optional[str] = None
    device: Optional[str] = None
    dtype: Optional[str] = None
    negative_prompt: Optional[str] = None
    num_inference_steps: Optional[int] = None
    guidance_scale: Optional[float] = None
    height: Optional[int] = None
    width: Optional[int] = None
    num_frames: Optional[int] = None
    #: sampler settings for every variant (scheduler, flow_shift, timesteps, cfg_interval, cfg_batching)
    sampling: dict = dataclasses.field(default_factory=dict)
    capture_steps: tuple = (0, -1)
    capture_rows: int = 4096
    in_context: bool = True
    warmup: int = 1
    output_dir: Optional[str] = "outputs/compare"
    write_video: bool = True
    save_clips: bool = False
    fps: int = 16
    progress: bool = True
    base: Optional[AttentionSettings] = None
    dit_weights: Any = None

    def validate(self) -> None:
        if len(self.variants) < 2:
            raise AttentionConfigError(
                f"compare needs at least two --variant (got {len(self.variants)}); the first is the reference"
            )
        names = [v.name for v in self.variants]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise AttentionConfigError(f"--variant names must be unique; repeated: {', '.join(dup)}")
        if not self.prompts or any(not str(p).strip() for p in self.prompts):
            raise AttentionConfigError("compare needs at least one non-empty --prompt")
        if not self.seeds or any(int(s) < 0 for s in self.seeds):
            raise AttentionConfigError("--seed values must be integers >= 0")
        if self.capture_rows < 0:
            raise AttentionConfigError("--capture-rows must be >= 0 (0 = every row)")
        if self.warmup < 0:
            raise AttentionConfigError("--warmup must be >= 0")
        if self.num_inference_steps:
            resolve_steps(self.capture_steps, self.num_inference_steps)


# ------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reference_map(pipe) -> dict:
    """``{layer_key: (backend, config)}`` of the reference pipeline's self-attention layers."""
    return {layer.layer_key: (layer.backend, dict(layer.config)) for layer in self_attention_layers(pipe.dit_modules)}


def _cache_args(var: Variant) -> tuple:
    """``(cache_backend, cache_backend_config)`` of a variant's generate calls (``none``: no cache)."""
    return ("none", None) if var.cache is None else (var.cache["backend"], var.cache["config"])


def run_compare(cfg: CompareConfig) -> dict:
    """Run every variant over every prompt and seed and return the report (module docstring)."""
    from tqdm.auto import tqdm

    from ditattn.extras import require
    from ditattn.pipelines.wan import WanPipelineNative

    require("eval", "ditattn compare")  # its metrics and chart, before the first generation, not after all of them
    cfg.validate()
    for var in cfg.variants:  # every variant refused before the first run, not after it (plans, no weights)
        plan = WanPipelineNative.from_pretrained(
            cfg.model_path,
            var.settings(cfg.base),
            device=cfg.device,
            dtype=cfg.dtype,
            dit_quantization=var.dit_quantization,
            dit_weights=cfg.dit_weights,
            load_weights=False,
        )
        plan.prepare_cache(*_cache_args(var))
    pairs = [(pi, p, int(s)) for pi, p in enumerate(cfg.prompts) for s in cfg.seeds]
    bar = tqdm(
        total=len(cfg.variants) * len(pairs),
        desc="compare",
        unit="run",
        file=sys.stderr,
        disable=not cfg.progress,
        dynamic_ncols=True,
    )
    ref_map: Optional[dict] = None
    ref_recs: dict = {}
    frames: dict = {}  # (variant index, pair index) -> uint8 [F, H, W, 3]
    report_variants = []
    meta: dict[str, Any] = {}
    try:
        for vi, var in enumerate(cfg.variants):
            bar.set_postfix_str(var.name)
            pipe = WanPipelineNative.from_pretrained(
                cfg.model_path,
                var.settings(cfg.base),
                device=cfg.device,
                dtype=cfg.dtype,
                dit_quantization=var.dit_quantization,
                dit_weights=cfg.dit_weights,
            )
            d = pipe.defaults
            steps = cfg.num_inference_steps or d["num_inference_steps"]
            if cfg.sampling.get("timesteps"):
                steps = len(cfg.sampling["timesteps"])  # an explicit schedule overrides the step count
            capture = resolve_steps(cfg.capture_steps, steps)
            gen_kw = dict(
                height=cfg.height,
                width=cfg.width,
                num_frames=cfg.num_frames,
                num_inference_steps=steps,
                guidance_scale=cfg.guidance_scale,
                progress=False,
                **cfg.sampling,
            )
            gen_kw["cache_backend"], gen_kw["cache_backend_config"] = _cache_args(var)
            if vi == 0:
                ref_map = _reference_map(pipe)
                meta = {
                    "model": pipe.model_index.name,
                    "device": str(pipe.device),
                    "dtype": str(pipe.dtype).replace("torch.", ""),
                    "num_inference_steps": steps,
                    "capture_steps": sorted(capture),
                }
            for _ in range(cfg.warmup):
                pipe.generate(cfg.prompts[0], cfg.negative_prompt, seed=int(cfg.seeds[0]), **gen_kw)

            def on_step(done: int, total: int, dev=pipe.device) -> None:
                if done == total:  # the denoise time then covers the GPU work of the last step
                    _sync(dev)

            runs = []
            for ji, (pi, prompt, seed) in enumerate(pairs):
                reference = ref_map if (vi > 0 and cfg.in_context) else None
                with AttentionRecorder(
                    pipe.dit_modules, steps=capture, rows=cfg.capture_rows, reference=reference
                ) as rec:
                    res = pipe.generate(prompt, cfg.negative_prompt, seed=seed, on_step=on_step, **gen_kw)
                clip = res.frames[0]
                frames[(vi, ji)] = clip
                t = dict(res.timings)
                run = {
                    "prompt": prompt,
                    "prompt_index": pi,
                    "seed": seed,
                    "timings_s": t,
                    "dit_s": t["denoise"] - rec.hook_s,
                    "total_s": t["total"] - rec.hook_s,
                    "hook_s": rec.hook_s,
                    "attention_backends": res.attention_backends,
                    "kept_fraction": rec.kept_fraction(),
                    "sparse_calls": rec.sparse_calls,
                    "dense_phase_calls": rec.dense_calls,
                    "dense_fallback_calls": rec.fallback_calls,
                    "sparse_layers": res.stats.get("sparse_layers", {}),
                    "cache": res.cache,
                }
                if vi == 0:
                    ref_recs[ji] = rec
                else:
                    run.update(clip_metrics(clip, frames[(0, ji)]))
                    run["layers"] = rec.compare_to(ref_recs[ji])
                    # captured in the reference but not here: forwards a step cache reused ran no layer
                    run["layers_not_run"] = [
                        f"{k[0]}@{k[1]}" for k in sorted(set(ref_recs[ji].outputs) - set(rec.outputs))
                    ]
                    rec.outputs.clear()
                runs.append(run)
                bar.update(1)
            report_variants.append(
                {
                    "name": var.name,
                    "backend": var.backend or "auto",
                    "config": var.config,
                    "cache": var.cache,
                    "components": var.components,
                    "dit_quantization": var.dit_quantization,
                    "label": var.label(),
                    "dit_backends": pipe.dit_backends(),
                    "runs": runs,
                }
            )
            del pipe
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        bar.close()
    ref_runs = report_variants[0]["runs"]
    for i, rv in enumerate(report_variants):
        rv["summary"] = summarise(rv["runs"], None if i == 0 else ref_runs)
    report = {
        "reference": cfg.variants[0].name,
        "meta": meta,
        "prompts": list(cfg.prompts),
        "seeds": [int(s) for s in cfg.seeds],
        "variants": report_variants,
        "files": {},
        "notes": _not_run_notes(report_variants),
    }
    if cfg.output_dir:
        write_outputs(report, frames, pairs, cfg)
    return report


def _not_run_notes(variants: list) -> list[str]:
    """One note per variant whose runs skipped captured layers (their step reused by a step cache): its
    ``attn err`` covers only the layers that ran at the capture steps."""
    notes = []
    for rv in variants[1:]:
        missing = sorted({x for r in rv["runs"] for x in r.get("layers_not_run", [])})
        if missing:
            notes.append(
                f"variant {rv['name']}: {len(missing)} captured layer output(s) did not run (LAYER@STEP: "
                f"{', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}; their forward was reused by the step "
                "cache), so its attention error covers only the layers that ran; capture other steps with "
                "--capture-steps to measure them"
            )
    return notes


__all__ = ["CompareConfig", "Variant", "parse_variant", "run_compare", "format_summary", "json_ready"]
