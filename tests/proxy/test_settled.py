"""When a rollout's trajectory is whole in the recorder (ProxyApp.settled, issue 26.5): every answered or refused
call stored, a failed write retried first; a call whose harness hung up never holds it (its 499 is never trained)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.proxy.conftest import headers, until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_settled_waits_for_a_failed_write_to_be_retried(proxy, client, recorder):
    proxy.records.backoff_s = 0.2
    real = recorder.record
    refusals = []

    async def refusing(call):
        if len(refusals) < 2:
            refusals.append(call.seq)
            raise RuntimeError("database unavailable (injected)")
        await real(call)

    recorder.record = refusing
    answer = await client.post("/chat/completions", json=CHAT)
    assert answer.status_code == 200  # the harness has its answer; its record is not stored yet
    assert proxy.unstored("r1") == 1 and await proxy.settled("r1", 0.05) == 1
    started = time.monotonic()
    assert await proxy.settled("r1", 10) == 0  # the retry stored it
    assert time.monotonic() - started < 5 and [c.seq for c in recorder.calls] == [0] and refusals == [0, 0]
    assert await proxy.settled("r2", 0.01) == 0  # a rollout without calls is whole


async def test_a_call_whose_harness_hung_up_does_not_hold_its_rollout(live, fake, recorder):
    app, base = live
    fake.latency_s = 1.5
    async with httpx.AsyncClient(base_url=base + "/v1", headers=headers(), timeout=httpx.Timeout(10, read=0.2)) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/chat/completions", json=CHAT)
    await until(lambda: all(call.hung_up for call in app.outstanding.waiting.get("r1", ())), "the hang-up seen")
    assert app.unstored("r1") == 0 and await app.settled("r1", 0.5) == 0  # the engine still works on it
    await until(lambda: len(recorder.calls) == 1, "the abandoned call recorded", timeout_s=10)
    assert recorder.calls[0].status_code == 499 and app.unstored("r1") == 0


async def test_a_call_still_waiting_for_the_engine_holds_its_rollout(proxy, client, fake):
    fake.latency_s = 0.5
    call = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await until(lambda: proxy.gate.in_flight == 1, "the call admitted")
    assert proxy.unstored("r1") == 1 and await proxy.settled("r1", 0.05) == 1
    assert (await call).status_code == 200 and await proxy.settled("r1", 5) == 0
