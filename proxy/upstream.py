"""The engine client: the only module importing httpx; every transport error is mapped here once."""
from __future__ import annotations

import json
import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

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

    async def __aiter__(self):
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._release()


class ShardedTransport(httpx.AsyncBaseTransport):
    """Connection pools side by side, each request to the least busy one.

    httpcore re-checks every pooled connection (a socket poll each) whenever a request starts or ends, so
    one pool of N connections costs O(N) per request and O(N^2) per second at N concurrent calls: 64
    concurrent calls through one pool used half the proxy's CPU. Small pools keep each check short.
    """

    def __init__(self, shards: int, connections_per_shard: int) -> None:
        limits = httpx.Limits(max_connections=connections_per_shard, max_keepalive_connections=connections_per_shard)
        tls = ssl.create_default_context()  # one context for all shards: building one costs tens of ms
        self._pools = [httpx.AsyncHTTPTransport(limits=limits, verify=tls) for _ in range(shards)]
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
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_Released(response.stream, release), extensions=response.extensions)

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()


class Upstream:
    """One long-lived AsyncClient to an OpenAI-compatible engine (its pool sharded, see ShardedTransport)."""

    def __init__(self, config: UpstreamConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        # vLLM serves /tokenize at its root, beside /v1 rather than under it.
        self._root = config.base_url.rstrip("/").removesuffix("/v1") + "/"
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s,
                read=config.read_timeout_s,
                write=config.write_timeout_s,
                pool=config.pool_timeout_s,
            ),
            transport=transport or ShardedTransport(
                config.pool_shards, -(-config.max_connections // config.pool_shards)
            ),
        )

    async def post_json(self, path: str, body: dict) -> dict:
        """POST a JSON body, return the decoded JSON answer."""
        try:
            response = await self._client.post(path, content=json.dumps(body).encode(), headers=_JSON)
        except httpx.HTTPError as exc:
            raise _map_transport_error(exc) from exc
        if response.status_code >= 400:
            raise UpstreamStatusError(
                f"engine answered {response.status_code}", _decode_error_body(response.content), response.status_code
            )
        try:
            data = response.json()
        except ValueError as exc:
            raise UpstreamUnavailable("engine answered with invalid JSON") from exc
        if not isinstance(data, dict):
            raise UpstreamUnavailable("engine answered with a JSON value that is not an object")
        return data

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether the engine answers GET /health (at its root) with 200 within `timeout_s`."""
        try:
            response = await self._client.get(self._root + "health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def tokenize(self, body: dict) -> dict:
        """POST vLLM's /tokenize: `{"count", "max_model_len", "tokens"}` for a prompt or chat messages."""
        return await self.post_json(self._root + "tokenize", body)

    @asynccontextmanager
    async def stream(self, path: str, body: dict) -> AsyncIterator[AsyncIterator[dict]]:
        """POST a streaming request; yields an iterator over the decoded `data:` events (ends at [DONE])."""
        request = self._client.build_request("POST", path, content=json.dumps(body).encode(), headers=_JSON)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _map_transport_error(exc) from exc
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
            async for data in response.aiter_bytes():  # split lines here: cheaper than aiter_lines per event
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
            event = json.loads(data)
        except ValueError as exc:
            raise UpstreamUnavailable(f"engine sent an invalid stream event: {data[:200]!r}") from exc
        if isinstance(event, dict) and "choices" not in event and ("error" in event or event.get("object") == "error"):
            raise UpstreamStatusError("engine reported an error mid-stream", event, 500)
        return event

    async def aclose(self) -> None:
        await self._client.aclose()


_JSON = {"content-type": "application/json"}
