"""Clients that attack the live proxy: slowloris, huge headers, hang-ups mid-stream, gzip bombs, huge bodies.

Each asserts behaviour, not timings: a well-behaved rollout's calls all succeed while the attack runs, every
attacker gets a 4xx or a clean close, and the proxy's memory stays bounded. bench/proxy_attack.py measures
the same attacks' cost in latency.
"""
from __future__ import annotations

import asyncio
import json
import zlib

import httpx
import pytest

from common.procs import rss_bytes
from proxy.app import create_app
from proxy.call import STREAM_INCOMPLETE
from proxy.types import UpstreamConfig
from tests.proxy.conftest import SERVED, LiveServer, headers, until
from tests.proxy.fake_upstream import Reply

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
STREAMED = {
    "/chat/completions": {**CHAT, "stream": True},
    "/completions": {"model": "m", "prompt": "hi", "stream": True},
    "/responses": {"model": "m", "input": "hi", "stream": True},
    "/messages": {"model": "m", "max_tokens": 512, "messages": [{"role": "user", "content": "hi"}], "stream": True},
}
ATTACKERS = 24
GOOD_CALLS = 20
MB = 1024 * 1024


async def good_rollout(base: str, secret: str = "s2", calls: int = GOOD_CALLS) -> list[int]:
    """The statuses of a well-behaved rollout's sequential chat calls (rollout r2, on its own connection)."""
    async with httpx.AsyncClient(base_url=base.replace("/r1", "/r2") + "/v1", headers=headers(secret),
                                 timeout=30) as c:
        return [(await c.post("/chat/completions", json=CHAT)).status_code for _ in range(calls)]


