"""A stock diffusers ``WanPipeline`` with ditattn's attention inside it: the DiT step of
diffusers alone next to ``ditattn.integrations.diffusers.apply(pipe, attention_backend="fa")`` and
``apply(pipe, attention_backend="video_sparse_attn", attention_backend_config={"sparsity": 0.9})``.

The pipeline is diffusers' own ``WanPipeline`` with the Wan2.1 DiT (1.3B by default, random weights:
nothing is downloaded), a one-layer UMT5 text encoder of the real width (4096) and the tiny VAE (the
VAE and text encoder are not what is measured).  Each variant runs the same call (same seed,
classifier-free guidance, ``--steps`` steps, latent output); CUDA events around every transformer
forward give the DiT time per denoising step (the two guidance passes together), median over the
steps of the timed call after a warm-up call.  ``rel_err``: the final latents against diffusers alone.

    python bench/diffusers_apply.py --arch 1.3b --res 480p --frames 81 --steps 3 --out $OUT

Prints a short table last; writes every figure to ``$OUT/diffusers_apply.json``.  CPU smoke run:
``python bench/diffusers_apply.py --arch tiny --res tiny --frames 5 --steps 2 --out /tmp/x``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import WAN_ARCH, WAN_COMMON, WAN_RES, Recorder, add_wan_args, env_info, fmt_table, guarded, rel_err  # noqa: E402

VARIANTS = ("diffusers", "ditattn:fa", "ditattn:video_sparse_attn:sparsity=0.9")


def build_pipeline(arch: str, device, dtype):
    """diffusers' WanPipeline around a random Wan2.1 DiT of ``arch``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from ditattn.models.tiny import SCHEDULER, VAE, build_byte_tokenizer

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(**WAN_COMMON, **WAN_ARCH[arch]).to(device, dtype)
    text = UMT5EncoderModel(
        UMT5Config(
            vocab_size=259,
            d_model=WAN_COMMON["text_dim"],
            d_kv=64,
            d_ff=256,
            num_layers=1,
            num_decoder_layers=0,
            num_heads=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            dropout_rate=0.0,
        )
    ).to(device, dtype)
    vae = AutoencoderKLWan(**VAE).to(device, torch.float32)
    pipe = WanPipeline(
        tokenizer=build_byte_tokenizer(),
        text_encoder=text,
        transformer=transformer,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


class StepTimer:
    """CUDA-event (CPU: wall-clock) time of every transformer forward, grouped by denoising step."""

    def __init__(self, model):
        self.rows: list[tuple[float, float]] = []  # (timestep, ms)
        self._open = []
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post, with_kwargs=True),
        ]

    def _pre(self, module, args, kwargs):
        t = kwargs.get("timestep")
        t = float(t.flatten()[0]) if isinstance(t, torch.Tensor) else float("nan")
        if torch.cuda.is_available():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open.append((t, ev))
        else:
            self._open.append((t, time.perf_counter()))

    def _post(self, module, args, kwargs, output):
        t, start = self._open.pop()
        if torch.cuda.is_available():
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.rows.append((t, (start, end)))
        else:
            self.rows.append((t, (time.perf_counter() - start) * 1e3))

    def step_ms(self) -> list[float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        per: dict[float, float] = {}
        for t, v in self.rows:
            ms = v[0].elapsed_time(v[1]) if isinstance(v, tuple) else v
            per[t] = per.get(t, 0.0) + ms
        return list(per.values())

    def remove(self):
        for h in self.handles:
            h.remove()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_wan_args(ap, text_len=False)
    ap.add_argument("--steps", type=int, default=3, help="denoising steps of each timed call")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma list: diffusers (alone), diffusers:NAME (its set_attention_backend), "
        "ditattn:BACKEND[:k=v;k=v] (apply)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.arch == "tiny":
        args.frames = min(args.frames, 5)

    from ditattn.integrations import diffusers as dd

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16
    h, w = WAN_RES[args.res]
    t0 = time.time()
    pipe = build_pipeline(args.arch, dev, dt)
    grid = ((args.frames - 1) // 4 + 1, h // 16, w // 16)
    rec = Recorder(
        args.out,
        "diffusers_apply",
        {
            "arch": args.arch,
            "res": args.res,
            "frames": args.frames,
            "steps": args.steps,
            "grid": grid,
            "env": env_info(),
        },
    )
    print(
        f"arch {args.arch} {h}x{w}x{args.frames} grid {grid} ({grid[0] * grid[1] * grid[2]} tokens), "
        f"built in {time.time() - t0:.1f}s",
        flush=True,
    )
    call = dict(
        prompt="a red fox running through fresh snow",
        height=h,
        width=w,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=5.0,
        output_type="latent",
    )
    reference = None
    for spec in [s for s in args.variants.split(",") if s]:
        side, _, rest = spec.partition(":")
        name, _, cfg = rest.partition(":")

        def run(spec=spec, side=side, name=name, cfg=cfg):
            dd.remove(pipe)
            pipe.transformer.set_attention_backend("native")
            if side == "diffusers" and name:
                pipe.transformer.set_attention_backend(name)
            elif side == "ditattn":
                config = dict(kv.split("=") for kv in cfg.split(";") if kv) or None
                config = {k: float(v) for k, v in config.items()} if config else None
                dd.apply(pipe, attention_backend=name, attention_backend_config=config)
            with torch.no_grad():
                pipe(**call, generator=torch.Generator("cpu").manual_seed(0))  # warm-up (kernels, autotune)
                timer = StepTimer(pipe.transformer)
                start = time.perf_counter()
                latents = pipe(**call, generator=torch.Generator("cpu").manual_seed(0)).frames
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                total = time.perf_counter() - start
                timer.remove()
            steps = sorted(timer.step_ms())
            backends = dd.call_backends(pipe) if side == "ditattn" else [name or "native"]
            return latents.float(), steps[len(steps) // 2], total, backends

        res = guarded(rec, spec, run)
        if res is None:
            continue
        latents, step_ms, total, backends = res
        if reference is None:
            reference, base = latents, step_ms
        row = rec.add(
            variant=spec,
            backends=",".join(backends),
            step_ms=step_ms,
            speedup=base / step_ms,
            call_s=total,
            rel_err=rel_err(latents, reference),
        )
        print(
            f"{spec:<42} step {step_ms:9.1f} ms  {row['speedup']:5.2f}x  call {total:6.2f} s  "
            f"err {row['rel_err']:.2e}  [{row['backends']}]",
            flush=True,
        )
    dd.remove(pipe)
    print()
    print(
        fmt_table(
            rec.data["rows"],
            [
                ("variant", "pipeline", ""),
                ("backends", "DiT attention", ""),
                ("step_ms", "DiT ms / step (CFG: 2 passes)", ".1f"),
                ("speedup", "vs diffusers alone", ".2f"),
                ("call_s", "call s", ".2f"),
                ("rel_err", "latents rel err", ".2e"),
            ],
        )
    )


if __name__ == "__main__":
    main()
