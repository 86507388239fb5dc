"""Judge the clips of a ``ditattn compare --save-clips`` run with the shapes model's semantic judge.

    ditattn compare --model-path ditattn:shapes --prompt "a red circle moving right" ... \
        --variant dense=torch_sdpa --variant vsa=video_sparse_attn:sparsity=0.75 --save-clips --output-path DIR
    python bench/judge_clips.py DIR

For every variant and clip (``DIR/clips.npz``, prompts and seeds from ``DIR/compare.json``) it runs
``ditattn.train.judge.judge`` on the prompt's colour, motion and shape (prompts in the training grammar with
one shape; others are listed as not judged): the dominant palette colour, whether it is the prompted one,
the centroid travel ``dx`` / ``dy`` (fractions of the frame, y down) or the area ratio ``growth``, whether
the motion is the prompted one, the shape the last frames show and whether it is the prompted one.
``same`` says whether the verdict (colour ok, motion ok, shape ok) equals
the reference variant's on the same prompt and seed.  Prints a table per clip and one per variant and
writes ``DIR/judge.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fmt_table  # noqa: E402  (also puts src/ on the path)


def judge_run(out_dir: str) -> dict:
    import numpy as np

    from ditattn.evaluation.report import clip_key
    from ditattn.train.judge import judge
    from ditattn.train.scenes import parse_caption

    rep_path, clips_path = os.path.join(out_dir, "compare.json"), os.path.join(out_dir, "clips.npz")
    for path in (rep_path, clips_path):
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"{path} not found (run ditattn compare with --save-clips --output-path {out_dir})"
            )
    with open(rep_path) as fh:
        rep = json.load(fh)
    rows = []
    with np.load(clips_path) as clips:
        for var in rep["variants"]:
            for run in var["runs"]:
                key = clip_key(var["name"], run["prompt_index"], run["seed"])
                if key not in clips.files:
                    raise KeyError(f"{clips_path} has no clip {key!r}")
                parsed = parse_caption(run["prompt"])
                psnr = run.get("psnr")
                row = {
                    "variant": var["name"],
                    "prompt": run["prompt"],
                    "seed": run["seed"],
                    "psnr": float(psnr) if isinstance(psnr, str) else psnr,
                    "ssim": run.get("ssim"),
                }
                if parsed is None or len(parsed) != 1:
                    row["judged"] = False
                else:
                    color, shape, motion = parsed[0]
                    v = judge(clips[key], color, motion, shape)
                    row.update(
                        judged=True,
                        dominant=v.dominant,
                        color_ok=v.color_ok,
                        motion_ok=v.motion_ok,
                        ok=v.ok,
                        area=v.area,
                        dx=v.dx,
                        dy=v.dy,
                        growth=v.growth,
                        shape=v.shape,
                        shape_ok=v.shape_ok,
                    )
                rows.append(row)
    ref = {(r["prompt"], r["seed"]): r for r in rows if r["variant"] == rep["reference"]}
    for r in rows:
        base = ref.get((r["prompt"], r["seed"]))
        if r.get("judged") and base is not None and base.get("judged"):
            keys = ("color_ok", "motion_ok", "shape_ok")
            r["same"] = all(r[k] == base[k] for k in keys)
    summary = []
    for var in rep["variants"]:
        sel = [r for r in rows if r["variant"] == var["name"] and r.get("judged")]
        summary.append(
            {
                "variant": var["name"],
                "judged": len(sel),
                "color_ok": sum(r["color_ok"] for r in sel),
                "motion_ok": sum(r["motion_ok"] for r in sel),
                "ok": sum(r["ok"] for r in sel),
                "shape_ok": sum(r["shape_ok"] for r in sel),
                "same": sum(bool(r.get("same")) for r in sel),
                "psnr_mean": var.get("summary", {}).get("psnr_mean"),
                "ssim_mean": var.get("summary", {}).get("ssim_mean"),
            }
        )
    return {"reference": rep["reference"], "rows": rows, "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="the --output-path of a ditattn compare --save-clips run")
    args = ap.parse_args(argv)
    try:
        res = judge_run(args.out_dir)
    except (FileNotFoundError, KeyError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    with open(os.path.join(args.out_dir, "judge.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    cols = [
        ("variant", "variant", ""),
        ("prompt", "prompt", ""),
        ("seed", "seed", ""),
        ("dominant", "dominant", ""),
        ("color_ok", "colour ok", ""),
        ("motion_ok", "motion ok", ""),
        ("dx", "dx", ".3f"),
        ("dy", "dy", ".3f"),
        ("growth", "growth", ".2f"),
        ("shape", "shape seen", ""),
        ("shape_ok", "shape ok", ""),
        ("same", f"same as {res['reference']}", ""),
        ("psnr", "PSNR", ".2f"),
        ("ssim", "SSIM", ".4f"),
    ]
    print(fmt_table(res["rows"], cols))
    print()
    print(
        fmt_table(
            res["summary"],
            [
                ("variant", "variant", ""),
                ("judged", "clips judged", ""),
                ("color_ok", "colour ok", ""),
                ("motion_ok", "motion ok", ""),
                ("ok", "both ok", ""),
                ("shape_ok", "shape ok", ""),
                ("same", f"same verdict as {res['reference']}", ""),
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
