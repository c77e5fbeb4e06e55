"""A weight update in the middle of concurrent calls: every recorded call's version is that of the weights that
produced it, because the run's engine (GatedEngine) drains the proxy's gate before it swaps the weights."""
import asyncio
import threading
import time

import httpx
import pytest

from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from runs.gated_engine import GatedEngine
from tests.proxy.fake_upstream import FakeVLLM

CLIENTS = 8


class FakeWeights:
    """The Engine protocol over the fake vLLM: pause does nothing (like vLLM's own pause for calls still queued
    at the proxy), an update takes a while and changes the weights that answer."""

    def __init__(self, fake: FakeVLLM):
        self.fake, self.version = fake, 0

    async def pause(self) -> None:
        pass

    async def update_weights(self, model, version: int) -> None:
        await asyncio.sleep(0.2)
        self.fake.version = self.version = version

    async def resume(self) -> None:
        pass


@pytest.fixture
def stand():
    """(fake engine, proxy server, recorder, weights): the proxy on its own thread as in a run."""
    fake = FakeVLLM(latency_s=0.05)
    upstream_server = ProxyServer(fake, host="127.0.0.1").start()
    directory, recorder = InMemoryDirectory(), InMemoryRecorder()
    for i in range(CLIENTS):
        directory.add(f"r{i}", "key")
    weights = FakeWeights(fake)
    upstream = UpstreamConfig(base_url=f"http://127.0.0.1:{upstream_server.port}/v1", served_model="policy")
    app = create_app(directory, recorder, upstream, policy_version=lambda: weights.version)
    proxy = ProxyServer(app, host="127.0.0.1").start()
    yield fake, proxy, recorder, weights
    proxy.stop()
    upstream_server.stop()


def calls_during_updates(proxy, engine, updates=3):
    """CLIENTS threads call in a loop while `engine` takes `updates` weight updates; returns when all stopped."""
    stop = threading.Event()
    answered = [0] * CLIENTS

    def client(i):
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                body = {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}
                response = http.post(f"http://127.0.0.1:{proxy.port}/rollouts/r{i}/v1/chat/completions", json=body,
                                     headers={"authorization": "Bearer key"})
                assert response.status_code == 200, response.text
                answered[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()

    async def update(version):
        await engine.pause()
        try:
            await engine.update_weights(None, version)
        finally:
            await engine.resume()

    deadline = time.monotonic() + 30  # every client served once by version 0 first, however slowly threads start
    while not all(answered) and time.monotonic() < deadline:
        time.sleep(0.05)
    for version in range(1, updates + 1):
        time.sleep(0.3)
        asyncio.run(update(version))
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(30)


def served_by(call) -> int:
    return int(call.upstream_response["system_fingerprint"].removeprefix("v"))


def test_every_recorded_version_is_the_one_that_served_the_call(stand):
    fake, proxy, recorder, weights = stand
    calls_during_updates(proxy, GatedEngine(weights, proxy))
    assert len(recorder.calls) > 50
    assert {c.policy_version for c in recorder.calls} == {0, 1, 2, 3}
    assert [(c.policy_version, served_by(c)) for c in recorder.calls if c.policy_version != served_by(c)] == []
    assert fake.mixed == []  # no answer ran across a weight swap


def test_without_the_gate_calls_run_across_the_swap(stand):
    """The control: updating the engine alone (what runs did before) lets calls straddle the swap."""
    fake, proxy, recorder, weights = stand
    calls_during_updates(proxy, weights)
    mislabelled = [c for c in recorder.calls if c.policy_version != served_by(c)]
    assert fake.mixed or mislabelled


def test_a_weight_update_whose_calls_never_drain_fails_saying_so_and_reopens_the_gate(stand):
    """Issue 26.3: a call stuck at the engine (here 5 s against a 0.3 s drain timeout) no longer holds the run
    forever: the update fails with a clear error, and the gate opens again for the harnesses' other calls."""
    from runs.gated_engine import WeightSyncStalled

    fake, proxy, recorder, weights = stand
    fake.latency_s = 5.0
    stuck = threading.Thread(target=lambda: httpx.post(
        f"http://127.0.0.1:{proxy.port}/rollouts/r0/v1/chat/completions", timeout=30, headers={"authorization":
        "Bearer key"}, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}))
    stuck.start()
    deadline = time.monotonic() + 10
    while proxy.app.gate.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    engine = GatedEngine(weights, proxy, drain_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(WeightSyncStalled, match=r"1 calls still in flight after 0.3s.*"
                                                r"LIGHTNING_WEIGHT_SYNC_DRAIN_S=0.3.*stuck"):
        asyncio.run(engine.pause())
    assert time.monotonic() - started < 3
    assert not proxy.app.gate.paused and weights.version == 0  # no update happened; the gate is open again
    stuck.join(30)
    assert [c.status_code for c in recorder.calls] == [200]
