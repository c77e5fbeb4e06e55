"""The engine connections' reads and writes on asyncio's own transports: httpcore's network backend without anyio.

httpcore runs every read and write through anyio (a cancel scope, a deadline timer and a checkpoint each) and polls
every idle connection's socket when a request starts or ends: about a sixth of the proxy's CPU per call under load.
httpcore takes its network backend as a documented extension point (`AsyncNetworkBackend`); this one keeps what
arrives in a protocol's buffer, so a read returns at once when bytes are there and otherwise waits on one future with
httpcore's timeout as its deadline, and an idle connection is readable when its protocol has seen bytes or the end.
Pooling, HTTP/1.1 and the timeouts' values stay httpcore's and httpx's.
"""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore

HIGH_WATER = 256 * 1024
"""Bytes buffered from one connection before its socket is no longer read (the engine then waits for us)."""


class _Buffer(asyncio.Protocol):
    """What one connection has received, its end, and whether its writes must wait for the peer to read."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []  # received, not yet read
        self.size = 0
        self.ended = False  # the peer closed its side, or the connection is lost
        self.error: BaseException | None = None  # why it was lost, when not cleanly
        self.paused = False  # the transport holds more unsent bytes than its limit
        self._waiter: asyncio.Future | None = None  # the read or write waiting for progress

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > HIGH_WATER:
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close the transport: HTTP/1.1 never half-closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended, self.error = True, exc
        self._wake()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def take(self, max_bytes: int) -> bytes:
        """Up to `max_bytes` of what was received (a single chunk, the usual case, is not copied)."""
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        if len(data) > max_bytes:
            self.chunks.append(data[max_bytes:])
            data = data[:max_bytes]
        self.size -= len(data)
        if self.size <= HIGH_WATER and not self.ended:
            self.transport.resume_reading()
        return data

    async def progress(self, timeout: float | None, error: type[Exception]) -> None:
        """Wait for bytes, the end, or room to write; `error` (a timeout) after `timeout` s without."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter, error, timeout)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _expire(waiter: asyncio.Future, error: type[Exception], timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(error(f"no progress within {timeout} s"))


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, buffer: _Buffer) -> None:
        self._transport, self._buffer = transport, buffer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        buffer = self._buffer
        if not buffer.chunks and not buffer.ended:
            await buffer.progress(timeout, httpcore.ReadTimeout)
        if buffer.chunks:
            return buffer.take(max_bytes)
        if buffer.error is not None:
            raise httpcore.ReadError(f"connection lost: {buffer.error!r}")
        return b""  # the end: httpcore tells a cut answer from a whole one

    async def write(self, data: bytes, timeout: float | None = None) -> None:
        if not data:
            return
        if self._buffer.ended or self._transport.is_closing():
            raise httpcore.WriteError("connection closed")
        self._transport.write(data)
        if self._buffer.paused and not self._buffer.ended:
            await self._buffer.progress(timeout, httpcore.WriteTimeout)
        if self._buffer.error is not None:
            raise httpcore.WriteError(f"connection lost: {self._buffer.error!r}")

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport = await loop.start_tls(self._transport, self._buffer, ssl_context,
                                                 server_hostname=server_hostname)
        except TimeoutError:
            self._transport.close()
            raise httpcore.ConnectTimeout(f"TLS handshake not done within {timeout} s") from None
        except (OSError, ssl.SSLError) as exc:
            self._transport.close()
            raise httpcore.ConnectError(f"TLS handshake failed: {exc!r}") from exc
        self._buffer.transport = transport
        return _Stream(transport, self._buffer)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle connection with bytes or an end waiting is no longer usable
            return bool(self._buffer.chunks) or self._buffer.ended
        names = {"ssl_object": "ssl_object", "client_addr": "sockname", "server_addr": "peername", "socket": "socket"}
        return self._transport.get_extra_info(names[info]) if info in names else None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend on asyncio's transports (see the module docstring)."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[tuple] | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = (local_address, 0) if local_address else None
        return await self._connect(loop.create_connection(_Buffer, host, port, local_addr=local), timeout,
                                   socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[tuple] | None = None) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        return await self._connect(loop.create_unix_connection(_Buffer, path), timeout, socket_options)

    @staticmethod
    async def _connect(connecting, timeout: float | None, socket_options: Iterable[tuple] | None) -> _Stream:
        try:
            async with asyncio.timeout(timeout):
                transport, buffer = await connecting
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"not connected within {timeout} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock: socket.socket = transport.get_extra_info("socket")
        for option in socket_options or ():  # asyncio has already set TCP_NODELAY
            sock.setsockopt(*option)
        return _Stream(transport, buffer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
