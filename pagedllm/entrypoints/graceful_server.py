"""The uvicorn server `pagedllm serve`, `router` and `disagg-proxy` run: SIGTERM drains, then exits 0."""

from __future__ import annotations


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
