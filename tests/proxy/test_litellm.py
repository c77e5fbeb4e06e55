"""litellm as a client of the proxy: its OpenAI route (chat, tools, streaming) and its Anthropic route (messages)."""
from __future__ import annotations

import json

import litellm
import pytest

from tests.proxy.fake_upstream import IM_END, Reply, encode

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
MESSAGES = [{"role": "user", "content": "hi"}]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic notes on litellm's own types


async def test_it_serves_litellm_openai_calls_with_tools_and_streaming(live, fake, recorder):
    _, base = live
    fake.replies.append(Reply(tool_calls=[("bash", '{"command": "ls"}')]))

    tool = await litellm.acompletion(model="openai/my-agent-model", api_base=base + "/v1", api_key="s1",
                                     messages=MESSAGES, tools=TOOLS)
    stream = await litellm.acompletion(model="openai/my-agent-model", api_base=base + "/v1", api_key="s1",
                                       messages=MESSAGES, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])

    call = tool.choices[0].message.tool_calls[0]
    assert call.function.name == "bash" and json.loads(call.function.arguments) == {"command": "ls"}
    assert text == "Hello! You said: hi"
    assert [(c.api, c.stream, c.status_code) for c in recorder.calls] == [("chat", False, 200), ("chat", True, 200)]
    assert recorder.calls[1].completion_ids == encode(text) + [IM_END]
    assert recorder.calls[0].request["model"] == "my-agent-model"


async def test_it_serves_litellm_anthropic_calls(live, recorder):
    _, base = live

    answer = await litellm.acompletion(model="anthropic/claude-sonnet-4-5", api_base=base, api_key="s1",
                                       messages=MESSAGES, max_tokens=64)

    assert answer.choices[0].message.content == "Hello! You said: hi"
    [call] = recorder.calls
    assert call.api == "messages" and call.status_code == 200 and call.completion_ids[-1] == IM_END
