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
* the mean kept fraction of blocks for sparse backends (dense phases count as 1).

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
import math
import os
import re
import sys
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ditattn.attention.config import (parse_attention_backend_config, parse_component_overrides,
                                      validate_backend_config)
from ditattn.attention.context import AttentionSettings
from ditattn.attention.names import AttentionBackendEnum
from ditattn.errors import AttentionConfigError
from ditattn.evaluation.capture import AttentionRecorder, resolve_steps, self_attention_layers
from ditattn.evaluation.metrics import clip_metrics
from ditattn.models.quantization import MODES, check_mode

log = logging.getLogger("ditattn.compare")

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
VARIANT_SYNTAX = ("NAME=BACKEND[:k=v;k=v][@component=backend,...][+fp8|+int8] or NAME={json object with backend, "
                  "config, components, dit_quantization}; BACKEND 'auto' = automatic choice; +fp8 / +int8: 8-bit DiT "
                  "linears")


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

    def settings(self, base: Optional[AttentionSettings] = None) -> AttentionSettings:
        """The run settings: ``base`` (autotune, parallel degrees, compile flags) with this
        variant's backend, config and component overrides."""
        base = base or AttentionSettings()
        return dataclasses.replace(
            base, backend=AttentionBackendEnum.from_name(self.backend) if self.backend else None,
            config=dict(self.config), component_overrides=parse_component_overrides(self.components or None))

    def label(self) -> str:
        cfg = ",".join(f"{k}={v}" for k, v in self.config.items())
        comps = ",".join(f"{k}={v}" for k, v in self.components.items())
        quant = f"+{self.dit_quantization}" if self.dit_quantization != "none" else ""
        return f"{self.backend or 'auto'}" + (f":{cfg}" if cfg else "") + (f"@{comps}" if comps else "") + quant


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
    if spec.startswith("{"):
        try:
            data = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise AttentionConfigError(f"--variant {name}: not valid JSON ({exc}); expected {VARIANT_SYNTAX}") from None
        unknown = set(data) - {"backend", "config", "components", "dit_quantization"}
        if unknown:
            raise AttentionConfigError(f"--variant {name}: unknown key(s) {sorted(unknown)}; accepted: backend, "
                                       "config, components, dit_quantization")
        backend, config, comps = data.get("backend"), data.get("config") or {}, data.get("components") or {}
        quant = data.get("dit_quantization") or "none"
        if not isinstance(config, dict) or not isinstance(comps, dict):
            raise AttentionConfigError(f"--variant {name}: 'config' and 'components' must be JSON objects")
    else:
        head, plus, tail = spec.rpartition("+")
        spec, quant = (head, tail.strip()) if plus and tail.strip() in MODES else (spec, "none")
        spec, at, comp_text = spec.partition("@")
        backend, colon, cfg_text = spec.partition(":")
        config = {}
        for piece in cfg_text.split(";") if colon else ():
            if piece.strip():
                config.update(parse_attention_backend_config(piece))
        comps = dict(p.strip().partition("=")[::2] for p in comp_text.split(",") if p.strip()) if at else {}
    backend = str(backend or "").strip()
    if backend.lower() in ("", "auto"):
        if config:
            raise AttentionConfigError(f"--variant {name}: a config needs a backend (got 'auto' with keys "
                                       f"{sorted(config)})")
        canon = None
    else:
        canon = AttentionBackendEnum.from_name(backend).value
        full = validate_backend_config(canon, config)
        config = {k: full[k] for k in config}
    parse_component_overrides(comps or None)  # validates component keys and backend names
    return Variant(name, canon, config, {str(k).strip(): str(v).strip() for k, v in comps.items()},
                   check_mode(quant))


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
    output_dir: where the JSON, chart, contact sheet and videos go (None: nothing written).
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
    capture_steps: tuple = (0, -1)
    capture_rows: int = 4096
    in_context: bool = True
    warmup: int = 1
    output_dir: Optional[str] = "outputs/compare"
    write_video: bool = True
    fps: int = 16
    progress: bool = True
    base: Optional[AttentionSettings] = None
    dit_weights: Any = None

    def validate(self) -> None:
        if len(self.variants) < 2:
            raise AttentionConfigError(f"compare needs at least two --variant (got {len(self.variants)}); the first "
                                       "is the reference")
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


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def _summarise(runs: list[dict], ref_runs: Optional[list[dict]]) -> dict:
    layers = [row for r in runs for row in r.get("layers", [])]
    dit = _mean(r["dit_s"] for r in runs)
    tot = _mean(r["total_s"] for r in runs)
    out = {"dit_s": dit, "total_s": tot, "kept_fraction": _mean(r["kept_fraction"] for r in runs)}
    if ref_runs is not None:
        rd, rt = _mean(r["dit_s"] for r in ref_runs), _mean(r["total_s"] for r in ref_runs)
        out["speedup_dit"] = rd / dit if dit else None
        out["speedup_total"] = rt / tot if tot else None
        ps = [r["psnr"] for r in runs]
        out["psnr_mean"] = math.inf if all(math.isinf(p) for p in ps) else _mean(p for p in ps if not math.isinf(p))
        out["psnr_min"] = min(ps)
        out["ssim_mean"], out["ssim_min"] = _mean(r["ssim"] for r in runs), min(r["ssim"] for r in runs)
        out["ms_ssim_mean"] = _mean(r["ms_ssim"] for r in runs)
        out["attn_rel_err_mean"] = _mean(x["rel_err"] for x in layers)
        out["attn_rel_err_max"] = max((x["rel_err"] for x in layers), default=None)
        out["attn_cosine_min"] = min((x["cosine"] for x in layers), default=None)
        ic = [x for x in layers if x["in_context_rel_err"] is not None]
        out["in_context_rel_err_mean"] = _mean(x["in_context_rel_err"] for x in ic)
        out["in_context_rel_err_max"] = max((x["in_context_rel_err"] for x in ic), default=None)
        out["in_context_cosine_min"] = min((x["in_context_cosine"] for x in ic), default=None)
    return out


