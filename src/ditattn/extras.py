"""Optional dependencies: which ``pip install ditattn[EXTRA]`` provides which module, and the
one-line error when one is missing.

The extras (``pyproject.toml``): ``server`` (``ditattn serve``: FastAPI, uvicorn, pydantic,
python-multipart, prometheus-client; checked here), ``scale`` (``serve --replicas``: Ray Serve and
psycopg for the PostgreSQL job store; checked here), ``eval`` (``ditattn compare``: torchmetrics and
matplotlib; checked here, before the first generation), ``quant`` (torchao: ``--dit-quantization fp8|int8``,
checked by :mod:`ditattn.models.quantization` with the platform), ``gpu`` (Triton and FlashAttention-4 for NVIDIA
GPUs: a backend without its runtime is refused or substituted with the install hint that
``ditattn backends`` shows) and ``dev`` (the test tools).  Everything else is a hard dependency.
"""

from __future__ import annotations

import importlib.util

from ditattn.errors import AttentionConfigError

# extra -> ((import name, distribution name), ...)
EXTRAS: dict[str, tuple[tuple[str, str], ...]] = {
    "server": (
        ("fastapi", "fastapi"),
        ("uvicorn", "uvicorn"),
        ("pydantic", "pydantic"),
        ("python_multipart", "python-multipart"),
        ("prometheus_client", "prometheus-client"),
    ),
    # serve --replicas (Ray Serve) / --job-store postgresql://
    "scale": (("ray", "ray[serve]"), ("psycopg", "psycopg[binary]")),
    # ditattn compare (PSNR / SSIM / MS-SSIM, compare.png) and the bench/ plots
    "eval": (("torchmetrics", "torchmetrics"), ("matplotlib", "matplotlib")),
}


class MissingDependencyError(AttentionConfigError, ImportError):
    """An optional dependency is not installed; the message names it and the extra that installs it."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def missing(extra: str) -> list[str]:
    """The distributions of ``extra`` whose modules are not importable here."""
    return [dist for module, dist in EXTRAS[extra] if not _installed(module)]


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingDependencyError` (one line: what needs it, what is missing, the pip
    command) unless every module of ``extra`` is installed."""
    gone = missing(extra)
    if gone:
        verb = "is" if len(gone) == 1 else "are"
        raise MissingDependencyError(
            f"{what} needs {', '.join(gone)}, which {verb} not installed; install ditattn[{extra}] "
            f"(pip install 'ditattn[{extra}]', or from a checkout: pip install '.[{extra}]')"
        )


class _DropTorchaoImportNotice:
    """A logging filter: drops torchao's import-time notice that it skips its C++ extensions for this
    torch build (ditattn does not use them: :mod:`ditattn.models.quantization`); torchao's other
    messages pass."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("Skipping import of cpp extensions")


def quiet_third_party_import_notices() -> None:
    """Keep ``import ditattn`` (and the diffusers / torchao imports it triggers later) free of
    third-party notices that concern nothing ditattn runs: torchao's C++-extension notice, and the
    ``SyntaxWarning`` (invalid escape sequences in its docstrings) that Python 3.12+ prints when it compiles
    torchao's sources without cached bytecode (an install with ``--no-compile``, a read-only site).  Idempotent."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=SyntaxWarning, module=r".*torchao[./\\]")  # by file path
    log = logging.getLogger("torchao")
    if not any(isinstance(f, _DropTorchaoImportNotice) for f in log.filters):
        log.addFilter(_DropTorchaoImportNotice())
