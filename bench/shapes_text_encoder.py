"""Frozen random vs jointly trained UMT5 for ``ditattn:shapes``: which one makes the DiT follow prompts?

    python bench/shapes_text_encoder.py --minutes 10 --out /tmp/te   # one CPU thread, both variants

A controlled CPU experiment, independent of VAE quality: the DiT stage of ``ditattn.train`` runs
unchanged, but on "pixel latents" (each clip average-pooled 8x8 in space and sampled every 4th
frame: 3 colour channels of the 16, the rest zero) instead of VAE latents, at 64x64x9.  Each
variant gets the same seed and wall time; then 30 single-shape prompts (every colour x motion)
are sampled (Euler flow steps with classifier-free guidance), upsampled back to pixels and judged
by :func:`ditattn.train.judge.judge`.  Prints one line per variant: steps, final loss, colour and
motion accuracy; writes ``results.json``.
"""
import argparse
import dataclasses
import json
import os
import types

import torch
import torch.nn.functional as F

from ditattn.train.dit_stage import TextEncoder, train_dit
from ditattn.train.flow import install_text_bias, shift_sigmas
from ditattn.train.judge import judge
from ditattn.train.recipe import Bucket, recipe as get_recipe
from ditattn.train.scenes import COLORS, MOTIONS, SHAPES
from ditattn.train.tracking import Budget, LossLog


class PixelLatents:
    """Stands in for the VAE: ``encode(x).latent_dist.mode()`` = pooled clip in 16 channels."""

    def __init__(self):
        self.config = types.SimpleNamespace(latents_mean=[0.0] * 16, latents_std=[0.5] * 3 + [1.0] * 13)

    def encode(self, x):
        z = F.avg_pool3d(x[:, :, ::4], kernel_size=(1, 8, 8))
        z = torch.cat([z, z.new_zeros(z.shape[0], 13, *z.shape[2:])], dim=1)
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: z))

    @staticmethod
    def decode(z, frames: int):
        rgb = z[:, :3].clamp(-1, 1)
        up = rgb.repeat_interleave(8, dim=-1).repeat_interleave(8, dim=-2)
        return up.repeat_interleave(4, dim=2)[:, :, :frames]


@torch.no_grad()
def sample(te, dit, prompts, seed, steps=20, guidance=5.0, shape=(16, 3, 8, 8), shift=3.0):
    text = TextEncoder(te, torch.device("cpu"))
    proc = install_text_bias(dit)
    ctx, bias = text(list(prompts) + [""] * len(prompts))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((len(prompts), *shape), generator=g)
    sig = shift_sigmas(torch.linspace(1, 0, steps + 1), shift)
    for i in range(steps):
        proc.bias = bias
        v = dit(torch.cat([x, x]), torch.full((2 * len(prompts),), float(sig[i]) * 1000), ctx).sample
        cond, uncond = v.chunk(2)
        x = x + (sig[i + 1] - sig[i]) * (uncond + guidance * (cond - uncond))
    return x  # normalised latents


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    base = get_recipe("cpu")
    base = dataclasses.replace(base, dit_stage=dataclasses.replace(
        base.dit_stage, buckets=(Bucket(64, 64, 9),), batch_tokens=48 * 32, max_batch=32, reuse=4))
    prompts = [(c, SHAPES[i % 3], m) for i, (c, m) in enumerate((c, m) for m in MOTIONS for c in COLORS)]
    results = {}
    for variant, text_lr in (("trained", base.dit_stage.text_lr), ("frozen", 0.0)):
        r = base.with_overrides(text_lr=text_lr)
        losses = LossLog(os.path.join(args.out, variant))
        te, dit, steps = train_dit(r, PixelLatents(), Budget(args.minutes * 60), torch.device("cpu"), args.seed, losses)
        z = sample(te, dit, [f"a {c} {s} {m}" for c, s, m in prompts], seed=7)
        clips = PixelLatents.decode(z * 0.5, 9)  # [N, 3, 9, 64, 64]: undo the colour channels' std 0.5
        frames = ((clips + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 4, 1).numpy()
        verdicts = [judge(fr, c, m) for fr, (c, s, m) in zip(frames, prompts)]
        loss = losses.stages["dit"][-50:]
        results[variant] = dict(steps=steps, final_loss=sum(x[2] for x in loss) / len(loss),
                                color_accuracy=sum(v.color_ok for v in verdicts) / len(verdicts),
                                motion_accuracy=sum(v.motion_ok for v in verdicts) / len(verdicts))
        print(variant, results[variant], flush=True)
        losses.write()
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
