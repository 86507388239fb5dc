"""Stacked bar chart of one DiT step per side/variant from ``bench/e2e.py --profile`` JSON.

python bench/plot_e2e.py $OUT/e2e480.json docs/img/e2e_step_h200.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    rows = [r for r in json.load(open(src))["rows"] if "profile" in r]
    cats = ["attention", "gemm", "quantize", "norm", "inductor-fused", "copy/cast", "elementwise/other"]
    labels = [f"{r['side']}\n{r['backend'].split(':')[0]}\n{r.get('variant', '')}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(rows)
    for c in cats:
        vals = [r["profile"]["categories_ms"].get(c, 0.0) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i] + 5, f"{r['ms']:.0f} ms", ha="center", fontsize=8)
    ax.set_ylabel("GPU ms per DiT step (profiled)")
    ax.set_title("Wan2.1-1.3B DiT step, 480p x 81 frames, H200, bf16")
    ax.legend(fontsize=7)
    plt.xticks(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
