"""OpenAI-compatible image/video server with per-request attention overrides and dynamic batching.

``protocol``: request/response bodies; ``scheduler``: queue + batching worker; ``runner``: the model
side (attention validation, batch generation); ``metrics``: Prometheus text; ``app``: the FastAPI
app factory :func:`create_app` and ``ditattn serve`` (:func:`serve_main`). FastAPI and uvicorn are
imported only when the app is built.
"""

__all__ = ["create_app", "serve_main"]


def __getattr__(name):
    if name in __all__:
        from ditattn.server import app as _app

        return getattr(_app, name)
    raise AttributeError(f"module 'ditattn.server' has no attribute {name!r}")
