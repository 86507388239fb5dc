"""How the app answers what the routes do not: the API key check and request counting
(middleware), and every error as an OpenAI error body (exception handlers)."""
from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ditattn.server.protocol import RequestError, error_body

log = logging.getLogger("ditattn.server")


def _endpoint_label(routes: list, request: Request) -> str:
    """The matched route's path template (bounded label values), also for requests refused before
    routing (401); ``other`` for paths no route serves."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return path
    from starlette.routing import Match

    for r in routes:
        try:
            if r.matches(request.scope)[0] == Match.FULL:
                return getattr(r, "path", "other")
        except Exception:  # pragma: no cover - defensive
            continue
    return "other"


def install_auth_and_metrics(app: FastAPI, routes: list) -> None:
    """Middleware: ``Authorization: Bearer <key>`` on every path but ``/health`` when the server
    has an API key (401 otherwise), and every response counted by endpoint and status (``routes``:
    the app's routes, to label requests refused before routing)."""

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        state = app.state.server
        key = state.config.api_key
        response = None
        if key is not None and request.url.path != "/health":
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                msg = ("missing API key: send 'Authorization: Bearer <key>'" if not auth
                       else "invalid API key in the Authorization header")
                response = JSONResponse(error_body(msg, type="authentication_error", code="invalid_api_key"),
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if response is None:
            response = await call_next(request)
        state.metrics.requests.labels(endpoint=_endpoint_label(routes, request), status=str(response.status_code)).inc()
        return response


def install_error_handlers(app: FastAPI) -> None:
    """Exception handlers: :class:`RequestError` as its status and body, HTTP and validation
    errors as OpenAI error bodies, anything else as a logged 500."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        if exc.status >= 500:
            log.error("request failed: %s", exc.message)
        elif exc.status not in (401, 404) and exc.code != "attention_refused":  # those are logged where raised
            log.warning("request refused (%d): %s", exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(msg, type=kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"invalid value for '{loc}': {first.get('msg', 'invalid')}", param=loc),
                            status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}: {exc}", type="server_error"),
                            status_code=500)
