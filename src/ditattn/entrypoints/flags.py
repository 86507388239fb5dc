"""The command-line flags, grouped as ``--help`` shows them.

Every flag's ``dest`` is a :class:`~ditattn.runconfig.RunConfig` key and its default is
``argparse.SUPPRESS``: the namespace holds only the flags that were given, so they override
``--config FILE.yaml``, which overrides the config's defaults (the only place defaults live).  Value
checks are the config's own (:mod:`ditattn.runconfig`), so a flag and a YAML key are refused with the
same words.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from ditattn.runconfig import DTYPES, OFFLOAD_MODES
from ditattn.runconfig.checks import boolean, finite_float, nonneg_int, positive_float, positive_int, tcp_port


def arg_type(check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a config check (its ValueError becomes argparse's one-line error)."""
    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = check.__name__
    return convert


POS_INT, NONNEG_INT, PORT = arg_type(positive_int), arg_type(nonneg_int), arg_type(tcp_port)
FLOAT, POS_FLOAT, BOOL = arg_type(finite_float), arg_type(positive_float), arg_type(boolean)


def config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", dest="config_file", metavar="FILE.yaml",
                   help="settings from a YAML (or JSON) file: keys are the long flag names without the leading "
                        "dashes (e.g. 'num-inference-steps: 4'); flags given on the command line override it")


def attention_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("attention")
    g.add_argument("--attention-backend", metavar="NAME",
                   help="global attention backend (see 'ditattn backends'; fa3/fa4 -> fa, cudnn_sdpa -> "
                        "torch_cudnn_sdpa). Strict for the DiT; auxiliary components fall back when "
                        "incompatible. With --backend diffusers it is passed to diffusers' set_attention_backend")
    g.add_argument("--component-attention-backends", metavar="SPEC",
                   help="per-component overrides: text_encoder=torch_sdpa,transformer.cross=fa or a JSON "
                        "object; keys are model_index.json module names, optionally with .self/.cross")
    g.add_argument("--attention-backend-config", metavar="CFG",
                   help="backend parameters: a .json/.yaml file, a JSON object, or k=v,k=v pairs (kernel choices "
                        "too, e.g. impl=triton,pv_dtype=fp8 for sage_attn; 'ditattn backends' lists every key)")
    g.add_argument("--attention-backend-override", metavar="NAME",
                   help="request-scoped backend for the DiT denoise loop: fa, torch_sdpa, sage_attn, sage_attn_3")
    g.add_argument("--enable-attention-backend-autotune", type=BOOL, metavar="true|false",
                   help="time compatible candidates per automatically chosen layer on its first large input "
                        "and switch when one is faster and agrees numerically (default false)")
    g.add_argument("--skip-softmax-threshold-scale-factor", type=POS_FLOAT, metavar="X",
                   help="request-scoped skip softmax (BLASST): tiles with estimated mass below X/context_length "
                        "are skipped; no default, calibrate per model")
    g.add_argument("--skip-softmax-start-step", type=NONNEG_INT, metavar="N",
                   help="zero-based denoising step where skip softmax starts (default 0)")


def platform_flags(p: argparse.ArgumentParser) -> None:
    """``--platform NAME[:SM]`` / ``--platform-packages A,B`` (``plan``, ``backends``): simulate a machine.
    Checked by :class:`~ditattn.runconfig.SimulationConfig` (like a backend name: an ``error:`` line
    and exit status 2 from ``main``)."""
    g = p.add_argument_group("simulated platform (see what another machine would run)")
    g.add_argument("--platform", metavar="NAME[:SM]",
                   help="resolve as if on this platform instead of the machine here: cuda:80, cuda:90, cuda:100, "
                        "cuda:120 (any SM), rocm, xpu, musa, npu, mps, cpu; nothing runs on it")
    g.add_argument("--platform-packages", metavar="A,B",
                   help="optional packages the simulated platform has (default none), by import name, "
                        "optionally pinned: flash_attn.cute,triton,sageattention==2.2.0")


