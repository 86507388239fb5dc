"""Whole text-to-video generation: ditattn's native Wan pipeline against diffusers' WanPipeline.

Writes a diffusers-format Wan 2.1 folder with random weights: the Wan2.1-1.3B DiT architecture
(bf16), the real Wan 2.1 VAE architecture (``AutoencoderKLWan()`` defaults), a one-layer UMT5 text
encoder of the real width (4096, so the DiT's text projection is full size; the 24-layer 4.7B
encoder is out of scope here: it runs once per prompt), the byte tokenizer and UniPC.  Then times
one full generation on each side (warm-up run first, same prompt, steps, size, CFG), and reports
the per-stage split of ours (text, denoise, decode).

    python bench/generate.py --steps 4 --out $OUT/generate.json
    python bench/generate.py --steps 50 --skip-diffusers --backends auto --out $OUT/generate50.json
    python bench/generate.py --steps 4 --guidance 1 --sampling "scheduler=lcm;timesteps=1000/750/500/250;flow_shift=5"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from common import WAN_ARCH, WAN_COMMON, WAN_RES, add_wan_args  # noqa: E402


def build_folder(path: str, arch: str) -> None:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from ditattn.models.tiny import SCHEDULER, TEXT_ENCODER, build_byte_tokenizer

    torch.manual_seed(0)
    te = dict(TEXT_ENCODER, d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=4)
    text_encoder = UMT5EncoderModel(UMT5Config(**te)).eval()
    transformer = WanTransformer3DModel(**WAN_COMMON, **WAN_ARCH[arch]).to(torch.bfloat16).eval()
    vae = AutoencoderKLWan().eval()
    pipe = WanPipeline(
        tokenizer=build_byte_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**SCHEDULER),
        transformer=transformer,
    )
    pipe.save_pretrained(path, safe_serialization=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_wan_args(ap, text_len=False)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--backends", default="auto,video_sparse_attn:sparsity=0.9", help="ours, comma list")
    ap.add_argument("--folder", default=None, help="reuse/write the model folder here (default: a temp dir)")
    ap.add_argument("--skip-diffusers", action="store_true", help="time ditattn only (no diffusers baseline)")
    ap.add_argument(
        "--sampling",
        default="",
        help="extra generate() arguments of ours as k=v;k=v, e.g. "
        "scheduler=lcm;timesteps=1000/750/500/250;flow_shift=5;cfg_batching=sequential",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sampling = parse_sampling(args.sampling)
    h, w = WAN_RES[args.res]
    folder = args.folder or os.path.join(tempfile.mkdtemp(), "wan-random")
    t0 = time.time()
    if not os.path.exists(os.path.join(folder, "model_index.json")):
        build_folder(folder, args.arch)
    print(f"model folder {folder} ready in {time.time() - t0:.1f}s", flush=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: smoke runs of the script only
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    prompt = "a red fox running through fresh snow, cinematic"
    rows = []

    def dump():
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(
                    {
                        "arch": args.arch,
                        "res": args.res,
                        "frames": args.frames,
                        "steps": args.steps,
                        "guidance": args.guidance,
                        "rows": rows,
                    },
                    fh,
                    indent=2,
                )

    if not args.skip_diffusers:
        run_diffusers(folder, args, h, w, dev, sync, prompt, rows, dump)
    run_ours(folder, args, h, w, dev, sync, prompt, rows, dump, sampling)
    base = rows[0]["total_s"]
    print(f"\n{args.arch} {args.res} x {args.frames} frames, {args.steps} steps, CFG {args.guidance} {args.sampling}")
    print(f"{'side':<27} {'backend':<24} {'total s':>8} {'vs first':>8}  stages")
    for r in rows:
        st = " ".join(f"{k}={v:.2f}" for k, v in r.get("stages_s", {}).items())
        print(f"{r['side']:<27} {r['backend']:<24} {r['total_s']:8.2f} {base / r['total_s']:8.2f}x  {st}")


def parse_sampling(text: str) -> dict:
    """``"scheduler=lcm;timesteps=1000/750/500/250"`` -> generate() keyword arguments."""
    out: dict = {}
    for item in [i for i in text.split(";") if i]:
        key, _, value = item.partition("=")
        out[key] = (
            [float(v) for v in value.split("/")]
            if key == "timesteps"
            else (float(value) if key == "flow_shift" else value)
        )
    return out


def run_diffusers(folder, args, h, w, dev, sync, prompt, rows, dump):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.bfloat16)
    pipe.vae.to(torch.float32)
    pipe.to(dev)
    run = lambda n, out="np": pipe(
        prompt=prompt,
        height=h,
        width=w,
        num_frames=args.frames,
        num_inference_steps=n,
        guidance_scale=args.guidance,
        output_type=out,
        generator=torch.Generator(dev).manual_seed(0),
    )
    run(1, "latent")  # warm-up (no decode)
    sync()
    t0 = time.perf_counter()
    run(args.steps)
    sync()
    rows.append({"side": "diffusers WanPipeline", "backend": "native (SDPA)", "total_s": time.perf_counter() - t0})
    print(rows[-1], flush=True)
    dump()
    del pipe
    torch.cuda.empty_cache() if dev == "cuda" else None


def run_ours(folder, args, h, w, dev, sync, prompt, rows, dump, sampling):
    from ditattn.attention.config import parse_attention_backend_config
    from ditattn.attention.context import AttentionSettings
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.pipelines.wan import WanPipelineNative

    for spec in [s for s in args.backends.split(",") if s]:
        name, _, cfg = spec.partition(":")
        settings = AttentionSettings(
            backend=None if name == "auto" else B.from_name(name),
            config=parse_attention_backend_config(cfg.replace(";", ",")),
        )
        native = WanPipelineNative.from_pretrained(folder, settings, device=dev, dtype="bfloat16")
        gen = lambda n, out="uint8": native.generate(
            prompt,
            height=h,
            width=w,
            num_frames=args.frames,
            num_inference_steps=n,
            guidance_scale=args.guidance,
            progress=False,
            output_type=out,
            **sampling,
        )
        gen(1, "latent")  # warm-up (no decode)
        sync()
        t0 = time.perf_counter()
        res = gen(args.steps)
        sync()
        rows.append(
            {
                "side": "ditattn WanPipelineNative",
                "backend": spec,
                "chosen": res.attention_backends,
                "total_s": time.perf_counter() - t0,
                "stages_s": res.timings,
            }
        )
        print(rows[-1], flush=True)
        dump()
        del native
        torch.cuda.empty_cache() if dev == "cuda" else None


if __name__ == "__main__":
    main()
