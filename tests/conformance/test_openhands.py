"""Conformance: the OpenHands template (openhands-sdk + openhands-tools, local workspace) against the scripted engine.

Measured with openhands-sdk 1.58.2 / openhands-tools 1.58.2 and the tiny Qwen2 tokenizer: two non-streamed POST
/v1/chat/completions calls and no side request. Each offers the tools terminal ({"command": string} required;
security_risk, summary, is_input, timeout, reset optional), file_editor, finish and think, with a system prompt
of about 14,000 tokens given as a list of text parts (and extra fields the engine ignores: reasoning_effort,
prompt_cache_key). The first answer is the terminal call running the task's command; the agent sends it back
(its content as a list of text parts, the arguments string verbatim) with the output as a `tool` message, and the
second answer, the text DONE without a tool call, ends the conversation (status finished). vLLM joins text parts
into a string before the chat template, as the scripted engine does, so the second prompt extends the first
prompt + completion token for token: both calls are clean, one merged sample, every produced token trained.
"""
from __future__ import annotations

import json

import pytest

from tests.conformance.conftest import assert_conformant

pytestmark = pytest.mark.conformance

SLUG = "openhands"
COMMAND = "sed -i 's/draft/final/' notes.txt"


def test_openhands_edits_the_file_and_every_call_trains_clean(run_template, conformance_row):
    result = run_template(SLUG)

    assert_conformant(result)
    assert result.verdict == "ok", result.reasons
    assert [(c.api, c.stream) for c in result.calls] == [("chat", False)] * 2
    tools = [t["function"]["name"] for t in result.calls[0].request["tools"]]
    assert tools == ["terminal", "file_editor", "finish", "think"]
    first = result.calls[0].response["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in first] == [
        ("terminal", {"command": COMMAND})]
    assert result.calls[1].request["messages"][-1]["role"] == "tool"
    assert result.outcome["final_message"] == "DONE"
    assert result.outcome["agent_exit_status"] == "finished"
    assert result.build.drift == {0: "clean", 1: "clean"}
    assert [s.call_seqs for s in result.build.samples] == [(0, 1)]
    assert result.trained_tokens == result.engine_tokens
    conformance_row(SLUG, result)
