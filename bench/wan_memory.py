"""Whole generations of a Wan2.1-14B-architecture checkpoint (random weights) with and without CPU
offload and VAE tiling: peak GPU memory and time per stage.

The checkpoint is a skeleton folder (real configs: UMT5-XXL text encoder, the 14B DiT, the Wan 2.1
VAE; only the small VAE gets real random weights on disk); the native loaders are wrapped so the text
encoder and the DiT get random bf16 weights in memory instead of reading 40 GB of files.  Each
variant runs in its own process (clean peak-memory counters, one failure or time-out does not stop
the others) through the public pipeline: ``WanPipelineNative.from_pretrained(..., offload=...,
vae_tiling=...)`` then ``generate(...)``.

    python bench/wan_memory.py --res 720p --frames 81 --steps 2 --variants none,group+tiling --out $OUT/wan_memory.json

Variants: an offload mode (``none``, ``text_encoder``, ``model``, ``group``) with optional ``+tiling``
and ``+slicing``.  Prints a table last; writes every figure to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import WAN_ARCH, WAN_COMMON, WAN_RES  # noqa: E402

UMT5_XXL = dict(
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_decoder_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    model_type="umt5",
    architectures=["UMT5EncoderModel"],
)
# arch "tiny" (CPU smoke runs): a one-layer encoder of the same width over the byte tokenizer's 259 ids
UMT5_TINY = dict(UMT5_XXL, vocab_size=259, d_ff=512, num_layers=1, num_decoder_layers=1, num_heads=8)
SCHEDULER = dict(
    _class_name="UniPCMultistepScheduler",
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=5.0,
    solver_order=2,
    solver_type="bh2",
    predict_x0=True,
    lower_order_final=True,
    final_sigmas_type="zero",
)


def build_skeleton(folder: str, arch: str) -> None:
    """model_index.json + configs; the VAE (small) with random weights on disk; tokenizer files."""
    import torch
    from diffusers import AutoencoderKLWan

    from ditattn.models.tiny import VAE as TINY_VAE
    from ditattn.models.tiny import build_byte_tokenizer

    def dump(path, data):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(data, fh)

    dump(
        os.path.join(folder, "model_index.json"),
        {
            "_class_name": "WanPipeline",
            "_diffusers_version": "0.42.1",
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        },
    )
    dump(os.path.join(folder, "text_encoder", "config.json"), UMT5_TINY if arch == "tiny" else UMT5_XXL)
    dump(
        os.path.join(folder, "transformer", "config.json"),
        {"_class_name": "WanTransformer3DModel", **WAN_COMMON, **WAN_ARCH[arch]},
    )
    dump(os.path.join(folder, "scheduler", "scheduler_config.json"), SCHEDULER)
    build_byte_tokenizer().save_pretrained(os.path.join(folder, "tokenizer"))
    torch.manual_seed(0)
    # the Wan 2.1 VAE config with random weights; arch "tiny" (CPU smoke runs) takes the built-in tiny
    # model's VAE (same class and compression, base dim 8): the full one's 64x64 decode costs seconds
    vae = AutoencoderKLWan(**TINY_VAE) if arch == "tiny" else AutoencoderKLWan()
    vae.save_pretrained(os.path.join(folder, "vae"))


def _random_weights(load, keep):
    """Wrap a native loader: build the model on the meta device, then give every parameter random
    values (a repeated N(0, 0.02) block, cheap to write) in its run dtype on the load device."""
    import torch
    from torch import nn

    def wrapped(folder, *, dtype, device, variant=None, load_weights=True):
        model = load(folder, dtype=dtype, device=device, variant=variant, load_weights=False)
        if not load_weights:
            return model
        g = torch.Generator(device="cpu").manual_seed(0)
        block = (torch.randn(1 << 24, generator=g) * 0.02).to(device)
        for mod_name, mod in model.named_modules():
            for name, p in list(mod._parameters.items()):
                if p is None:
                    continue
                full = f"{mod_name}.{name}" if mod_name else name
                want = torch.float32 if dtype != torch.float32 and keep(full) else dtype
                t = torch.empty(p.shape, dtype=want, device=device)
                flat = t.view(-1)
                for i in range(0, flat.numel(), block.numel()):
                    n = min(block.numel(), flat.numel() - i)
                    flat[i : i + n].copy_(block[:n])
                mod._parameters[name] = nn.Parameter(t, requires_grad=False)
        return model.eval()

    return wrapped


def worker(args) -> dict:
    import torch

    import ditattn.pipelines.loading as loading
    from ditattn.models.wan.transformer import KEEP_FP32
    from ditattn.pipelines.wan import WanPipelineNative

    mode, *flags = args.worker.split("+")
    for comp, keep in (
        ("text_encoder", lambda n: n.split(".")[-2:-1] == ["wo"]),
        ("transformer", lambda n: any(part in KEEP_FP32 for part in n.split("."))),
    ):
        cls, what, load = loading.NATIVE_MODELS[comp]
        loading.NATIVE_MODELS[comp] = (cls, what, _random_weights(load, keep))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    pipe = WanPipelineNative.from_pretrained(
        args.folder,
        device=dev,
        dtype="bfloat16",
        offload=mode,
        offload_group_blocks=args.group_blocks,
        vae_tiling="tiling" in flags,
        vae_slicing="slicing" in flags,
    )
    if dev.type == "cuda":
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    resident = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    h, w = WAN_RES[args.res]
    res = pipe.generate(
        "a red fox running through fresh snow",
        height=h,
        width=w,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        guidance_scale=5.0,
        seed=0,
        progress=False,
    )
    frames = res.frames
    return {
        "variant": args.worker,
        "offload": mode,
        "vae_tiling": "tiling" in flags,
        "load_s": load_s,
        "resident_after_load_gib": resident / 2**30,
        "peak_gib": None if res.peak_memory is None else res.peak_memory / 2**30,
        "timings_s": res.timings,
        "denoise_s_per_step": res.timings["denoise"] / args.steps,
        "frames_shape": list(frames.shape),
        "frames_std": float(frames.std()),
        "offloaded": pipe.placement.offloaded,
        "backends": res.attention_backends,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="14b", choices=sorted(WAN_ARCH))
    ap.add_argument("--res", default="720p", choices=sorted(WAN_RES))
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--variants", default="none,group+tiling")
    ap.add_argument("--group-blocks", type=int, default=1, help="DiT blocks per streamed group (group offload)")
    ap.add_argument("--timeout-s", type=float, default=270, help="time limit of each variant's process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    results = {"arch": args.arch, "res": args.res, "frames": args.frames, "steps": args.steps, "rows": []}
    with tempfile.TemporaryDirectory(prefix="wan-skeleton-") as folder:
        t0 = time.perf_counter()
        build_skeleton(folder, args.arch)
        print(f"skeleton checkpoint in {time.perf_counter() - t0:.1f}s", flush=True)
        for variant in [v for v in args.variants.split(",") if v]:
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                variant,
                "--folder",
                folder,
                "--arch",
                args.arch,
                "--res",
                args.res,
                "--frames",
                str(args.frames),
                "--steps",
                str(args.steps),
                "--group-blocks",
                str(args.group_blocks),
            ]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
                line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
                row = json.loads(line[7:]) if line else {"variant": variant, "error": proc.stderr[-1500:]}
            except subprocess.TimeoutExpired:
                row = {"variant": variant, "error": f"time limit {args.timeout_s:g}s"}
            row["wall_s"] = time.perf_counter() - t0
            results["rows"].append(row)
            print(json.dumps(row)[:400], flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump(results, fh, indent=2)

    print(f"\nWan {args.arch} {args.res} x {args.frames} frames, {args.steps} steps, CFG, bf16")
    print(
        f"{'variant':<22}{'peak GiB':>10}{'resident':>10}{'load s':>8}{'text s':>8}{'s/step':>8}{'decode s':>10}"
        f"{'total s':>9}"
    )
    for r in results["rows"]:
        if "error" in r:
            print(
                f"{r['variant']:<22} error: {r['error'].strip().splitlines()[-1][:90] if r['error'].strip() else '?'}"
            )
            continue
        t = r["timings_s"]
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(
            f"{r['variant']:<22}{peak:>10}{r['resident_after_load_gib']:>10.1f}{r['load_s']:>8.1f}{t['text']:>8.1f}"
            f"{r['denoise_s_per_step']:>8.1f}{t['decode']:>10.1f}{t['total']:>9.1f}"
        )


if __name__ == "__main__":
    main()
