"""FLOPs per training step of ``ditattn:shapes`` (preset ``full``) and the steps a budget buys.

    python bench/shapes_flops.py [--preset full] [--tflops 800] [--mfu 0.15 0.3] [--vae-s 180] [--dit-s 300]

Counts one clip of every shape with ``torch.utils.flop_counter`` on the CPU (forward; training =
3x forward), scales by the recipe's batch sizes, and prints per stage / bucket: GFLOP per clip,
TFLOP per step, and steps within the budget at the given fractions of peak (``--mfu``).
"""
import argparse

import torch
from torch.utils.flop_counter import FlopCounterMode

from ditattn.train.dit_stage import bucket_batch, build_text_encoder, build_transformer
from ditattn.train.flow import text_context
from ditattn.train.recipe import recipe as get_recipe
from ditattn.train.vae_stage import build_vae, decode_unclamped


def count(fn) -> float:
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="full")
    p.add_argument("--tflops", type=float, default=800.0, help="peak bf16 TFLOP/s")
    p.add_argument("--mfu", type=float, nargs="+", default=[0.1, 0.25])
    p.add_argument("--vae-s", type=float, default=180.0)
    p.add_argument("--dit-s", type=float, default=300.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    r = get_recipe(args.preset)
    vae, te, dit = build_vae(r, 0).eval(), build_text_encoder(r, 0).eval(), build_transformer(r, 0).eval()
    v = r.vae_stage
    x = torch.randn(1, 3, v.frames[0], v.crop, v.crop)
    enc = count(lambda: vae.encode(x).latent_dist.mode())
    z = vae.encode(x).latent_dist.mode()
    dec = count(lambda: decode_unclamped(vae, z))
    vae_step = 3 * (enc + dec) * v.batch
    rows = [("vae train", f"{v.crop}x{v.crop}x{v.frames[0]}", v.batch, (enc + dec) / 1e9, vae_step / 1e12, args.vae_s)]
    d = r.dit_stage
    ids = torch.randint(3, 259, (1, 40))
    hidden = te(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    ctx, _ = text_context(hidden, torch.ones_like(ids))
    total_w = sum(b.weight for b in d.buckets)
    mean_step = 0.0
    for b in d.buckets:
        lat = torch.randn(1, 16, (b.frames - 1) // 4 + 1, b.height // 8, b.width // 8)
        fwd = count(lambda: dit(lat, torch.tensor([500.0]), ctx))
        clip = torch.randn(1, 3, b.frames, b.height, b.width)
        e = count(lambda: vae.encode(clip).latent_dist.mode())
        B = bucket_batch(b, r)
        step = 3 * fwd * B + e * -(-B // d.reuse)
        mean_step += step * b.weight / total_w
        rows.append((f"dit train ({b.tokens()} tok)", f"{b.height}x{b.width}x{b.frames}", B, (3 * fwd + e / d.reuse) / 1e9,
                     step / 1e12, None))
    rows.append(("dit mean step", "weighted", "", "", mean_step / 1e12, args.dit_s))
    head = ["stage", "size", "batch", "GFLOP/clip", "TFLOP/step"] + [f"steps @{m:.0%}" for m in args.mfu]
    print(" | ".join(head))
    for name, size, batch, per_clip, per_step, budget in rows:
        steps = [f"{budget * args.tflops * m / per_step:,.0f}" if budget else "" for m in args.mfu]
        pc = f"{per_clip:.2f}" if per_clip != "" else ""
        print(" | ".join([name, size, str(batch), pc, f"{per_step:.2f}"] + steps))


if __name__ == "__main__":
    main()
