"""Harnesses that hang up: a call whose answer the harness never received is recorded 499, never as a 200."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from proxy.call import NOT_DELIVERED
from tests.proxy.conftest import headers, until
from tests.proxy.fake_upstream import IM_END, encode, render_chat

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = "Hello! You said: hi"
HANG_UP = httpx.Timeout(10, read=0.2)  # the harness gives up long before the engine's 0.6 s answer


async def test_it_records_a_call_whose_harness_timed_out_as_499_and_its_retry_as_200(live, fake, recorder):
    app, base = live
    fake.latency_s = 0.6
    async with httpx.AsyncClient(base_url=base + "/v1", headers=headers(), timeout=HANG_UP) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/chat/completions", json=CHAT)
        fake.latency_s = 0.0
        retry = await c.post("/chat/completions", json=CHAT)
        await until(lambda: len(recorder.calls) == 2 and app.gate.in_flight == 0, "the abandoned call recorded")

    left, kept = recorder.for_rollout("r1")
    assert retry.status_code == 200 and retry.json()["choices"][0]["message"]["content"] == ANSWER
    assert (left.seq, left.status_code, left.error) == (0, 499, "client disconnected before the answer was delivered")
    assert (kept.seq, kept.status_code, kept.error) == (1, 200, None)
    # The engine was left to finish: the record keeps the answer the harness never saw, with its token ids.
    assert left.completion_ids == kept.completion_ids == encode(ANSWER) + [IM_END]
    assert left.prompt_ids == kept.prompt_ids == render_chat(CHAT["messages"])
    assert len(left.logprobs) == len(left.completion_ids) and left.finish_reason == "stop"
    assert left.response["choices"][0]["message"]["content"] == ANSWER
    assert fake.answered == 2


@pytest.mark.parametrize("upstream_stream", [False])
async def test_it_records_a_replayed_stream_whose_harness_left_before_the_answer_as_499(live, fake, recorder):
    app, base = live
    fake.latency_s = 0.6
    async with httpx.AsyncClient(base_url=base + "/v1", headers=headers(), timeout=HANG_UP) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/chat/completions", json={**CHAT, "stream": True})
        await until(lambda: len(recorder.calls) == 1 and app.gate.in_flight == 0, "the abandoned call recorded")

    [call] = recorder.calls
    assert (call.status_code, call.error, call.stream) == (499, "client disconnected before the answer was delivered",
                                                          True)
    assert call.completion_ids == encode(ANSWER) + [IM_END]


async def test_it_marks_a_stream_the_harness_cut_short_incomplete(live, fake, recorder):
    app, base = live
    fake.chunk_delay_s = 0.05
    async with httpx.AsyncClient(base_url=base + "/v1", headers=headers()) as c:
        async with c.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as r:
            async for line in r.aiter_lines():
                if '"content":"Hell"' in line:
                    break
    await until(lambda: len(recorder.calls) == 1 and app.gate.in_flight == 0, "the cut stream recorded")

    [call] = recorder.calls
    assert (call.status_code, call.error) == (499, "stream incomplete: client disconnected before the stream ended")
    assert call.completion_ids[:4] == encode("Hell") and call.finish_reason is None


@pytest.mark.parametrize("upstream_stream", [False])
async def test_it_marks_a_replayed_stream_cut_short_incomplete(proxy, recorder):
    """The engine's whole answer is replayed as a stream; the harness hangs up after the first event."""
    gone = asyncio.Event()
    inbox = [{"type": "http.request", "body": json.dumps({**CHAT, "stream": True}).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if inbox:
            return inbox.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("body"):
            gone.set()
            await asyncio.sleep(0.2)  # the server notices the hang-up before the next event

    path = "/rollouts/r1/v1/chat/completions"
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"authorization", b"Bearer s1"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1234), "server": ("proxy", 80)}
    await proxy(scope, receive, send)
    await until(lambda: len(recorder.calls) == 1 and proxy.gate.in_flight == 0, "the cut replay recorded")

    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    [call] = recorder.calls
    assert (call.status_code, call.error) == (499, "stream incomplete: client disconnected before the stream ended")
    assert call.completion_ids == encode(ANSWER) + [IM_END]


STREAMED = {
    "/chat/completions": {**CHAT, "stream": True},
    "/completions": {"model": "m", "prompt": "hi", "stream": True},
    "/responses": {"model": "m", "input": "hi", "stream": True},
    "/messages": {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], "stream": True},
}
API = {"/chat/completions": "chat", "/completions": "completions", "/responses": "responses", "/messages": "messages"}


@pytest.mark.parametrize("upstream_stream", [True, False])
@pytest.mark.parametrize("path", list(STREAMED))
async def test_it_records_a_stream_whose_harness_left_before_the_first_byte_as_499(live, fake, recorder, path):
    """The harness sends its whole streaming request on a raw socket and closes it before any answer byte."""
    app, base = live
    fake.latency_s = 0.3
    host, port = base.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(STREAMED[path]).encode()
    writer.write(f"POST /rollouts/r1/v1{path} HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer s1\r\n"
                 f"x-api-key: s1\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                 + body)
    await writer.drain()
    await until(lambda: fake.calls == 1, "the call sent to the engine")
    writer.close()  # before the engine has answered: not a byte of the answer reached the harness
    await until(lambda: len(recorder.calls) == 1 and app.gate.in_flight == 0, "the abandoned stream recorded")

    [call] = recorder.calls
    assert (call.status_code, call.error, call.stream, call.api) == (499, NOT_DELIVERED, True, API[path])
    assert call.request == STREAMED[path]
    # The engine was left to finish: the record keeps the answer nobody received, with its token ids.
    assert call.completion_ids[-1] == IM_END and len(call.logprobs) == len(call.completion_ids) == len(
        encode("Hello! You said: hi")) + 1
    assert fake.answered == 1


async def test_a_slow_stream_whose_harness_left_before_the_first_byte_is_still_read_to_its_end(live, fake, recorder):
    """Nothing reached the harness, so nothing is cut: the engine's whole answer is recorded 499, as for whole answers
    (a harness that leaves mid-stream has the stream stopped instead, see above)."""
    app, base = live
    fake.latency_s, fake.chunk_delay_s = 0.3, 0.05  # the answer streams for a quarter of a second after the hang-up
    host, port = base.split("//")[1].split("/")[0].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({**CHAT, "stream": True}).encode()
    writer.write(f"POST /rollouts/r1/v1/chat/completions HTTP/1.1\r\nhost: proxy\r\nauthorization: Bearer s1\r\n"
                 f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    await until(lambda: fake.calls == 1, "the call sent to the engine")
    writer.close()
    await until(lambda: len(recorder.calls) == 1 and app.gate.in_flight == 0, "the abandoned stream recorded")

    [call] = recorder.calls
    assert (call.status_code, call.error, call.stream) == (499, NOT_DELIVERED, True)
    assert call.completion_ids == encode(ANSWER) + [IM_END] and call.finish_reason == "stop"
    assert len(call.logprobs) == len(call.completion_ids)
