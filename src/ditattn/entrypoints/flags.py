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
import functools
from typing import Any, Callable

from ditattn.runconfig import SECTIONS, RunConfig
from ditattn.runconfig.checks import nonneg_int, positive_int


def arg_type(check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a config check (its ValueError becomes argparse's one-line error)."""

    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = check.__name__
    return convert


POS_INT, NONNEG_INT = arg_type(positive_int), arg_type(nonneg_int)  # flags outside RunConfig (compare)


def typed(key: str) -> Callable[[str], Any]:
    """The argparse ``type`` of the RunConfig field ``key``: that field's own check (so a flag and a
    YAML key accept the same values, bounds included)."""
    section = RunConfig.keys()[key]
    cls = SECTIONS[section]
    return arg_type(next(f.metadata["check"] for f in dataclasses.fields(cls) if f.name == key))


@functools.lru_cache(maxsize=None)  # the fields are fixed; a parser looks each one up several times
def _config_field(key: str) -> dataclasses.Field:
    section = RunConfig.keys()[key]
    if section is None:
        raise KeyError(f"{key} is a top-level RunConfig key, not a field of a section")
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == key)


def field_help(key: str) -> str:
    """The ``--help`` text of the flag of RunConfig field ``key``: the field's help, plus its default when
    that is not empty (a bool as ``true`` / ``false``)."""
    f = _config_field(key)
    text = f.metadata["help"]
    if isinstance(f.default, bool):
        return text + f" (default {str(f.default).lower()})"
    if f.default not in (None, (), ""):
        return text + f" (default {f.default})"
    return text


#: fields whose flag converts its value while parsing (numbers, booleans); text fields (names, paths, specs)
#: are checked when the RunConfig is built, with the rest of the settings
_PARSED_TYPES = {"int", "float", "bool", "Optional[int]", "Optional[float]", "Optional[bool]"}


def field_flags(g, *keys: str) -> None:
    """Add ``--KEY`` for each RunConfig field ``KEY`` to the parser or group ``g``, described once: the
    help text, value check and metavar are the field's own metadata (:func:`ditattn.runconfig.fields.setting`),
    and a non-empty default is appended as "(default X)" (:func:`field_help`).  A bool field (also an
    ``Optional[bool]`` one, unset = the command's default) takes an optional value (``--flag`` = true,
    ``--flag false``); a field whose check names its
    choices lists them; a tuple field (``lora_path``) is repeated, each value one item."""
    for key in keys:
        f = _config_field(key)
        check = f.metadata["check"]
        kw: dict[str, Any] = dict(type=typed(key)) if str(f.type) in _PARSED_TYPES else {}
        if isinstance(f.default, bool) or str(f.type) == "Optional[bool]":  # a tri-state too: bare = true
            kw.update(nargs="?", const=True, metavar="true|false")
        elif getattr(check, "choices", None):
            kw.update(choices=check.choices)
        elif isinstance(f.default, tuple):
            kw.update(action="append", metavar=f.metadata.get("metavar") or key.upper())  # checked as a whole
        else:
            kw.update(metavar=f.metadata.get("metavar") or key.rsplit("_", 1)[-1].upper())
        g.add_argument("--" + key.replace("_", "-"), dest=key, help=field_help(key), **kw)


def config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE.yaml",
        help="settings from a YAML (or JSON) file: keys are the long flag names without the leading "
        "dashes (e.g. 'num-inference-steps: 4'); flags given on the command line override it (--cache-backend "
        "or --attention-backend naming another backend also drops the file's keys of the old one)",
    )


def attention_flags(p: argparse.ArgumentParser) -> None:
    field_flags(
        p.add_argument_group("attention"),
        "attention_backend",
        "component_attention_backends",
        "attention_backend_config",
        "attention_backend_override",
        "enable_attention_backend_autotune",
        "skip_softmax_threshold_scale_factor",
        "skip_softmax_start_step",
    )


