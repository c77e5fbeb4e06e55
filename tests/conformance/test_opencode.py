"""Conformance: the OpenCode templates (`opencode run`, one per API: chat, responses, anthropic) against the scripted
engine.

Measured with opencode 1.18.33 and the tiny Qwen2 tokenizer, in each mode: three streamed calls, and no connection
but to the proxy (strace). The first is the title side request: OpenCode asks its small model (the same model here)
for a session title, under its own system prompt ("You are a title generator") and without tools; it starts
first, so it is the rollout's first call (clean) and trains as a sample of its own. The second is the agent's
first turn, with the build agent's system prompt and nine tools (bash, edit, glob, grep, read, skill, task, todowrite,
write): it extends nothing before it (another system prompt), so it forks a new sample, and gets the bash call. The
third sends the history back and gets DONE. opencode-chat lays its small-model overlay (small_model.json) over the
config: its agent turns carry four tools (bash, edit, read, write) and the overlay's short prompts; nothing else
changes.

OpenCode re-serialises the call's arguments compactly ({"command":"sed ..."}, where the engine wrote
{"command": "sed ..."}) in chat and responses modes; in anthropic mode it sends them as an object that the proxy
dumps. vLLM parses tool-call arguments into objects before the chat template dumps them, so the history renders
exactly as the engine's answer did in every mode: the third call extends the second token for token (clean), and
the agent's two calls merge into one sample. Every token the engine produced is trained.
"""
from __future__ import annotations

import json

import pytest

from proxy.types import RecordedCall
from tests.conformance.conftest import assert_conformant

pytestmark = pytest.mark.conformance

COMMAND = "sed -i 's/draft/final/' notes.txt"
TITLE_PROMPT = "You are a title generator."
TOOLS = ["bash", "edit", "glob", "grep", "read", "skill", "task", "todowrite", "write"]
SMALL_MODEL_TOOLS = {"opencode-chat": ["bash", "edit", "read", "write"]}
"""The tools a template's overlay leaves on (slug -> names); the others send OpenCode's stock TOOLS."""
MODES = {
    "opencode-chat": ("chat", '{"command":"sed -i \'s/draft/final/\' notes.txt"}'),
    "opencode-responses": ("responses", '{"command":"sed -i \'s/draft/final/\' notes.txt"}'),
    "opencode-anthropic": ("messages", '{"command": "sed -i \'s/draft/final/\' notes.txt"}'),
}
"""slug -> (the API the proxy sees, the bash call's arguments as the engine got them back in the history)."""


def is_title(call: RecordedCall) -> bool:
    """Whether a call is the title side request (told apart by its system prompt, in the engine's chat form)."""
    messages = call.upstream_request["messages"]
    return messages[0]["role"] == "system" and messages[0]["content"].startswith(TITLE_PROMPT)


def tool_calls(call: RecordedCall) -> list[tuple[str, dict]]:
    """(name, arguments) of the tool calls the engine answered a call with."""
    message = call.upstream_response["choices"][0]["message"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]


def sent_back_arguments(call: RecordedCall) -> list[str]:
    """The arguments strings of the assistant tool calls in a call's history, as the engine got them."""
    return [c["function"]["arguments"] for m in call.upstream_request["messages"] if m["role"] == "assistant"
            for c in m.get("tool_calls") or ()]


@pytest.mark.parametrize("slug", list(MODES))
def test_opencode_edits_the_file_and_its_title_request_trains_apart(slug, run_template, conformance_row):
    api, arguments_back = MODES[slug]
    result = run_template(slug)

    assert_conformant(result)
    assert result.verdict == "ok", result.reasons
    assert [(c.api, c.stream) for c in result.calls] == [(api, True)] * 3
    titles = [c for c in result.calls if is_title(c)]
    agent = [c for c in result.calls if not is_title(c)]
    assert len(titles) == 1 and "tools" not in titles[0].upstream_request
    assert [sorted(t["function"]["name"] for t in c.upstream_request["tools"]) for c in agent] == [
        SMALL_MODEL_TOOLS.get(slug, TOOLS)] * 2
    assert [tool_calls(c) for c in agent] == [[("bash", {"command": COMMAND})], []]
    assert sent_back_arguments(agent[1]) == [arguments_back]
    assert result.outcome["final_message"] == "DONE"
    # Whichever of the title and the agent's first turn reaches the proxy first is clean, the other forks.
    assert [result.build.drift[c.seq] for c in result.calls] == ["clean", "fork", "clean"]
    assert sorted(s.call_seqs for s in result.build.samples) == sorted([(titles[0].seq,), tuple(c.seq for c in agent)])
    assert result.trained_tokens == result.engine_tokens
    conformance_row(slug, result)
