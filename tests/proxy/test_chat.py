"""POST /rollouts/<id>/v1/chat/completions: passthrough, token capture, streaming, tools (httpx and the openai SDK)."""
from __future__ import annotations

import json
from dataclasses import replace

import httpx
import openai
import pytest

from tests.proxy.conftest import SERVED
from tests.proxy.fake_upstream import IM_END, Fault, Reply, decode, encode, render_chat, tool_text

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
BOTH = pytest.mark.parametrize("upstream_stream", [True, False], ids=["engine-streams", "engine-whole"])


async def test_it_records_engine_token_ids_and_hides_them_from_the_harness(client, fake, recorder):
    r = await client.post("/chat/completions", json={"model": "gpt-4o", "messages": MESSAGES, "temperature": 0.7})

    assert r.status_code == 200
    body = r.json()
    assert body["model"] == "gpt-4o"
    assert body["choices"][0]["message"]["content"] == "Hello! You said: hi"
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    assert body["choices"][0]["logprobs"] is None
    sent = fake.requests[-1]
    assert sent["model"] == SERVED and sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["temperature"] == 0.7
    [call] = recorder.calls
    assert (call.rollout_id, call.seq, call.api, call.status_code, call.stream) == ("r1", 0, "chat", 200, False)
    assert call.request == {"model": "gpt-4o", "messages": MESSAGES, "temperature": 0.7}
    assert call.response == body
    assert call.prompt_ids == render_chat(MESSAGES)
    assert call.completion_ids == encode("Hello! You said: hi") + [IM_END]
    assert call.logprobs == [fake.logprob(i) for i in range(len(call.completion_ids))]
    assert call.finish_reason == "stop" and call.policy_version == 3 and call.error is None
    assert call.upstream_request["model"] == SERVED


async def test_it_returns_token_ids_and_logprobs_when_the_harness_asks(client, recorder):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "logprobs": True,
                                                     "return_token_ids": True})

    choice = r.json()["choices"][0]
    assert r.json()["prompt_token_ids"] == render_chat(MESSAGES)
    assert choice["token_ids"] == recorder.calls[0].completion_ids
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


async def test_it_passes_unknown_fields_through_to_the_engine(client, fake):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "top_k": 5,
                                                     "chat_template_kwargs": {"enable_thinking": False}})

    assert r.status_code == 200
    assert fake.requests[-1]["top_k"] == 5
    assert fake.requests[-1]["chat_template_kwargs"] == {"enable_thinking": False}


async def test_it_assigns_seq_per_rollout_in_arrival_order(client, recorder):
    for _ in range(3):
        await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES})
    r2 = await client.post("http://proxy/rollouts/r2/v1/chat/completions", json={"model": "m", "messages": MESSAGES},
                           headers={"authorization": "Bearer s2"})

    assert r2.status_code == 200
    assert [(c.rollout_id, c.seq) for c in recorder.calls] == [("r1", 0), ("r1", 1), ("r1", 2), ("r2", 5)]


@BOTH
async def test_it_streams_and_records_complete_token_ids(client, recorder, upstream_stream):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True})

    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello! You said: hi"
    assert all("usage" not in c and "prompt_token_ids" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    [call] = recorder.calls
    assert call.stream is True and call.status_code == 200
    assert call.prompt_ids == render_chat(MESSAGES)
    assert call.completion_ids == encode("Hello! You said: hi") + [IM_END]
    assert len(call.logprobs) == len(call.completion_ids)
    assert call.response["choices"][0]["message"]["content"] == "Hello! You said: hi"
    assert call.response["usage"]["completion_tokens"] == len(call.completion_ids)


async def test_it_keeps_the_usage_chunk_when_the_harness_asks(client):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "stream": True,
                                                     "stream_options": {"include_usage": True}})

    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == len(render_chat(MESSAGES))


async def test_it_records_a_length_cut_without_end_token(client, recorder):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 5})

    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert recorder.calls[0].completion_ids == encode("Hello")
    assert recorder.calls[0].finish_reason == "length"


# --- the official openai SDK over real sockets ----------------------------------------------------------


@BOTH
async def test_it_serves_the_openai_sdk_with_streaming_tool_calls(live, fake, recorder, upstream_stream):
    _, base = live
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s1", max_retries=0)
    fake.replies.append(Reply(text="", tool_calls=[("bash", '{"cmd": "ls -la"}')]))

    stream = await sdk.chat.completions.create(model="gpt-5", messages=MESSAGES, tools=TOOLS, stream=True)
    names, args, finish = [], [], None
    async for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            names.append(call.function.name or "")
            args.append(call.function.arguments or "")
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    await sdk.close()

    assert "".join(names) == "bash" and json.loads("".join(args)) == {"cmd": "ls -la"} and finish == "tool_calls"
    [call] = recorder.calls
    assert call.finish_reason == "tool_calls"
    assert decode(call.completion_ids) == '<tool_call>{"name": "bash", "arguments": "{\\"cmd\\": \\"ls -la\\"}"}</tool_call>'
    assert call.response["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"cmd": "ls -la"}'}


async def test_it_serves_a_tool_round_trip_through_the_openai_sdk(live, fake, recorder):
    _, base = live
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s1", max_retries=0)
    fake.replies.extend([Reply(tool_calls=[("bash", '{"cmd": "pwd"}')]), Reply(text="You are in /tmp.")])

    first = await sdk.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "/tmp"}]
    second = await sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    await sdk.close()

    assert call.function.name == "bash" and first.choices[0].finish_reason == "tool_calls"
    assert second.choices[0].message.content == "You are in /tmp."
    assert [c.seq for c in recorder.calls] == [0, 1]
    assert recorder.calls[1].request["messages"][-1] == {"role": "tool", "tool_call_id": call.id, "content": "/tmp"}
    assert recorder.calls[1].prompt_ids == render_chat(recorder.calls[1].upstream_request["messages"], TOOLS)


async def test_it_asks_the_engine_for_whole_answers_when_tools_are_offered(proxy, fake, recorder):
    proxy.config = replace(proxy.config, stream_with_tools=False)  # the default
    fake.replies.append(Reply(tool_calls=[("bash", '{"cmd": "ls"}')]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy/rollouts/r1/v1",
                                 headers={"authorization": "Bearer s1"}) as c:
        r = await c.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": True})

    assert "stream" not in fake.requests[-1]
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "bash"
    assert recorder.calls[0].stream is True and recorder.calls[0].error is None


async def test_it_flags_a_call_whose_token_ids_the_engine_left_incomplete(client, fake, recorder):
    fake.faults.append(Fault(drop_tool_ids=True))
    fake.replies.append(Reply(text="ok", tool_calls=[("bash", '{"cmd": "ls"}')]))
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": True})

    assert r.status_code == 200
    [call] = recorder.calls
    assert call.status_code == 200 and call.completion_ids == encode("ok") + [IM_END]
    total = len(encode("ok" + tool_text("bash", '{"cmd": "ls"}'))) + 1
    assert call.error == (f"incomplete token capture: the engine reported {total} completion tokens but returned "
                          "3 token ids and 3 logprobs")
