"""dashboard.conversations: recorded calls of each API read back as turns, tool definitions and tool-call counts.

Payloads have the shapes the proxy records from real harnesses (FIELD-NOTES.md, tests/proxy/): OpenCode and
mini-SWE-agent on chat, Codex on responses, Claude Code on messages; a stream's `response` is the assembled final
object (proxy.app), so a streamed call reads like a whole one.
"""
from dashboard.conversations import (
    Conversation,
    ToolCall,
    Turn,
    conversation,
    shared_prefix,
    tool_call_counts,
    tool_definitions,
)

BASH = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}


def roles(conv: Conversation) -> list[str]:
    return [t.role for t in conv.turns]


# --- chat (OpenCode streams, mini-SWE-agent does not) --------------------------------------------------------------

CHAT_REQUEST = {
    "model": "policy", "stream": True,
    "messages": [
        {"role": "system", "content": "You are opencode."},
        {"role": "user", "content": [{"type": "text", "text": "list"}, {"type": "text", "text": "files"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt\nb.txt"},
    ],
    "tools": [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": BASH}},
              {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}],
}
CHAT_RESPONSE = {  # what the proxy records for a stream: the assembled chat.completion
    "id": "chatcmpl-1", "object": "chat.completion", "model": "policy",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": "Reading both.", "reasoning_content": "two files",
        "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.txt"}'}},
            {"id": "call_3", "type": "function", "function": {"name": "read", "arguments": '{"path": "b.txt"}'}}]}}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 20},
}


def test_it_reads_a_chat_call():
    conv = conversation("chat", CHAT_REQUEST, CHAT_RESPONSE)

    assert roles(conv) == ["system", "user", "assistant", "tool", "assistant"]
    system, user, assistant, tool, answer = conv.turns
    assert system == Turn("system", "You are opencode.")
    assert user.text == "list\nfiles\n[image_url]"
    assert assistant.tool_calls == (ToolCall("call_1", "bash", '{"cmd":"ls"}'),) and assistant.text == ""
    assert (tool.tool_call_id, tool.text) == ("call_1", "a.txt\nb.txt")
    assert answer.completion and not tool.completion
    assert (answer.text, answer.reasoning) == ("Reading both.", "two files")
    assert [c.name for c in answer.tool_calls] == ["read", "read"]
    assert answer.tool_calls[0].pretty_arguments == '{\n  "path": "a.txt"\n}'
    assert [(t.name, t.description, t.parameters) for t in conv.tools] == [
        ("bash", "run a command", BASH), ("read", "", {"type": "object"})]
    assert conv.error == "" and conv.context == conv.turns[:4] and conv.completion == (answer,)


def test_a_developer_message_reads_as_system_and_an_unknown_role_as_a_note():
    conv = conversation("chat", {"messages": [{"role": "developer", "content": "Be brief."},
                                              {"role": "critic", "content": "hm"}]}, None)

    assert [(t.role, t.text) for t in conv.turns] == [("system", "Be brief."), ("note", "hm")]


def test_a_failed_call_shows_its_error_and_no_completion():
    openai_error = {"error": {"message": "engine unavailable", "type": "upstream_error", "code": 503}}
    anthropic_error = {"type": "error", "error": {"type": "overloaded_error", "message": "engine busy"}}

    failed = conversation("chat", CHAT_REQUEST, openai_error)
    assert failed.error == "engine unavailable" and failed.completion == () and len(failed.context) == 4
    assert conversation("messages", {"messages": []}, anthropic_error).error == "engine busy"
    assert conversation("chat", CHAT_REQUEST, None).completion == ()  # the proxy itself failed: no body


def test_an_empty_answer_is_shown_as_an_empty_assistant_turn():
    conv = conversation("messages", {"messages": [{"role": "user", "content": "go"}]},
                        {"type": "message", "role": "assistant", "content": [], "stop_reason": "max_tokens"})

    assert conv.completion == (Turn("assistant", completion=True),)


# --- completions ---------------------------------------------------------------------------------------------------

def test_it_reads_a_completions_call():
    conv = conversation("completions", {"prompt": "1+1=", "max_tokens": 4},
                        {"object": "text_completion", "choices": [{"index": 0, "text": "2", "finish_reason": "stop"}]})

    assert [(t.role, t.text, t.completion) for t in conv.turns] == [("user", "1+1=", False), ("assistant", "2", True)]
    assert conv.tools == ()


def test_a_prompt_of_token_ids_is_counted_not_shown():
    assert conversation("completions", {"prompt": [1, 2, 3]}, None).turns == (Turn("user", "[3 prompt token ids]"),)
    assert [t.text for t in conversation("completions", {"prompt": ["a", [5, 6]]}, None).turns] == [
        "a", "[2 prompt token ids]"]


# --- responses (Codex) ---------------------------------------------------------------------------------------------

CODEX_REQUEST = {
    "model": "gpt-5-codex", "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the test"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "look first"}],
         "encrypted_content": "gAAA"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command":["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "tests.py"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done!"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
    ],
    "tools": [
        {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array"}}}},
        {"type": "custom", "name": "apply_patch", "description": "Edit files", "format": {"type": "grammar"}},
        {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "grep", "parameters": {}}]},
        {"type": "web_search"},
    ],
}
CODEX_RESPONSE = {
    "id": "resp_1", "object": "response", "status": "completed",
    "output": [
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Running the tests.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1_0", "call_id": "call_3", "name": "shell",
         "arguments": '{"command":["pytest"]}', "status": "completed"},
    ],
}


