"""Serving the proxy with uvicorn on its own thread and event loop, driven from synchronous code (the run)."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.procs import name_os_thread
from proxy.app import ProxyApp

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 30.0
"""Default seconds a client has to send a whole request, head and body (harnesses send theirs in well under 1 s)."""


class RequestDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive whole, head and body.

    uvicorn closes idle keep-alive connections but lets a request arrive as slowly as its client likes, so a
    client trickling bytes (slowloris) holds a connection, a file descriptor and buffers for ever. Here each
    request must be received in full within `request_timeout_s` of the connection opening or of the previous
    answer ending, or the connection is closed. Answers are not limited: a long stream is sent after its request
    was whole. A subclass sets `request_timeout_s` (see `request_deadline`).
    """

    request_timeout_s: float = REQUEST_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if not self._receiving():
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # first: super() may take in a pipelined request, which disarms it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _receiving(self) -> bool:
        """Whether a request is still (or not yet) coming in: waiting for its head, or in its body."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._receiving() and not self.transport.is_closing():
            logger.info("closing connection from %s: no whole request within %.0f s", self.client,
                        self.request_timeout_s)
            self.transport.close()


def request_deadline(seconds: float) -> type[RequestDeadlineProtocol]:
    """The h11 protocol class with a `seconds` deadline per request, for uvicorn.Config(http=...)."""
    if not seconds > 0:
        raise ValueError(f"request_timeout_s must be a positive number of seconds, got {seconds!r}")
    return type("RequestDeadlineProtocol", (RequestDeadlineProtocol,), {"request_timeout_s": float(seconds)})


def uvicorn_config(app, request_timeout_s: float = REQUEST_TIMEOUT_S, **options: Any) -> uvicorn.Config:
    """How the proxy is served: uvicorn with the per-request deadline, quiet logs, no access log."""
    options = {"log_level": "warning", "access_log": False, "lifespan": "on", **options}
    return uvicorn.Config(app, http=request_deadline(request_timeout_s), **options)


class ProxyServer:
    """Runs a ProxyApp under uvicorn in a daemon thread; pause/resume/version are safe to call from any thread."""

    def __init__(self, app: ProxyApp, host: str = "0.0.0.0", port: int = 0,
                 request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # bound now, so `port` is known (port 0 picks a free one)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn_config(app, request_timeout_s))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def base_url(self, rollout_id: str, host: str | None = None) -> str:
        """OPENAI_BASE_URL for a rollout (ANTHROPIC_BASE_URL is the same without the trailing /v1)."""
        reach = host or ("127.0.0.1" if self.host == "0.0.0.0" else self.host)
        return f"http://{reach}:{self.port}/rollouts/{rollout_id}/v1"

    def start(self, timeout: float = 30.0) -> ProxyServer:
        def run() -> None:
            name_os_thread()  # proxy:<port>, for top -H and bench/run_profile.py
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._server.serve(sockets=[self._sock]))
            except BaseException as exc:  # surfaced by start(); the thread must not die silently
                self._error = exc
                logger.exception("proxy server on port %d stopped with an error", self.port)
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=run, name=f"proxy:{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"proxy server did not start on port {self.port}: {self._error!r}")
        logger.info("proxy serving on %s:%d", self.host, self.port)
        return self

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float | None) -> Any:
        if self._loop is None or not self._thread or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("proxy server is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def pause(self, timeout: float | None = None) -> None:
        """Hold new calls and block until calls in flight drain and are recorded (TimeoutError if not in time)."""
        self._call(self.app.pause(timeout), None)

    def resume(self) -> None:
        self._call(self.app.resume(), 30)

    def settled(self, rollout_id: str, timeout: float) -> int:
        """Block until every call of the rollout is stored or `timeout` s passed; the records still unstored."""
        return self._call(self.app.settled(rollout_id, timeout), timeout + 30)

    def set_policy_version(self, version: int) -> None:
        self.app.set_policy_version(version)  # a plain attribute write: safe from any thread

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving; uvicorn's shutdown runs the app's lifespan end (flush records, close the engine client)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
