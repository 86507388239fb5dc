"""The report of ``ditattn compare`` (:mod:`ditattn.evaluation.compare`): the per-variant summary
(:func:`summarise`), the files written next to it (``compare.json`` as strict JSON, the quality /
speed chart, the contact sheet, side-by-side videos) and the text table printed last.

``frames`` maps ``(variant index, pair index)`` to a clip, uint8 ``[F, H, W, 3]``; ``pairs`` lists
``(prompt index, prompt, seed)`` in run order.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Optional, Sequence

import numpy as np


def _mean(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def summarise(runs: list[dict], ref_runs: Optional[list[dict]]) -> dict:
    """One variant's summary of its ``runs`` (mean times, kept fraction; against the reference's
    ``ref_runs``, None for the reference itself: speed-ups, PSNR / SSIM / MS-SSIM, attention errors)."""
    layers = [row for r in runs for row in r.get("layers", [])]
    dit = _mean(r["dit_s"] for r in runs)
    tot = _mean(r["total_s"] for r in runs)
    out = {
        "dit_s": dit,
        "total_s": tot,
        "kept_fraction": _mean(r["kept_fraction"] for r in runs),
        "dense_fallback_calls": sum(r.get("dense_fallback_calls", 0) for r in runs),
    }
    caches = [r["cache"] for r in runs if r.get("cache")]
    if caches:  # step cache: DiT forwards per forward computed (and the same for block work)
        out["forwards_computed"] = sum(c["computed"] for c in caches)
        out["forward_ratio"] = sum(c["forwards"] for c in caches) / max(out["forwards_computed"], 1)
        out["block_ratio"] = sum(c["blocks_total"] for c in caches) / max(sum(c["blocks_computed"] for c in caches), 1)
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


# ------------------------------------------------------------------------------------------------
# files


def json_ready(obj):
    """``obj`` with non-finite floats as strings (``"inf"``, ``"-inf"``, ``"nan"``): strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def clip_key(variant: str, prompt_index: int, seed: int) -> str:
    """The key of one clip in ``clips.npz`` (``--save-clips``)."""
    return f"{variant}_p{prompt_index}_s{seed}"


def write_outputs(report: dict, frames: dict, pairs: Sequence, cfg) -> None:
    """Write ``compare.json``, ``compare.png``, ``contact_sheet.png``, the side-by-side videos and (with
    ``cfg.save_clips``) ``clips.npz`` into ``cfg.output_dir`` (``cfg``: the run's
    :class:`~ditattn.evaluation.compare.CompareConfig`);
    their paths go into ``report["files"]`` (a file that could not be written is listed in
    ``report["notes"]`` with the reason)."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    files, notes = report["files"], report.setdefault("notes", [])
    names = [v.name for v in cfg.variants]
    # an earlier compare's clips and videos in this folder would pass for this run's: they go
    ours = re.compile(r"^(clips\.npz|side_by_side_p\d+_s\d+\.mp4)$")
    stale = [f for f in sorted(os.listdir(cfg.output_dir)) if ours.match(f)]
    for f in stale:
        os.remove(os.path.join(cfg.output_dir, f))
    if stale:
        notes.append(f"removed {len(stale)} file(s) of an earlier compare in {cfg.output_dir}: {', '.join(stale[:6])}")
    files["chart"] = quality_speed_chart(report, os.path.join(cfg.output_dir, "compare.png"))
    files["contact_sheet"] = contact_sheet(
        frames, pairs, names, report, os.path.join(cfg.output_dir, "contact_sheet.png")
    )
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
                notes.append(
                    f"side-by-side video not written ({type(exc).__name__}: {exc}); the contact sheet has the frames"
                )
                break
    if getattr(cfg, "save_clips", False):
        path = os.path.join(cfg.output_dir, "clips.npz")
        np.savez_compressed(
            path,
            **{
                clip_key(names[vi], pi, seed): frames[(vi, ji)]
                for vi in range(len(names))
                for ji, (pi, _p, seed) in enumerate(pairs)
            },
        )
        files["clips"] = path
    path = os.path.join(cfg.output_dir, "compare.json")
    files["json"] = path
    from ditattn.files import atomic_write

    atomic_write(path, json.dumps(json_ready(report), indent=1))


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
        ax1.annotate(
            v["name"] + (" (identical)" if p == math.inf else ""),
            (x, y),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
        err = s.get("in_context_rel_err_mean")
        if err is None:
            err = s.get("attn_rel_err_mean")
        if err:
            ax2.scatter([x], [err])
            ax2.annotate(v["name"], (x, err), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ref = report["reference"]
    ax1.set(xlabel=f"DiT speed-up over {ref}", ylabel=f"PSNR vs {ref} (dB)", title="whole clip")
    ax2.set(
        xlabel=f"DiT speed-up over {ref}",
        ylabel="attention rel. L2 error (in context)",
        title="per layer, mean",
        yscale="log",
    )
    for ax in (ax1, ax2):
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{report['meta'].get('model', '')}: quality vs speed ({len(report['prompts'])} prompts x "
        f"{len(report['seeds'])} seeds)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def contact_sheet(
    frames: dict, pairs: Sequence, names: Sequence[str], report: dict, path: str, max_width: int = 256
) -> str:
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
    for ji, (_pi, prompt, seed) in enumerate(pairs):
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

    lines = [
        f"{'variant':<16} {'DiT s':>8} {'x DiT':>6} {'total s':>8} {'PSNR':>6} {'SSIM':>6} {'MS-SSIM':>7} "
        f"{'attn err':>9} {'in-ctx':>9} {'kept':>5} {'fwd x':>5} {'fallbk':>6}"
    ]
    for v in report["variants"]:
        s = v["summary"]
        lines.append(
            f"{v['name']:<16} {f(s['dit_s'], '8.2f')} {f(s.get('speedup_dit'), '6.2f')} "
            f"{f(s['total_s'], '8.2f')} {f(s.get('psnr_mean'), '6.2f')} {f(s.get('ssim_mean'), '6.4f')} "
            f"{f(s.get('ms_ssim_mean'), '7.4f')} {f(s.get('attn_rel_err_mean'), '9.2e')} "
            f"{f(s.get('in_context_rel_err_mean'), '9.2e')} {f(s['kept_fraction'], '5.2f')} "
            f"{f(s.get('forward_ratio'), '5.2f')} {f(s.get('dense_fallback_calls'), '6.0f')}"
        )
    return "\n".join(lines)
