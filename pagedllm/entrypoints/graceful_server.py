"""The uvicorn server `pagedllm serve`, `router` and `disagg-proxy` run: SIGTERM drains, then exits 0."""

from __future__ import annotations

# How long an idle kept-alive connection stays open, server side: longer than the 5 s httpx (and so the official
# openai client) keeps one in its pool. At uvicorn's and vLLM's 5 s both timers fire together, and a POST sent on
# the pooled connection as the server closes it gets a connection reset (an httpx.ReadError), however sound the
# server; a soak test met one in 5,000 requests.
SERVER_KEEP_ALIVE_S = 10
# How long our own clients (the router, `bench serve`, `bench soak`) keep an idle connection pooled: well under
# the server's, so they never reuse one it is closing, also to a server started with a shorter --timeout-keep-alive
CLIENT_KEEPALIVE_EXPIRY_S = 2.0
HTTPX_KEEPALIVE_EXPIRY_S = 5.0  # httpx's default, which the openai client keeps


def client_limits(max_connections: int | None, max_keepalive_connections: int | None = 20):
    """httpx pool limits (``None``: no limit; 20 kept alive is httpx's default) for a client of a pagedllm server:
    idle connections leave the pool before the server would close them (see CLIENT_KEEPALIVE_EXPIRY_S)."""
    import httpx

    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S,
    )


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
