"""The engine client: the only module importing httpx; every transport error is mapped here once."""
from __future__ import annotations

import json
import logging
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


class UpstreamStatusError(UpstreamError):
    """The engine answered 4xx/5xx; its status and body pass through to the harness."""


def _map_transport_error(exc: httpx.HTTPError) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"engine timed out ({type(exc).__name__})")
    if isinstance(exc, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return UpstreamUnavailable(f"engine unreachable ({type(exc).__name__}: {exc})")
    return UpstreamUnavailable(f"engine request failed ({type(exc).__name__}: {exc})")


def _decode_error_body(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace")[:2000]


class Upstream:
    """One long-lived pooled AsyncClient to an OpenAI-compatible engine."""

    def __init__(self, config: UpstreamConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
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
            limits=httpx.Limits(
                max_connections=config.max_connections, max_keepalive_connections=config.max_connections
            ),
            transport=transport,
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
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError as exc:
                    raise UpstreamUnavailable(f"engine sent an invalid stream event: {data[:200]!r}") from exc
                if isinstance(event, dict) and "error" in event and "choices" not in event:
                    raise UpstreamStatusError("engine reported an error mid-stream", event, 500)
                yield event
        except httpx.HTTPError as exc:
            raise _map_transport_error(exc) from exc

    async def aclose(self) -> None:
        await self._client.aclose()


_JSON = {"content-type": "application/json"}
