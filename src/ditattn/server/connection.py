"""The HTTP/1.1 connection handling of ``ditattn serve``: uvicorn's h11 protocol with read timeouts
and half-close support (:class:`GuardedH11Protocol`), and the uvicorn configuration that uses it
(:func:`uvicorn_config`).

* A connection must send a request's headers within ``header_timeout_s`` of its first byte (or of
  being opened, or of the previous response), and a request body may not stall for more than
  ``body_timeout_s``; past that the connection is closed (a body cut short is a disconnect for the
  handler: its job, if any, is cancelled).  uvicorn itself only times out idle keep-alive
  connections.
* A client that half-closes its socket (``shutdown(SHUT_WR)``) after sending a complete request
  still gets its answer: the end of its input is not a disconnect.  To tell such a client from one
  that went away, the server sends one informational ``100 Continue`` (which HTTP/1.1 clients skip)
  and checks the socket shortly after: a client that has closed its socket answers it with a reset,
  and that one counts as disconnected.
"""

from __future__ import annotations

import logging
import socket
import struct

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ditattn.server")
PROBE_CHECKS_S = (0.05, 0.25, 1.0, 3.0)  # after the probe: when to look for the reset of a closed client
_TCP_CLOSE = 7  # Linux tcp_info.tcpi_state of a connection that was reset


class GuardedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with the read timeouts and the half-close handling of the module
    docstring; ``header_timeout_s`` / ``body_timeout_s`` are set by :func:`protocol_class`."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_timer = None
        self._half_closed = False
        self._arm(self.header_timeout_s, "request headers")

    # -- read timeouts ---------------------------------------------------------------------------
    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out, what, seconds)

    def _disarm(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
            self._read_timer = None

    def _read_timed_out(self, what: str, seconds: float) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        log.warning("closing a connection from %s: no complete %s within %g s", _peer(self.client), what, seconds)
        self.transport.close()  # connection_lost marks a running request as disconnected

    def _rearm(self) -> None:
        """Arm the timer for what the client owes now: headers (while its side is idle with bytes of
        a next request buffered, or a new connection), a body (while it sends one), nothing else."""
        their = self.conn.their_state
        if their is h11.SEND_BODY:
            self._arm(self.body_timeout_s, "request body")
        elif their is h11.IDLE and self.conn.trailing_data[0]:
            if getattr(self, "_read_timer", None) is None:  # headers: counted from their first byte
                self._arm(self.header_timeout_s, "request headers")
        else:
            self._disarm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.transport.is_closing():
            self._rearm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._half_closed and not self.transport.is_closing():
            self.transport.close()  # the client sends nothing more

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- half-close --------------------------------------------------------------------------------
    def eof_received(self):
        """The client ended its side.  Keep the connection open for the answer when a complete request
        is being answered; otherwise (idle, or a request cut short) it is a disconnect."""
        self._disarm()
        cycle = self.cycle
        answering = cycle is not None and not cycle.response_complete and self.conn.their_state is h11.DONE
        if not answering:
            return None  # asyncio closes the transport: connection_lost
        self._half_closed = True
        cycle.keep_alive = False
        if self.conn.our_state is h11.SEND_RESPONSE and self.scope.get("http_version") == "1.1":
            try:  # the probe: a client that closed its socket answers it with a reset
                self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            except h11.LocalProtocolError:
                return True
            self.loop.call_later(PROBE_CHECKS_S[0], self._check_reset, 0)
        return True

    def _check_reset(self, i: int) -> None:
        if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
            return
        if _was_reset(self.transport.get_extra_info("socket")):
            log.info("the client %s closed its connection before the answer", _peer(self.client))
            self.transport.abort()  # connection_lost: the waiting request is cancelled
        elif i + 1 < len(PROBE_CHECKS_S):
            self.loop.call_later(PROBE_CHECKS_S[i + 1] - PROBE_CHECKS_S[i], self._check_reset, i + 1)


def _was_reset(sock) -> bool:
    """Whether the peer of TCP socket ``sock`` has reset the connection (Linux ``TCP_INFO``; False
    where it cannot be told)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        if struct.unpack("B", info[:1])[0] == _TCP_CLOSE:
            return True
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
    except (OSError, AttributeError, struct.error):
        return False


def _peer(client) -> str:
    return "%s:%d" % client if client else "a client"


def protocol_class(header_timeout_s: float, body_timeout_s: float) -> type:
    """A :class:`GuardedH11Protocol` subclass with these timeouts (uvicorn instantiates the class)."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


def uvicorn_config(app, config, **kw):
    """The ``uvicorn.Config`` serving ``app`` under ``config`` (a
    :class:`~ditattn.runconfig.ServerConfig`: host, port, read timeouts); ``kw``: further uvicorn
    settings (log level, ...)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=protocol_class(config.header_timeout_s, config.body_timeout_s),
        **kw,
    )