def run_compare(cfg: CompareConfig) -> dict:
    """Run every variant over every prompt and seed and return the report (module docstring)."""
    from tqdm.auto import tqdm

    from ditattn.pipelines.wan import WanPipelineNative

    cfg.validate()
    pairs = [(pi, p, int(s)) for pi, p in enumerate(cfg.prompts) for s in cfg.seeds]
    bar = tqdm(total=len(cfg.variants) * len(pairs), desc="compare", unit="run", file=sys.stderr,
               disable=not cfg.progress, dynamic_ncols=True)
    ref_map: Optional[dict] = None
    ref_recs: dict = {}
    frames: dict = {}  # (variant index, pair index) -> uint8 [F, H, W, 3]
    report_variants = []
    meta: dict[str, Any] = {}
    try:
        for vi, var in enumerate(cfg.variants):
            bar.set_postfix_str(var.name)
            pipe = WanPipelineNative.from_pretrained(cfg.model_path, var.settings(cfg.base), device=cfg.device,
                                                     dtype=cfg.dtype, dit_quantization=var.dit_quantization,
                                                     dit_weights=cfg.dit_weights)
            d = pipe.defaults
            steps = cfg.num_inference_steps or d["num_inference_steps"]
            capture = resolve_steps(cfg.capture_steps, steps)
            gen_kw = dict(height=cfg.height, width=cfg.width, num_frames=cfg.num_frames, num_inference_steps=steps,
                          guidance_scale=cfg.guidance_scale, progress=False)
            if vi == 0:
                ref_map = _reference_map(pipe)
                meta = {"model": pipe.model_index.name, "device": str(pipe.device),
                        "dtype": str(pipe.dtype).replace("torch.", ""), "num_inference_steps": steps,
                        "capture_steps": sorted(capture)}
            for _ in range(cfg.warmup):
                pipe.generate(cfg.prompts[0], cfg.negative_prompt, seed=int(cfg.seeds[0]), **gen_kw)

            def on_step(done: int, total: int, dev=pipe.device) -> None:
                if done == total:  # the denoise time then covers the GPU work of the last step
                    _sync(dev)

            runs = []
            for ji, (pi, prompt, seed) in enumerate(pairs):
                reference = ref_map if (vi > 0 and cfg.in_context) else None
                with AttentionRecorder(pipe.dit_modules, steps=capture, rows=cfg.capture_rows,
                                       reference=reference) as rec:
                    res = pipe.generate(prompt, cfg.negative_prompt, seed=seed, on_step=on_step, **gen_kw)
                clip = res.frames[0]
                frames[(vi, ji)] = clip
                t = dict(res.timings)
                run = {"prompt": prompt, "prompt_index": pi, "seed": seed, "timings_s": t,
                       "dit_s": t["denoise"] - rec.hook_s, "total_s": t["total"] - rec.hook_s, "hook_s": rec.hook_s,
                       "attention_backends": res.attention_backends, "kept_fraction": rec.kept_fraction(),
                       "sparse_calls": rec.sparse_calls, "dense_phase_calls": rec.dense_calls}
                if vi == 0:
                    ref_recs[ji] = rec
                else:
                    run.update(clip_metrics(clip, frames[(0, ji)]))
                    run["layers"] = rec.compare_to(ref_recs[ji])
                    rec.outputs.clear()
                runs.append(run)
                bar.update(1)
            report_variants.append({"name": var.name, "backend": var.backend or "auto", "config": var.config,
                                    "components": var.components, "dit_quantization": var.dit_quantization,
                                    "label": var.label(),
                                    "dit_backends": pipe.dit_backends(), "runs": runs})
            del pipe
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        bar.close()
    ref_runs = report_variants[0]["runs"]
    for i, rv in enumerate(report_variants):
        rv["summary"] = _summarise(rv["runs"], None if i == 0 else ref_runs)
    report = {"reference": cfg.variants[0].name, "meta": meta,
              "prompts": list(cfg.prompts), "seeds": [int(s) for s in cfg.seeds], "variants": report_variants,
              "files": {}}
    if cfg.output_dir:
        write_outputs(report, frames, pairs, cfg)
    return report


