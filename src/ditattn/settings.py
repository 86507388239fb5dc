"""The environment variables ditattn reads, in one place.

Behaviour (which kernel a backend runs, its precision, the server's limits) is configured through
typed settings: flags, ``--config FILE.yaml``, :class:`ditattn.runconfig.RunConfig` and backend
config keys (``ditattn backends`` lists them).  The environment only holds facts about the machine
and the process:

==========================  =====================================================================
``DITATTN_CACHE``           where the built-in ``ditattn:`` models are written once and reused
                            (default ``~/.cache/ditattn``)
``DITATTN_NUM_THREADS``     PyTorch CPU threads of a CPU run (default: the cores other processes
                            leave idle, see ``ditattn generate``); ``OMP_NUM_THREADS`` also wins
``DITATTN_DIST_TIMEOUT_S``  seconds a sequence-parallel rank waits in one collective before it
                            fails (default 1800)
==========================  =====================================================================

Variables that used to select backend implementations are retired: :func:`check_retired` turns
a leftover one into an error that names the config key replacing it, so it is never silently
ignored.  Variables of other projects that ditattn honours: ``TRITON_INTERPRET=1`` (run the Triton
kernels in Triton's CPU interpreter), ``HF_HOME`` / ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` (repo
ids given to ``--model-path``), ``OMP_NUM_THREADS``, ``TQDM_DISABLE``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from ditattn.errors import AttentionConfigError
from ditattn.files import folder_problem


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, its default (as text, None = unset) and what it sets."""

    name: str
    default: Optional[str]
    help: str


CACHE = EnvVar("DITATTN_CACHE", None, "where the built-in ditattn: models are written (default ~/.cache/ditattn)")
NUM_THREADS = EnvVar("DITATTN_NUM_THREADS", None, "PyTorch CPU threads of a CPU run (default: the idle cores)")
DIST_TIMEOUT_S = EnvVar("DITATTN_DIST_TIMEOUT_S", "1800", "seconds a sequence-parallel rank waits in one collective")
VARIABLES = (CACHE, NUM_THREADS, DIST_TIMEOUT_S)

# retired variable -> the setting that replaced it
RETIRED = {
    "DITATTN_SAGE_IMPL": "the sage_attn config key 'impl' (--attention-backend-config impl=triton)",
    "DITATTN_SAGE_PV": "the sage_attn config key 'pv_dtype' (--attention-backend-config pv_dtype=fp8)",
    "DITATTN_BLOCK_SPARSE_IMPL": "the sparse backends' config key 'block_sparse_impl' "
    "(--attention-backend-config block_sparse_impl=flex)",
}


def _get(var: EnvVar) -> Optional[str]:
    value = os.environ.get(var.name)
    return var.default if value is None or not value.strip() else value.strip()


def cache_dir() -> str:
    """``$DITATTN_CACHE`` or ``~/.cache/ditattn``; :class:`AttentionConfigError` naming the variable when
    that is not a folder ditattn can create and write into."""
    given = _get(CACHE)
    path = given or os.path.join(os.path.expanduser("~"), ".cache", "ditattn")
    where = f"{CACHE.name}={path!r}" if given else f"the cache folder {path} (set {CACHE.name} to move it)"
    why = folder_problem(path)
    if why is not None:
        raise AttentionConfigError(f"{where} cannot be created or written ({why}); accepted: a writable folder")
    return path


def num_threads() -> Optional[int]:
    """``$DITATTN_NUM_THREADS`` as a positive integer, None when unset."""
    text = _get(NUM_THREADS)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise AttentionConfigError(f"{NUM_THREADS.name} must be a positive integer, got {text!r}")
    most = 4 * (os.cpu_count() or 1)  # more threads than that only contend (and very many crash the process)
    if value > most:
        raise AttentionConfigError(
            f"{NUM_THREADS.name}={value} is more than 4 threads per core of this machine "
            f"({os.cpu_count()} cores); accepted: 1 to {most}"
        )
    return value


def dist_timeout_s() -> float:
    """``$DITATTN_DIST_TIMEOUT_S`` as a positive number of seconds (default 1800)."""
    text = _get(DIST_TIMEOUT_S)
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = 0.0
    if not 0 < value < float("inf"):
        raise AttentionConfigError(f"{DIST_TIMEOUT_S.name} must be a positive number of seconds, got {text!r}")
    return value


def check_environment() -> None:
    """Every ``DITATTN_`` variable of this table that is set, checked at a command's start (a bad value
    is an :class:`AttentionConfigError` before any work, also where the setting would not be used), and
    no retired variable set (:func:`check_retired`)."""
    check_retired()
    num_threads()
    if _get(DIST_TIMEOUT_S) is not None:
        dist_timeout_s()


def check_retired(*names: str) -> None:
    """Raise :class:`AttentionConfigError` if one of the retired variables ``names`` (all of them
    when none is given) is set, naming the setting that replaced it."""
    for name in names or tuple(RETIRED):
        if os.environ.get(name, "").strip():
            raise AttentionConfigError(f"{name} is no longer read; use {RETIRED[name]}")