async def connect(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base.split("//")[1].split("/")[0].split(":")
    return await asyncio.open_connection(host, int(port))


def head(path: str, extra: str = "") -> bytes:
    return (f"POST /rollouts/r1/v1{path} HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer s1\r\n"
            f"content-type: application/json\r\n{extra}").encode()


async def test_slowloris_headers_do_not_hold_up_other_rollouts(live):
    app, base = live
    conns = [await connect(base) for _ in range(ATTACKERS)]
    for i, (_, writer) in enumerate(conns):  # each stops part-way through its request line or headers
        writer.write(head("/chat/completions")[: 5 + i * 3])
        await writer.drain()

    statuses = await good_rollout(base)

    assert statuses == [200] * GOOD_CALLS
    for _, writer in conns:
        writer.close()
    await until(lambda: app.gate.in_flight == 0, "the gate empty")


async def test_slow_bodies_hold_no_slot_in_the_gate_and_do_not_block_a_pause(live):
    app, base = live
    conns = [await connect(base) for _ in range(ATTACKERS)]
    for _, writer in conns:  # headers done, then 2 bytes of a promised 1 MB body, then nothing
        writer.write(head("/messages", f"content-length: {MB}\r\n\r\n") + b'{"')
        await writer.drain()

    statuses = await good_rollout(base)
    await asyncio.wait_for(app.pause(), 10)  # a body still arriving is not a call in flight
    await app.resume()

    assert statuses == [200] * GOOD_CALLS and app.gate.in_flight == 0
    for _, writer in conns:
        writer.close()


async def test_oversized_headers_get_a_4xx_or_a_clean_close(live):
    _, base = live
    reader, writer = await connect(base)
    try:  # uvicorn may answer and close before the client has written it all: a reset here is a clean close
        writer.write(head("/chat/completions", "x-junk: " + "a" * (256 * 1024) + "\r\n"))
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # read() returns at EOF: the proxy closed
    except ConnectionResetError:
        answer = b""
    writer.close()

    assert answer == b"" or answer.startswith(b"HTTP/1.1 4"), answer[:200]
    assert await good_rollout(base, calls=3) == [200] * 3


# Not /completions: the fake engine paces only chat streams (chunk_delay_s), so a completions stream ends first.
@pytest.mark.parametrize("path", ["/chat/completions", "/responses", "/messages"])
async def test_many_harnesses_hanging_up_mid_stream_are_all_recorded_incomplete(live, fake, recorder, path):
    app, base = live
    fake.chunk_delay_s = 0.01  # 100 chunks of 4 bytes: a second per stream, long enough to be cut
    fake.replies.extend(Reply(text="word " * 80) for _ in range(8))

    async def hang_up() -> None:
        async with httpx.AsyncClient(base_url=base + "/v1", headers={**headers(), "x-api-key": "s1"}) as c:
            async with c.stream("POST", path, json=STREAMED[path]) as r:
                assert r.status_code == 200
                async for _ in r.aiter_raw():
                    break  # first bytes seen: leave, closing the connection

    await asyncio.gather(*(hang_up() for _ in range(8)))
    statuses = await good_rollout(base, calls=5)
    await until(lambda: len(recorder.for_rollout("r1")) == 8 and app.gate.in_flight == 0, "8 cut streams recorded")

    assert statuses == [200] * 5
    assert {(c.status_code, c.error) for c in recorder.for_rollout("r1")} == {(499, STREAM_INCOMPLETE)}
    assert [c.status_code for c in recorder.for_rollout("r2")] == [200] * 5


@pytest.fixture
async def small_limit(fake, directory, recorder):
    """A live proxy with a 4 MB body limit, so huge-body attacks stay quick; yields the base url of r1."""
    async with LiveServer(fake) as engine:
        app = create_app(directory, recorder, UpstreamConfig(base_url=engine.url + "/v1", served_model=SERVED),
                         max_body_bytes=4 * MB)
        async with LiveServer(app) as server:
            yield server.url + "/rollouts/r1"
        await app.aclose()


def gzip_bomb(inflated_mb: int) -> bytes:
    """A gzip stream of `inflated_mb` MB of zeros, about a thousandth of that on the wire."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip container
    block = bytes(MB)
    return b"".join(packer.compress(block) for _ in range(inflated_mb)) + packer.flush()


def huge_bodies() -> dict[str, tuple[bytes, dict[str, str], int]]:
    """Attack bodies of about the limit or more, with their extra headers and the status each must get."""
    under = 4 * MB - 1024
    return {
        "over the limit, declared": (b"x" * (5 * MB), {}, 413),
        "over the limit, chunked": (b"x" * (5 * MB), {"transfer-encoding": "chunked"}, 413),
        "not JSON": (b"{" + b"a" * under, {}, 400),
        # Refused before parsing: 4M brackets could parse to 512 MB of lists, over the budget for all bodies.
        "deeply nested": (b"[" * under, {}, 413),
        "gzip bomb": (gzip_bomb(256), {"content-encoding": "gzip"}, 415),
    }


async def test_huge_bodies_leave_memory_bounded_and_others_served(small_limit, recorder):
    base = small_limit
    attacks = huge_bodies()
    rounds = 6  # 5 attacks x 6 rounds: over 100 MB sent at the proxy

    async def attack(c: httpx.AsyncClient) -> list[int]:
        got = []
        for content, extra, _ in attacks.values():
            stream = content if "transfer-encoding" not in extra else _chunks(content)
            r = await c.post("/chat/completions", content=stream, headers={"content-type": "application/json", **extra})
            got.append(r.status_code)
        return got

    async with httpx.AsyncClient(base_url=base + "/v1", headers=headers(), timeout=60) as c:
        await attack(c)  # warm up: the allocator's first high-water mark is not growth
        before = rss_bytes()
        results = await asyncio.gather(*(attack(c) for _ in range(rounds)), good_rollout(base))
        grown = rss_bytes() - before

    assert results[:-1] == [[status for *_, status in attacks.values()]] * rounds
    assert results[-1] == [200] * GOOD_CALLS
    assert recorder.for_rollout("r1") == []
    # Concurrent attacks hold up to two copies of a body each (parts, then joined); a leak would keep all.
    assert grown < rounds * 2 * 4 * MB + 32 * MB, f"RSS grew {grown / MB:.0f} MB"


async def _chunks(content: bytes, size: int = 256 * 1024):
    for i in range(0, len(content), size):
        yield content[i:i + size]


async def test_a_client_that_vanishes_mid_body_leaves_nothing_behind(live, recorder):
    app, base = live
    for path in STREAMED:
        reader, writer = await connect(base)
        writer.write(head(path, f"content-length: {MB}\r\n\r\n") + json.dumps(STREAMED[path]).encode()[:10])
        await writer.drain()
        writer.close()

    assert await good_rollout(base, calls=3) == [200] * 3
    assert recorder.for_rollout("r1") == [] and app.gate.in_flight == 0
