"""``ditattn backends``: every attention backend, whether it runs here and why not, and its config keys."""

from __future__ import annotations

import json
import sys

from ditattn.runconfig import DTYPES, RunConfig, flag_name


def _check_attention_options(cfg: RunConfig) -> None:
    """``backends`` accepts the attention flags but lists every backend regardless: validate what
    was given exactly as ``plan`` does (bad names, bad values, keys that configure no backend in use
    -> AttentionConfigError) and say on stderr that the listing does not depend on them, so nothing
    is ignored silently.  Without a model, the backends in use are the named ones and the
    platform's automatic dense choices (what serves every other layer)."""
    import torch

    from ditattn.attention.config import check_backend_config
    from ditattn.attention.names import AttentionBackendEnum
    from ditattn.attention.specs import LayerRequest
    from ditattn.platforms import current_platform
    from ditattn.platforms.policy import auto_candidates

    a = cfg.attention
    given = a.given()
    if not given:
        return
    if a.attention_backend_override:
        AttentionBackendEnum.from_name(a.attention_backend_override)
    settings = cfg.attention_settings()  # parses names, component overrides and the config as plan does
    plat = current_platform()
    auto = [
        b
        for role in ("self", "cross")
        for dt in (torch.bfloat16, torch.float32)
        for b in auto_candidates(LayerRequest(role=role, head_dim=128, dtype=dt), plat)
    ]
    check_backend_config(settings.config, settings.named_backends() + auto)
    a.skip_softmax()
    sys.stderr.write(
        f"note: {', '.join('--' + flag_name(k) for k in given)} checked; the backend list does not "
        "depend on them (use 'ditattn plan' to see their effect)\n"
    )


#: how a "runs here" statement names the dtypes of a restricted backend
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def here_statement(info) -> str:
    """Whether ``info``'s backend runs here: ``no``, ``yes``, or, when it runs in only some of the
    compute dtypes a run may choose (``--dtype``; its declared dtypes on this platform, e.g.
    sparge_attn's CPU path), ``yes, bf16/fp16 only``."""
    if not info.usable_here:
        return "no"
    if set(DTYPES) <= set(info.dtypes):
        return "yes"
    return f"yes, {'/'.join(_SHORT_DTYPE.get(d, d) for d in sorted(info.dtypes))} only"


def short_reason(info) -> str:
    """Why ``info``'s backend does not run here, in one short phrase: the platform's substitute when
    there is one, else the first reason (cut at its first clause)."""
    if info.substitute_here:
        return f"runs {info.substitute_here.split(':', 1)[0]} instead"
    first = info.reasons[0] if info.reasons else ""
    for cut in ("; ", " (", ": "):
        if len(first) > 72 and cut in first[20:]:
            first = first[: first.index(cut, 20)]
    return first if len(first) <= 72 else first[:71] + "…"


def run(cfg: RunConfig) -> int:
    """``ditattn backends``: one line per backend on this platform (or the one ``--platform``
    simulates): name, kind, whether it runs here and, if not, why in a few words; ``NAME`` or
    ``--verbose``: in full; ``--json``: everything, as data.  A reader that closes the pipe early
    (``ditattn backends | head``) ends the listing quietly."""
    try:
        return _listing(cfg)
    except BrokenPipeError:
        # the process-wide SIGPIPE handler stays Python's (a server in the same process must survive a
        # closed socket); point stdout at /dev/null so the interpreter's final flush stays quiet too
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _listing(cfg: RunConfig) -> int:
    from ditattn.platforms import current_platform
    from ditattn.registry import list_backends

    with cfg.simulation.scope():
        _check_attention_options(cfg)
        plat = current_platform()
        infos = list_backends(plat)
    name = cfg.backends.backend_name
    if name is not None:
        from ditattn.attention.names import AttentionBackendEnum

        wanted = AttentionBackendEnum.from_name(name).value
        infos = [i for i in infos if i.name == wanted]
    if cfg.json:
        print(
            json.dumps({"platform": plat.to_json(), "backends": [i.to_json() for i in infos]}, indent=2, default=str)
        )
        return 0
    sim = f" [simulated, packages: {', '.join(sorted(plat.packages or ())) or 'none'}]" if plat.simulated else ""
    print(f"platform: {plat.describe()}{sim}")
    if name is None and not cfg.verbose:
        print(f"{'backend':<30} {'kind':<17} {'here':<5} why not")
        for i in infos:
            names = i.name + (f" ({', '.join(i.aliases)})" if i.aliases else "")
            print(
                f"{names:<30} {i.kind:<17} {here_statement(i):<5} {'' if i.usable_here else short_reason(i)}".rstrip()
            )
        print("'ditattn backends NAME' shows one backend in full (parameters, every reason); --verbose all of them")
        return 0
    width = max([5] + [len(here_statement(i)) + 1 for i in infos])  # "yes, bf16/fp16 only" keeps the columns
    print(f"{'backend':<24} {'kind':<17} {'here':<{width}} platforms / why not")
    for i in infos:
        _print_full(i, width)
    return 0


def _print_full(i, width: int = 5) -> None:
    names = i.name + (f" ({', '.join(i.aliases)})" if i.aliases else "")
    here = here_statement(i)
    flags = [
        f
        for f, on in (
            ("lossy", i.lossy),
            ("LSE", i.returns_lse),
            ("bias", i.accepts_bias),
            ("drop-in", i.drop_in),
            ("self-only", not i.cross_attention),
        )
        if on
    ]
    print(f"{names:<24} {i.kind:<17} {here:<{width}} {','.join(i.platforms)}  [{' '.join(flags)}]")
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
