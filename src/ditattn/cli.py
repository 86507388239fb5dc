"""The ``ditattn`` command line: ``generate``, ``plan``, ``backends``, ``serve``, ``compare``.

User-input errors print one line ``error: <what was wrong; what is accepted>`` to stderr and exit
with status 2 (no traceback).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional, Sequence

from ditattn.errors import AttentionConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        sys.stderr.write(f"error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _pos_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 1-65535, got {v}")
    return v


def _pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):  # nan/inf would silently produce a NaN video
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def add_attention_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("attention")
    g.add_argument("--attention-backend", metavar="NAME",
                   help="global attention backend (see 'ditattn backends'; fa3/fa4 -> fa, cudnn_sdpa -> "
                        "torch_cudnn_sdpa). Strict for the DiT; auxiliary components fall back when "
                        "incompatible. With --backend diffusers it is passed to diffusers' set_attention_backend")
    g.add_argument("--component-attention-backends", metavar="SPEC",
                   help="per-component overrides: text_encoder=torch_sdpa,transformer.cross=fa or a JSON "
                        "object; keys are model_index.json module names, optionally with .self/.cross")
    g.add_argument("--attention-backend-config", metavar="CFG",
                   help="backend parameters: a .json/.yaml file, a JSON object, or k=v,k=v pairs")
    g.add_argument("--attention-backend-override", metavar="NAME",
                   help="request-scoped backend for the DiT denoise loop: fa, torch_sdpa, sage_attn, sage_attn_3")
    g.add_argument("--enable-attention-backend-autotune", type=_bool, default=False, metavar="true|false",
                   help="time compatible candidates per automatically chosen layer on its first large input "
                        "and switch when one is faster and agrees numerically (default false)")
    g.add_argument("--skip-softmax-threshold-scale-factor", type=_pos_float, metavar="X",
                   help="request-scoped skip softmax (BLASST): tiles with estimated mass below X/context_length "
                        "are skipped; no default, calibrate per model")
    g.add_argument("--skip-softmax-start-step", type=_nonneg_int, default=None, metavar="N",
                   help="zero-based denoising step where skip softmax starts (default 0)")


def add_model_flags(p: argparse.ArgumentParser, *, prompt_required: bool, several: bool = False) -> None:
    """Model and sampling flags; ``several``: ``--prompt`` and ``--seed`` may repeat (``compare``)."""
    g = p.add_argument_group("model and sampling")
    if several:
        g.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                       help="text prompt (repeat for several prompts)")
    elif prompt_required:
        g.add_argument("--prompt", required=True, help="text prompt")
    g.add_argument("--model-path", default=None, metavar="PATH_OR_ID",
                   help="local diffusers-format Wan checkpoint directory, or ditattn:tiny-wan / ditattn:tiny-wan2.2 "
                        "(default ditattn:tiny-wan, built locally, no download)")
    g.add_argument("--negative-prompt", default=None, help="negative prompt for classifier-free guidance")
    g.add_argument("--num-inference-steps", type=_pos_int, default=None, metavar="N", help="denoising steps")
    g.add_argument("--guidance-scale", type=_float, default=None, metavar="G", help="classifier-free guidance scale")
    g.add_argument("--height", type=_pos_int, default=None, metavar="H", help="output height in pixels")
    g.add_argument("--width", type=_pos_int, default=None, metavar="W", help="output width in pixels")
    g.add_argument("--num-frames", type=_pos_int, default=None, metavar="F", help="frames (1 = image)")
    if several:
        g.add_argument("--seed", type=_nonneg_int, nargs="+", action="extend", default=None, metavar="S",
                       help="random seeds, integers >= 0; every prompt runs with every seed (default 0)")
    else:
        g.add_argument("--seed", type=_nonneg_int, default=0, metavar="S", help="random seed, an integer >= 0 (default 0)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    g.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="compute dtype (default float32 on cpu, bfloat16 on GPUs)")
    g.add_argument("--backend", default="native", choices=("native", "diffusers"),
                   help="native ditattn pipeline (default) or the stock diffusers pipeline")
    g.add_argument("--model-variant", default=None, metavar="NAME", help="model variant (for checkpoints that have several)")
    g.add_argument("--num-gpus", type=_pos_int, default=1, metavar="N", help="processes for sequence parallelism")
    g.add_argument("--ulysses-degree", type=_pos_int, default=None, metavar="U", help="Ulysses degree")
    g.add_argument("--ring-degree", type=_pos_int, default=None, metavar="R", help="ring-attention degree")
    perf = p.add_argument_group("performance")
    perf.add_argument("--enable-torch-compile", action="store_true",
                      help="torch.compile each DiT block (attention stays eager, so backend selection still applies); "
                           "per-request overrides and skip softmax are then refused")
    perf.add_argument("--enable-cuda-graph", action="store_true",
                      help="CUDA only: compile the DiT blocks with CUDA graphs (breakable at attention); implies "
                           "--enable-torch-compile; per-request overrides and skip softmax are then refused")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ditattn", description="Diffusion-transformer inference with pluggable attention backends.")
    p.add_argument("-v", "--verbose", action="store_true", help="log attention decisions and fallbacks")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    g = sub.add_parser("generate", help="run a pipeline and write the video (.mp4) or image (.png)",
                       description="Run the pipeline and write the result into --output-path.")
    add_model_flags(g, prompt_required=True)
    o = g.add_argument_group("output")
    o.add_argument("--output-path", default="outputs", metavar="DIR", help="output directory (default outputs/)")
    o.add_argument("--output-file", default=None, metavar="NAME", help="output file name (default derived from the prompt)")
    o.add_argument("--save-output", action="store_true", default=True, help="write the output file (default on)")
    o.add_argument("--no-save-output", dest="save_output", action="store_false", help="do not write the output")
    o.add_argument("--fps", type=_pos_int, default=None, help="frames per second of the MP4 (default 16; videos only)")
    add_attention_flags(g)

    pl = sub.add_parser("plan", help="resolve every attention layer without denoising and print the plan",
                        description="Build the pipeline, resolve each attention layer, print which backend it got and why.")
    add_model_flags(pl, prompt_required=False)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_attention_flags(pl)

    b = sub.add_parser("backends", help="list every attention backend, whether it runs here and why not")
    b.add_argument("--json", action="store_true", help="print JSON")
    add_attention_flags(b)

    s = sub.add_parser("serve", help="OpenAI-compatible image/video server")
    add_model_flags(s, prompt_required=False)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=30000, help="port (default 30000)")
    s.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    s.add_argument("--max-batch-size", type=_pos_int, default=4, help="dynamic batching: requests per batch (default 4)")
    s.add_argument("--max-queue", type=_pos_int, default=64, help="queued requests before 429 (default 64)")
    add_attention_flags(s)
    s.set_defaults(seed=None)  # requests carry their own seed; see _check_serve_flags

    c = sub.add_parser(
        "compare", help="paired generations under several attention settings: time, PSNR/SSIM, per-layer error",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the same prompts and seeds under two or more attention settings (--variant; the first is "
                    "the reference), pair the clips per prompt and seed, and report per variant: DiT and whole "
                    "time, PSNR / SSIM / MS-SSIM against the reference, the per-layer attention-output error and "
                    "cosine at the capture steps (against the reference run, and against the reference backend on "
                    "the layer's own inputs), and the kept fraction of sparse backends. Writes compare.json, "
                    "compare.png, contact_sheet.png and side-by-side MP4s into --output-path.",
        epilog="example:\n  ditattn compare --prompt 'a red circle moving right' --prompt 'a blue square' \\\n"
               "    --variant dense=torch_sdpa --variant vsa='video_sparse_attn:sparsity=0.5' --seed 0 1")
    add_model_flags(c, prompt_required=True, several=True)
    cv = c.add_argument_group("comparison")
    cv.add_argument("--variant", action="append", required=True, metavar="NAME=SPEC",
                    help="an attention setting: NAME=BACKEND[:k=v;k=v][@component=backend,...] or NAME={json with "
                         "backend, config, components}; BACKEND 'auto' = automatic. Repeat; the first is the reference")
    cv.add_argument("--capture-steps", default="0,-1", metavar="LIST",
                    help="denoising steps whose attention outputs are compared, comma-separated, negative = from "
                         "the end (default 0,-1)")
    cv.add_argument("--capture-rows", type=_nonneg_int, default=4096, metavar="N",
                    help="sequence rows kept per captured attention output (default 4096; 0 = all)")
    cv.add_argument("--no-in-context", dest="in_context", action="store_false",
                    help="skip running the reference backend on each layer's own inputs at the capture steps")
    cv.add_argument("--warmup", type=_nonneg_int, default=1, metavar="N",
                    help="untimed generations per variant first, so one-time costs (imports, kernel compilation) do not "
                         "bias the first variant's time (default 1)")
    cv.add_argument("--output-path", default="outputs/compare", metavar="DIR",
                    help="where compare.json, compare.png, contact_sheet.png and the videos go (default outputs/compare)")
    cv.add_argument("--no-video", dest="write_video", action="store_false", help="do not write side-by-side MP4s")
    cv.add_argument("--fps", type=_pos_int, default=16, help="frames per second of the MP4s (default 16)")
    cv.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary table")
    add_attention_flags(c)
    return p


_ATTENTION_FLAGS = (("attention_backend", "--attention-backend"),
                    ("component_attention_backends", "--component-attention-backends"),
                    ("attention_backend_config", "--attention-backend-config"),
                    ("attention_backend_override", "--attention-backend-override"),
                    ("enable_attention_backend_autotune", "--enable-attention-backend-autotune"),
                    ("skip_softmax_threshold_scale_factor", "--skip-softmax-threshold-scale-factor"),
                    ("skip_softmax_start_step", "--skip-softmax-start-step"))


def _check_backends_flags(args) -> None:
    """``backends`` accepts the attention flags (DESIGN 1.2) but lists every backend regardless:
    validate what was given (bad names, unknown config keys -> AttentionConfigError) and say on
    stderr that the listing does not depend on them, so nothing is ignored silently."""
    from ditattn.attention.config import (SCHEMAS, parse_attention_backend_config,
                                          parse_component_overrides)
    from ditattn.attention.names import AttentionBackendEnum
    from ditattn.pipelines.run import skip_softmax_from_args

    given = [flag for attr, flag in _ATTENTION_FLAGS
             if getattr(args, attr, None) is not None and getattr(args, attr) is not False]
    if not given:
        return
    for attr in ("attention_backend", "attention_backend_override"):
        if getattr(args, attr, None):
            AttentionBackendEnum.from_name(getattr(args, attr))
    parse_component_overrides(args.component_attention_backends)
    cfg = parse_attention_backend_config(args.attention_backend_config)
    known = {p.name for params in SCHEMAS.values() for p in params}
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise AttentionConfigError(f"config key(s) {', '.join(map(repr, unknown))} belong to no backend; "
                                   "accepted: the params listed by 'ditattn backends'")
    skip_softmax_from_args(args)
    sys.stderr.write(f"note: {', '.join(given)} checked; the backend list does not depend on them "
                     "(use 'ditattn plan' to see their effect)\n")


def cmd_backends(args) -> int:
    from ditattn.registry import list_backends
    from ditattn.platforms import current_platform

    import signal

    _check_backends_flags(args)

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `ditattn backends | head` exits quietly
    infos = list_backends()
    plat = current_platform()
    if args.json:
        print(json.dumps({"platform": plat.to_json(), "backends": [i.to_json() for i in infos]}, indent=2, default=str))
        return 0
    print(f"platform: {plat.describe()}")
    print(f"{'backend':<24} {'kind':<17} {'here':<5} platforms / why not")
    for i in infos:
        names = i.name + (f" ({', '.join(i.aliases)})" if i.aliases else "")
        here = "yes" if i.usable_here else "no"
        flags = [f for f, on in (("lossy", i.lossy), ("LSE", i.returns_lse), ("bias", i.accepts_bias),
                                 ("drop-in", i.drop_in), ("self-only", not i.cross_attention)) if on]
        print(f"{names:<24} {i.kind:<17} {here:<5} {','.join(i.platforms)}  [{' '.join(flags)}]")
        print(f"{'':<24} {i.summary}")
        if i.usable_here and i.runtime:
            print(f"{'':<24} runs here via: {i.runtime}")
        for r in i.reasons:
            print(f"{'':<24} - {r}")
        if i.substitute_here:
            print(f"{'':<24} falls back here to {i.substitute_here}")
        if i.missing_kernel and i.missing_kernel not in i.reasons:
            print(f"{'':<24} note: {i.missing_kernel}")
        for prm in i.params:
            req = " (required)" if prm["required"] else ""
            print(f"{'':<24} param {prm['name']}: {prm['type']} = {prm['default']!r}{req} — {prm['help']}")
        if i.notes:
            print(f"{'':<24} note: {i.notes}")
        if i.operating_point:
            from ditattn.attention.operating_points import OperatingPoint

            print(f"{'':<24} measured {OperatingPoint(**i.operating_point).describe()}")
    return 0


def _check_serve_flags(args) -> None:
    """Before loading the model: refuse ``--seed`` (each request carries its own seed, so the flag
    would be ignored) and an address the server cannot bind (bad host, port in use)."""
    import socket

    if args.seed is not None:
        raise AttentionConfigError("--seed does not apply to serve; accepted: a 'seed' field in each request "
                                   "(requests without one get a random seed)")
    try:
        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AttentionConfigError(f"--host {args.host!r} cannot be resolved ({exc}); accepted: an IP address or "
                                   "host name of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            raise AttentionConfigError(f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); accepted: "
                                       "a free port and an address of this machine") from None


def cmd_compare(args) -> int:
    """``ditattn compare``: the arguments become a typed CompareConfig; the work is
    :func:`ditattn.evaluation.compare.run_compare`."""
    from ditattn.evaluation.compare import CompareConfig, format_summary, json_ready, parse_variant, run_compare
    from ditattn.pipelines.run import settings_from_args

    refused = [flag for attr, flag in _ATTENTION_FLAGS
               if attr != "enable_attention_backend_autotune" and getattr(args, attr, None) is not None]
    if refused:
        raise AttentionConfigError(f"compare takes its attention settings per variant, not {', '.join(refused)}; "
                                   "accepted: --variant NAME=BACKEND[:k=v;k=v][@component=backend,...]")
    if args.backend != "native" or args.num_gpus != 1:
        raise AttentionConfigError("compare runs the native pipeline on one device; accepted: --backend native, "
                                   "--num-gpus 1")
    try:
        steps = tuple(int(x) for x in args.capture_steps.split(",") if x.strip())
    except ValueError:
        raise AttentionConfigError(f"--capture-steps {args.capture_steps!r}: expected comma-separated integers "
                                   "(negative = from the end), e.g. 0,-1") from None
    cfg = CompareConfig(
        variants=[parse_variant(v) for v in args.variant], prompts=list(args.prompt), seeds=args.seed or [0],
        model_path=args.model_path, device=args.device, dtype=args.dtype, negative_prompt=args.negative_prompt,
        num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale, height=args.height,
        width=args.width, num_frames=args.num_frames, capture_steps=steps, capture_rows=args.capture_rows,
        in_context=args.in_context, warmup=args.warmup, output_dir=args.output_path, write_video=args.write_video,
        fps=args.fps, base=settings_from_args(args))
    import torch

    from ditattn.pipelines.run import _tune_cpu_threads

    threads = torch.get_num_threads()
    _tune_cpu_threads(args.device)  # on a busy CPU, fewer threads run much faster (see its docstring)
    try:
        report = run_compare(cfg)
    finally:
        torch.set_num_threads(threads)
    if args.json:
        print(json.dumps(json_ready(report), indent=1))
    else:
        for note in report.get("notes", []):
            print(f"note: {note}")
        for key, val in report["files"].items():
            print(f"{key}: {', '.join(val) if isinstance(val, list) else val}")
        print(format_summary(report))
    return 0


def _drop_refusal_log(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("request refused")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    # generate/plan report a refused override / skip softmax as the one `error:` line; the server-side
    # log warning would print the same reason a second time
    attn_log = logging.getLogger("ditattn.attention")
    if args.command in ("generate", "plan"):
        attn_log.addFilter(_drop_refusal_log)
    try:
        if args.command == "backends":
            return cmd_backends(args)
        if args.command == "generate":
            from ditattn.pipelines.run import generate_main

            return generate_main(args)
        if args.command == "plan":
            from ditattn.pipelines.run import plan_main

            return plan_main(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "serve":
            _check_serve_flags(args)
            from ditattn.server.app import serve_main

            return serve_main(args)
    except AttentionConfigError as exc:
        msg = " ".join(str(exc).split())  # one line, even for multi-line parser errors
        if args.command in ("generate", "plan") and "dtype" in msg and "not supported" in msg \
                and getattr(args, "dtype", None) is None:
            msg += " (the compute dtype is chosen with --dtype)"
        sys.stderr.write(f"error: {msg}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    finally:
        attn_log.removeFilter(_drop_refusal_log)
    return 0
