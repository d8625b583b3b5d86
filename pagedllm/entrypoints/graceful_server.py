"""The uvicorn server `pagedllm serve`, `router` and `disagg-proxy` run: SIGTERM drains, then exits 0."""

from __future__ import annotations

from dataclasses import dataclass

# How long an idle kept-alive connection stays open, server side: longer than the 5 s httpx (and so the official
# openai client) keeps one in its pool. At uvicorn's and vLLM's 5 s both timers fire together, and a POST sent on
# the pooled connection as the server closes it gets a connection reset (an httpx.ReadError), however sound the
# server; a soak test met one in 5,000 requests.
SERVER_KEEP_ALIVE_S = 10
# How long our own clients (the router, `bench serve`, `bench soak`) keep an idle connection pooled: well under
# the server's, so they never reuse one it is closing, also to a server started with a shorter --timeout-keep-alive
CLIENT_KEEPALIVE_EXPIRY_S = 2.0
HTTPX_KEEPALIVE_EXPIRY_S = 5.0  # httpx's default, which the openai client keeps
# How long a request's headers may take to arrive whole (from the connection's start, or the previous answer on a
# kept-alive one), and each chunk of its body: a half-sent request is closed then, not held (a file descriptor each)
REQUEST_HEADER_TIMEOUT_S = 30.0
REQUEST_BODY_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 4096  # open connections (and requests in flight) before the server answers 503


@dataclass(frozen=True, slots=True)
class ConnectionBounds:
    """How long a request's headers and each chunk of its body may take, and how many connections may be open: one
    set for `pagedllm serve` and the routers in front of servers (`router`, `disagg-proxy`, the data-parallel
    front), so none of them holds a half-sent request."""

    header_timeout: float = REQUEST_HEADER_TIMEOUT_S
    body_timeout: float = REQUEST_BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config's arguments for the header deadline and the connection cap (the body's deadline is the
        app's BodyLimit middleware)."""
        return {
            "http": timed_http_protocol(self.header_timeout, self.max_connections),
            "limit_concurrency": self.max_connections,
        }


def connection_bounds(args) -> ConnectionBounds:
    """The bounds the command line asked for (`--request-header-timeout`, `--request-body-timeout`,
    `--max-connections`)."""
    return ConnectionBounds(args.request_header_timeout, args.request_body_timeout, args.max_connections)


def client_limits(max_connections: int | None, max_keepalive_connections: int | None = 20):
    """httpx pool limits (``None``: no limit; 20 kept alive is httpx's default) for a client of a pagedllm server:
    idle connections leave the pool before the server would close them (see CLIENT_KEEPALIVE_EXPIRY_S)."""
    import httpx

    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
    )


def timed_http_protocol(header_timeout: float, max_connections: int, impl: str = "auto") -> type:
    """uvicorn's HTTP protocol (``impl``: httptools where installed, as uvicorn's "auto" picks, else h11) with a
    deadline on each request's headers. uvicorn's own keep-alive timer stops at the first byte of a request, so a
    client that sends half a header is otherwise held forever. Also logs (at most once a minute) when
    ``max_connections`` is reached."""
    import logging
    import time

    base: type
    if impl == "auto":
        try:
            import httptools  # noqa: F401 (uvicorn's httptools protocol needs it; a plain install has h11 only)

            impl = "httptools"
        except ImportError:
            impl = "h11"
    if impl == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base

    logger = logging.getLogger("pagedllm")
    last_warning = [0.0]

    class TimedHttpProtocol(base):
        """The timer runs from the connection's start and from each answer; when it fires, a connection with no
        request in progress (its headers never completed) is closed."""

        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) >= max_connections and time.monotonic() - last_warning[0] > 60:
                last_warning[0] = time.monotonic()
                logger.warning(
                    "%d connections open: the limit (--max-connections %d) is reached; new ones get 503",
                    len(self.connections),
                    max_connections,
                )
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is in progress: its headers came whole (its body has a timeout of its own)
            if not self.transport.is_closing():
                logger.info("closed a connection whose request headers did not arrive in %.0f s", header_timeout)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # the next request on a kept-alive connection: a deadline anew
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return TimedHttpProtocol


def graceful_server_class():
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """SIGTERM is the orderly way to stop a server: drain in-flight requests, then exit 0.

        uvicorn re-raises captured signals after shutdown (so the process dies of
        SIGTERM); we drop SIGTERM from that list and keep SIGINT's behaviour.
        """

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            for hook in getattr(getattr(self.config.app, "state", None), "on_exit", ()):
                hook()  # e.g. end the streams that would never finish by themselves
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    return GracefulServer
