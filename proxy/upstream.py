"""The engine client: the only module importing httpx; every transport error is mapped here once."""
from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpcore
import httpx

from proxy.sockets import AsyncioBackend
from proxy.types import UpstreamConfig

logger = logging.getLogger(__name__)


class UpstreamError(Exception):
    """The engine could not give an answer; `status` is what the harness gets."""

    status = 502

    def __init__(self, message: str, body: Any = None, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.body = body
        if status is not None:
            self.status = status


class UpstreamTimeout(UpstreamError):
    status = 504


class UpstreamUnavailable(UpstreamError):
    status = 502


class UpstreamGone(UpstreamUnavailable):
    """The connection failed (refused, reset, closed without an answer): the engine may have died. A call cut off
    this way is the one kind proxy.replicas retries on another replica."""


class UpstreamStatusError(UpstreamError):
    """The engine answered 4xx/5xx; its status and body pass through to the harness."""


def _map_transport_error(exc: httpx.HTTPError) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"engine timed out ({type(exc).__name__})")
    if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return UpstreamGone(f"engine unreachable ({type(exc).__name__}: {exc})")
    return UpstreamUnavailable(f"engine request failed ({type(exc).__name__}: {exc})")


def _decode_error_body(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")[:2000]


class _Released(httpx.AsyncByteStream):
    """A response body that tells its shard when the connection is free again."""

    def __init__(self, stream: httpx.AsyncByteStream, release) -> None:
        self._stream, self._release = stream, release

    def __aiter__(self):
        return self._stream.__aiter__()  # the pool's own iterator: no generator in between for every chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._release()


def _utf8_json(data: bytes) -> Any:
    """json.loads for the engine's answers, which are UTF-8 (JSON between systems and event streams always are):
    without json.loads's guess at UTF-16 and UTF-32 for every chunk."""
    return _DECODER.decode(data.decode("utf-8", "surrogatepass"))


_DECODER = json.JSONDecoder()


def _body(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body as it arrives: the transport's own stream (no decoder or re-chunking in between) unless the engine
    compressed it (the proxy asks for no encoding, so it never should)."""
    if response.headers.get("content-encoding", "identity") == "identity":
        return response.stream.__aiter__()
    return response.aiter_bytes()


class _Pool(httpx.AsyncHTTPTransport):
    """httpx's transport over an httpcore pool whose connections read and write through proxy.sockets, not anyio."""

    def __init__(self, limits: httpx.Limits, tls: ssl.SSLContext) -> None:
        super().__init__(limits=limits, verify=tls)
        # httpx takes no network backend for httpcore: its pool is made again, with the same settings and ours
        # (httpx is pinned in requirements.txt; `_pool` is what its handle_async_request and aclose use).
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=tls, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections, keepalive_expiry=limits.keepalive_expiry,
            network_backend=AsyncioBackend())


class ShardedTransport(httpx.AsyncBaseTransport):
    """Connection pools side by side, each request to the least busy one.

    httpcore re-checks every pooled connection whenever a request starts or ends, so one pool of N connections
    costs O(N) per request and O(N^2) per second at N concurrent calls: 64 concurrent calls through one pool used
    half the proxy's CPU. Small pools keep each check short.
    """

    def __init__(self, shards: int, connections_per_shard: int) -> None:
        limits = httpx.Limits(max_connections=connections_per_shard, max_keepalive_connections=connections_per_shard)
        tls = ssl.create_default_context()  # one context for all shards: building one costs tens of ms
        self._pools = [_Pool(limits, tls) for _ in range(shards)]
        self._busy = [0] * shards

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        index = min(range(len(self._pools)), key=self._busy.__getitem__)
        self._busy[index] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._busy[index] -= 1

        try:
            response = await self._pools[index].handle_async_request(request)
        except BaseException:
            release()
            raise
        response.stream = _Released(response.stream, release)
        return response

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()


class Upstream:
    """One long-lived connection pool to an OpenAI-compatible engine (sharded, see ShardedTransport).

    Requests go straight to the httpx transport, not through an AsyncClient: the client's layers (URL merging,
    cookie extraction, auth and redirect flows, a second stream wrapper) cost about a tenth of the proxy's CPU per
    call and do nothing for an engine that sets no cookies and never redirects. What the client would add is kept:
    explicit timeouts (the transport's `timeout` extension), the bearer key, and every transport error mapped once.
    """

    def __init__(self, config: UpstreamConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self._base = config.base_url.rstrip("/") + "/"
        # vLLM serves /tokenize at its root, beside /v1 rather than under it.
        self._root = config.base_url.rstrip("/").removesuffix("/v1") + "/"
        self._auth = [("authorization", f"Bearer {config.api_key}")] if config.api_key else []
        self._json = [("content-type", "application/json"), *self._auth]
        self._timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s,
                                      write=config.write_timeout_s, pool=config.pool_timeout_s).as_dict()
        self._transport = transport or ShardedTransport(
            config.pool_shards, -(-config.max_connections // config.pool_shards))
        self._urls: dict[str, httpx.URL] = {}

    def _request(self, method: str, path: str, body: dict | None = None, timeout: dict | None = None) -> httpx.Request:
        """`path` below the base URL (or an absolute URL), with a JSON body."""
        url = self._urls.get(path)
        if url is None:  # parsed once per path: httpx's URL parsing is dear
            url = self._urls[path] = httpx.URL(path if "://" in path else self._base + path)
        content = None if body is None else json.dumps(body).encode()
        return httpx.Request(method, url, headers=self._auth if body is None else self._json, content=content,
                             extensions={"timeout": timeout or self._timeout})

    async def _send(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._transport.handle_async_request(request)
        except httpx.HTTPError as exc:
            raise _map_transport_error(exc) from exc

    async def post_json(self, path: str, body: dict) -> dict:
        """POST a JSON body, return the decoded JSON answer."""
        response = await self._send(self._request("POST", path, body))
        try:
            content = b"".join([part async for part in _body(response)])
        except httpx.HTTPError as exc:
            raise _map_transport_error(exc) from exc
        finally:
            await response.aclose()
        if response.status_code >= 400:
            raise UpstreamStatusError(
                f"engine answered {response.status_code}", _decode_error_body(content), response.status_code
            )
        try:
            data = _utf8_json(content)
        except ValueError as exc:
            raise UpstreamUnavailable("engine answered with invalid JSON") from exc
        if not isinstance(data, dict):
            raise UpstreamUnavailable("engine answered with a JSON value that is not an object")
        return data

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the engine answers GET /health (at its root) with 200 within `timeout_s`."""
        try:
            response = await self._send(self._request("GET", self._root + "health",
                                                      timeout=httpx.Timeout(timeout_s).as_dict()))
            try:
                await response.aread()
            finally:
                await response.aclose()
        except (UpstreamError, httpx.HTTPError):
            return False
        return response.status_code == 200

    async def tokenize(self, body: dict) -> dict:
        """POST vLLM's /tokenize: `{"count", "max_model_len", "tokens"}` for a prompt or chat messages."""
        return await self.post_json(self._root + "tokenize", body)

    @asynccontextmanager
    async def stream(self, path: str, body: dict) -> AsyncIterator[AsyncIterator[dict]]:
        """POST a streaming request; yields an iterator over the decoded `data:` events (ends at [DONE])."""
        response = await self._send(self._request("POST", path, body))
        try:
            if response.status_code >= 400:
                try:
                    content = await response.aread()
                except httpx.HTTPError as exc:
                    raise _map_transport_error(exc) from exc
                raise UpstreamStatusError(
                    f"engine answered {response.status_code}", _decode_error_body(content), response.status_code
                )
            yield self._events(response)
        finally:
            await response.aclose()

    async def _events(self, response: httpx.Response) -> AsyncIterator[dict]:
        done, pending = False, b""
        try:
            async for data in _body(response):  # split lines here: cheaper than aiter_lines per event
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if done or not line.startswith(b"data:"):
                        continue  # read to the end even after [DONE]: keeps the connection reusable
                    event = self._decode(line[5:].strip())
                    if event is None:
                        done = True
                    else:
                        yield event
        except httpx.HTTPError as exc:
            raise _map_transport_error(exc) from exc
        if not done and pending.startswith(b"data:") and (event := self._decode(pending[5:].strip())) is not None:
            yield event

    @staticmethod
    def _decode(data: bytes) -> dict | None:
        """One `data:` payload; None for [DONE]."""
        if data == b"[DONE]":
            return None
        try:
            event = _utf8_json(data)
        except ValueError as exc:
            raise UpstreamUnavailable(f"engine sent an invalid stream event: {data[:200]!r}") from exc
        if isinstance(event, dict) and "choices" not in event and ("error" in event or event.get("object") == "error"):
            raise UpstreamStatusError("engine reported an error mid-stream", event, 500)
        return event

    async def aclose(self) -> None:
        await self._transport.aclose()

