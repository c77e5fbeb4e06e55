"""The scripted engine over HTTP: vLLM's answer shapes, the real chat template's ids, and the file-edit policy."""
from __future__ import annotations

import json

import httpx
import pytest

from proxy.scripted_engine import ScriptedEngine, ScriptedServer
from proxy.scripted_policy import SIDE_ANSWER, tool_arguments
from tests.conformance.conftest import CONFORMANCE_TASK

COMMAND = "sed -i 's/draft/final/' notes.txt"
SHELL = {"type": "function", "function": {"name": "shell", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
    "required": ["command"]}}}
MESSAGES = [{"role": "system", "content": "You edit files."}, {"role": "user", "content": CONFORMANCE_TASK["prompt"]}]


@pytest.fixture(scope="module")
def served(tiny_tokenizer_dir):
    with ScriptedServer(ScriptedEngine(tiny_tokenizer_dir, model_name="tiny")) as server:
        yield server


@pytest.fixture
def engine(served) -> ScriptedEngine:
    return served.engine


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.base_url.removesuffix("/v1"), timeout=30) as client:
        yield client


def prompt_ids(engine: ScriptedEngine, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """What vLLM sends the model: the chat template's text, tokenized without adding special tokens."""
    text = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def chat(http, messages, tools=None, **extra) -> dict:
    body = {"model": "tiny", "messages": messages, "return_token_ids": True, "logprobs": True, **extra}
    if tools:
        body["tools"] = tools
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_it_answers_a_tool_call_with_the_templates_ids(http, engine):
    answer = chat(http, MESSAGES, [SHELL])
    choice = answer["choices"][0]
    assert answer["prompt_token_ids"] == prompt_ids(engine, MESSAGES, [SHELL])
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "shell"
    assert json.loads(call["function"]["arguments"]) == {"command": ["bash", "-lc", COMMAND]}
    assert choice["token_ids"][-1] == engine.tokenizer.eos_token_id
    assert engine.tokenizer.decode(choice["token_ids"]) == (
        '<tool_call>\n{"name": "shell", "arguments": ' + call["function"]["arguments"] + "}\n</tool_call><|im_end|>")
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert engine.produced[-1] == choice["token_ids"]
    assert answer["usage"]["prompt_tokens"] == len(answer["prompt_token_ids"])


def test_it_makes_the_next_prompt_extend_prompt_and_completion(http, engine):
    """The harness sends the answer back unchanged: the next prompt starts with the exact ids of the last one."""
    first = chat(http, MESSAGES, [SHELL])
    message = first["choices"][0]["message"]
    result = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": ""}
    second = chat(http, MESSAGES + [message, result], [SHELL])
    before = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second["prompt_token_ids"][:len(before)] == before
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "DONE", "tool_calls": []}
    assert engine.tokenizer.decode(second["choices"][0]["token_ids"]) == "DONE<|im_end|>"
    assert second["choices"][0]["finish_reason"] == "stop"


def test_it_renders_history_arguments_however_the_harness_serialised_them(http):
    """Like vLLM, the engine parses a history's tool-call arguments before the template dumps them: a harness that
    sends them back compact (OpenCode) still extends its last prompt token for token."""
    first = chat(http, MESSAGES, [SHELL])
    message = first["choices"][0]["message"]
    call = message["tool_calls"][0]
    compact = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
    assert compact != call["function"]["arguments"]
    message = {**message, "tool_calls": [{**call, "function": {**call["function"], "arguments": compact}}]}
    result = {"role": "tool", "tool_call_id": call["id"], "content": ""}
    second = chat(http, MESSAGES + [message, result], [SHELL])
    before = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
    assert second["prompt_token_ids"][:len(before)] == before


def test_it_streams_token_ids_in_every_chunk(http, engine):
    body = {"model": "tiny", "messages": MESSAGES, "tools": [SHELL], "stream": True, "return_token_ids": True,
            "logprobs": True, "stream_options": {"include_usage": True}}
    chunks = stream_chunks(http, body)
    assert chunks[0]["prompt_token_ids"] == prompt_ids(engine, MESSAGES, [SHELL])
    choices = [c for chunk in chunks for c in chunk["choices"]]
    ids = [t for c in choices for t in c["token_ids"]]
    assert ids == engine.produced[-1]
    assert sum(len((c["logprobs"] or {}).get("content") or ()) for c in choices) == len(ids)
    calls = [call for c in choices for call in c["delta"].get("tool_calls") or ()]
    assert calls[0]["function"]["name"] == "shell"
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    assert json.loads(arguments) == {"command": ["bash", "-lc", COMMAND]}
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)


def test_it_streams_text_that_spells_the_answer(http, engine):
    done = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    chunks = stream_chunks(http, {"model": "tiny", "messages": done, "tools": [SHELL], "stream": True})
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == "DONE"
    assert engine.tokenizer.decode([t for c in choices for t in c["token_ids"]]) == "DONE<|im_end|>"


def test_it_gives_text_mode_agents_a_fenced_command_then_their_finishing_command(http):
    system = {"role": "system", "content": "Reply with one ```mswea_bash_command block. When you are done, run "
                                           "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}
    first = chat(http, [system, MESSAGES[1]])["choices"][0]["message"]
    assert first["content"].endswith(f"```mswea_bash_command\n{COMMAND}\n```") and first["tool_calls"] == []
    observation = {"role": "user", "content": "<returncode>0</returncode>"}
    second = chat(http, [system, MESSAGES[1], first, observation])["choices"][0]["message"]
    assert second["content"].endswith("```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")


def test_it_answers_side_requests_with_short_text(http):
    title = [{"role": "system", "content": "Generate a title for this conversation."}, MESSAGES[1]]
    answer = chat(http, title)["choices"][0]
    assert answer["message"]["content"] == SIDE_ANSWER and answer["finish_reason"] == "stop"


def test_it_tokenizes_chat_messages_like_the_chat_route(http, engine):
    response = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "tools": [SHELL]})
    assert response.status_code == 200
    body = response.json()
    assert body["tokens"] == prompt_ids(engine, MESSAGES, [SHELL]) and body["count"] == len(body["tokens"])
    plain = http.post("/tokenize", json={"model": "tiny", "prompt": "hello world"}).json()
    assert plain["tokens"] == engine.tokenizer.encode("hello world")
    both = http.post("/tokenize", json={"messages": MESSAGES, "continue_final_message": True})
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]


def test_it_completes_text_prompts_with_token_ids(http, engine):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Say hi", "logprobs": 0})
    choice = response.json()["choices"][0]
    assert choice["prompt_token_ids"] == engine.tokenizer.encode("Say hi")
    assert choice["token_ids"] == engine.produced[-1] and choice["text"] == SIDE_ANSWER
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])


def test_it_lists_its_model(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]


@pytest.mark.parametrize(("schema", "expected"), [
    ({"properties": {"cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}}, "required": ["cmd"]},
     {"cmd": "ls"}),
    ({"properties": {"command": {"type": "string"}, "description": {"type": "string"}},
      "required": ["command", "description"]}, {"command": "ls", "description": "Run a shell command"}),
    ({"properties": {"command": {"type": "string"}, "security_risk": {"type": "string", "enum": ["LOW", "HIGH"]}},
      "required": ["command", "security_risk"]}, {"command": "ls", "security_risk": "LOW"}),
])
def test_it_fills_shell_tool_arguments_from_the_schema(schema, expected):
    assert tool_arguments(schema, "ls") == expected
