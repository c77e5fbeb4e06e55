"""Pause and resume around weight updates: waiting, 429 with Retry-After, draining, policy versions."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import InMemoryRecorder, UpstreamConfig
from runs.gated_engine import GatedEngine
from tests.proxy.conftest import LiveServer, headers, until
from tests.proxy.fake_upstream import FakeVLLM

BOTH = pytest.mark.parametrize("upstream_stream", [True, False], ids=["engine-streams", "engine-whole"])
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_it_answers_429_with_retry_after_when_paused_too_long(proxy, client, recorder, fake):
    await proxy.pause()
    r = await client.post("/chat/completions", json=CHAT)
    m = await client.post("/messages", json={"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})

    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "engine_paused"
    assert m.status_code == 429 and m.json()["error"]["type"] == "rate_limit_error"
    assert fake.requests == []  # the engine never saw them
    # Recorded (issue 26.3): a harness that gives up on a refusal failed for the infrastructure, not the policy.
    assert [(c.seq, c.api, c.status_code, c.completion_ids) for c in recorder.calls] == [
        (0, "chat", 429, []), (1, "messages", 429, [])]
    assert recorder.calls[0].error == "engine_paused: the engine is paused for a weight update; retry shortly"
    assert recorder.calls[0].request == CHAT and recorder.calls[0].latency_ms >= 0


async def test_it_counts_the_train_calls_it_refuses_apart(proxy, client, directory, recorder):
    """Issue 40.6: the run's `rollout/gate_refusals` each step. Evaluation calls are refused alike but not counted:
    they train nothing (as in `busy_seconds`)."""
    directory.add("v1", "sv", split="val")
    await proxy.pause()
    refused = await client.post("/chat/completions", json=CHAT)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy/rollouts/v1/v1",
                                 headers=headers("sv")) as val:
        assert (await val.post("/chat/completions", json=CHAT)).status_code == 429
    await proxy.resume()
    answered = await client.post("/chat/completions", json=CHAT)

    assert (refused.status_code, answered.status_code) == (429, 200)
    assert proxy.gate.refusals == 1
    assert [(c.rollout_id, c.status_code) for c in recorder.calls] == [("r1", 429), ("v1", 429), ("r1", 200)]


async def test_a_refused_call_with_n_choices_keeps_the_rollouts_seqs_whole(proxy, client, recorder):
    await proxy.pause()
    r = await client.post("/chat/completions", json={**CHAT, "n": 2})
    await proxy.resume()
    after = await client.post("/chat/completions", json=CHAT)
    assert (r.status_code, after.status_code) == (429, 200)
    assert [(c.seq, c.status_code) for c in recorder.calls] == [(0, 429), (1, 429), (2, 200)]


async def test_it_holds_new_calls_while_paused_and_lets_them_through_on_resume(proxy, client, recorder):
    proxy.gate.wait_s = 30
    await proxy.pause()
    call = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await until(lambda: proxy.gate.waiting == 1, "call waiting at the gate")
    proxy.set_policy_version(4)
    await proxy.resume()
    r = await call

    assert r.status_code == 200
    assert recorder.calls[0].policy_version == 4


async def test_it_returns_from_pause_only_after_calls_in_flight_drain(proxy, client, fake, recorder):
    fake.latency_s = 0.3
    call = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await until(lambda: proxy.gate.in_flight == 1, "call in flight")
    assert fake.answered == 0

    await proxy.pause()

    assert fake.answered == 1
    assert (await call).status_code == 200 and proxy.gate.in_flight == 0 and proxy.gate.paused
    assert len(recorder.calls) == 1


async def test_it_raises_when_calls_do_not_drain_in_time_and_stays_paused(proxy, client, fake):
    fake.latency_s = 1.0
    call = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await until(lambda: proxy.gate.in_flight == 1, "call in flight")

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
    await until(lambda: app.gate.in_flight == 0, "stream finished")


async def test_it_reads_a_callable_policy_version(proxy, client, recorder):
    versions = iter([10, 11])
    proxy.set_policy_version(0)
    proxy._policy_version = lambda: next(versions)
    await client.post("/chat/completions", json=CHAT)
    await client.post("/chat/completions", json=CHAT)

    assert [c.policy_version for c in recorder.calls] == [10, 11]


async def test_it_counts_busy_time_while_any_call_is_in_flight_and_not_idle_time(proxy, client, fake):
    fake.latency_s = 0.3
    await asyncio.sleep(0.2)  # idle before the first call
    assert proxy.busy_seconds == 0.0
    first = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await asyncio.sleep(0.1)
    second = asyncio.create_task(client.post("/chat/completions", json=CHAT))
    await until(lambda: proxy.gate.in_flight == 2, "both calls in flight")
    during = proxy.busy_seconds  # the open interval counts while calls are in flight
    assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    busy = proxy.busy_seconds
    await asyncio.sleep(0.3)  # idle again

    assert 0.05 < during < busy
    assert busy == pytest.approx(0.4, abs=0.15)  # 0.3 s each, 0.1 s apart: 0.4 s with at least one in flight
    assert proxy.busy_seconds == busy


class SlowRecorder(InMemoryRecorder):
    """Takes a moment to store each call, like a database write."""

    async def record(self, call):
        await asyncio.sleep(0.01)
        await super().record(call)


@BOTH
async def test_it_stamps_every_call_with_the_weights_that_answered_it(fake, directory, upstream_stream):
    """Eight harnesses call in a loop (half of the calls streamed) while the run swaps weights mid-way.

    Without the pause (`fake.version = 1; app.set_policy_version(1)` alone) this fails: calls admitted on
    version 0 are answered, or finished, by version 1 (`fake.mixed`, fingerprint "v1" on a version-0 record).
    """
    recorder = SlowRecorder()
    fake.latency_s, fake.chunk_delay_s = 0.02, 0.005
    async with LiveServer(fake) as engine:
        config = UpstreamConfig(base_url=engine.url + "/v1", stream=upstream_stream)
        app = create_app(directory, recorder, config, pause_wait_s=30)
        async with LiveServer(app) as server, httpx.AsyncClient(base_url=server.url + "/rollouts/r1/v1",
                                                                headers=headers(), timeout=30) as c:
            stop = asyncio.Event()

            async def harness(i: int) -> None:
                n = 0
                while not stop.is_set():
                    r = await c.post("/chat/completions", json={**CHAT, "stream": (i + n) % 2 == 1})
                    assert r.status_code == 200
                    n += 1

            harnesses = [asyncio.create_task(harness(i)) for i in range(8)]
            await until(lambda: len(recorder.calls) >= 24 and fake.calls > fake.answered,
                        "a call on version 0 inside the engine")
            await app.pause()
            admitted, recorded, in_flight = fake.calls, len(recorder.calls), app.gate.in_flight
            fake.version = 1
            app.set_policy_version(1)
            await app.resume()
            await until(lambda: len(recorder.calls) >= recorded + 24, "calls on version 1")
            stop.set()
            await asyncio.gather(*harnesses)
        await app.aclose()

    assert in_flight == 0 and recorded == admitted  # pause returned after every admitted call was recorded
    calls = recorder.for_rollout("r1")
    assert [c.status_code for c in calls] == [200] * len(calls)
    assert {c.policy_version for c in calls} == {0, 1} and {c.stream for c in calls} == {False, True}
    assert [c.upstream_response["system_fingerprint"] for c in calls] == [f"v{c.policy_version}" for c in calls]
    assert fake.mixed == []


class SlowUpdate:
    """The scheduler's Engine over the fake vLLM: a weight update that takes `update_s`."""

    def __init__(self, fake: FakeVLLM, update_s: float):
        self.fake, self.update_s, self.version = fake, update_s, 0

    async def pause(self) -> None:
        pass

    async def update_weights(self, model, version: int) -> None:
        await asyncio.sleep(self.update_s)
        self.fake.version = self.version = version

    async def resume(self) -> None:
        pass


