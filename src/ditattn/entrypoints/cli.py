"""The ``ditattn`` command line: parse the flags (and ``--config FILE.yaml``) into one
:class:`~ditattn.runconfig.RunConfig` and hand it to the command's ``run``.

User-input errors print one line ``error: <what was wrong; what is accepted>`` to stderr and exit
with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import logging
import re
import sys
from typing import Callable, Optional, Sequence

from ditattn.entrypoints import flags
from ditattn.errors import AttentionConfigError, short_repr
from ditattn.runconfig import RunConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, with the values argparse quotes cut short
        message = re.sub(r"'([^']{100,})'|\"([^\"]{100,})\"", lambda m: short_repr(m.group(1) or m.group(2)), message)
        m = re.match(r"argument (--[\w-]+)(/[\w-]+)*: expected (one|at least one) argument", message)
        if m:  # a value that starts with '-' (--cfg-interval -1:1) reads as a flag to argparse
            message += f" (a value starting with '-' is given as {m.group(1)}=VALUE)"
        sys.stderr.write(f"error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: its help, its flag groups, the RunConfig sections (and top-level keys) it
    reads — what ``--config`` may set — and ``run``, ``"module:function"`` taking the RunConfig and
    returning the exit status (imported only when the command runs, so ``--help`` stays fast)."""

    name: str
    help: str
    description: str
    flags: tuple[Callable[[argparse.ArgumentParser], None], ...]
    accept: tuple[str, ...]
    run: str


def _json(what: str):
    return lambda p: flags.json_flag(p, what)


COMMANDS = (
    Command(
        "generate",
        "run a pipeline and write the video (.mp4) or image (.png)",
        "Run the pipeline and write the result into --output-path.",
        (lambda p: flags.model_flags(p, prompt=True), flags.output_flags, flags.attention_flags, flags.cache_flags),
        ("model", "sampling", "attention", "cache", "parallel", "output", "verbose"),
        "ditattn.entrypoints.generate:run",
    ),
    Command(
        "plan",
        "resolve every attention layer without denoising and print the plan",
        "Build the pipeline, resolve each attention layer, print which backend it got and why.",
        (flags.model_flags, _json("the plan"), flags.attention_flags, flags.cache_flags, flags.platform_flags),
        ("model", "sampling", "attention", "cache", "parallel", "simulation", "verbose", "json"),
        "ditattn.entrypoints.plan:run",
    ),
    Command(
        "backends",
        "list every attention backend, whether it runs here and why not",
        "One line per attention backend: its name, kind, whether it runs here and, if not, why. "
        "'ditattn backends NAME' or --verbose: parameters and every reason in full.",
        (flags.backends_flags, _json("the list"), flags.attention_flags, flags.platform_flags),
        ("attention", "simulation", "backends", "verbose", "json"),
        "ditattn.entrypoints.backends:run",
    ),
    Command(
        "serve",
        "OpenAI-compatible image/video server",
        "Serve the model over an OpenAI-compatible HTTP API (images, video jobs, models, health, metrics).",
        (flags.model_flags, flags.server_flags, flags.attention_flags, flags.cache_flags),
        ("model", "sampling", "attention", "cache", "parallel", "server", "verbose"),
        "ditattn.entrypoints.serve:run",
    ),
    Command(
        "calibrate-cache",
        "calibrate the step-cache methods (teacache, magcache) for a model",
        "Run uncached generations of the given prompts, record per step how much the DiT's modulated input and "
        "its block-stack residual change, and write a calibration JSON (the TeaCache polynomial and the MagCache "
        "magnitude-ratio curve) that the methods take as calibration=PATH (docs/caching.md).",
        (lambda p: flags.model_flags(p, seed=False, parallel=False), flags.calibrate_flags),
        ("model", "sampling", "calibrate", "verbose"),
        "ditattn.entrypoints.calibrate_cache:run",
    ),
    Command(
        "compare",
        "paired generations under several attention settings: time, PSNR/SSIM, per-layer error",
        "Run the same prompts and seeds under two or more attention settings (--variant; the first is the "
        "reference), pair the clips per prompt and seed, and report per variant: DiT and whole time, PSNR / "
        "SSIM / MS-SSIM against the reference, the per-layer attention-output error and cosine at the capture "
        "steps (against the reference run, and against the reference backend on the layer's own inputs), and "
        "the kept fraction of sparse backends. Writes compare.json, compare.png, contact_sheet.png and "
        "side-by-side MP4s into --output-path (docs/evaluation.md).",
        (lambda p: flags.model_flags(p, seed=False), flags.compare_flags, _json("the report"), flags.attention_flags),
        ("model", "sampling", "attention", "parallel", "output", "compare", "verbose", "json"),
        "ditattn.entrypoints.compare:run",
    ),
)


