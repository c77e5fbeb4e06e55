"""ProxyServer: the proxy under uvicorn on its own thread, driven synchronously like a run does."""
from __future__ import annotations

import threading

import httpx

from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from tests.proxy.fake_upstream import FakeVLLM

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_it_serves_pauses_and_resumes_from_synchronous_code():
    fake = FakeVLLM(latency_s=0.2)
    directory, recorder = InMemoryDirectory(), InMemoryRecorder()
    directory.add("r1", "s1")
    engine = ProxyServer(fake, host="127.0.0.1").start()  # the fake engine, served the same way
    app = create_app(directory, recorder, UpstreamConfig(base_url=f"http://127.0.0.1:{engine.port}/v1"),
                     pause_wait_s=30)
    with ProxyServer(app, host="127.0.0.1") as server:
        url = server.base_url("r1") + "/chat/completions"
        first = httpx.post(url, json=CHAT, headers={"authorization": "Bearer s1"}, timeout=30)
        results = []
        slow = threading.Thread(target=lambda: results.append(
            httpx.post(url, json=CHAT, headers={"authorization": "Bearer s1"}, timeout=30)))
        slow.start()
        while app.gate.in_flight == 0:
            threading.Event().wait(0.005)
        server.pause(timeout=10)  # returns once the slow call has drained
        drained = fake.answered
        server.set_policy_version(7)
        server.resume()
        slow.join()
        after = httpx.post(url, json=CHAT, headers={"authorization": "Bearer s1"}, timeout=30)
    engine.stop()

    assert (first.status_code, results[0].status_code, after.status_code) == (200, 200, 200)
    assert drained == 2
    assert [(c.seq, c.policy_version) for c in recorder.calls] == [(0, 0), (1, 0), (2, 7)]
    assert server.base_url("r1") == f"http://127.0.0.1:{server.port}/rollouts/r1/v1"
