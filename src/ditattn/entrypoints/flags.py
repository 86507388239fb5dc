"""The command-line flags, grouped as ``--help`` shows them.

Every flag's ``dest`` is a :class:`~ditattn.runconfig.RunConfig` key and its default is
``argparse.SUPPRESS``: the namespace holds only the flags that were given, so they override
``--config FILE.yaml``, which overrides the config's defaults (the only place defaults live).  Value
checks are the config's own (:mod:`ditattn.runconfig`), so a flag and a YAML key are refused with the
same words.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

from ditattn.runconfig import DIT_QUANTIZATION, DTYPES, OFFLOAD_MODES, SECTIONS, RunConfig
from ditattn.runconfig.checks import boolean, nonneg_int, positive_int


def arg_type(check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a config check (its ValueError becomes argparse's one-line error)."""
    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = check.__name__
    return convert


BOOL = arg_type(boolean)
POS_INT, NONNEG_INT = arg_type(positive_int), arg_type(nonneg_int)  # flags outside RunConfig (compare)


def typed(key: str) -> Callable[[str], Any]:
    """The argparse ``type`` of the RunConfig field ``key``: that field's own check (so a flag and a
    YAML key accept the same values, bounds included)."""
    section = RunConfig.keys()[key]
    cls = SECTIONS[section]
    return arg_type(next(f.metadata["check"] for f in dataclasses.fields(cls) if f.name == key))


def _config_field(key: str) -> dataclasses.Field:
    section = RunConfig.keys()[key]
    if section is None:
        raise KeyError(f"{key} is a top-level RunConfig key, not a field of a section")
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == key)


