"""Serving the proxy with uvicorn on its own thread and event loop, driven from synchronous code (the run)."""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

import uvicorn

from proxy.app import ProxyApp

logger = logging.getLogger(__name__)


class ProxyServer:
    """Runs a ProxyApp under uvicorn in a daemon thread; pause/resume/version are safe to call from any thread."""

    def __init__(self, app: ProxyApp, host: str = "0.0.0.0", port: int = 0) -> None:
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))  # bound now, so `port` is known (port 0 picks a free one)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def base_url(self, rollout_id: str, host: str | None = None) -> str:
        """OPENAI_BASE_URL for a rollout (ANTHROPIC_BASE_URL is the same without the trailing /v1)."""
        reach = host or ("127.0.0.1" if self.host == "0.0.0.0" else self.host)
        return f"http://{reach}:{self.port}/rollouts/{rollout_id}/v1"

    def start(self, timeout: float = 30.0) -> ProxyServer:
        def run() -> None:
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
