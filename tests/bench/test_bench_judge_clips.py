"""bench/judge_clips.py judges the clips of a ``ditattn compare --save-clips`` run (hand-made clips here: a
red square that moves right under the reference variant and stays put under the other)."""

import json

import numpy as np


def _clip(moving: bool, frames=9, size=64):
    from ditattn.train.scenes import BACKGROUND, COLORS

    clip = np.empty((frames, size, size, 3), np.uint8)
    clip[:] = np.round(np.array(BACKGROUND) * 255).astype(np.uint8)
    red = np.round(np.array(COLORS["red"]) * 255).astype(np.uint8)
    for f in range(frames):
        x0 = 8 + (f * 4 if moving else 0)  # 32 px = half the frame over the clip
        clip[f, 24:40, x0 : x0 + 12] = red
    return clip


def _write_run(tmp_path):
    from ditattn.evaluation.report import clip_key

    prompts = ["a red square moving right", "a cat"]
    runs = lambda psnr: [
        {"prompt": p, "prompt_index": i, "seed": 0, "psnr": psnr, "ssim": 0.9}  # noqa: E731
        for i, p in enumerate(prompts)
    ]
    rep = {
        "reference": "dense",
        "variants": [
            {"name": "dense", "runs": runs(None), "summary": {}},
            {"name": "vsa", "runs": runs("inf"), "summary": {"psnr_mean": 20.0}},
        ],
    }
    (tmp_path / "compare.json").write_text(json.dumps(rep))
    clips = {
        clip_key("dense", 0, 0): _clip(True),
        clip_key("vsa", 0, 0): _clip(False),
        clip_key("dense", 1, 0): _clip(True),
        clip_key("vsa", 1, 0): _clip(True),
    }
    np.savez_compressed(tmp_path / "clips.npz", **clips)


def test_judge_clips_verdicts_and_agreement(tmp_path, run_bench):
    _write_run(tmp_path)
    out = run_bench("judge_clips.py", str(tmp_path))
    res = json.loads((tmp_path / "judge.json").read_text())
    rows = {(r["variant"], r["prompt"]): r for r in res["rows"]}
    dense, vsa = rows[("dense", "a red square moving right")], rows[("vsa", "a red square moving right")]
    assert dense["dominant"] == "red" and dense["color_ok"] and dense["motion_ok"] and dense["dx"] > 0.4
    assert vsa["color_ok"] and not vsa["motion_ok"] and abs(vsa["dx"]) < 1e-6 and vsa["same"] is False
    assert rows[("vsa", "a cat")]["judged"] is False  # not in the training grammar
    summary = {s["variant"]: s for s in res["summary"]}
    assert summary["dense"]["judged"] == 1 and summary["dense"]["ok"] == 1 and summary["dense"]["same"] == 1
    assert summary["vsa"]["ok"] == 0 and summary["vsa"]["color_ok"] == 1 and summary["vsa"]["same"] == 0
    assert dense["shape"] == "square" and dense["shape_ok"] and summary["dense"]["shape_ok"] == 1  # a 12 x 16 block
    assert "| vsa | a red square moving right | 0 | red | True | False |" in out


def test_judge_clips_without_clips_says_how_to_get_them(tmp_path, capsys):
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("judge_clips", os.path.join(root, "bench", "judge_clips.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "compare.json").write_text("{}")
    assert mod.main([str(tmp_path)]) == 2
    assert "--save-clips" in capsys.readouterr().err