def cache_flags(p: argparse.ArgumentParser) -> None:
    """``--cache-backend`` / ``--cache-backend-config`` (the step cache; RunConfig's cache section)."""
    field_flags(p.add_argument_group("step cache"), "cache_backend", "cache_backend_config")


#: RunConfig fields whose flag is not ``--KEY`` (the command's own short name for it)
FLAG_NAMES = {"calibrate_prompts": "--prompt", "calibrate_seeds": "--seed", "calibrate_output": "--output"}


def calibrate_flags(p: argparse.ArgumentParser) -> None:
    """``calibrate-cache``: prompts, seeds and the output file (RunConfig's calibrate section)."""
    g = p.add_argument_group("calibration")
    for key, kw in (
        ("calibrate_prompts", dict(action="append")),
        ("calibrate_seeds", dict(nargs="+", action="extend", type=NONNEG_INT)),
        ("calibrate_output", dict(type=typed("calibrate_output"))),
    ):
        g.add_argument(
            FLAG_NAMES[key], dest=key, metavar=_config_field(key).metadata["metavar"], help=field_help(key), **kw
        )


def platform_flags(p: argparse.ArgumentParser) -> None:
    """``--platform NAME[:SM]`` / ``--platform-packages A,B`` (``plan``, ``backends``): simulate a machine.
    Checked by :class:`~ditattn.runconfig.SimulationConfig` (like a backend name: an ``error:`` line
    and exit status 2 from ``main``)."""
    field_flags(
        p.add_argument_group("simulated platform (see what another machine would run)"),
        "platform",
        "platform_packages",
    )


def model_flags(p: argparse.ArgumentParser, *, prompt: bool = False, seed: bool = True, parallel: bool = True) -> None:
    """Model, sampling, parallelism and performance flags (``generate``, ``plan``, ``serve``,
    ``compare``); ``--prompt`` only where the command takes one (``generate``), ``--seed`` unless the
    command has its own (``compare``), the parallelism flags where the command reads them (not
    ``calibrate-cache``: one process)."""
    g = p.add_argument_group("model and sampling")
    if prompt:
        field_flags(g, "prompt", "image")
    field_flags(
        g,
        "model_path",
        "revision",
        "local_files_only",
        "negative_prompt",
        "num_inference_steps",
        "guidance_scale",
        "guidance_scale_2",
        "height",
        "width",
        "num_frames",
    )
    field_flags(
        p.add_argument_group("sampler and guidance (docs/steps.md)"),
        "scheduler",
        "flow_shift",
        "timesteps",
        "cfg_interval",
        "cfg_batching",
    )
    if seed:
        field_flags(g, "seed")
    field_flags(g, "device", "dtype", "backend", "model_variant")
    if parallel:
        field_flags(g, "num_gpus", "ulysses_degree", "ring_degree", "cfg_parallel", "vae_parallel")
    field_flags(p.add_argument_group("LoRA"), "lora_path", "lora_fuse")
    field_flags(p.add_argument_group("memory"), "offload", "offload_group_blocks", "vae_tiling", "vae_slicing")
    field_flags(p.add_argument_group("performance"), "enable_torch_compile", "enable_cuda_graph", "dit_quantization")
    field_flags(g, "dit_weights")


def output_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("output")
    field_flags(o, "output_path", "output_file", "save_output")
    o.add_argument("--no-save-output", dest="save_output", action="store_false", help="do not write the output")
    field_flags(o, "fps", "overwrite")


def backends_flags(p: argparse.ArgumentParser) -> None:
    """``backends [NAME] [--verbose]``."""
    p.add_argument("backend_name", nargs="?", metavar="NAME", help=field_help("backend_name"))
    verbose_flag(p, "every backend in full: parameters, every reason, notes and measured operating points")


VERBOSE_HELP = "log attention decisions and fallbacks"


