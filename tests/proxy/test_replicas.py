"""Several engine replicas behind one proxy (proxy.replicas): rollouts pinned, new ones to the least busy replica,
a call cut off by a dying replica retried once on another and recorded retried, and nothing left when all died.

Each replica is the fake vLLM behind a transport that can "kill" it: calls in flight then fail as a reset
connection, later ones as a refused connection, and /health stops answering.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from tests.proxy.conftest import headers, until
from tests.proxy.fake_upstream import FakeVLLM, Reply

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


class Replica(httpx.AsyncBaseTransport):
    """A fake vLLM replica on an in-process transport, with /health, calls it can hold, and a kill switch."""

    def __init__(self, name: str) -> None:
        self.fake = FakeVLLM()
        self.fake.app.routes.append(Route("/health", self._health, methods=["GET"]))
        self.name, self.dead, self.hold = name, False, asyncio.Event()
        self.hold.set()
        self.held = 0  # chat calls waiting on `hold` now
        self.reset_once = False  # the next chat call fails as a reset connection, the replica still healthy
        self.stream_cut: int | None = None  # streams: the connection drops after this many events
        self._killed = asyncio.Event()
        self._inner = httpx.ASGITransport(app=self._app)

    async def _health(self, request) -> JSONResponse:
        return JSONResponse({})

    async def _app(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/chat/completions"):
            self.held += 1
            try:
                await self.hold.wait()
            finally:
                self.held -= 1
        await self.fake(scope, receive, send)

    def kill(self) -> None:
        """As a SIGKILL: calls in flight are cut off, new connections refused."""
        self.dead = True
        self._killed.set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.dead:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        if self.reset_once and request.url.path.endswith("/chat/completions"):
            self.reset_once = False
            raise httpx.ReadError("[Errno 104] Connection reset by peer")
        answering = asyncio.ensure_future(self._inner.handle_async_request(request))
        killed = asyncio.ensure_future(self._killed.wait())
        await asyncio.wait({answering, killed}, return_when=asyncio.FIRST_COMPLETED)
        killed.cancel()
        if not answering.done():
            answering.cancel()
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        response = answering.result()
        if self.stream_cut is None or response.headers.get("content-type", "").find("event-stream") < 0:
            return response
        body = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, stream=_Cut(self, body, self.stream_cut))


class _Cut(httpx.AsyncByteStream):
    """A stream body whose connection drops (the replica dies) after `events` SSE events."""

    def __init__(self, replica: Replica, body: bytes, events: int) -> None:
        self.replica, self.parts, self.events = replica, [p + b"\n\n" for p in body.split(b"\n\n") if p], events

    async def __aiter__(self):
        for part in self.parts[:self.events]:
            yield part
        self.replica.kill()
        raise httpx.ReadError("[Errno 104] Connection reset by peer")


@pytest.fixture
def replicas() -> list[Replica]:
    return [Replica("a"), Replica("b")]


@pytest.fixture
def directory() -> InMemoryDirectory:
    d = InMemoryDirectory()
    for i in range(1, 5):
        d.add(f"r{i}", "s1")
    return d


def make_proxy(replicas, directory, recorder, alive=None, stream=True):
    config = UpstreamConfig(base_url="http://engine/v1", served_model="served",
                            replica_urls=tuple(f"http://replica-{r.name}/v1" for r in replicas), stream=stream)
    return create_app(directory, recorder, config, transport=replicas, replica_alive=alive)


@pytest.fixture
async def proxy(replicas, directory, recorder):
    app = make_proxy(replicas, directory, recorder)
    yield app
    await app.aclose()


def chat(app, rollout: str, **extra):
    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), headers=headers(),
                                     base_url=f"http://proxy/rollouts/{rollout}/v1") as client:
            return await client.post("/chat/completions", json={**CHAT, **extra})
    return asyncio.ensure_future(call())


def content(response: httpx.Response, stream: bool) -> str:
    """The answer's text, from a whole answer or joined from a stream's deltas (none of which is an error)."""
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert not any("error" in e for e in events), events
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def routed(recorder: InMemoryRecorder) -> list[tuple[str, int, int | None, bool, int]]:
    return [(c.rollout_id, c.seq, c.replica, c.retried, c.status_code) for c in sorted(
        recorder.calls, key=lambda c: (c.rollout_id, c.seq))]


async def test_it_pins_each_rollout_to_one_replica_and_spreads_new_rollouts(proxy, replicas, recorder):
    for _ in range(3):
        for rollout in ("r1", "r2"):
            assert (await chat(proxy, rollout)).status_code == 200

    assert routed(recorder) == [("r1", s, 0, False, 200) for s in range(3)] + [("r2", s, 1, False, 200)
                                                                              for s in range(3)]
    assert [r.fake.calls for r in replicas] == [3, 3]


async def test_it_sends_a_new_rollout_to_the_replica_with_fewest_calls_in_flight(proxy, replicas, recorder):
    replicas[0].hold.clear()
    first = chat(proxy, "r1")  # replica 0 (both idle), held there
    await until(lambda: replicas[0].held == 1, "r1's call held on replica 0")
    assert (await chat(proxy, "r2")).status_code == 200  # replica 1: 0 calls in flight against 1
    assert (await chat(proxy, "r3")).status_code == 200  # replica 1 again: replica 0 still has one in flight
    replicas[0].hold.set()
    assert (await first).status_code == 200

    assert routed(recorder) == [("r1", 0, 0, False, 200), ("r2", 0, 1, False, 200), ("r3", 0, 1, False, 200)]
    assert proxy.engines.in_flight == [0, 0]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_cut_off_by_a_dying_replica_is_retried_once_on_another_and_its_rollout_repinned(
        proxy, replicas, recorder, stream):
    replicas[0].hold.clear()
    cut = chat(proxy, "r1", stream=stream)
    await until(lambda: replicas[0].held == 1, "r1's call in flight on replica 0")
    replicas[0].kill()
    response = await cut
    after = await chat(proxy, "r1", stream=stream)

    assert (response.status_code, after.status_code) == (200, 200)
    assert content(response, stream) == content(after, stream) == "Hello! You said: hi"
    assert routed(recorder) == [("r1", 0, 1, True, 200), ("r1", 1, 1, False, 200)]
    assert recorder.calls[0].completion_ids and recorder.calls[0].error is None
    assert (replicas[0].fake.answered, replicas[1].fake.calls) == (0, 2)
    assert list(proxy.engines.dead) == [0] and proxy.engines.pinned("r1") == 1


async def test_a_stream_cut_before_its_first_event_is_retried_on_another_replica(proxy, replicas, recorder):
    replicas[0].stream_cut = 0  # answers 200, then the connection drops before any event
    response = await chat(proxy, "r1", stream=True)

    assert response.status_code == 200 and content(response, True) == "Hello! You said: hi"
    assert routed(recorder) == [("r1", 0, 1, True, 200)]
    assert list(proxy.engines.dead) == [0]


async def test_a_stream_cut_after_an_event_went_out_fails_as_with_one_engine(proxy, replicas, recorder):
    replicas[0].fake.replies.append(Reply("a long enough answer to stream in several chunks"))
    replicas[0].stream_cut = 2  # the harness has had part of replica 0's answer: no retry
    response = await chat(proxy, "r1", stream=True)

    assert response.status_code == 200  # the stream had started
    assert '"error"' in response.text and "engine unreachable" in response.text
    (call,) = recorder.calls
    assert (call.replica, call.retried, call.status_code) == (0, False, 502)
    assert call.error.endswith("(mid-stream)") and "engine unreachable" in call.error
    assert replicas[1].fake.calls == 0


async def test_a_reset_on_a_healthy_replica_retries_the_call_and_keeps_the_replica(proxy, replicas, recorder):
    assert (await chat(proxy, "r1")).status_code == 200  # pinned to replica 0
    replicas[0].reset_once = True
    assert (await chat(proxy, "r1")).status_code == 200  # retried on replica 1; 0 answers /health
    assert (await chat(proxy, "r2")).status_code == 200  # a new rollout: replica 0 is still served

    assert routed(recorder) == [("r1", 0, 0, False, 200), ("r1", 1, 1, True, 200), ("r2", 0, 0, False, 200)]
    assert proxy.engines.dead == {} and proxy.engines.pinned("r1") == 1


async def test_a_call_is_retried_only_once_and_fails_when_every_replica_is_dead(proxy, replicas, recorder):
    replicas[1].kill()  # unnoticed: no call has gone there yet
    replicas[0].hold.clear()
    cut = chat(proxy, "r1")
    await until(lambda: replicas[0].held == 1, "r1's call in flight on replica 0")
    replicas[0].kill()
    failed = await cut  # retried on replica 1, which refuses it too: no second retry
    none_left = await chat(proxy, "r2")

    assert failed.status_code == 502 and "engine unreachable" in failed.json()["error"]["message"]
    assert none_left.status_code == 502 and "no live replica left" in none_left.json()["error"]["message"]
    assert routed(recorder) == [("r1", 0, 1, True, 502), ("r2", 0, None, False, 502)]
    assert sorted(proxy.engines.dead) == [0, 1]


async def test_a_replica_whose_process_is_gone_gets_no_calls(replicas, directory, recorder):
    app = make_proxy(replicas, directory, recorder, alive=lambda index: index != 0)
    try:
        for rollout in ("r1", "r2", "r3"):
            assert (await chat(app, rollout)).status_code == 200
    finally:
        await app.aclose()

    assert routed(recorder) == [(r, 0, 1, False, 200) for r in ("r1", "r2", "r3")]
    assert replicas[0].fake.calls == 0 and app.engines.dead == {0: "its process is gone"}


async def test_with_one_engine_calls_record_no_replica_and_a_refused_call_is_not_retried(directory, recorder):
    engine = Replica("only")
    app = create_app(directory, recorder, UpstreamConfig(base_url="http://engine/v1"), transport=engine)
    try:
        ok = await chat(app, "r1")
        engine.kill()
        refused = await chat(app, "r1")
    finally:
        await app.aclose()

    assert (ok.status_code, refused.status_code) == (200, 502)
    assert routed(recorder) == [("r1", 0, None, False, 200), ("r1", 1, None, False, 502)]
    assert app.engines.dead == {}
