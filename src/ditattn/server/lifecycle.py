"""Graceful shutdown of ``ditattn serve`` (:class:`DrainingServer`, a ``uvicorn.Server``).

The first SIGTERM (or Ctrl-C) starts a drain instead of closing the port: new generation requests
get 503 with ``Retry-After`` while status, listing and downloads keep working; queued image
requests end with 503; the running batch has ``--drain-timeout-s`` to finish, then it is stopped at
its next denoising step (a video job goes back to ``queued``); finished MP4s are written; queued
video jobs stay in the job store of ``--output-dir`` for the next start.  Then uvicorn closes the
port and the process exits with status 0.  A second signal exits at once (status 128 + signal):
the job store is written through on every change, so even then no job is lost — one that was
running is re-queued by the next start.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import uvicorn

log = logging.getLogger("ditattn.server")


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose exit signals drain ``state`` (a
    :class:`~ditattn.server.state.ServerState`) first; see the module docstring."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state
        self.signals = 0

    def handle_exit(self, sig: int, frame) -> None:  # called by uvicorn's signal handlers (main thread)
        self.signals += 1
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if self.signals == 1:
            log.warning(
                "%s: draining (new work gets 503; the running job has %g s to finish; queued video jobs "
                "are kept%s); send it again to exit at once",
                name,
                self.state.config.drain_timeout_s,
                ""
                if self.state.videos.jobs is not None
                else " only with --output-dir, which this server was not given",
            )
            threading.Thread(target=self._drain_then_exit, name="ditattn-drain", daemon=True).start()
            return
        log.warning(
            "second %s: exiting at once (the job store holds every job; a running one is re-queued by the next start)",
            name,
        )
        for handler in logging.getLogger().handlers:
            try:
                handler.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(128 + int(sig))

    def _drain_then_exit(self) -> None:
        try:
            self.state.drain(self.state.config.drain_timeout_s)
        except Exception:  # noqa: BLE001 - the exit must happen whatever the drain met
            log.exception("drain failed")
        finally:
            self.should_exit = True