# ------------------------------------------------------------------------------------------------
# outputs


def json_ready(obj):
    """``obj`` with non-finite floats as strings (``"inf"``, ``"-inf"``, ``"nan"``): strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def write_outputs(report: dict, frames: dict, pairs: Sequence, cfg: CompareConfig) -> None:
    """Write ``compare.json``, ``compare.png``, ``contact_sheet.png`` and the side-by-side videos
    into ``cfg.output_dir``; their paths go into ``report["files"]`` (a file that could not be
    written is listed in ``report["notes"]`` with the reason)."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    files, notes = report["files"], report.setdefault("notes", [])
    names = [v.name for v in cfg.variants]
    files["chart"] = quality_speed_chart(report, os.path.join(cfg.output_dir, "compare.png"))
    files["contact_sheet"] = contact_sheet(frames, pairs, names, report,
                                           os.path.join(cfg.output_dir, "contact_sheet.png"))
    if cfg.write_video:
        from ditattn.pipelines.output import save_frames

        files["videos"] = []
        for ji, (pi, _prompt, seed) in enumerate(pairs):
            clips = [frames[(vi, ji)] for vi in range(len(names))]
            if clips[0].shape[0] < 2:
                continue
            path = os.path.join(cfg.output_dir, f"side_by_side_p{pi}_s{seed}.mp4")
            try:
                files["videos"].append(save_frames(np.concatenate(clips, axis=2), path, fps=cfg.fps))
            except (ImportError, OSError, RuntimeError, ValueError) as exc:
                notes.append(f"side-by-side video not written ({type(exc).__name__}: {exc}); the contact sheet has "
                             "the frames")
                break
    path = os.path.join(cfg.output_dir, "compare.json")
    files["json"] = path
    with open(path, "w") as fh:
        json.dump(json_ready(report), fh, indent=1)