def test_a_run_holds_calls_as_long_as_a_drain_and_a_reload_may_take(fake, directory, recorder):
    """Issue 40.6: the gate refused a call after 30 s while a weight update may drain for
    LIGHTNING_WEIGHT_SYNC_DRAIN_S (600 s) and then reload, so rollouts with more calls were dropped more often."""
    app = create_app(directory, recorder, UpstreamConfig(base_url="http://engine/v1"))  # as runs.orchestrator does
    server = ProxyServer(app, host="127.0.0.1")
    try:
        GatedEngine(SlowUpdate(fake, 0), server, drain_timeout_s=600)
        assert app.gate.wait_s > 600
        from trainer.engine.sync import CONTROL_TIMEOUT_S  # the reload's bound

        assert app.gate.wait_s == 600 + CONTROL_TIMEOUT_S
        GatedEngine(SlowUpdate(fake, 0), server, drain_timeout_s=None)  # drains as long as calls take
        assert app.gate.wait_s is None
    finally:
        server.stop()


@pytest.mark.slow
def test_a_call_waits_out_a_weight_update_longer_than_30_s_and_is_answered_by_the_new_weights(directory, recorder):
    """The behaviour behind the number: a call that arrives as a 31 s weight update starts is held, not refused."""
    fake = FakeVLLM()
    with ProxyServer(fake, host="127.0.0.1") as upstream:
        app = create_app(directory, recorder, UpstreamConfig(base_url=f"http://127.0.0.1:{upstream.port}/v1"),
                         policy_version=lambda: weights.version)
        with ProxyServer(app, host="127.0.0.1") as proxy:
            weights = SlowUpdate(fake, 31.0)
            engine = GatedEngine(weights, proxy, drain_timeout_s=5)
            asyncio.run(engine.pause())
            answers = []
            call = threading.Thread(target=lambda: answers.append(httpx.post(
                f"http://127.0.0.1:{proxy.port}/rollouts/r1/v1/chat/completions", json=CHAT, headers=headers(),
                timeout=120)))
            call.start()
            deadline = time.monotonic() + 10
            while app.gate.waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert app.gate.waiting == 1
            asyncio.run(engine.update_weights(None, 1))
            asyncio.run(engine.resume())
            call.join(60)

    [answer] = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["system_fingerprint"] == "v1"
    assert [(c.status_code, c.policy_version) for c in recorder.calls] == [(200, 1)]
    assert app.gate.refusals == 0
