"""One Wan DiT step with 8-bit linears (``--dit-quantization``) against bf16 and diffusers' default.

Builds the Wan2.1 architecture (``--arch 1.3b`` or ``14b``) with random weights once, times
diffusers' ``WanTransformer3DModel`` (default attention) on them, then for every attention backend
(``--backends``, default ``fa,sage_attn``) builds the native DiT on the SAME weights with bf16, fp8
and int8 linears (``--quant``) and times one step (CUDA events, warm-up first, median of
``--repeats``) per variant (``eager``; ``compiled`` = torch.compile of each block, runs last).
FP8 rows quantize activations with ditattn's fused per-row quantizer (``src/ditattn/models/fp8_linear.py``;
each row's ``activations`` field says for how many linears, and which stayed on torchao's path).

Accuracy, like the attention benchmarks: at each of ``--timesteps`` the DiT output's relative L2
error and cosine against the bf16-linears DiT of the same backend (the quantization alone) and the
relative error against diffusers (everything).  Random weights have no trained outliers: the
whole-generation check on a trained checkpoint is ``ditattn compare --variant bf16=fa --variant
fp8=fa+fp8``.

    python bench/dit_quant.py --arch 1.3b --out-dir $OUT        # H200: see docs/benchmarks.md

Writes ``<out-dir>/dit_quant_<arch>.json`` after every row and prints a short table last.  On a
machine without CUDA (``--arch tiny --res tiny``) it smoke-tests the code paths (fp8 rows are
refused there with the reason; the timings mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import WAN_ARCH as ARCH  # noqa: E402
from common import WAN_COMMON, Deadline, Recorder, add_wan_args, cosine, env_info, profile_step, rel_err
from e2e import median_ms, native_model, wan_inputs  # noqa: E402


def _num(v, fmt: str) -> str:
    """``v`` formatted, or ``-`` right-aligned to the format's width when there is none."""
    return format(v, fmt) if v is not None else format("-", ">" + "".join(c for c in fmt.split(".")[0] if c.isdigit()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_wan_args(ap)
    ap.add_argument("--backends", default="fa,sage_attn", help="attention backends of ours (name[:k=v;k=v])")
    ap.add_argument("--quant", default="none,fp8,int8", help="comma list of none, fp8, int8")
    ap.add_argument("--variants", default="eager", help="comma list of eager, compiled (torch.compile per block)")
    ap.add_argument("--timesteps", default="900,500,100", help="timesteps of the accuracy check (the first is timed)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--diffusers-backend",
        default="native",
        help="diffusers attention backend of the baseline ('native': its default SDPA)",
    )
    ap.add_argument(
        "--min-features",
        type=int,
        default=None,
        help="override the rule's smallest quantized GEMM width (default: the library's; smoke tests "
        "of the tiny architecture need a smaller one)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="also profile one eager step per row (GPU time per kernel category)"
    )
    ap.add_argument("--budget-s", type=float, default=560.0, help="stop starting new rows after this many seconds")
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "."))
    args = ap.parse_args()

    from diffusers import WanTransformer3DModel

    from ditattn.attention.context import forward_context
    from ditattn.models import quantization as Q
    from ditattn.models.wan.transformer import KEEP_FP32, cast_model
    from ditattn.models.weights import target_dtype
    from ditattn.platforms import platform_for_device

    deadline = Deadline(args.budget_s)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = torch.bfloat16
    if args.arch == "tiny":
        args.frames, args.text_len = 5, 16
    cfg = dict(**WAN_COMMON, **ARCH[args.arch])
    rule = (
        Q.DEFAULT_RULE
        if args.min_features is None
        else dataclasses.replace(Q.DEFAULT_RULE, min_features=args.min_features)
    )
    timesteps = [float(s) for s in args.timesteps.split(",") if s]
    modes = [m for m in args.quant.split(",") if m]
    variants = [v for v in ("eager", "compiled") if v in args.variants.split(",")]
    torch.manual_seed(0)
    t0 = time.time()
    ref = WanTransformer3DModel(**cfg)
    sd = ref.state_dict()
    cast_model(ref, dt, KEEP_FP32).to(dev).eval()
    x, _, txt, _, grid = wan_inputs(args, cfg, dev, dt)
    ts = {t: torch.tensor([t], device=dev) for t in timesteps}
    seq = grid[0] * grid[1] * grid[2]
    rec = Recorder(
        args.out_dir,
        f"dit_quant_{args.arch}",
        {
            "arch": args.arch,
            "res": args.res,
            "frames": args.frames,
            "grid": grid,
            "seq": seq,
            "timesteps": timesteps,
            "env": env_info(),
            "rule_min_features": rule.min_features,
        },
    )
    print(
        f"arch {args.arch} res {args.res} frames {args.frames} grid {grid} S={seq} built in {time.time() - t0:.1f}s",
        flush=True,
    )

    with torch.no_grad():
        ref.set_attention_backend(args.diffusers_backend)
        call = lambda t: ref(hidden_states=x, timestep=ts[t], encoder_hidden_states=txt, return_dict=False)[0]  # noqa: E731
        diff_out = {t: call(t).float() for t in timesteps}
        base_ms = median_ms(lambda: call(timesteps[0]), repeats=args.repeats)
        rec.add(side="diffusers", backend=args.diffusers_backend, quant="none", variant="eager", ms=base_ms)
        print(f"diffusers {args.diffusers_backend:<12} {base_ms:8.1f} ms", flush=True)
        ref.cpu()
        del ref
        # the weights once on the device in their run dtypes; every model below assigns (shares) them,
        # and quantization replaces a linear's weight with a new tensor, leaving these untouched
        sd = {
            k: v.to(dev, target_dtype(k, dt, lambda n: any(p in KEEP_FP32 for p in n.split("."))))
            for k, v in sd.items()
        }
        if dev.type == "cuda":
            torch.cuda.empty_cache()

        platform = platform_for_device(dev)
        for spec in [s for s in args.backends.split(",") if s]:
            bf16_out = None
            for mode in modes:
                if deadline.left() < 0:
                    rec.note(f"budget of {args.budget_s:.0f}s spent: {spec} {mode} and later rows not run")
                    break
                reason = Q.why_not(mode, platform, dt)
                if reason:
                    rec.add(side="ditattn", backend=spec, quant=mode, error=reason)
                    print(f"ditattn  {spec:<12} {mode:<5} refused: {reason}", flush=True)
                    continue
                try:
                    model, chosen = native_model(cfg, sd, spec, dt, dev, cast=False)
                    t_q = time.time()
                    plan = Q.quantize_linears(model, mode, rule)
                    quant_s = time.time() - t_q
                    for label in variants:
                        if label == "compiled":
                            from ditattn.models.wan.compile import compile_blocks

                            compile_blocks(model)
                        with forward_context(step=10**6, num_steps=10**6):  # past any dense warm-up steps
                            outs = {t: model(x, ts[t], txt).float() for t in timesteps}
                            ms = median_ms(lambda: model(x, ts[timesteps[0]], txt), repeats=args.repeats)
                            prof = (
                                profile_step(lambda: model(x, ts[timesteps[0]], txt))
                                if args.profile and dev.type == "cuda" and label == "eager"
                                else None
                            )
                        if mode == "none" and bf16_out is None:
                            bf16_out = outs
                        steps = []
                        for t in timesteps:
                            row_t = {"t": t, "rel_err_vs_diffusers": rel_err(outs[t], diff_out[t])}
                            if bf16_out is not None:
                                row_t.update(
                                    rel_err_vs_bf16=rel_err(outs[t], bf16_out[t]),
                                    cos_vs_bf16=cosine(outs[t], bf16_out[t]),
                                )
                            steps.append(row_t)
                        row = rec.add(
                            side="ditattn",
                            backend=spec,
                            chosen=chosen,
                            quant=mode,
                            variant=label,
                            ms=ms,
                            speedup_vs_diffusers=base_ms / ms,
                            quantized_linears=len(plan.quantized),
                            linears=len(plan.decisions),
                            activations=plan.activations(),
                            quantize_s=quant_s,
                            per_step=steps,
                            max_rel_err_vs_bf16=max((s["rel_err_vs_bf16"] for s in steps), default=None)
                            if bf16_out is not None
                            else None,
                            min_cos_vs_bf16=min((s["cos_vs_bf16"] for s in steps), default=None)
                            if bf16_out is not None
                            else None,
                            profile=prof,
                        )
                        print(
                            f"ditattn  {spec:<12} {mode:<5} {label:<8} {ms:8.1f} ms {base_ms / ms:5.2f}x  "
                            f"err vs bf16 {_num(row['max_rel_err_vs_bf16'], '.2e')} "
                            f"cos {_num(row['min_cos_vs_bf16'], '.5f')}  {chosen}",
                            flush=True,
                        )
                    del model
                except Exception as exc:  # a failing row is recorded, the others still run
                    rec.add(side="ditattn", backend=spec, quant=mode, error=f"{type(exc).__name__}: {exc}"[:400])
                    print(f"ditattn  {spec:<12} {mode:<5} {type(exc).__name__}: {exc}", flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()

    print(f"\nwrote {rec.path}")
    print(
        f"{'side':<9} {'backend':<12} {'linears':<7} {'variant':<8} {'ms':>8} {'vs diffusers':>13} "
        f"{'err vs bf16':>12} {'cos vs bf16':>12}"
    )
    for r in rec.data["rows"]:
        if "ms" in r:
            print(
                f"{r['side']:<9} {r['backend']:<12} {r['quant']:<7} {r['variant']:<8} {r['ms']:8.1f} "
                f"{r.get('speedup_vs_diffusers', 1.0):12.2f}x {_num(r.get('max_rel_err_vs_bf16'), '12.2e')} "
                f"{_num(r.get('min_cos_vs_bf16'), '12.5f')}"
            )
        else:
            print(f"{r['side']:<9} {r['backend']:<12} {r['quant']:<7} error: {r['error'][:90]}")


if __name__ == "__main__":
    main()
