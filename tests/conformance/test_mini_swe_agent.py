"""Conformance: the mini-SWE-agent templates (`mini` via litellm, tool-calling and text-based) against the scripted
engine.

Measured with mini-swe-agent 2.4.6 (litellm 1.110.2) and the tiny Qwen2 tokenizer: two non-streamed POST
/v1/chat/completions calls per mode and no side request (litellm's catalogues come from its bundled copies).
- tools: mini.yaml's system + instance prompt and one `bash` tool ({"command": string}). The first answer is the
  bash call running the task's command; the agent sends the call back (arguments string verbatim, content null)
  and the output as a `tool` message, and the second answer is the bash call `echo
  COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, which makes the agent stop with exit status Submitted (the scripted
  DONE text is never asked for: a reply without a tool call would be a format error to this agent).
- text: mini_textbased.yaml's prompts, no tools; each answer is a THOUGHT and a ```mswea_bash_command block, the
  output comes back as a user message (<returncode>0</returncode><output>...), the second block is the same
  finishing echo.
Both modes send their history back unchanged, so the second prompt extends the first prompt + completion token
for token: both calls are clean, one merged sample, and every token the engine produced is trained.
"""
from __future__ import annotations

import json

import pytest

from tests.conformance.conftest import assert_conformant

pytestmark = pytest.mark.conformance

COMMAND = "sed -i 's/draft/final/' notes.txt"
FINISH = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def bash_commands(result) -> list[str]:
    """The command of every bash tool call the engine answered, in call order."""
    return [json.loads(call["function"]["arguments"])["command"] for c in result.calls
            for call in c.response["choices"][0]["message"]["tool_calls"] or ()]


def assert_two_clean_calls(result) -> None:
    assert_conformant(result)
    assert result.verdict == "ok", result.reasons
    assert [(c.api, c.stream) for c in result.calls] == [("chat", False)] * 2
    assert result.outcome["agent_exit_status"] == "Submitted"
    assert result.build.drift == {0: "clean", 1: "clean"}
    assert [s.call_seqs for s in result.build.samples] == [(0, 1)]
    assert result.trained_tokens == result.engine_tokens


def test_tool_calling_mode_runs_bash_calls_and_every_call_trains_clean(run_template, conformance_row):
    slug = "mini-swe-agent-tools"
    result = run_template(slug)

    assert_two_clean_calls(result)
    assert [[t["function"]["name"] for t in c.request["tools"]] for c in result.calls] == [["bash"], ["bash"]]
    assert bash_commands(result) == [COMMAND, FINISH]
    assert result.calls[1].request["messages"][-1]["role"] == "tool"
    conformance_row(slug, result)


def test_text_mode_runs_fenced_commands_and_every_call_trains_clean(run_template, conformance_row):
    slug = "mini-swe-agent-text"
    result = run_template(slug)

    assert_two_clean_calls(result)
    assert [c.request.get("tools") for c in result.calls] == [None, None]
    replies = [c.response["choices"][0]["message"]["content"] for c in result.calls]
    assert [f"```mswea_bash_command\n{command}\n```" in reply for reply, command in zip(replies, [COMMAND, FINISH])] \
        == [True, True]
    assert result.calls[1].request["messages"][-1] == {"role": "user",
                                                       "content": "<returncode>0</returncode>\n<output>\n</output>"}
    assert result.outcome["final_message"] == replies[1]
    conformance_row(slug, result)
