"""How the app answers what the routes do not: the API key check (without a key: the ``Host`` /
``Origin`` check that keeps web pages elsewhere from driving the server), request counting and internal
errors (one ASGI middleware, :class:`ServerMiddleware`), and every error as an OpenAI error body
(exception handlers).

Every response is counted once in ``ditattn_http_requests`` by endpoint and status — 401s refused
before routing, 500s and requests whose client went away (499) included.  An unexpected exception
is logged once, with its traceback and a reference, and answered with a fixed message carrying that
reference (never the exception's text or a path); it does not propagate to uvicorn, which would log
it a second time.
"""

from __future__ import annotations

import hmac
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ditattn.server.protocol import RequestError, error_body
from ditattn.server.state import internal_message

log = logging.getLogger("ditattn.server")
CLIENT_CLOSED = 499


def _endpoint_label(routes: list, scope: dict) -> str:
    """The matched route's path template (bounded label values), also for requests refused before
    routing (401); ``other`` for paths no route serves."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return path
    from starlette.routing import Match

    for r in routes:
        try:
            if r.matches(scope)[0] == Match.FULL:
                return getattr(r, "path", "other")
        except Exception:  # pragma: no cover - defensive
            continue
    return "other"


class ServerMiddleware:
    """Pure ASGI middleware around the routes: ``Authorization: Bearer <key>`` on every path but
    ``/health`` when the server has an API key (401 otherwise), the request counter, and the last
    line against unexpected exceptions (see the module docstring).  ``routes``: the app's routes, to
    label requests refused before routing."""

    def __init__(self, app, routes: list):
        self.app = app
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state.server
        status = {"code": None}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self._auth(state, scope) or origin_refusal(state.config, scope)
            if refusal is not None:
                await refusal(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        except ClientDisconnect:  # the client left while its body was read
            status["code"] = status["code"] or CLIENT_CLOSED
        except Exception as exc:  # noqa: BLE001 - the one place that answers what nothing else caught
            ref = uuid.uuid4().hex[:12]
            log.error(
                "internal error on %s %s (reference %s): %s: %s",
                scope.get("method"),
                scope.get("path", "")[:200],
                ref,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            if status["code"] is None:
                await JSONResponse(error_body(internal_message(ref), type="server_error"), status_code=500)(
                    scope, receive, send_counted
                )
            else:  # the response had started: it cannot become a 500 any more
                status["code"] = 500
        finally:
            state.metrics.requests.labels(
                endpoint=_endpoint_label(self.routes, scope), status=str(status["code"] or 500)
            ).inc()

    @staticmethod
    def _auth(state, scope):
        key = state.config.api_key
        if key is None or scope.get("path") == "/health":
            return None
        auth = Request(scope).headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return None
        msg = (
            "missing API key: send 'Authorization: Bearer <key>'"
            if not auth
            else "invalid API key in the Authorization header"
        )
        return JSONResponse(
            error_body(msg, type="authentication_error", code="invalid_api_key"),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )


LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def _host_name(value: str) -> str:
    """The host name of a ``Host`` header value or URL authority (port and IPv6 brackets dropped, lower case)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _local_name(config, name: str) -> bool:
    """A host name this server answers without an API key: an IP address (a page elsewhere cannot
    rebind one), localhost, ``--host``, the ``--public-url`` host, or one of ``--allowed-hosts``."""
    from urllib.parse import urlsplit

    allowed = {*LOCAL_NAMES, _host_name(config.host), *(_host_name(h) for h in config.allowed_hosts)}
    if config.public_url:
        allowed.add((urlsplit(config.public_url).hostname or "").lower())
    return "*" in config.allowed_hosts or name in allowed or name.endswith(".localhost") or _is_ip(name)


def origin_refusal(config, scope):
    """Without an API key, the 403 for a request a web page elsewhere could have sent: a ``Host``
    header that is not one of this server's names (DNS rebinding), or an ``Origin`` header (a
    browser's cross-site request) that is neither this server's own origin, a local one, nor one of
    ``--allowed-origins``.  None to let the request through (always, with an API key)."""
    if config.api_key is not None or scope.get("path") == "/health":
        return None
    headers = Request(scope).headers
    host = headers.get("host")
    if host is not None and not _local_name(config, _host_name(host)):
        msg = (
            f"Host '{host[:100]}' is not a name of this server; without --api-key it answers localhost, IP "
            "addresses, --host and the --public-url host (add names with --allowed-hosts)"
        )
        return JSONResponse(error_body(msg, type="permission_error", code="host_not_allowed"), status_code=403)
    origin = headers.get("origin")
    if origin is None or "*" in config.allowed_origins:
        return None
    from urllib.parse import urlsplit

    o = origin.strip().lower().rstrip("/")
    allowed = {a.strip().lower().rstrip("/") for a in config.allowed_origins}
    try:
        parts = urlsplit(o)
        name = (parts.hostname or "").lower()
    except ValueError:
        parts, name = None, ""
    own = host is not None and parts is not None and parts.netloc == host.strip().lower()
    local = name in LOCAL_NAMES or name.endswith(".localhost")
    if o in allowed or (parts is not None and parts.scheme in ("http", "https") and (own or local)):
        return None
    msg = (
        f"requests from the web page origin '{origin[:100]}' are refused: without --api-key this server only "
        "answers its own and local pages (add origins with --allowed-origins, or set --api-key)"
    )
    return JSONResponse(error_body(msg, type="permission_error", code="origin_not_allowed"), status_code=403)


def install_auth_and_metrics(app: FastAPI, routes: list) -> None:
    """Add :class:`ServerMiddleware` (``routes``: the app's routes, for endpoint labels)."""
    app.add_middleware(ServerMiddleware, routes=routes)


def install_error_handlers(app: FastAPI) -> None:
    """Exception handlers: :class:`RequestError` as its status, headers and body (logged once),
    HTTP and validation errors as OpenAI error bodies."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        if exc.logged:
            pass
        elif exc.status >= 500:
            log.error("request failed (%d): %s", exc.status, exc.message)
        elif exc.status not in (401, 404) and exc.code != "attention_refused":  # those are logged where raised
            log.warning("request refused (%d): %s", exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        headers = dict(getattr(exc, "headers", None) or {})
        allow = headers.get("Allow") or headers.get("allow")
        msg = f"{request.method[:20]} {request.url.path[:200]}: {exc.detail}"
        if exc.status_code == 405 and allow:
            msg += f"; allowed methods: {allow}"
        return JSONResponse(error_body(msg, type=kind), status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:])[:100] or None
        return JSONResponse(
            error_body(f"invalid value for '{loc}': {first.get('msg', 'invalid')}", param=loc), status_code=400
        )
