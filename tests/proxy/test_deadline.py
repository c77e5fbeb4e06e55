"""Slowloris: a client that trickles its request is closed at the request deadline; answers are not limited.

The proxy is served as a run serves it (proxy.server.uvicorn_config) with a 1 s deadline, on a real socket.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from proxy.app import create_app
from proxy.server import RequestDeadlineProtocol, request_deadline
from proxy.types import UpstreamConfig
from tests.proxy.conftest import SERVED, LiveServer, headers, until
from tests.proxy.fake_upstream import IM_END, Reply, encode

DEADLINE_S = 1.0
SLOW_CLIENTS = 32
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
LONG = "word " * 40  # 50 chunks of 4 bytes at 0.05 s: a stream of 2.5 s, longer than the deadline


@pytest.fixture
async def deadline_live(fake, directory, recorder):
    """Fake engine and proxy on real sockets, the proxy with a 1 s request deadline; yields (proxy, base of r1)."""
    async with LiveServer(fake) as engine:
        app = create_app(directory, recorder, UpstreamConfig(base_url=engine.url + "/v1", served_model=SERVED))
        async with LiveServer(app, request_timeout_s=DEADLINE_S) as server:
            yield app, server.url
        await app.aclose()


async def trickle(url: str, i: int) -> str:
    """Send a request a byte every 0.1 s (head only, or a head then a body) until the proxy closes the connection.

    Returns how it ended: 'closed' (EOF or reset from the proxy) or 'answered' with the status line if the
    proxy answered instead; fails if the connection outlives 40 bytes (4 s, four deadlines).
    """
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(CHAT).encode()
    request = (f"POST /rollouts/r1/v1/chat/completions HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer s1\r\n"
               f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    if i % 2:  # half send their head at once and trickle only the body
        start = request.index(b"\r\n\r\n") + 4
        writer.write(request[:start])
        request = request[start:]
    ended = asyncio.create_task(reader.read(1024))
    try:
        for k in range(40):
            if ended.done():
                break
            writer.write(request[k:k + 1])
            await writer.drain()
            await asyncio.wait({ended}, timeout=0.1)
        got = await asyncio.wait_for(ended, 1)
    except (ConnectionResetError, BrokenPipeError):
        return "closed"
    finally:
        ended.cancel()
        writer.close()
    return "closed" if got == b"" else "answered " + got.split(b"\r\n")[0].decode()


async def test_trickling_clients_are_closed_while_a_long_stream_and_other_calls_are_served(deadline_live, fake,
                                                                                         recorder):
    app, url = deadline_live
    fake.chunk_delay_s = 0.05
    fake.replies.append(Reply(text=LONG))

    async def good_rollout() -> tuple[list[int], str]:
        async with httpx.AsyncClient(base_url=url + "/rollouts/r2/v1", headers=headers("s2"), timeout=30) as c:
            streamed = ""
            async with c.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            statuses = [(await c.post("/chat/completions", json=CHAT)).status_code for _ in range(10)]
            return statuses, streamed

    *ends, (statuses, streamed) = await asyncio.gather(*(trickle(url, i) for i in range(SLOW_CLIENTS)),
                                                        good_rollout())
    await until(lambda: app.gate.in_flight == 0 and app.bodies.in_use == 0, "the proxy idle")

    assert ends == ["closed"] * SLOW_CLIENTS
    assert statuses == [200] * 10 and streamed == LONG
    assert recorder.for_rollout("r1") == []  # no trickled request was ever admitted
    calls = recorder.for_rollout("r2")
    assert [(c.seq, c.status_code, c.error) for c in calls] == [(5 + k, 200, None) for k in range(11)]
    assert calls[0].stream and calls[0].completion_ids == encode(LONG) + [IM_END]


async def test_a_keep_alive_connection_gets_a_new_deadline_for_each_request(deadline_live, recorder):
    """Calls spread over three deadlines on one connection: each request arrives whole in time, none is cut."""
    _, url = deadline_live
    async with httpx.AsyncClient(base_url=url + "/rollouts/r1/v1", headers=headers(), timeout=30) as c:
        statuses = []
        for _ in range(6):
            statuses.append((await c.post("/chat/completions", json=CHAT)).status_code)
            await asyncio.sleep(DEADLINE_S / 2)

    assert statuses == [200] * 6
    assert [(c.seq, c.status_code) for c in recorder.for_rollout("r1")] == [(k, 200) for k in range(6)]


def test_the_deadline_must_be_positive():
    assert request_deadline(2.5).request_timeout_s == 2.5
    assert issubclass(request_deadline(2.5), RequestDeadlineProtocol)
    with pytest.raises(ValueError, match="request_timeout_s must be a positive number of seconds, got 0"):
        request_deadline(0)
