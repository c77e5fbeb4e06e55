"""POST /rollouts/<id>/v1/messages: Anthropic Messages translated to chat completions, streaming, tool use."""
from __future__ import annotations

import anthropic
import pytest

from proxy.anthropic_api import chat_messages, chat_tool_choice
from tests.proxy.fake_upstream import IM_END, Reply, encode, render_chat

TOOL = {"name": "bash", "description": "run a command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
BOTH = pytest.mark.parametrize("upstream_stream", [True, False], ids=["engine-streams", "engine-whole"])


def test_it_translates_system_blocks_tool_use_and_tool_results():
    system = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    messages = [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "text", "text": "Sure."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a.txt"}]},
                                     {"type": "text", "text": "and now?"}]},
        {"role": "system", "content": "Reminder: be brief."},
    ]

    assert chat_messages(system, messages) == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "user", "content": "and now?"},
        {"role": "system", "content": "Reminder: be brief."},
    ]


def test_it_maps_tool_choice():
    assert chat_tool_choice({"type": "any"}) == "required"
    assert chat_tool_choice({"type": "auto"}) == "auto"
    assert chat_tool_choice({"type": "tool", "name": "bash"}) == {"type": "function", "function": {"name": "bash"}}


async def test_it_maps_stop_sequences_and_usage(client, fake, recorder):
    fake.replies.append(Reply(text="one two STOP three"))
    r = await client.post("/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 50, "system": "Count.",
                                             "stop_sequences": ["STOP"], "messages": [{"role": "user", "content": "go"}]})

    body = r.json()
    assert r.status_code == 200 and body["type"] == "message" and body["model"] == "claude-sonnet-4-5"
    assert body["content"] == [{"type": "text", "text": "one two "}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "STOP")
    sent = fake.requests[-1]
    assert sent["stop"] == ["STOP"] and sent["max_tokens"] == 50
    assert body["usage"]["input_tokens"] == len(render_chat(sent["messages"]))
    assert recorder.calls[0].completion_ids == encode("one two ") + [IM_END]


async def test_it_reports_max_tokens(client, recorder):
    r = await client.post("/messages", json={"model": "c", "max_tokens": 4, "messages": [{"role": "user", "content": "go"}]})

    assert r.json()["stop_reason"] == "max_tokens" and r.json()["usage"]["output_tokens"] == 4
    assert recorder.calls[0].finish_reason == "length"


async def test_it_serves_a_tool_use_round_trip_through_the_anthropic_sdk(live, fake, recorder):
    _, base = live
    sdk = anthropic.AsyncAnthropic(base_url=base, api_key="s1", max_retries=0)
    fake.replies.extend([Reply(text="Checking.", tool_calls=[("bash", '{"cmd": "ls"}')]), Reply(text="There is a.txt.")])
    messages = [{"role": "user", "content": "What files are here?"}]

    first = await sdk.messages.create(model="claude-sonnet-4-5", max_tokens=256, tools=[TOOL], messages=messages,
                                      system="You are a coding agent.")
    text, tool_use = first.content
    messages += [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "a.txt"}]}]
    second = await sdk.messages.create(model="claude-sonnet-4-5", max_tokens=256, tools=[TOOL], messages=messages)
    await sdk.close()

    assert first.stop_reason == "tool_use" and text.text == "Checking."
    assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "bash", {"cmd": "ls"})
    assert second.content[0].text == "There is a.txt." and second.stop_reason == "end_turn"
    upstream = recorder.calls[1].upstream_request
    assert upstream["messages"][0] == {"role": "user", "content": "What files are here?"}
    assert upstream["messages"][-1] == {"role": "tool", "tool_call_id": tool_use.id, "content": "a.txt"}
    assert upstream["tools"][0]["function"]["parameters"] == TOOL["input_schema"]
    assert [c.api for c in recorder.calls] == ["messages", "messages"]
    assert recorder.calls[1].prompt_ids == render_chat(upstream["messages"], upstream["tools"])


@BOTH
async def test_it_streams_events_the_anthropic_sdk_assembles(live, fake, recorder, upstream_stream):
    _, base = live
    sdk = anthropic.AsyncAnthropic(base_url=base, api_key="s1", max_retries=0)
    fake.replies.append(Reply(text="Let me run it.", tool_calls=[("bash", '{"cmd": "pwd"}')]))

    async with sdk.messages.stream(model="claude-haiku-4-5", max_tokens=256, tools=[TOOL],
                                   messages=[{"role": "user", "content": "where?"}]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    await sdk.close()

    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == "Let me run it."
    assert final.content[1].type == "tool_use" and final.content[1].input == {"cmd": "pwd"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == len(recorder.calls[0].completion_ids)
    [call] = recorder.calls
    assert call.stream is True and call.response["content"][1]["input"] == {"cmd": "pwd"}
    assert call.response["id"] == final.id and call.completion_ids[-1] == IM_END


async def test_it_continues_a_prefilled_assistant_turn(client, fake, recorder):
    r = await client.post("/messages", json={"model": "c", "max_tokens": 20, "messages": [
        {"role": "user", "content": "Answer in JSON."}, {"role": "assistant", "content": "{"}]})

    assert r.status_code == 200
    sent = fake.requests[-1]
    assert sent["messages"][-1] == {"role": "assistant", "content": "{"}
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)