def verbose_flag(p: argparse.ArgumentParser, help: str = VERBOSE_HELP) -> None:
    """``-v`` / ``--verbose``: on the top-level parser (``ditattn -v generate``) and on every command
    (``ditattn generate -v``), one setting (``verbose``) either way."""
    p.add_argument("-v", "--verbose", action="store_true", help=help)


def json_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def server_flags(p: argparse.ArgumentParser) -> None:
    """``serve``: address, batching, limits and lifecycle; every flag is a ServerConfig field."""
    field_flags(
        p.add_argument_group("server"),
        "host",
        "port",
        "api_key",
        "public_url",
        "output_dir",
        "max_batch_size",
        "max_queue",
        "batch_window_s",
        "drain_timeout_s",
        "allowed_hosts",
        "allowed_origins",
        "header_timeout_s",
        "body_timeout_s",
    )
    field_flags(
        p.add_argument_group("request limits (a request over one gets HTTP 400 naming it)"),
        "request_timeout_s",
        "max_output_pixels",
        "max_steps",
        "max_n",
        "max_side",
        "max_pixels",
        "max_frames",
        "max_fps",
        "max_body_bytes",
        "max_image_bytes",
        "max_image_pixels",
        "max_json_depth",
        "max_videos_kept",
    )
    field_flags(
        p.add_argument_group("scale-out (Ray Serve replicas; docs/serving.md)"),
        "replicas",
        "replica_process",
        "ray_address",
        "job_store",
        "job_lease_s",
        "job_max_attempts",
    )


def compare_flags(p: argparse.ArgumentParser) -> None:
    """``compare``: prompts, seeds, variants, what is captured, where it is written."""
    g = p.add_argument_group("comparison")
    g.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        metavar="TEXT",
        help="text prompt (repeat for several; required; --config key 'prompts')",
    )
    g.add_argument(
        "--seed",
        dest="seeds",
        type=NONNEG_INT,
        nargs="+",
        action="extend",
        metavar="S",
        help="random seeds, integers >= 0; every prompt runs with every seed (default 0; key 'seeds')",
    )
    g.add_argument(
        "--variant",
        action="append",
        metavar="NAME=SPEC",
        help="an attention setting: NAME=BACKEND[:k=v;k=v][@component=backend,...][+fp8|+int8]"
        "[+cache:METHOD[:k=v;k=v]] or NAME={json with backend, config, components, dit_quantization, "
        "cache}; BACKEND 'auto' = automatic; +fp8 / +int8 quantize the DiT's linears (see "
        "--dit-quantization); +cache:teacache:threshold=0.3 adds a step cache (docs/caching.md). "
        "Repeat; the first is the reference",
    )
    g.add_argument(
        "--capture-steps",
        metavar="LIST",
        help="denoising steps whose attention outputs are compared, comma-separated, negative = from "
        "the end (default 0,-1)",
    )
    g.add_argument(
        "--capture-rows",
        type=NONNEG_INT,
        metavar="N",
        help="sequence rows kept per captured attention output (default 4096; 0 = all)",
    )
    g.add_argument(
        "--no-in-context",
        dest="in_context",
        action="store_false",
        help="skip running the reference backend on each layer's own inputs at the capture steps",
    )
    g.add_argument(
        "--warmup",
        type=NONNEG_INT,
        metavar="N",
        help="untimed generations per variant first, so one-time costs (imports, kernel compilation) "
        "do not bias the first variant's time (default 1)",
    )
    g.add_argument(
        "--output-path",
        metavar="DIR",
        help="where compare.json, compare.png, contact_sheet.png and the videos go (default outputs/)",
    )
    g.add_argument("--no-video", dest="write_video", action="store_false", help="do not write side-by-side MP4s")
    g.add_argument(
        "--save-clips",
        dest="save_clips",
        action="store_true",
        help="also write every clip losslessly to clips.npz (uint8 [frames, height, width, 3] under "
        "'<variant>_p<prompt index>_s<seed>'), e.g. for bench/judge_clips.py",
    )
    g.add_argument("--fps", type=POS_INT, help="frames per second of the MP4s (default 16)")