@functools.lru_cache(maxsize=None)  # read once: every parser shows it
def _version() -> str:
    """The installed distribution's version (importlib.metadata), else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ditattn")
    except PackageNotFoundError:
        from ditattn import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ditattn",
        description="Diffusion-transformer inference with pluggable attention backends.",
        argument_default=argparse.SUPPRESS,
    )
    flags.verbose_flag(p)
    p.add_argument("--version", action="version", version=f"ditattn {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for cmd in COMMANDS:
        sp = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description, argument_default=argparse.SUPPRESS)
        for add in cmd.flags:
            add(sp)
        if "--verbose" not in sp._option_string_actions:  # also after the command: ditattn generate -v
            flags.verbose_flag(sp)
        flags.config_flag(sp)
    return p


#: (section, backend field, its config field): a backend named on the command line replaces the config file's
#: backend together with that backend's config, unless the command line gives a config too
_REPLACED_WITH_BACKEND = (
    ("cache", "cache_backend", "cache_backend_config"),
    ("attention", "attention_backend", "attention_backend_config"),
)


def build_config(command: Command, given: dict, notes: Optional[list] = None) -> RunConfig:
    """The run's config: defaults, then ``--config`` (``given["config_file"]``), then the flags.  A backend
    flag (``--cache-backend``, ``--attention-backend``) that names another backend than the file's drops the
    file's config of that backend (its keys were the old backend's); ``notes`` receives one sentence each."""
    given = dict(given)
    path = given.pop("config_file", None)
    cfg = RunConfig.from_file(path, accept=command.accept) if path else RunConfig()
    for section, name, keys in _REPLACED_WITH_BACKEND:
        old = getattr(getattr(cfg, section), name, None)
        if name in given and keys not in given and getattr(getattr(cfg, section), keys, None) is not None:
            new = given[name]
            if str(new or "none").strip().lower() != str(old or "none").strip().lower():
                cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{keys: None})})
                if notes is not None:
                    flag = name.replace("_", "-")
                    notes.append(
                        f"--{flag} {new} replaces the config file's {flag} {old or 'none'} and its {flag}-config "
                        f"(give --{flag}-config on the command line to set keys)"
                    )
    return RunConfig.from_mapping(given, base=cfg, accept=command.accept, source="command line")


def _drop_refusal_log(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("request refused")


def _out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: Python's MemoryError, PyTorch's OutOfMemoryError (CUDA) or its CPU allocator's
    RuntimeError."""
    text = str(exc)
    return (
        isinstance(exc, MemoryError)
        or "OutOfMemoryError" in type(exc).__name__
        or ("can't allocate memory" in text or "not enough memory" in text)
    )


def check_flags_once(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """``parser.error`` (exit 2) when one setting is given twice on the command line (``--seed 1 --seed 2``,
    ``--no-save-output --save-output true``): argparse keeps the last silently.  Repeatable flags
    (``--prompt`` of calibrate-cache, ``--lora-path``, ``--variant``...) are exempt."""
    tokens = list(argv)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    name = next((t for t in tokens if sub is not None and t in sub.choices), None)
    if name is None:
        return
    sp = sub.choices[name]
    options = sp._option_string_actions
    seen: dict[str, list[str]] = {}
    for tok in tokens[tokens.index(name) + 1 :]:
        if tok == "--":
            break
        if not tok.startswith("--"):
            continue
        opt = tok.split("=", 1)[0]
        action = options.get(opt)
        if action is None:  # argparse's unique-prefix abbreviations
            hits = {a for o, a in options.items() if o.startswith(opt)}
            action = hits.pop() if len(hits) == 1 else None
        if action is None or isinstance(action, (argparse._AppendAction, argparse._ExtendAction)):
            continue
        seen.setdefault(action.dest, []).append(opt)
    twice = {d: opts for d, opts in seen.items() if len(opts) > 1}
    if twice:
        dest, opts = next(iter(twice.items()))
        sp.error(f"{' and '.join(dict.fromkeys(opts))} set one setting ({dest}) {len(opts)} times; give it once")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    check_flags_once(parser, sys.argv[1:] if argv is None else argv)
    given = vars(ns)
    name = given.pop("command")
    command = next(c for c in COMMANDS if c.name == name)
    logging.basicConfig(
        level=logging.INFO if given.get("verbose") else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # torchao (imported by diffusers when it is installed) warns on import that it skips its C++ extensions
    # for this torch: ditattn does not use them (ditattn.models.quantization), so the line is only noise
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # generate/plan report a refused override / skip softmax as the one `error:` line; the server-side
    # log warning would print the same reason a second time
    attn_log = logging.getLogger("ditattn.attention")
    if command.name in ("generate", "plan"):
        attn_log.addFilter(_drop_refusal_log)
    cfg = None
    try:
        from ditattn import settings

        settings.check_environment()
        notes: list = []
        cfg = build_config(command, given, notes)
        for note in notes:
            sys.stderr.write(f"warning: {note}\n")
        if cfg.verbose:
            logging.getLogger().setLevel(logging.INFO)
        for note in cfg.ignored_settings():  # given, but it would do nothing: said, not dropped silently
            sys.stderr.write(f"warning: {note}\n")
        module, _, func = command.run.partition(":")
        return int(getattr(importlib.import_module(module), func)(cfg) or 0)
    except AttentionConfigError as exc:
        msg = " ".join(str(exc).split())  # one line, even for multi-line parser errors
        if (
            command.name in ("generate", "plan")
            and "dtype" in msg
            and "not supported" in msg
            and (cfg is None or cfg.model.dtype is None)
        ):
            msg += " (the compute dtype is chosen with --dtype)"
        sys.stderr.write(f"error: {msg}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except OSError as exc:  # the machine's refusal (a full disk, a read-only or vanished folder), not a bug
        if exc.errno is None:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        sys.stderr.write(f"error: {exc.strerror or exc}{where}; nothing more was written\n")
        return 1
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        sys.stderr.write(
            f"error: out of memory ({first}); try a smaller --height / --width / --num-frames, --offload model, "
            "or a lower precision (--dtype bfloat16)\n"
        )
        return 1
    finally:
        attn_log.removeFilter(_drop_refusal_log)
