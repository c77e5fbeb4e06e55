"""POST /rollouts/<id>/v1/messages/count_tokens: the engine's own count of the rendered prompt, never recorded."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.app import create_app
from proxy.types import UpstreamConfig
from tests.proxy.conftest import SERVED
from tests.proxy.fake_upstream import IM_END, IM_START, Fault, encode, render_chat

TOOL = {"name": "bash", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
CHAT_TOOL = {"type": "function", "function": {"name": "bash", "parameters": TOOL["input_schema"],
                                              "description": "run a command"}}
SYSTEM = "You are Claude Code."
USER = {"role": "user", "content": "list files"}
COUNT = {"model": "claude-sonnet-4-5", "system": SYSTEM, "messages": [USER]}
ANTHROPIC = {"anthropic-version": "2023-06-01"}


async def test_it_counts_the_prompt_messages_would_send_and_records_nothing(live, fake, recorder):
    _, base = live
    sdk = anthropic.AsyncAnthropic(base_url=base, api_key="s1", max_retries=0)

    counted = await sdk.messages.count_tokens(model="claude-sonnet-4-5", system=SYSTEM, messages=[USER], tools=[TOOL])
    message = await sdk.messages.create(model="claude-sonnet-4-5", system=SYSTEM, messages=[USER], tools=[TOOL],
                                        max_tokens=32)

    # the fake's template by hand: tools block, system turn, user turn, then the assistant header
    tools_text = "tools\n" + json.dumps([CHAT_TOOL], sort_keys=True)
    expected = ([IM_START] + encode(tools_text) + [IM_END] + encode("\n")
                + [IM_START] + encode("system\n" + SYSTEM) + [IM_END] + encode("\n")
                + [IM_START] + encode("user\nlist files") + [IM_END] + encode("\n")
                + [IM_START] + encode("assistant\n"))
    assert counted.input_tokens == len(expected) == message.usage.input_tokens
    assert fake.tokenized == [{"model": SERVED, "add_generation_prompt": True, "tools": [CHAT_TOOL],
                               "messages": [{"role": "system", "content": SYSTEM}, USER]}]
    assert [c.api for c in recorder.calls] == ["messages"]  # the count is not a model call
    assert len(fake.requests) == 1 and recorder.calls[0].prompt_ids == expected


async def test_it_answers_exactly_input_tokens(client, fake, recorder):
    r = await client.post("/messages/count_tokens", json=COUNT, headers=ANTHROPIC)

    assert r.status_code == 200
    assert r.json() == {"input_tokens": len(render_chat([{"role": "system", "content": SYSTEM}, USER]))}
    assert recorder.calls == [] and fake.requests == []


async def test_it_counts_a_prefilled_reply_as_a_continuation(client, fake, recorder):
    body = {**COUNT, "messages": [USER, {"role": "assistant", "content": "Here are"}]}
    r = await client.post("/messages/count_tokens", json=body)

    assert r.status_code == 200
    [sent] = fake.tokenized
    assert (sent["add_generation_prompt"], sent["continue_final_message"]) == (False, True)
    assert r.json() == {"input_tokens": len(render_chat(sent["messages"]))}
    assert recorder.calls == []


@pytest.mark.parametrize("auth", [{}, {"x-api-key": "wrong"}, {"authorization": "Bearer s2"}])
async def test_it_needs_the_rollouts_key(proxy, fake, recorder, auth):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        r = await c.post("/rollouts/r1/v1/messages/count_tokens", json=COUNT, headers={**ANTHROPIC, **auth})

    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                    "message": "missing or invalid API key for this rollout"}}
    assert fake.tokenized == [] and recorder.calls == []


async def test_it_answers_404_for_an_unknown_rollout_and_409_once_finished(proxy, client, directory, fake, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as c:
        unknown = await c.post("/rollouts/nope/v1/messages/count_tokens", json=COUNT, headers={"x-api-key": "s1"})
    directory.finish("r1")
    finished = await client.post("/messages/count_tokens", json=COUNT)

    assert unknown.status_code == 404
    assert unknown.json() == {"type": "error", "error": {"type": "not_found_error", "message": "unknown rollout 'nope'"}}
    assert finished.status_code == 409
    assert finished.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": "rollout 'r1' is finished"}}
    assert fake.tokenized == [] and recorder.calls == []


@pytest.mark.parametrize(("body", "message"), [
    ({"model": "c"}, "missing required field 'messages'"),
    ({"messages": [USER]}, "missing required field 'model'"),
    ({"model": "c", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be user or assistant"),
    ({"model": "c", "messages": [USER], "tools": {"name": "bash"}}, "field 'tools' must be an array, got dict"),
    ([USER], "request body must be a JSON object"),
])
async def test_it_rejects_a_bad_body_in_anthropics_error_shape(client, fake, body, message):
    r = await client.post("/messages/count_tokens", json=body)

    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    assert fake.tokenized == []


async def test_it_rejects_a_body_that_is_not_json(client, fake):
    r = await client.post("/messages/count_tokens", content=b"{nope", headers={"content-type": "application/json"})

    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": "request body is not valid JSON"}}
    assert fake.tokenized == []


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (500, "api_error")])
async def test_it_passes_an_engine_error_through_in_anthropics_shape(client, fake, recorder, status, kind):
    fake.faults.append(Fault(status=status))
    r = await client.post("/messages/count_tokens", json=COUNT)

    assert r.status_code == status
    assert r.json() == {"type": "error", "error": {"type": kind, "message": f"fake engine error {status}"}}
    assert len(fake.tokenized) == 1 and recorder.calls == []


async def test_it_answers_502_when_the_engine_gives_no_count(directory, recorder):
    engine = Starlette(routes=[Route("/tokenize", lambda request: JSONResponse({"tokens": []}), methods=["POST"])])
    config = UpstreamConfig(base_url="http://engine/v1", served_model=SERVED)
    app = create_app(directory, recorder, config, transport=httpx.ASGITransport(app=engine))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
        r = await c.post("/rollouts/r1/v1/messages/count_tokens", json=COUNT, headers={"x-api-key": "s1"})
    await app.aclose()

    assert r.status_code == 502
    assert r.json() == {"type": "error", "error": {"type": "api_error",
                                                    "message": "engine answered /tokenize without a token count"}}
    assert recorder.calls == []


async def test_it_counts_while_the_proxy_is_paused_for_a_weight_update(proxy, client, fake, recorder):
    await proxy.pause(timeout=1.0)
    try:
        r = await client.post("/messages/count_tokens", json=COUNT)
    finally:
        await proxy.resume()

    assert r.status_code == 200 and r.json()["input_tokens"] == len(render_chat(fake.tokenized[0]["messages"]))
    assert proxy.gate.in_flight == 0 and recorder.calls == []
