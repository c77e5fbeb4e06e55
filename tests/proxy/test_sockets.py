"""proxy.sockets, httpcore's network backend on asyncio's transports, against real local sockets (the proxy's live
tests run every engine call through it as well)."""
from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import httpcore
import pytest

from proxy import sockets
from proxy.sockets import AsyncioBackend
from tests.proxy.conftest import until


class Peer:
    """A local TCP server whose one connection the test drives (what it sends, whether it reads, when it closes)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls
        self.connected: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def __aenter__(self) -> Peer:
        self.server = await asyncio.start_server(lambda r, w: self.connected.put_nowait((r, w)), "127.0.0.1", 0,
                                                 ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()


async def connect(peer: Peer) -> tuple[httpcore.AsyncNetworkStream, asyncio.StreamReader, asyncio.StreamWriter]:
    stream = await AsyncioBackend().connect_tcp("127.0.0.1", peer.port, timeout=5)
    reader, writer = await peer.connected.get()
    return stream, reader, writer


async def read_all(stream: httpcore.AsyncNetworkStream, max_bytes: int = 65536) -> bytes:
    parts = []
    while part := await stream.read(max_bytes, timeout=5):
        assert len(part) <= max_bytes
        parts.append(part)
    return b"".join(parts)


async def test_it_reads_what_the_peer_sent_then_an_empty_read_at_its_end():
    async with Peer() as peer:
        stream, reader, writer = await connect(peer)
        await stream.write(b"GET / HTTP/1.1\r\n\r\n", timeout=5)
        assert await reader.readexactly(18) == b"GET / HTTP/1.1\r\n\r\n"
        writer.write(b"hello, ")
        writer.write(b"engine")
        await writer.drain()
        writer.close()

        assert await read_all(stream) == b"hello, engine"
        assert await stream.read(100, timeout=5) == b""
        await stream.aclose()


async def test_a_long_answer_arrives_whole_though_reading_pauses_past_the_high_water_mark():
    body = bytes(range(256)) * (4 * sockets.HIGH_WATER // 256)  # four times what is buffered before a pause
    async with Peer() as peer:
        stream, _, writer = await connect(peer)
        writer.write(body)
        writer.close()
        await until(lambda: stream._buffer.size > sockets.HIGH_WATER, "the buffer past its high water mark")

        assert await read_all(stream, max_bytes=10_000) == body
        await stream.aclose()


async def test_a_read_without_progress_is_a_read_timeout_and_the_stream_still_reads_after():
    async with Peer() as peer:
        stream, _, writer = await connect(peer)
        with pytest.raises(httpcore.ReadTimeout):
            await stream.read(100, timeout=0.05)
        writer.write(b"late")
        await writer.drain()

        assert await stream.read(100, timeout=5) == b"late"
        await stream.aclose()


async def test_a_write_the_peer_never_reads_is_a_write_timeout():
    async with Peer() as peer:
        stream, _, _ = await connect(peer)  # the peer never reads: the kernel's buffers fill, then asyncio's
        with pytest.raises(httpcore.WriteTimeout):
            for _ in range(64):
                await stream.write(bytes(1024 * 1024), timeout=0.2)
        await stream.aclose()


async def test_a_refused_connection_is_a_connect_error():
    async with Peer() as peer:
        port = peer.port
    with pytest.raises(httpcore.ConnectError):
        await AsyncioBackend().connect_tcp("127.0.0.1", port, timeout=5)


async def test_an_idle_connection_turns_readable_when_the_peer_closes_it_and_writes_then_fail():
    async with Peer() as peer:
        stream, _, writer = await connect(peer)
        assert stream.get_extra_info("is_readable") is False  # idle and open: httpcore may reuse it
        assert stream.get_extra_info("server_addr") == ("127.0.0.1", peer.port)
        writer.close()
        await until(lambda: stream.get_extra_info("is_readable"), "the close seen")

        assert await stream.read(100, timeout=5) == b""
        with pytest.raises(httpcore.WriteError):
            await stream.write(b"more", timeout=5)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost (openssl), and its key."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


async def test_it_speaks_tls_after_start_tls(certificate):
    cert, key = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    async with Peer(tls=server_side) as peer:
        plain = await AsyncioBackend().connect_tcp("127.0.0.1", peer.port, timeout=5)
        stream = await plain.start_tls(ssl.create_default_context(cafile=str(cert)), "localhost", timeout=5)
        reader, writer = await peer.connected.get()
        await stream.write(b"ping", timeout=5)
        assert await reader.readexactly(4) == b"ping"
        writer.write(b"pong")
        await writer.drain()

        assert await stream.read(100, timeout=5) == b"pong"
        assert stream.get_extra_info("ssl_object").server_hostname == "localhost"
        writer.close()
        await stream.aclose()


async def test_a_certificate_it_cannot_verify_is_a_connect_error(certificate):
    cert, key = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    async with Peer(tls=server_side) as peer:
        plain = await AsyncioBackend().connect_tcp("127.0.0.1", peer.port, timeout=5)
        with pytest.raises(httpcore.ConnectError):
            await plain.start_tls(ssl.create_default_context(), "localhost", timeout=5)  # system CAs only
