"""The bound on memory for request bodies, all requests together: the estimate, the budget, and a proxy under a
flood of large bodies whose resident memory is read from outside its process."""
from __future__ import annotations

import asyncio
import json
import tracemalloc

import httpx
import pytest

from common.procs import kill_group, rss_bytes, status_kib
from proxy.app import create_app
from proxy.budget import BodyBudget, ParseCost, parse_cost
from proxy.errors import ProxyError
from proxy.types import UpstreamConfig
from tests.proxy import proxy_process
from tests.proxy.conftest import SERVED, LiveServer, headers

MB = 1024 * 1024
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PATHS = ["/chat/completions", "/completions", "/responses", "/messages"]
GOOD = {"/chat/completions": CHAT, "/completions": {"model": "m", "prompt": "hi"},
        "/responses": {"model": "m", "input": "hi"},
        "/messages": {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}}


SHAPES = [b"[]", b"{}", b'{"k":1}', b'{"k":[]}', b"1.5", b'"ab"', b"[[1,2]]", b'{"a":{}}', b'{"ab":"cd"}',
          b'"\\u00e9x"', '"é"'.encode(), '"😀abcdefgh"'.encode(), b'"\\ud83d\\ude00abcdefgh"', b"1e300"]


@pytest.mark.parametrize("item", SHAPES)
def test_the_parse_estimate_covers_what_json_loads_allocates_and_keeps(item):
    raw = b"[" + b",".join([item] * 20_000) + b"]"
    tracemalloc.start()
    try:
        parsed = json.loads(raw)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    cost = parse_cost(raw)

    assert len(parsed) == 20_000
    assert peak <= cost.peak - len(raw), (peak, cost)  # cost.peak counts the joined copy of the parts too
    assert kept <= cost.kept, (kept, cost)


def test_the_parse_estimate_by_hand():
    assert parse_cost(b'{"a": [1, 2]}') == ParseCost(peak=2 * 13 + 13 + 128 * 4, kept=13 + 128 * 4)
    assert parse_cost('["é"]'.encode()) == ParseCost(peak=5 * 6 + 4 * 6 + 128, kept=4 * 6 + 128)  # é: 2 bytes


def test_the_budget_refuses_past_its_limit_and_lets_small_requests_through():
    budget = BodyBudget(limit_bytes=10 * MB, grace_bytes=100)
    big, small, huge = budget.hold(), budget.hold(), budget.hold()
    big.take(10 * MB - 50)
    small.take(100)  # within its grace: served although the total is now over the limit
    with pytest.raises(ProxyError) as full:
        small.take(1)
    with pytest.raises(ProxyError) as alone:
        huge.take(11 * MB)

    assert (full.value.status, full.value.code, full.value.headers) == (503, "proxy_overloaded", {"retry-after": "1"})
    assert (alone.value.status, alone.value.code) == (413, "request_too_large")
    assert "needs about 11 MB of proxy memory once parsed, over the proxy's 10 MB" in alone.value.message
    assert (budget.in_use, budget.refused, huge.held) == (10 * MB + 50, 1, 0)
    big.release()
    small.take(5 * MB)  # room again
    small.release()
    assert budget.in_use == 0 and big.held == small.held == 0
    with pytest.raises(ValueError, match="limit_bytes > 0"):
        BodyBudget(0)


@pytest.mark.parametrize("path", PATHS)
async def test_a_body_that_would_parse_past_the_whole_budget_is_refused_before_parsing(fake, directory, recorder,
                                                                                       path):
    app = create_app(directory, recorder, UpstreamConfig(base_url="http://engine/v1", served_model=SERVED),
                     bodies_limit_bytes=4 * MB, transport=httpx.ASGITransport(app=fake))
    wide = b'{"model": "m", "x": [' + b",".join([b"[]"] * 40_000) + b"]}"  # 120 KB, 40,000 lists once parsed
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy/rollouts/r1/v1",
                                 headers={**headers(), "x-api-key": "s1"}) as c:
        r = await c.post(path, content=wide, headers={"content-type": "application/json"})
        ok = await c.post(path, json=GOOD[path])
    await app.aclose()

    assert r.status_code == 413
    message = ("request body needs about 11 MB of proxy memory once parsed, over the proxy's 4 MB for all bodies "
               "together")
    if path == "/messages":
        assert r.json() == {"type": "error", "error": {"type": "request_too_large", "message": message}}
    else:
        assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                      "code": "request_too_large"}}
    assert ok.status_code == 200 and len(recorder.calls) == 1 and recorder.calls[0].status_code == 200
    assert app.bodies.in_use == 0 and app.gate.in_flight == 0


