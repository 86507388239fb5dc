"""Write the golden reference clip of ``ditattn:shapes`` that ``tests/models/test_shapes_model.py`` reproduces.

    python -m ditattn.train.reference            # -> tests/data/shapes_golden.npz

Generates :data:`GOLDEN` (prompt, seed, and the model's sampling defaults) with the native
pipeline on the CPU in float32 from the installed package weights, and stores the uint8 frames
with the settings and the digest of the weights.  Run it again whenever the shipped weights change.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

GOLDEN = dict(prompt="a red circle moving right", seed=0)
DEFAULT_OUT = os.path.join("tests", "data", "shapes_golden.npz")


def generate_golden(package=None, cache_root=None) -> dict:
    """The golden clip and its settings: ``{"frames": uint8 [F, H, W, 3], "prompt", "seed", "height",
    "width", "num_frames", "num_inference_steps", "guidance_scale", "digest"}``."""
    import torch

    from ditattn.models.shapes import package_digest, sampling_defaults, shapes_model_path
    from ditattn.pipelines.wan import WanPipelineNative

    d = sampling_defaults(package)
    pipe = WanPipelineNative.from_pretrained(shapes_model_path(cache_root, package), device="cpu", dtype=torch.float32)
    res = pipe.generate(GOLDEN["prompt"], seed=GOLDEN["seed"], progress=False, **d)
    return dict(frames=res.frames[0], digest=package_digest(package), **GOLDEN, **d)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ditattn.train.reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"where to write (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    ref = generate_golden()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez_compressed(args.out, **{k: np.asarray(v) for k, v in ref.items()})
    print(
        f"wrote {args.out}: {ref['prompt']!r} seed {ref['seed']}, {ref['width']}x{ref['height']}x"
        f"{ref['num_frames']}, {ref['num_inference_steps']} steps, weights {ref['digest']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
