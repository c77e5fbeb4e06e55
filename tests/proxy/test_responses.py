"""POST /rollouts/<id>/v1/responses: translation to chat completions and back, streaming events, the openai SDK."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from proxy.app import create_app
from proxy.errors import ProxyError
from proxy.recording import ResponseLog
from proxy.responses_api import chat_tools, input_messages
from proxy.types import RecordedCall, UpstreamConfig
from tests.proxy.conftest import SERVED, headers
from tests.proxy.fake_upstream import IM_END, Reply, encode, render_chat

TOOL = {"type": "function", "name": "bash", "description": "run a command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
BOTH = pytest.mark.parametrize("upstream_stream", [True, False], ids=["engine-streams", "engine-whole"])


def test_it_translates_instructions_developer_messages_parts_and_tool_items():
    items = [
        {"role": "developer", "content": "You are Codex."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"},
                                                         {"type": "input_text", "text": "files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
    ]

    assert input_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "You are Codex."},
        {"role": "user", "content": "list\nfiles"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ]


def test_it_keeps_function_tools_flattens_namespaces_and_drops_hosted_tools():
    tools = [TOOL, {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": [{**TOOL, "name": "grep"}]}]

    assert [t["function"]["name"] for t in chat_tools(tools)] == ["bash", "grep"]
    assert chat_tools([TOOL])[0]["function"]["parameters"] == TOOL["parameters"]


def test_it_rejects_malformed_items_naming_them():
    with pytest.raises(ProxyError, match=r"input\[0\].role must be"):
        input_messages(None, [{"type": "message", "role": "robot", "content": "x"}])
    with pytest.raises(ProxyError, match=r"input\[0\].call_id must be a string"):
        input_messages(None, [{"type": "function_call_output", "output": "x"}])


async def test_it_answers_a_plain_request_and_records_token_ids(client, fake, recorder):
    r = await client.post("/responses", json={"model": "gpt-5-codex", "input": "hi", "instructions": "Be brief.",
                                              "max_output_tokens": 64, "store": False, "include": ["reasoning.encrypted_content"]})

    body = r.json()
    assert r.status_code == 200 and body["object"] == "response" and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "Hello! You said: hi"
    assert body["usage"]["output_tokens"] == len(encode("Hello! You said: hi")) + 1
    sent = fake.requests[-1]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert sent["max_tokens"] == 64 and sent["return_token_ids"] is True and sent["logprobs"] is True
    [call] = recorder.calls
    assert call.api == "responses" and call.response == body
    assert call.prompt_ids == render_chat(sent["messages"]) and call.completion_ids[-1] == IM_END


@BOTH
async def test_it_continues_a_previous_response_without_its_instructions(client, fake, recorder, upstream_stream):
    first = await client.post("/responses", json={"model": "m", "input": "hi", "instructions": "Be brief."})
    body = {"model": "m", "previous_response_id": first.json()["id"], "input": "again?", "instructions": "Be terse.",
            "stream": upstream_stream}
    second = await client.post("/responses", json=body)

    assert second.status_code == 200
    assert fake.requests[-1]["messages"] == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! You said: hi"}, {"role": "user", "content": "again?"}]
    call = recorder.calls[1]
    assert call.request == body and call.prompt_ids == render_chat(fake.requests[-1]["messages"])
    assert call.response["previous_response_id"] == first.json()["id"]
    assert recorder.calls[0].response["previous_response_id"] is None


async def test_it_follows_a_chain_of_previous_responses_with_tool_calls_through_the_sdk(live, fake, recorder):
    _, base = live
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s1", max_retries=0)
    fake.replies.extend([Reply(text="Let me look.", tool_calls=[("bash", '{"cmd": "ls"}')]), Reply(text="a.txt"),
                         Reply(text="Done.")])

    first = await sdk.responses.create(model="gpt-5", input="What is here?", tools=[TOOL])
    call_id = first.output[1].call_id
    second = await sdk.responses.create(model="gpt-5", previous_response_id=first.id, tools=[TOOL],
                                        input=[{"type": "function_call_output", "call_id": call_id, "output": "a.txt"}])
    third = await sdk.responses.create(model="gpt-5", previous_response_id=second.id, input="Thanks", tools=[TOOL])
    await sdk.close()

    assert third.output_text == "Done." and third.previous_response_id == second.id
    assert fake.requests[-1]["messages"] == [
        {"role": "user", "content": "What is here?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "a.txt"},
        {"role": "assistant", "content": "a.txt"},
        {"role": "user", "content": "Thanks"}]
    prompts = [c.prompt_ids for c in recorder.calls]
    assert prompts[2][: len(prompts[1])] == prompts[1]  # each turn extends the last: the calls merge cleanly


async def test_an_unknown_previous_response_is_a_400_naming_it(client, fake, recorder):
    r = await client.post("/responses", json={"model": "m", "input": "hi", "previous_response_id": "resp_nope"})

    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Previous response with id 'resp_nope' not found in this rollout.",
                                  "type": "invalid_request_error", "param": None, "code": "previous_response_not_found"}}
    assert fake.requests == [] and recorder.calls == []


async def test_another_rollouts_response_is_not_found(proxy, client, fake, recorder):
    first = await client.post("/responses", json={"model": "m", "input": "hi"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy/rollouts/r2/v1",
                                 headers=headers("s2")) as other:
        r = await other.post("/responses", json={"model": "m", "input": "x", "previous_response_id": first.json()["id"]})

    assert r.status_code == 400 and first.json()["id"] in r.json()["error"]["message"]
    assert len(fake.requests) == 1 and [c.rollout_id for c in recorder.calls] == ["r1"]


async def test_a_restarted_proxy_resolves_a_previous_response_from_the_recorder(client, fake, directory, recorder):
    first = await client.post("/responses", json={"model": "m", "input": "hi", "store": False})
    restarted = create_app(directory, recorder, UpstreamConfig(base_url="http://engine/v1", served_model=SERVED),
                           transport=httpx.ASGITransport(app=fake))
    assert restarted.records.responses._entries == {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=restarted), headers=headers(),
                                 base_url="http://proxy/rollouts/r1/v1") as http:
        r = await http.post("/responses", json={"model": "m", "input": "more", "previous_response_id": first.json()["id"]})
    await restarted.aclose()

    assert r.status_code == 200
    assert [m["content"] for m in fake.requests[-1]["messages"]] == ["hi", "Hello! You said: hi", "more"]
    assert recorder.calls[1].upstream_request["messages"] == fake.requests[-1]["messages"]


async def test_the_response_log_is_bounded_and_falls_back_to_the_recorder(recorder):
    log = ResponseLog(recorder, max_entries=2)
    calls = [_responses_call(f"resp_{i}", "hi") for i in range(3)]
    for call in calls:
        log.remember(call)
    recorder.calls.extend(calls[:1])  # only the first is in the "database"

    assert [key[1] for key in log._entries] == ["resp_1", "resp_2"]
    assert await log.find("r1", "resp_2") == ({"input": "hi"}, {"id": "resp_2", "output": []})
    assert await log.find("r1", "resp_0") == (calls[0].request, calls[0].response)
    assert await log.find("r2", "resp_2") is None
    assert await ResponseLog(object()).find("r1", "resp_0") is None  # a recorder that cannot look answers up


def _responses_call(response_id: str, text: str) -> RecordedCall:
    return RecordedCall("r1", 0, "responses", {"model": "m", "input": text, "tools": [TOOL]},
                        {"id": response_id, "object": "response", "output": []}, {}, [1], [2], [-0.1], "stop", 200, 1.0,
                        0, None, False, 0.0)


async def test_it_marks_a_length_cut_incomplete(client, recorder):
    r = await client.post("/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3})

    assert r.json()["status"] == "incomplete" and r.json()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert recorder.calls[0].completion_ids == encode("Hel")


async def test_it_serves_a_function_call_round_trip_through_the_openai_sdk(live, fake, recorder):
    _, base = live
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s1", max_retries=0)
    fake.replies.extend([Reply(text="Let me look.", tool_calls=[("bash", '{"cmd": "ls"}')]), Reply(text="One file: a.txt")])

    first = await sdk.responses.create(model="gpt-5", input="What is here?", tools=[TOOL])
    message, call = first.output
    follow = [{"role": "user", "content": "What is here?"}, *[item.model_dump(exclude_none=True) for item in first.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}]
    second = await sdk.responses.create(model="gpt-5", input=follow, tools=[TOOL])
    await sdk.close()

    assert message.type == "message" and message.content[0].text == "Let me look."
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "bash", {"cmd": "ls"})
    assert second.output_text == "One file: a.txt"
    upstream = recorder.calls[1].upstream_request["messages"]
    assert upstream[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]}
    assert upstream[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "a.txt"}
    assert recorder.calls[0].finish_reason == "tool_calls"


@BOTH
async def test_it_streams_events_the_openai_sdk_assembles(live, fake, recorder, upstream_stream):
    _, base = live
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s1", max_retries=0)
    fake.replies.append(Reply(text="Running it.", tool_calls=[("bash", '{"cmd": "pwd"}')]))

    async with sdk.responses.stream(model="gpt-5", input="where am I?", tools=[TOOL]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    await sdk.close()

    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert final.output_text == "Running it."
    assert final.output[1].name == "bash" and json.loads(final.output[1].arguments) == {"cmd": "pwd"}
    [call] = recorder.calls
    assert call.stream is True and call.response["output"][1]["arguments"] == '{"cmd": "pwd"}'
    assert call.response["id"] == final.id
    assert call.completion_ids == encode('Running it.<tool_call>{"name": "bash", "arguments": "{\\"cmd\\": \\"pwd\\"}"}</tool_call>') + [IM_END]


async def test_it_ends_a_cut_stream_with_response_completed_marked_incomplete(client, recorder):
    r = await client.post("/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3, "stream": True})

    events = [json.loads(block.split("data: ", 1)[1]) for block in r.text.split("\n\n") if "data: " in block]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["status"] == "incomplete" and events[-1]["response"]["output"][0]["content"][0]["text"] == "Hel"
    assert recorder.calls[0].response == events[-1]["response"]
