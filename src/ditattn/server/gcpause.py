"""Python's garbage collector in a serving process: the time it takes, and a freeze of what the
server loaded before it served.

A server process holds a few hundred thousand long-lived Python objects once its pipeline is loaded
(torch, FastAPI, Ray's modules on a replica).  A full collection walks all of them: tens to hundreds
of milliseconds of a request that happens to trigger one.  :func:`freeze_loaded` moves them into the
collector's permanent generation (``gc.freeze``), so later collections walk only what requests
allocate; :func:`seconds` is the process's time in the collector so far, which the image route
reports as ``gc`` in its ``Server-Timing`` header.
"""

from __future__ import annotations

import gc
import time

_state = {"total": 0.0, "start": 0.0}


def _track(phase: str, info: dict) -> None:
    # collections run one at a time under the GIL: a "start" is always followed by its "stop"
    if phase == "start":
        _state["start"] = time.perf_counter()
    else:
        _state["total"] += time.perf_counter() - _state["start"]


def install() -> None:
    """Start counting the time spent in the collector (idempotent; a few microseconds per collection)."""
    if _track not in gc.callbacks:
        gc.callbacks.append(_track)


def seconds() -> float:
    """Seconds this process has spent in the garbage collector since :func:`install`."""
    return _state["total"]


def freeze_loaded() -> int:
    """Collect once, then freeze every object alive now (the loaded pipeline, the imported modules) out
    of later collections; returns how many objects are frozen.  Call once, when the server is loaded and
    before it serves: objects frozen are still freed by reference counting, only their cycles are no
    longer looked for."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