def test_it_reads_a_codex_responses_call():
    conv = conversation("responses", {**CODEX_REQUEST, "instructions": "Be brief."}, CODEX_RESPONSE)

    assert roles(conv) == ["system", "system", "user", "assistant", "tool", "assistant", "tool", "note", "assistant"]
    instructions, developer, user, assistant, output, patch, patched, note, answer = conv.turns
    assert (instructions.text, developer.text, user.text) == ("Be brief.", "You are Codex.", "fix the test")
    assert (assistant.reasoning, assistant.text) == ("look first", "Looking.")  # reasoning opens its turn
    assert assistant.tool_calls == (ToolCall("call_1", "shell", '{"command":["ls"]}'),)  # joins its text
    assert (output.tool_call_id, output.text) == ("call_1", "tests.py")
    assert patch.tool_calls == (ToolCall("call_2", "apply_patch", "*** Begin Patch"),)
    assert patch.tool_calls[0].pretty_arguments == "*** Begin Patch"  # not JSON: as written
    assert (patched.tool_call_id, patched.text) == ("call_2", "Done!")
    assert note.text.startswith("[web_search_call]")
    assert answer.completion and answer.text == "Running the tests."
    assert answer.tool_calls == (ToolCall("call_3", "shell", '{"command":["pytest"]}'),)
    assert [(t.name, t.hosted) for t in conv.tools] == [
        ("shell", False), ("apply_patch", False), ("grep", False), ("web_search", True)]


def test_a_string_input_is_one_user_turn():
    conv = conversation("responses", {"input": "hi"}, {"output": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]}]})

    assert [(t.role, t.text) for t in conv.turns] == [("user", "hi"), ("assistant", "hello")]


# --- messages (Claude Code) ----------------------------------------------------------------------------------------

CLAUDE_REQUEST = {
    "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "text", "text": "Sure."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                           "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a.txt"}]},
                                     {"type": "tool_result", "tool_use_id": "toolu_0", "content": "denied",
                                      "is_error": True},
                                     {"type": "text", "text": "and now?"}]},
        {"role": "system", "content": "Reminder: be brief."},
    ],
    "tools": [{"name": "Bash", "description": "Run a command",
               "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}},
              {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
}
CLAUDE_RESPONSE = {  # what the proxy records for a stream: the assembled message
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5", "stop_reason": "tool_use",
    "content": [{"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"file_path": "a.txt"}}],
    "usage": {"input_tokens": 50, "output_tokens": 12},
}


def test_it_reads_a_claude_code_messages_call():
    conv = conversation("messages", CLAUDE_REQUEST, CLAUDE_RESPONSE)

    assert roles(conv) == ["system", "user", "assistant", "tool", "tool", "user", "system", "assistant"]
    system, user, assistant, result, denied, text, reminder, answer = conv.turns
    assert (system.text, user.text) == ("You are Claude Code.", "list files")
    assert (assistant.reasoning, assistant.text) == ("hmm", "Sure.")
    assert assistant.tool_calls == (ToolCall("toolu_1", "Bash", '{"command": "ls"}'),)
    assert (result.tool_call_id, result.text, result.is_error) == ("toolu_1", "a.txt", False)
    assert (denied.tool_call_id, denied.is_error) == ("toolu_0", True)
    assert (text.text, reminder.text) == ("and now?", "Reminder: be brief.")
    assert answer.completion and answer.tool_calls == (ToolCall("toolu_2", "Read", '{"file_path": "a.txt"}'),)
    assert [(t.name, t.hosted) for t in conv.tools] == [("Bash", False), ("web_search", True)]


# --- across the calls of a rollout ---------------------------------------------------------------------------------

def test_it_counts_the_models_tool_calls_once_each_over_the_completions():
    first = conversation("chat", CHAT_REQUEST, CHAT_RESPONSE)  # context calls bash once: the history, not counted
    follow_up = {**CHAT_REQUEST, "messages": CHAT_REQUEST["messages"] + [
        CHAT_RESPONSE["choices"][0]["message"],
        {"role": "tool", "tool_call_id": "call_2", "content": "A"},
        {"role": "tool", "tool_call_id": "call_3", "content": "B"}]}
    second = conversation("chat", follow_up, {"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "call_4", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]}}]})

    assert tool_call_counts([first, second]) == {"read": 2, "bash": 1}
    assert [t.name for t in tool_definitions([first, second])] == ["bash", "read"]


def test_a_later_call_repeating_the_history_shares_its_prefix():
    first = conversation("chat", CHAT_REQUEST, CHAT_RESPONSE)
    compact = dict(CHAT_RESPONSE["choices"][0]["message"])  # OpenCode re-serialises arguments compactly
    compact["tool_calls"] = [
        {**c, "function": {**c["function"], "arguments": c["function"]["arguments"].replace(" ", "")}}
        for c in compact["tool_calls"]]
    compact.pop("reasoning_content")
    follow_up = conversation("chat", {"messages": CHAT_REQUEST["messages"] + [
        compact, {"role": "tool", "tool_call_id": "call_2", "content": "A"}]}, None)
    other = conversation("chat", {"messages": [{"role": "system", "content": "Generate a title."}]}, None)

    assert shared_prefix(first, follow_up) == 5  # the answer matches without the reasoning the harness dropped
    assert shared_prefix(other, follow_up) == 0
    edited = {**compact, "content": "Reading one."}
    assert shared_prefix(conversation("chat", CHAT_REQUEST, {"choices": [{"message": edited}]}), follow_up) == 4


def test_an_unknown_api_or_a_malformed_body_never_raises():
    assert conversation("grpc", {}, None).turns[0].role == "note"
    assert conversation("chat", "not a dict", ["nor", "this"]).turns == ()
    odd = {"messages": [{"role": "user", "content": [{"type": "image"}, 7]}]}
    assert conversation("messages", odd, None).turns[0].text == "[image]"