def field_flags(g, *keys: str) -> None:
    """Add ``--KEY`` for each RunConfig field ``KEY`` to the parser or group ``g``, described once: the
    help text, value check and metavar are the field's own metadata (:func:`ditattn.runconfig.fields.setting`),
    and a non-empty default is appended as "(default X)".  A bool field with a bool default takes an
    optional value (``--flag`` = true, ``--flag false``)."""
    for key in keys:
        f = _config_field(key)
        text = f.metadata["help"]
        if isinstance(f.default, bool):
            kw: dict[str, Any] = dict(nargs="?", const=True, metavar="true|false")
            text += f" (default {str(f.default).lower()})"
        else:
            kw = dict(metavar=f.metadata.get("metavar") or key.rsplit("_", 1)[-1].upper())
            if f.default not in (None, (), ""):
                text += f" (default {f.default})"
        g.add_argument("--" + key.replace("_", "-"), dest=key, type=typed(key), help=text, **kw)


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
    g.add_argument("--skip-softmax-threshold-scale-factor", type=typed("skip_softmax_threshold_scale_factor"), metavar="X",
                   help="request-scoped skip softmax (BLASST): tiles with estimated mass below X/context_length "
                        "are skipped; no default, calibrate per model")
    g.add_argument("--skip-softmax-start-step", type=typed("skip_softmax_start_step"), metavar="N",
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


def model_flags(p: argparse.ArgumentParser, *, prompt: bool = False, seed: bool = True) -> None:
    """Model, sampling, parallelism and performance flags (``generate``, ``plan``, ``serve``,
    ``compare``); ``--prompt`` only where the command takes one (``generate``), ``--seed`` unless the
    command has its own (``compare``)."""
    g = p.add_argument_group("model and sampling")
    if prompt:
        g.add_argument("--prompt", help="text prompt (required; here or in --config)")
        g.add_argument("--image", metavar="PATH",
                       help="first frame for image-to-video checkpoints (Wan 2.1 I2V, Wan 2.2 I2V-A14B: required; "
                            "TI2V-5B: optional): a PNG, JPEG, WebP or BMP file. Without --height/--width the output "
                            "takes the model's default area at the image's aspect ratio")
    from ditattn.models.builtin import BUILTIN_MODELS, DEFAULT_MODEL

    g.add_argument("--model-path", metavar="PATH_OR_ID",
                   help="local diffusers-format Wan checkpoint directory, a Hugging Face repo id (org/name, e.g. "
                        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers: the local cache first, else a download; HF_HUB_OFFLINE=1 "
                        "honoured), or a built-in model: "
                        + ", ".join(f"{m.name} ({m.summary})" for m in BUILTIN_MODELS.values())
                        + f"; default {DEFAULT_MODEL}; built-in models are built locally, nothing is downloaded")
    g.add_argument("--revision", metavar="REV", help="branch, tag or commit of a Hugging Face repo id (default main)")
    g.add_argument("--local-files-only", action="store_true",
                   help="resolve a Hugging Face repo id from the local cache only (never download)")
    g.add_argument("--negative-prompt", help="negative prompt for classifier-free guidance")
    g.add_argument("--num-inference-steps", type=typed("num_inference_steps"), metavar="N", help="denoising steps")
    g.add_argument("--guidance-scale", type=typed("guidance_scale"), metavar="G", help="classifier-free guidance scale")
    g.add_argument("--guidance-scale-2", type=typed("guidance_scale_2"), metavar="G",
                   help="guidance scale of the low-noise expert of two-expert Wan 2.2 checkpoints (default: "
                        "--guidance-scale); the switch point is the checkpoint's boundary_ratio")
    g.add_argument("--height", type=typed("height"), metavar="H", help="output height in pixels")
    g.add_argument("--width", type=typed("width"), metavar="W", help="output width in pixels")
    g.add_argument("--num-frames", type=typed("num_frames"), metavar="F", help="frames (1 = image)")
    if seed:
        g.add_argument("--seed", type=typed("seed"), metavar="S", help="random seed, an integer >= 0 (default 0)")
    g.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=DTYPES, help="compute dtype (default float32 on cpu, bfloat16 on GPUs)")
    g.add_argument("--backend", choices=("native", "diffusers"),
                   help="native ditattn pipeline (default) or the stock diffusers pipeline")
    g.add_argument("--model-variant", metavar="NAME", help="model variant (for checkpoints that have several)")
    g.add_argument("--num-gpus", type=typed("num_gpus"), metavar="N", help="processes for sequence parallelism")
    g.add_argument("--ulysses-degree", type=typed("ulysses_degree"), metavar="U", help="Ulysses degree")
    g.add_argument("--ring-degree", type=typed("ring_degree"), metavar="R", help="ring-attention degree")
    field_flags(g, "cfg_parallel", "vae_parallel")
    lora = p.add_argument_group("LoRA")
    lora.add_argument("--lora-path", action="append", metavar="[COMPONENT=]PATH[:SCALE]",
                      help="load a diffusers / PEFT-format Wan LoRA (a .safetensors file, or a folder with "
                           "pytorch_lora_weights.safetensors) into the DiT; repeat for several. COMPONENT: transformer "
                           "(default) or transformer_2 (the low-noise expert of two-expert checkpoints); SCALE "
                           "default 1.0. On serve, requests pick adapters by file name with a 'lora' field")
    lora.add_argument("--lora-fuse", type=typed("lora_fuse"), metavar="true|false",
                      help="fuse the LoRAs into the weights (no per-step cost, fixed scales); default true for "
                           "generate, false for serve (requests may then change the scales)")
    mem = p.add_argument_group("memory")
    mem.add_argument("--offload", choices=OFFLOAD_MODES,
                     help="CPU offload: text_encoder (the encoders visit the GPU only to encode), model (each "
                          "component on the GPU only while it runs), group (model, and the DiT streamed to the GPU "
                          "a group of blocks at a time, the next group copied while the current one computes); "
                          "default none")
    mem.add_argument("--offload-group-blocks", type=typed("offload_group_blocks"), metavar="N",
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
    perf.add_argument("--dit-quantization", choices=DIT_QUANTIZATION,
                      help="8-bit linear layers for the DiT through torchao (pip install 'ditattn[quant]'), quantized "
                           "once at load time: fp8 = e4m3 weights per output channel and activations per token "
                           "(NVIDIA GPU with compute capability >= 8.9, --dtype bfloat16); int8 = the same in int8 "
                           "(CPU or NVIDIA GPU). The self-attention, cross-attention query/output and feed-forward GEMMs "
                           "are quantized; the time and text embeddings, the cross-attention K/V and the final "
                           "projection stay in --dtype ('ditattn plan' lists them). Default none")
    g.add_argument("--dit-weights", metavar="FILE.safetensors",
                   help="take the DiT's weights from this single file instead of the checkpoint folder's: diffusers "
                        "or original Wan key names, bf16/fp16/fp32 or 8-bit with scales (ComfyUI/Kijai "
                        "*_fp8_scaled, *_fp8_e4m3fn, LightX2V FP8/INT8), dequantized when loaded; a model with two "
                        "DiTs takes transformer=FILE,transformer_2=FILE")


def output_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output")
    o.add_argument("--output-path", metavar="DIR",
                   help="output directory (default outputs/), or the output file itself when it ends in .mp4 / .png")
    o.add_argument("--output-file", metavar="NAME", help="output file name (default derived from the prompt)")
    o.add_argument("--save-output", action="store_true", help="write the output file (default on)")
    o.add_argument("--no-save-output", dest="save_output", action="store_false", help="do not write the output")
    o.add_argument("--fps", type=typed("fps"), help="frames per second of the MP4 (default 16; videos only)")
    o.add_argument("--overwrite", action="store_true",
                   help="replace an existing output file (default: keep it and add a numeric suffix, _1, _2, ...)")


def json_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def server_flags(p: argparse.ArgumentParser) -> None:
    """``serve``: address, batching, limits and lifecycle; every flag is a ServerConfig field."""
    g = p.add_argument_group("server")
    g.add_argument("--host", help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=typed("port"), help="port (default 30000)")
    g.add_argument("--api-key", help="require Authorization: Bearer KEY")
    g.add_argument("--public-url", metavar="URL", type=typed("public_url"),
                   help="external base URL of this server (e.g. https://img.example.com); image URLs are built from "
                        "it (default: relative URLs, never from the request's Host header)")
    g.add_argument("--output-dir", metavar="DIR",
                   help="where outputs and the video job store (jobs.sqlite) live; a restart with the same folder "
                        "re-queues unfinished video jobs and serves finished ones (default: a temporary folder "
                        "removed at shutdown)")
    g.add_argument("--max-batch-size", type=typed("max_batch_size"), metavar="B",
                   help="dynamic batching: requests per batch (default 4)")
    g.add_argument("--max-queue", type=typed("max_queue"), metavar="N", help="queued requests before 429 (default 64)")
    g.add_argument("--batch-window-s", type=typed("batch_window_s"), metavar="S",
                   help="seconds the scheduler waits for more requests to fill a batch (default 0.01)")
    g.add_argument("--drain-timeout-s", type=typed("drain_timeout_s"), metavar="S",
                   help="after SIGTERM: seconds the running job may take to finish before it is stopped at its next "
                        "step and kept queued for the next start (default 20); a second SIGTERM exits at once")
    field_flags(p.add_argument_group("scale-out (Ray Serve replicas; docs/serving.md)"), "replicas", "ray_address",
                "job_store", "job_lease_s", "job_max_attempts")
    lim = p.add_argument_group("request limits (a request over one gets HTTP 400 naming it)")
    lim.add_argument("--request-timeout-s", type=typed("request_timeout_s"), metavar="S",
                     help="a request is stopped at its next denoising step this long after it was accepted (image: "
                          "504; video job: failed with 'timeout', counted from its start) (default 600)")
    lim.add_argument("--max-output-pixels", type=typed("max_output_pixels"), metavar="P",
                     help="largest width x height x frames x n of one request (default: 16 x the model's default "
                          "output, at most 1280x720x81 = 74649600; the tiny model: 2359296)")
    lim.add_argument("--max-steps", type=typed("max_steps"), metavar="N", help="most denoising steps (default 100)")
    lim.add_argument("--max-n", type=typed("max_n"), metavar="N", help="most images per image request (default 10)")
    lim.add_argument("--max-side", type=typed("max_side"), metavar="PX", help="largest width or height (default 2048)")
    lim.add_argument("--max-pixels", type=typed("max_pixels"), metavar="P",
                     help="largest width x height (default 1920x1088)")
    lim.add_argument("--max-frames", type=typed("max_frames"), metavar="F", help="most frames of a video (default 257)")
    lim.add_argument("--max-fps", type=typed("max_fps"), metavar="FPS", help="highest fps of a video (default 120)")
    lim.add_argument("--max-body-bytes", type=typed("max_body_bytes"), metavar="BYTES",
                     help="largest request body (default 1048576)")
    lim.add_argument("--max-image-bytes", type=typed("max_image_bytes"), metavar="BYTES",
                     help="largest input_reference image of an image-to-video job, encoded (default 10 MiB)")
    lim.add_argument("--max-image-pixels", type=typed("max_image_pixels"), metavar="P",
                     help="largest input_reference image in pixels (default 4096x4096)")
    lim.add_argument("--max-json-depth", type=typed("max_json_depth"), metavar="D",
                     help="deepest nesting of a JSON body, checked before parsing (default 32)")
    lim.add_argument("--max-videos-kept", type=typed("max_videos_kept"), metavar="N",
                     help="finished video jobs kept; beyond it the oldest are forgotten and their files removed "
                          "(logged) (default 1000)")


def compare_flags(p: argparse.ArgumentParser) -> None:
    """``compare``: prompts, seeds, variants, what is captured, where it is written."""
    g = p.add_argument_group("comparison")
    g.add_argument("--prompt", dest="prompts", action="append", metavar="TEXT",
                   help="text prompt (repeat for several; required; --config key 'prompts')")
    g.add_argument("--seed", dest="seeds", type=NONNEG_INT, nargs="+", action="extend", metavar="S",
                   help="random seeds, integers >= 0; every prompt runs with every seed (default 0; key 'seeds')")
    g.add_argument("--variant", action="append", metavar="NAME=SPEC",
                   help="an attention setting: NAME=BACKEND[:k=v;k=v][@component=backend,...][+fp8|+int8] or "
                        "NAME={json with backend, config, components, dit_quantization}; BACKEND 'auto' = automatic; "
                        "+fp8 / +int8 quantize the DiT's linears (see --dit-quantization). Repeat; the first is the "
                        "reference")
    g.add_argument("--capture-steps", metavar="LIST",
                   help="denoising steps whose attention outputs are compared, comma-separated, negative = from "
                        "the end (default 0,-1)")
    g.add_argument("--capture-rows", type=NONNEG_INT, metavar="N",
                   help="sequence rows kept per captured attention output (default 4096; 0 = all)")
    g.add_argument("--no-in-context", dest="in_context", action="store_false",
                   help="skip running the reference backend on each layer's own inputs at the capture steps")
    g.add_argument("--warmup", type=NONNEG_INT, metavar="N",
                   help="untimed generations per variant first, so one-time costs (imports, kernel compilation) "
                        "do not bias the first variant's time (default 1)")
    g.add_argument("--output-path", metavar="DIR",
                   help="where compare.json, compare.png, contact_sheet.png and the videos go (default outputs/)")
    g.add_argument("--no-video", dest="write_video", action="store_false", help="do not write side-by-side MP4s")
    g.add_argument("--save-clips", dest="save_clips", action="store_true",
                   help="also write every clip losslessly to clips.npz (uint8 [frames, height, width, 3] under "
                        "'<variant>_p<prompt index>_s<seed>'), e.g. for bench/judge_clips.py")
    g.add_argument("--fps", type=POS_INT, help="frames per second of the MP4s (default 16)")
