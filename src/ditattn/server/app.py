"""The OpenAI-compatible HTTP server: app assembly.

Endpoints (one router per resource, :mod:`ditattn.server.routes`): ``POST /v1/images/generations``,
``GET /v1/images/{id}/content``, ``POST /v1/videos``, ``GET /v1/videos``, ``GET /v1/videos/{id}``,
``GET /v1/videos/{id}/content``, ``DELETE /v1/videos/{id}``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``.

Every request is validated before it is queued: body fields, size / steps / frames / n limits, the
model name, and the attention settings (``attention_backend_override`` and ``skip_softmax_params``
through the runner's ``prepare``, which applies the override and skip-softmax rules and logs each refusal). Refusals
are 400s with an OpenAI error body. Valid requests go to the :class:`~ditattn.server.scheduler.Scheduler`
(429 with ``Retry-After`` when its queue is full; 503 while the server drains for a shutdown).
Outputs are written atomically under a server-owned folder with server-generated ids; no request
field names a path.  Cancellation (client disconnect, ``DELETE``), timeouts, the job store and the
graceful drain: :mod:`~ditattn.server.state`, :mod:`~ditattn.server.scheduler`,
:mod:`~ditattn.server.jobstore`, :mod:`~ditattn.server.lifecycle`.  ``ditattn serve`` itself:
:mod:`ditattn.entrypoints.serve`.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from fastapi import FastAPI

from ditattn.runconfig import ServerConfig
from ditattn.server import gcpause
from ditattn.server.errors import install_auth_and_metrics, install_error_handlers
from ditattn.server.routes import health, images, models, videos
from ditattn.server.state import ServerState


def create_app(runner, config: Optional[ServerConfig] = None, *, state: Optional[ServerState] = None) -> FastAPI:
    """Build the FastAPI app serving ``runner`` (see :class:`ditattn.server.runner.BaseRunner`)
    under ``config`` (None: the defaults).

    The scheduler thread starts with the app's lifespan (uvicorn runs it), which also reloads the
    job store of ``config.output_dir``, and stops at shutdown.  ``app.state.server`` is the
    :class:`~ditattn.server.state.ServerState`.  Raises AttentionConfigError for an output folder
    it cannot use (another server holds it, a foreign ``jobs.sqlite``).  ``state``: a prepared
    state to serve instead (a replica's :class:`~ditattn.server.cluster.ClusterState`, which
    restores its jobs itself).
    """
    state = state or ServerState(runner, config or ServerConfig())
    gcpause.install()  # the image route's Server-Timing reports the collector's share

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.start()
        restore = getattr(state, "restore_jobs", None)  # a replica's own restore
        restore() if restore is not None else videos.restore_jobs(state)  # --output-dir: the previous run's jobs
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="ditattn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    routers = [module.router for module in (images, videos, models, health)]
    install_auth_and_metrics(app, [route for router in routers for route in router.routes])
    install_error_handlers(app)
    for router in routers:
        for route in router.routes:  # HTTP: HEAD wherever GET is served (the headers alone; probes use it)
            methods = getattr(route, "methods", None)
            if methods is not None and "GET" in methods:
                methods.add("HEAD")
        app.include_router(router)
    return app
