"""POST /rollouts/<id>/v1/responses: translation to chat completions and back, streaming events, the openai SDK."""
from __future__ import annotations

import json

import openai
import pytest

from proxy.errors import ProxyError
from proxy.responses_api import chat_tools, input_messages
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


async def test_it_rejects_previous_response_id(client, recorder):
    r = await client.post("/responses", json={"model": "m", "input": "hi", "previous_response_id": "resp_1"})

    assert r.status_code == 400 and "previous_response_id is not supported" in r.json()["error"]["message"]
    assert recorder.calls == []


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
