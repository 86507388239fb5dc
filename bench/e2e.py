"""End-to-end DiT step: the native Wan transformer against diffusers' WanTransformer3DModel.

Builds the Wan2.1 architecture (1.3B by default; ``--arch 14b``) with random weights, loads the
SAME weights into both models, checks the outputs agree within bf16 tolerance and times one DiT
forward of each side by side (CUDA events, warm-up first, median of --repeats), for diffusers'
default attention and ours with several backends.  ``--i2v`` builds the image-to-video DiT instead
(Wan2.1-I2V: 36 input channels, 257 CLIP image tokens of width 1280 through the added image
cross-attention; the text stays 512 tokens, which diffusers' I2V attention assumes).

    python bench/e2e.py --arch 1.3b --res 480p --out $OUT/e2e.json
    python bench/e2e.py --arch 14b --res 480p --i2v --out $OUT/e2e_i2v.json

Prints a short table last; writes every figure to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import WAN_ARCH as ARCH  # noqa: E402
from common import WAN_COMMON, add_wan_args, profile_step, rel_err
from common import WAN_RES as RES


def median_ms(fn, warmup=2, repeats=5):
    if not torch.cuda.is_available():  # CPU smoke runs
        import time as _t

        fn()
        ts = []
        for _ in range(repeats):
            t0 = _t.perf_counter()
            fn()
            ts.append((_t.perf_counter() - t0) * 1e3)
        return sorted(ts)[len(ts) // 2]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def wan_inputs(args, cfg: dict, dev, dt):
    """One DiT step's inputs for ``--res`` / ``--frames`` / ``--text-len`` (seeded): latents ``[1,
    in_channels, F', H/8, W/8]``, timestep ``[1]`` (500), text ``[1, text_len, text_dim]``, CLIP
    image tokens ``[1, 257, 1280]`` when ``cfg`` has an ``image_dim`` (else None) and the latent grid."""
    h, w = RES[args.res]
    lat_f = (args.frames - 1) // 4 + 1
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, cfg["in_channels"], lat_f, h // 8, w // 8, device=dev, generator=g, dtype=dt)
    t = torch.tensor([500.0], device=dev)
    txt = torch.randn(1, args.text_len, cfg["text_dim"], device=dev, generator=g, dtype=dt)
    img = torch.randn(1, 257, 1280, device=dev, generator=g, dtype=dt) if cfg.get("image_dim") else None
    return x, t, txt, img, (lat_f, h // 16, w // 16)


def native_model(cfg: dict, sd: dict, spec: str, dt, dev, *, cast: bool = True):
    """The native Wan DiT of diffusers config ``cfg`` with the weights ``sd`` (assigned, not copied),
    its attention from ``spec`` (``auto`` or ``name[:k=v;k=v]``), on ``dev`` in compute dtype ``dt``;
    returns ``(model, the backends its layers chose)``."""
    from ditattn.attention.config import parse_attention_backend_config
    from ditattn.attention.context import AttentionSettings, attention_settings, component_scope
    from ditattn.attention.names import AttentionBackendEnum as B
    from ditattn.models.wan.transformer import KEEP_FP32, WanTransformer, WanTransformerConfig, cast_model

    name, _, cfg_txt = spec.partition(":")
    backend = None if name == "auto" else B.from_name(name)
    settings = AttentionSettings(backend=backend, config=parse_attention_backend_config(cfg_txt.replace(";", ",")))
    with attention_settings(settings), component_scope("transformer"):
        with torch.device("meta"):  # no random init: the weights come from sd
            model = WanTransformer(WanTransformerConfig.from_dict(cfg), dtype=dt)
    model.load_state_dict(sd, strict=True, assign=True)
    if cast:
        cast_model(model, dt, KEEP_FP32)
    model.to(dev).eval().requires_grad_(False)
    chosen = sorted({m.backend.value for m in model.modules() if hasattr(m, "backend") and hasattr(m, "role")})
    return model, chosen


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_wan_args(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--backends",
        default="auto,fa,torch_cudnn_sdpa,video_sparse_attn:sparsity=0.9",
        help="comma list of ours; name:k=v;k=v for a config",
    )
    ap.add_argument("--diffusers-backends", default="native,_native_cudnn")
    ap.add_argument(
        "--variants",
        default="eager",
        help="comma list of: eager (fused kernels, the default model), unfused (plain PyTorch ops, "
        "set_fused_ops(False)), compiled (torch.compile of each block, attention eager; runs last)",
    )
    ap.add_argument("--compile", action="store_true", help="shorthand: add 'compiled' to --variants")
    ap.add_argument(
        "--i2v",
        action="store_true",
        help="the image-to-video DiT (Wan2.1-I2V layout: in_channels 36, image_dim 1280, image cross-attention)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile one step per row (GPU time per kernel category, top kernels)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from diffusers import WanTransformer3DModel

    from ditattn.attention.context import forward_context
    from ditattn.models.wan.transformer import KEEP_FP32, cast_model

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16
    cfg = dict(**WAN_COMMON, **ARCH[args.arch])
    if args.i2v:
        if args.text_len != 512:
            ap.error("--i2v needs --text-len 512 (diffusers' image cross-attention splits the context at 512 tokens)")
        cfg.update(
            in_channels=36, image_dim=1280, added_kv_proj_dim=cfg["num_attention_heads"] * cfg["attention_head_dim"]
        )
    torch.manual_seed(0)
    t0 = time.time()
    ref = WanTransformer3DModel(**cfg)
    sd = ref.state_dict()
    cast_model(ref, dt, KEEP_FP32).to(dev).eval()
    if args.arch == "tiny":
        args.frames, args.text_len = 5, (512 if args.i2v else 16)  # diffusers' I2V attention needs 512
    x, t, txt, img, grid = wan_inputs(args, cfg, dev, dt)
    ref_kw = {"encoder_hidden_states_image": img} if args.i2v else {}
    seq = grid[0] * grid[1] * grid[2]
    print(
        f"arch {args.arch}{' i2v' if args.i2v else ''} res {args.res} frames {args.frames} grid {grid} S={seq} "
        f"built in {time.time() - t0:.1f}s",
        flush=True,
    )

    def dump(res):  # after every row, so a time limit keeps what was measured
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(res, fh, indent=2)

    results = {
        "arch": args.arch,
        "i2v": args.i2v,
        "res": args.res,
        "frames": args.frames,
        "seq": seq,
        "grid": grid,
        "rows": [],
    }

    with torch.no_grad():
        ref_out = None
        for name in [s for s in args.diffusers_backends.split(",") if s]:
            try:
                ref.set_attention_backend(name)
                fn = lambda: ref(hidden_states=x, timestep=t, encoder_hidden_states=txt, return_dict=False, **ref_kw)[
                    0
                ]
                out = fn()
                ms = median_ms(fn, repeats=args.repeats)
                if ref_out is None:
                    ref_out = out.float()
                row = {"side": "diffusers", "backend": name, "ms": ms, "rel_err": rel_err(out, ref_out)}
                if args.profile and torch.cuda.is_available():
                    row["profile"] = profile_step(fn)
                    print(f"  profile {row['profile']['categories_ms']}", flush=True)
                results["rows"].append(row)
                print(f"diffusers {name:<22} {ms:8.1f} ms", flush=True)
            except Exception as exc:  # a diffusers backend missing here is reported, not fatal
                results["rows"].append({"side": "diffusers", "backend": name, "error": str(exc)[:300]})
                print(f"diffusers {name}: {exc}", flush=True)
        base_ms = next(r["ms"] for r in results["rows"] if "ms" in r)
        ref.cpu()
        del ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        for spec in [s for s in args.backends.split(",") if s]:
            try:
                model, chosen = native_model(cfg, sd, spec, dt, dev)
                # compile_blocks compiles the blocks IN PLACE, so "compiled" runs after the eager variants
                wanted = [v for v in args.variants.split(",") if v] + (["compiled"] if args.compile else [])
                for label in [v for v in ("unfused", "eager", "compiled") if v in wanted]:
                    model.set_fused_ops(label != "unfused")
                    if label == "compiled":
                        from ditattn.models.wan.compile import compile_blocks

                        compile_blocks(model)
                    fn = lambda: model(x, t, txt, img)
                    with forward_context(step=10**6, num_steps=10**6):  # past any dense warm-up steps
                        out = fn()
                        if torch.cuda.is_available():
                            torch.cuda.synchronize()
                        ms = median_ms(fn, repeats=args.repeats)
                    err = rel_err(out, ref_out)
                    row = {
                        "side": "ditattn",
                        "backend": spec,
                        "variant": label,
                        "chosen": chosen,
                        "ms": ms,
                        "speedup_vs_diffusers_default": base_ms / ms,
                        "rel_err_vs_diffusers": err,
                    }
                    if args.profile and torch.cuda.is_available():
                        with forward_context(step=10**6, num_steps=10**6):
                            row["profile"] = profile_step(fn)
                        print(
                            f"  profile wall {row['profile']['wall_ms']:.1f} busy {row['profile']['busy_ms']:.1f} "
                            f"{ {k: round(v, 1) for k, v in row['profile']['categories_ms'].items()} }",
                            flush=True,
                        )
                    results["rows"].append(row)
                    dump(results)
                    print(
                        f"ditattn  {spec:<22} {label:<8} {ms:8.1f} ms  {base_ms / ms:5.2f}x  err {err:.2e}  {chosen}",
                        flush=True,
                    )
                del model
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception as exc:
                results["rows"].append(
                    {"side": "ditattn", "backend": spec, "error": f"{type(exc).__name__}: {exc}"[:400]}
                )
                print(f"ditattn  {spec}: {type(exc).__name__}: {exc}", flush=True)

    dump(results)
    print("\nside      backend                variant    ms      vs diffusers default   rel err")
    for r in results["rows"]:
        if "ms" in r:
            err = r.get("rel_err_vs_diffusers", r.get("rel_err", 0))
            print(
                f"{r['side']:<9} {r['backend']:<22} {r.get('variant', ''):<8} {r['ms']:8.1f} "
                f"{r.get('speedup_vs_diffusers_default', 1.0):8.2f}x {err:.2e}"
            )


if __name__ == "__main__":
    main()
