"""Pause and resume around weight updates: waiting, 429 with Retry-After, draining, policy versions."""
from __future__ import annotations

import asyncio

import httpx
import pytest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def _until(condition, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


async def test_it_answers_429_with_retry_after_when_paused_too_long(proxy, client, recorder, fake):
    await proxy.pause()
    r = await client.post("/chat/completions", json=CHAT)
    m = await client.post("/messages", json={"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})

    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "engine_paused"
    assert m.status_code == 429 and m.json()["error"]["type"] == "rate_limit_error"
    assert recorder.calls == [] and fake.requests == []


async def test_it_holds_new_calls_while_paused_and_lets_them_through_on_resume(proxy, client, recorder):
    proxy.gate.wait_s = 30
    await proxy.pause()
    call = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await _until(lambda: proxy.gate.waiting == 1, "call waiting at the gate")
    proxy.set_policy_version(4)
    await proxy.resume()
    r = await call

    assert r.status_code == 200
    assert recorder.calls[0].policy_version == 4


async def test_it_returns_from_pause_only_after_calls_in_flight_drain(proxy, client, fake, recorder):
    fake.latency_s = 0.3
    call = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await _until(lambda: proxy.gate.in_flight == 1, "call in flight")
    assert fake.answered == 0

    await proxy.pause()

    assert fake.answered == 1
    assert (await call).status_code == 200 and proxy.gate.in_flight == 0 and proxy.gate.paused
    assert len(recorder.calls) == 1


async def test_it_raises_when_calls_do_not_drain_in_time_and_stays_paused(proxy, client, fake):
    fake.latency_s = 1.0
    call = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await _until(lambda: proxy.gate.in_flight == 1, "call in flight")

    with pytest.raises(TimeoutError, match="1 calls still in flight"):
        await proxy.pause(timeout=0.05)
    assert proxy.gate.paused
    await proxy.resume()
    assert (await call).status_code == 200


async def test_it_counts_a_stream_in_flight_until_it_ends(live, fake):
    app, base = live
    fake.chunk_delay_s = 0.05

    async with httpx.AsyncClient(base_url=base + "/v1", headers={"authorization": "Bearer s1"}) as c:
        async with c.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as r:
            lines = r.aiter_lines()
            first = await lines.__anext__()
            assert first.startswith("data: ") and app.gate.in_flight == 1
            rest = [line async for line in lines]
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    await _until(lambda: app.gate.in_flight == 0, "stream finished")


async def test_it_reads_a_callable_policy_version(proxy, client, recorder):
    versions = iter([10, 11])
    proxy.set_policy_version(0)
    proxy._policy_version = lambda: next(versions)
    await client.post("/chat/completions", json=CHAT)
    await client.post("/chat/completions", json=CHAT)

    assert [c.policy_version for c in recorder.calls] == [10, 11]