STALLED = 4
FLOOD = 48
BODY_MB = 6


@pytest.mark.slow
async def test_a_flood_of_large_bodies_keeps_the_proxy_memory_bounded_and_serves_others(fake):
    """A proxy process with 24 MB for all bodies: 4 uploads stall holding 20 MB, 48 clients post 6 MB bodies at
    once over the four APIs, and a well-behaved rollout keeps calling. Its peak resident memory is read from
    /proc: without the budget the flood alone would hold about 48 x 12 MB."""
    async with LiveServer(fake) as engine:
        process, port = proxy_process.start(engine.url + "/v1", "--rollouts", "2", "--max-body-mb", "8",
                                            "--bodies-limit-mb", "24")
        try:
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base, timeout=60) as c:
                outcome = await _flood(c, port, process.pid)
                state = (await c.get("/test/state")).json()
        finally:
            kill_group(process.pid, grace_s=10)
            process.wait()

    statuses, good, grown_mb = outcome
    assert good == [200] * 10
    assert set(statuses) <= {400, 503} and statuses.count(503) == FLOOD, statuses  # no room for any of them
    assert [call for call in state["calls"] if call[0] == "r1"] == [["r1", 200, None]] * 12
    assert [call for call in state["calls"] if call[0] == "r0"] == []
    assert (state["in_flight"], state["bodies_in_use"], state["refused"]) == (0, 0, FLOOD)
    # The 24 MB budget, a grace of 256 KiB and uvicorn's buffers per connection, and the allocator's slack.
    assert grown_mb < 24 + FLOOD * 1 + 32, f"peak RSS grew {grown_mb:.0f} MB"


async def _flood(c: httpx.AsyncClient, port: int, pid: int) -> tuple[list[int], list[int], float]:
    key0, key1 = {**headers("secret-0"), "x-api-key": "secret-0"}, headers("secret-1")
    for _ in range(2):  # warm up: the allocator's first high-water mark is not growth
        assert (await c.post("/rollouts/r1/v1/chat/completions", json=CHAT, headers=key1)).status_code == 200
    before = rss_bytes(pid)

    stalled = []
    for _ in range(STALLED):  # 5 MB of a promised 8 MB body each, then nothing: 20 MB held
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"POST /rollouts/r0/v1/chat/completions HTTP/1.1\r\nhost: p\r\nauthorization: Bearer secret-0\r\n"
                     f"content-length: {8 * MB}\r\n\r\n".encode() + b"[" * (5 * MB))
        await writer.drain()
        stalled.append(writer)
    while (await c.get("/test/state")).json()["bodies_in_use"] < STALLED * 5 * MB:
        await asyncio.sleep(0.05)

    body = b'{"model": "m", "x": "' + b"a" * (BODY_MB * MB)  # not JSON (unterminated): a 400 once read whole

    async def large(i: int) -> int:
        path = PATHS[i % 4]
        r = await c.post(f"/rollouts/r0/v1{path}", content=body, headers={"content-type": "application/json", **key0})
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            if path == "/messages":
                assert r.json()["error"]["type"] == "overloaded_error"
            else:
                assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("service_unavailable",
                                                                                  "proxy_overloaded")
        return r.status_code

    async def good_rollout() -> list[int]:
        return [(await c.post("/rollouts/r1/v1/chat/completions", json=CHAT, headers=key1)).status_code
                for _ in range(10)]

    *statuses, good = await asyncio.gather(*(large(i) for i in range(FLOOD)), good_rollout())
    grown_mb = (status_kib("VmHWM", pid) * 1024 - before) / MB
    for writer in stalled:
        writer.close()
    while (await c.get("/test/state")).json()["bodies_in_use"]:
        await asyncio.sleep(0.05)
    return statuses, good, grown_mb
