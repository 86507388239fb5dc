"""OpenAI-compatible image/video server with per-request attention overrides and dynamic batching.

``app``: the FastAPI app factory :func:`create_app` (assembly only); ``routes``: one router per
resource (images, videos, models, health/metrics); ``state``: what the handlers share; ``bodies``:
reading JSON / form bodies; ``protocol``: request/response bodies; ``store``: video jobs and stored
images; ``media``: PNG / MP4 encoding; ``scheduler``: queue + batching worker; ``runner``: the model
side (attention validation, batch generation); ``metrics``: Prometheus metrics.  FastAPI and
uvicorn are imported only when the app is built; ``ditattn serve`` is :mod:`ditattn.entrypoints.serve`.
Without the ``server`` extra, importing this package raises the one-line
:class:`~ditattn.extras.MissingDependencyError` naming ``ditattn[server]``.
"""

from ditattn.extras import require

require("server", "the ditattn server")

__all__ = ["create_app"]


def __getattr__(name):
    if name in __all__:
        from ditattn.server import app as _app

        return getattr(_app, name)
    raise AttributeError(f"module 'ditattn.server' has no attribute {name!r}")
