"""Failures: bad input (400/413, nothing recorded), engine errors, timeouts and drops (recorded), recorder crashes."""
from __future__ import annotations

import json
import logging

import httpx
import pytest

from common.procs import free_port
from proxy.app import create_app
from proxy.types import InMemoryRecorder, UpstreamConfig
from tests.proxy.conftest import LiveServer, headers
from tests.proxy.fake_upstream import Fault, encode

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("content, message", [
    (b"{not json", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"),
    (json.dumps({"model": "m"}).encode(), "missing required field 'messages'"),
    (json.dumps({"model": "m", "messages": "hi"}).encode(), "field 'messages' must be an array, got str"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "missing required field 'model'"),
    (json.dumps({**CHAT, "stream": "yes"}).encode(), "field 'stream' must be a boolean, got str"),
    (json.dumps({**CHAT, "max_tokens": True}).encode(), "field 'max_tokens' must be an integer, got bool"),
    (json.dumps({"model": "m", "messages": [{"content": "no role"}]}).encode(), "messages[0] must be an object with a string 'role'"),
])
async def test_it_answers_400_for_bad_chat_input_and_records_nothing(client, fake, recorder, content, message):
    r = await client.post("/chat/completions", content=content, headers={"content-type": "application/json"})

    assert r.status_code == 400
    assert r.json()["error"]["message"] == message and r.json()["error"]["type"] == "invalid_request_error"
    assert recorder.calls == [] and fake.requests == []


async def test_it_answers_400_in_anthropic_format_for_bad_messages_input(client, recorder):
    r = await client.post("/messages", json={"model": "claude", "messages": [{"role": "user", "content": "hi"}]})

    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": "missing required field 'max_tokens'"}}
    assert recorder.calls == []


async def test_it_answers_413_for_a_body_over_the_limit(client, recorder):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = await client.post("/chat/completions", json=big)

    async def chunks():
        yield json.dumps(big).encode()

    m = await client.post("/messages", content=chunks(), headers={"content-type": "application/json"})

    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert m.status_code == 413 and m.json()["error"]["type"] == "request_too_large"
    assert recorder.calls == []


async def test_it_keeps_serving_after_bad_input(client, recorder):
    await client.post("/chat/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    r = await client.post("/chat/completions", json=CHAT)

    assert r.status_code == 200 and len(recorder.calls) == 1


@pytest.mark.parametrize("status", [400, 500])
async def test_it_passes_engine_errors_through_in_openai_format_and_records_them(client, fake, recorder, status):
    fake.faults.append(Fault(status=status))
    r = await client.post("/chat/completions", json=CHAT)

    assert r.status_code == status
    assert r.json()["error"]["message"] == f"fake engine error {status}"
    [call] = recorder.calls
    assert call.status_code == status and call.error == f"{status}: fake engine error {status}"
    assert call.response == r.json() and call.completion_ids == []


async def test_it_passes_engine_errors_through_in_anthropic_format_when_streaming(client, fake, recorder):
    fake.faults.append(Fault(status=500))
    r = await client.post("/messages", json={**MESSAGES, "stream": True})

    assert r.status_code == 500
    assert r.json() == {"type": "error", "error": {"type": "api_error", "message": "fake engine error 500"}}
    assert recorder.calls[0].status_code == 500 and recorder.calls[0].stream is True


async def test_it_answers_502_when_the_engine_is_unreachable_and_records_it(directory, recorder):
    port = free_port()  # nothing listens there
    app = create_app(directory, recorder, UpstreamConfig(base_url=f"http://127.0.0.1:{port}/v1", connect_timeout_s=2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy/rollouts/r1/v1",
                                 headers=headers()) as c:
        r = await c.post("/chat/completions", json=CHAT)
        m = await c.post("/messages", json={**MESSAGES, "stream": True})
    await app.aclose()

    assert r.status_code == 502 and r.json()["error"]["type"] == "bad_gateway"
    assert "engine unreachable (ConnectError" in r.json()["error"]["message"]
    assert m.status_code == 502 and m.json()["type"] == "error"
    assert [(c.seq, c.status_code) for c in recorder.calls] == [(0, 502), (1, 502)]
    assert recorder.calls[0].error.startswith("502: engine unreachable")


async def test_it_answers_504_when_the_engine_times_out_and_records_it(fake, directory, recorder):
    fake.faults.append(Fault(stall_s=0.5))
    async with LiveServer(fake) as engine:
        app = create_app(directory, recorder, UpstreamConfig(base_url=engine.url + "/v1", read_timeout_s=0.1))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy/rollouts/r1/v1",
                                     headers=headers()) as c:
            r = await c.post("/chat/completions", json=CHAT)
        await app.aclose()

    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    assert recorder.calls[0].status_code == 504 and "timed out (ReadTimeout)" in recorder.calls[0].error


async def test_it_records_a_stream_the_engine_drops_midway(live, fake, recorder):
    _, base = live
    fake.faults.append(Fault(cut_stream_after=2))
    async with httpx.AsyncClient(base_url=base + "/v1", headers=headers()) as c:
        r = await c.post("/chat/completions", json={**CHAT, "stream": True})

    events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert r.status_code == 200 and events[-1]["error"]["type"] == "bad_gateway"
    [call] = recorder.calls
    assert call.status_code == 502 and call.error.endswith("(mid-stream)")
    assert call.completion_ids == encode("Hello! Y") and len(call.logprobs) == 8
    assert call.response["choices"][0]["message"]["content"] == "Hello! Y"


class FlakyRecorder(InMemoryRecorder):
    """Fails its first `failures` records, like a database that is briefly down."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def record(self, call):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("database is locked")
        await super().record(call)


async def test_it_survives_a_recorder_crash_and_records_the_call_on_retry(fake, directory, caplog):
    recorder = FlakyRecorder(failures=2)
    app = create_app(directory, recorder, UpstreamConfig(base_url="http://engine/v1"),
                     transport=httpx.ASGITransport(app=fake))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy/rollouts/r1/v1",
                                 headers=headers()) as c:
        with caplog.at_level(logging.ERROR, logger="proxy.recording"):
            a = await c.post("/chat/completions", json=CHAT)
            b = await c.post("/chat/completions", json={**CHAT, "stream": True})
    assert (a.status_code, b.status_code) == (200, 200)
    assert recorder.calls == [] and len(app.records.retry) == 2
    assert "rollout r1 seq 0: recorder failed; queued for retry" in caplog.text

    assert await app.records.flush() is True
    await app.aclose()
    assert [(c.seq, c.stream, c.status_code) for c in recorder.calls] == [(0, False, 200), (1, True, 200)]