def model_flags(p: argparse.ArgumentParser, *, prompt: bool = False) -> None:
    """Model, sampling, parallelism and performance flags (``generate``, ``plan``, ``serve``);
    ``--prompt`` only where the command takes one (``generate``)."""
    g = p.add_argument_group("model and sampling")
    if prompt:
        g.add_argument("--prompt", help="text prompt (required; here or in --config)")
        g.add_argument("--image", metavar="PATH",
                       help="first frame for image-to-video checkpoints (Wan 2.1 I2V, Wan 2.2 I2V-A14B: required; "
                            "TI2V-5B: optional): a PNG, JPEG, WebP or BMP file. Without --height/--width the output "
                            "takes the model's default area at the image's aspect ratio")
    g.add_argument("--model-path", metavar="PATH_OR_ID",
                   help="local diffusers-format Wan checkpoint directory, or ditattn:tiny-wan / ditattn:tiny-wan2.2 "
                        "(default ditattn:tiny-wan, built locally, no download)")
    g.add_argument("--negative-prompt", help="negative prompt for classifier-free guidance")
    g.add_argument("--num-inference-steps", type=POS_INT, metavar="N", help="denoising steps")
    g.add_argument("--guidance-scale", type=FLOAT, metavar="G", help="classifier-free guidance scale")
    g.add_argument("--guidance-scale-2", type=FLOAT, metavar="G",
                   help="guidance scale of the low-noise expert of two-expert Wan 2.2 checkpoints (default: "
                        "--guidance-scale); the switch point is the checkpoint's boundary_ratio")
    g.add_argument("--height", type=POS_INT, metavar="H", help="output height in pixels")
    g.add_argument("--width", type=POS_INT, metavar="W", help="output width in pixels")
    g.add_argument("--num-frames", type=POS_INT, metavar="F", help="frames (1 = image)")
    g.add_argument("--seed", type=NONNEG_INT, metavar="S", help="random seed, an integer >= 0 (default 0)")
    g.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, help="compute dtype (default float32 on cpu, bfloat16 on GPUs)")
    g.add_argument("--backend", choices=("native", "diffusers"),
                   help="native ditattn pipeline (default) or the stock diffusers pipeline")
    g.add_argument("--model-variant", metavar="NAME", help="model variant (for checkpoints that have several)")
    g.add_argument("--num-gpus", type=POS_INT, metavar="N", help="processes for sequence parallelism")
    g.add_argument("--ulysses-degree", type=POS_INT, metavar="U", help="Ulysses degree")
    g.add_argument("--ring-degree", type=POS_INT, metavar="R", help="ring-attention degree")
    lora = p.add_argument_group("LoRA")
    lora.add_argument("--lora-path", action="append", metavar="[COMPONENT=]PATH[:SCALE]",
                      help="load a diffusers / PEFT-format Wan LoRA (a .safetensors file, or a folder with "
                           "pytorch_lora_weights.safetensors) into the DiT; repeat for several. COMPONENT: transformer "
                           "(default) or transformer_2 (the low-noise expert of two-expert checkpoints); SCALE "
                           "default 1.0. On serve, requests pick adapters by file name with a 'lora' field")
    lora.add_argument("--lora-fuse", type=BOOL, metavar="true|false",
                      help="fuse the LoRAs into the weights (no per-step cost, fixed scales); default true for "
                           "generate, false for serve (requests may then change the scales)")
    mem = p.add_argument_group("memory")
    mem.add_argument("--offload", choices=OFFLOAD_MODES,
                     help="CPU offload: text_encoder (the encoders visit the GPU only to encode), model (each "
                          "component on the GPU only while it runs), group (model, and the DiT streamed to the GPU "
                          "a group of blocks at a time, the next group copied while the current one computes); "
                          "default none")
    mem.add_argument("--offload-group-blocks", type=POS_INT, metavar="N",
                     help="DiT blocks per streamed group with --offload group (default 1)")
    mem.add_argument("--vae-tiling", action="store_true",
                     help="VAE encode/decode in overlapping 256-pixel tiles (needed for 720p x 81 frames on most GPUs)")
    mem.add_argument("--vae-slicing", action="store_true", help="VAE encode/decode one sample of a batch at a time")
    perf = p.add_argument_group("performance")
    perf.add_argument("--enable-torch-compile", action="store_true",
                      help="torch.compile each DiT block (attention stays eager, so backend selection still applies); "
                           "per-request overrides and skip softmax are then refused")
    perf.add_argument("--enable-cuda-graph", action="store_true",
                      help="CUDA only: compile the DiT blocks with CUDA graphs (breakable at attention); implies "
                           "--enable-torch-compile; per-request overrides and skip softmax are then refused")


def output_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--output-path", metavar="DIR", help="output directory (default outputs/)")
    o.add_argument("--output-file", metavar="NAME", help="output file name (default derived from the prompt)")
    o.add_argument("--save-output", action="store_true", help="write the output file (default on)")
    o.add_argument("--no-save-output", dest="save_output", action="store_false", help="do not write the output")
    o.add_argument("--fps", type=POS_INT, help="frames per second of the MP4 (default 16; videos only)")


def json_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=PORT, help="port (default 30000)")
    g.add_argument("--api-key", help="require Authorization: Bearer KEY")
    g.add_argument("--max-batch-size", type=POS_INT, help="dynamic batching: requests per batch (default 4)")
    g.add_argument("--max-queue", type=POS_INT, help="queued requests before 429 (default 64)")
    g.add_argument("--max-image-bytes", type=POS_INT, metavar="BYTES",
                   help="largest input_reference image of an image-to-video job, encoded (default 10 MiB)")
