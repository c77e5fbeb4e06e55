"""Fixtures: a fake vLLM, rollouts r1/r2, an in-memory recorder, the proxy over ASGI or a real socket."""
from __future__ import annotations

import asyncio
import os
import socket

import httpx
import pytest
import uvicorn

from proxy.app import create_app
from proxy.server import REQUEST_TIMEOUT_S, uvicorn_config
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from tests.proxy.fake_upstream import FakeVLLM

SERVED = "served-model"
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch its cost map


class LiveServer:
    """Serves an ASGI app on a free localhost port inside the test's event loop, configured as the proxy's server."""

    def __init__(self, app, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(app, request_timeout_s, lifespan="off"))
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> LiveServer:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
            await asyncio.sleep(0.005)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await self.task


async def until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Wait for `condition()` (polled) or fail naming `what`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


def headers(secret: str = "s1") -> dict[str, str]:
    return {"authorization": f"Bearer {secret}"}


@pytest.fixture
def fake() -> FakeVLLM:
    return FakeVLLM()


@pytest.fixture
def directory() -> InMemoryDirectory:
    d = InMemoryDirectory()
    d.add("r1", "s1")
    d.add("r2", "s2", next_seq=5)
    return d


@pytest.fixture
def recorder() -> InMemoryRecorder:
    return InMemoryRecorder()


@pytest.fixture
def upstream_stream() -> bool:
    """Whether the proxy streams from the engine; tests parametrize this to cover both paths."""
    return True


@pytest.fixture
def sampling() -> dict | None:
    """The run's sampling parameters the proxy enforces; None (harness's own) unless a test module overrides it."""
    return None


@pytest.fixture
async def proxy(fake, directory, recorder, upstream_stream, sampling):
    """The proxy talking to the fake engine over an in-process ASGI transport."""
    config = UpstreamConfig(base_url="http://engine/v1", served_model=SERVED, stream=upstream_stream,
                            stream_with_tools=upstream_stream, sampling=sampling)
    app = create_app(directory, recorder, config, policy_version=3, max_body_bytes=64 * 1024,
                     pause_wait_s=0.2, retry_after_s=2, transport=httpx.ASGITransport(app=fake))
    yield app
    await app.aclose()


@pytest.fixture
async def client(proxy):
    """httpx client for rollout r1 through the ASGI proxy."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy/rollouts/r1/v1",
                                 headers=headers()) as c:
        yield c


@pytest.fixture
async def live(fake, directory, recorder, upstream_stream, sampling):
    """Fake engine and proxy on real sockets (for SDKs and real streaming); yields (proxy, base url of r1)."""
    async with LiveServer(fake) as engine:
        config = UpstreamConfig(base_url=engine.url + "/v1", served_model=SERVED, stream=upstream_stream,
                                stream_with_tools=upstream_stream, sampling=sampling)
        app = create_app(directory, recorder, config, policy_version=3, pause_wait_s=0.2)
        async with LiveServer(app) as server:
            yield app, server.url + "/rollouts/r1"
        await app.aclose()
