"""Capture the q/k/v of a DiT's self-attention layers from one generation (activation file for bench/fidelity.py).

    python bench/capture_qkv.py --model-path PATH --prompt "a red circle moving right" \
        --steps 10,-1 --layers 0,5,10 --out qkv.safetensors

Format ``ditattn-qkv-v1`` (see ``ditattn.evaluation.capture.capture_qkv`` and docs/evaluation.md).
The pipeline runs with its automatic attention backends (or ``--attention-backend``), so the captured
inputs are those a dense run produces.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-path",
        default=None,
        help="diffusers-format Wan folder or a built-in model (default: ditattn:shapes, the trained one)",
    )
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--steps", default="-1", help="denoising steps to capture, comma-separated (negative = from the end)"
    )
    ap.add_argument("--layers", default=None, help="DiT block indices to capture, comma-separated (default all)")
    ap.add_argument("--num-inference-steps", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--num-frames", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--out", required=True, help="output .safetensors path")
    args = ap.parse_args()

    from ditattn.attention.context import AttentionSettings
    from ditattn.attention.names import AttentionBackendEnum
    from ditattn.errors import AttentionConfigError
    from ditattn.evaluation.capture import capture_qkv
    from ditattn.pipelines.wan import WanPipelineNative

    try:
        settings = AttentionSettings(
            backend=AttentionBackendEnum.from_name(args.attention_backend) if args.attention_backend else None
        )
        pipe = WanPipelineNative.from_pretrained(args.model_path, settings, device=args.device, dtype=args.dtype)
        entries = capture_qkv(
            pipe,
            args.prompt,
            args.out,
            steps=[int(s) for s in args.steps.split(",")],
            layers=[int(x) for x in args.layers.split(",")] if args.layers else None,
            seed=args.seed,
            num_inference_steps=args.num_inference_steps,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
        )
    except (AttentionConfigError, ValueError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    for e in entries:
        print(f"{e['name']}: grid {e['video_shape']}")
    print(f"wrote {args.out} ({len(entries)} entries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