def quality_speed_chart(report: dict, path: str) -> str:
    """PNG: PSNR against the reference (left) and the mean in-context attention error (right),
    each against the DiT speed-up over the reference; one point per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    others = report["variants"][1:]
    finite = [v["summary"]["psnr_mean"] for v in others if v["summary"]["psnr_mean"] not in (None, math.inf)]
    top = (max(finite) + 5) if finite else 60.0
    for v in others:
        s = v["summary"]
        x = s.get("speedup_dit") or 0.0
        p = s["psnr_mean"]
        y = top if p == math.inf else p
        ax1.scatter([x], [y])
        ax1.annotate(v["name"] + (" (identical)" if p == math.inf else ""), (x, y), fontsize=8,
                     xytext=(4, 4), textcoords="offset points")
        err = s.get("in_context_rel_err_mean")
        if err is None:
            err = s.get("attn_rel_err_mean")
        if err:
            ax2.scatter([x], [err])
            ax2.annotate(v["name"], (x, err), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ref = report["reference"]
    ax1.set(xlabel=f"DiT speed-up over {ref}", ylabel=f"PSNR vs {ref} (dB)", title="whole clip")
    ax2.set(xlabel=f"DiT speed-up over {ref}", ylabel="attention rel. L2 error (in context)", title="per layer, mean",
            yscale="log")
    for ax in (ax1, ax2):
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['meta'].get('model', '')}: quality vs speed ({len(report['prompts'])} prompts x "
                 f"{len(report['seeds'])} seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def contact_sheet(frames: dict, pairs: Sequence, names: Sequence[str], report: dict, path: str,
                  max_width: int = 256) -> str:
    """PNG grid: one row per (prompt, seed), one column per variant, each cell the first, middle and
    last frame (scaled to at most ``max_width`` pixels wide), labelled with the variant and PSNR."""
    from PIL import Image, ImageDraw

    cells = {}
    for (vi, ji), clip in frames.items():
        idx = sorted({0, clip.shape[0] // 2, clip.shape[0] - 1})
        row = np.concatenate([clip[i] for i in idx], axis=1)
        img = Image.fromarray(row)
        scale = min(1.0, max_width * len(idx) / img.width)
        if scale < 1.0:
            img = img.resize((max(1, int(img.width * scale)), max(1, int(img.height * scale))))
        cells[(vi, ji)] = img
    cw = max(c.width for c in cells.values())
    ch = max(c.height for c in cells.values())
    label_h = 28
    sheet = Image.new("RGB", (cw * len(names), (ch + label_h) * len(pairs)), "white")
    draw = ImageDraw.Draw(sheet)
    for ji, (pi, prompt, seed) in enumerate(pairs):
        for vi, name in enumerate(names):
            x, y = vi * cw, ji * (ch + label_h)
            run = report["variants"][vi]["runs"][ji]
            extra = "reference" if vi == 0 else f"PSNR {run['psnr']:.1f} dB  SSIM {run['ssim']:.3f}"
            draw.text((x + 3, y + 2), f"{name}  [{prompt[:28]} s{seed}]", fill="black")
            draw.text((x + 3, y + 14), extra, fill="black")
            sheet.paste(cells[(vi, ji)], (x, y + label_h))
    sheet.save(path)
    return path


def format_summary(report: dict) -> str:
    """A short text table of the per-variant summaries (printed last by ``ditattn compare``)."""
    def f(v, fmt):
        width = int(fmt.split(".")[0])
        if v is None:
            return "-".rjust(width)
        if isinstance(v, float) and math.isinf(v):
            return "inf".rjust(width)
        return format(v, fmt)

    lines = [f"{'variant':<16} {'DiT s':>8} {'x DiT':>6} {'total s':>8} {'PSNR':>6} {'SSIM':>6} {'MS-SSIM':>7} "
             f"{'attn err':>9} {'in-ctx':>9} {'kept':>5}"]
    for v in report["variants"]:
        s = v["summary"]
        lines.append(f"{v['name']:<16} {f(s['dit_s'], '8.2f')} {f(s.get('speedup_dit'), '6.2f')} "
                     f"{f(s['total_s'], '8.2f')} {f(s.get('psnr_mean'), '6.2f')} {f(s.get('ssim_mean'), '6.4f')} "
                     f"{f(s.get('ms_ssim_mean'), '7.4f')} {f(s.get('attn_rel_err_mean'), '9.2e')} "
                     f"{f(s.get('in_context_rel_err_mean'), '9.2e')} {f(s['kept_fraction'], '5.2f')}")
    return "\n".join(lines)


__all__ = ["CompareConfig", "Variant", "parse_variant", "run_compare", "format_summary", "json_ready"]
