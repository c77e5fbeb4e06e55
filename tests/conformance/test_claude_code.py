"""Conformance: the Claude Code template (claude -p over Anthropic Messages) against the scripted engine.

Measured with Claude Code 2.1.332 and the tiny Qwen2 tokenizer: two streamed POST /v1/messages?beta=true calls,
no count_tokens call and no side request (title, summary or small/fast-model calls: non-essential traffic is off).
The first offers Bash (input {"command": string, "description"?: string, ...}), Edit, Read, Write, Agent and the
other built-in tools, its system prompt as `system` blocks plus a `role: "system"` message after the user's turn,
and gets the Bash call; the second sends the history back (the tool_use input re-serialised by the proxy exactly
as the engine wrote it, the result as a tool_result block) and gets DONE. So both calls are clean, one merged
sample, and every token the engine produced is trained.
"""
from __future__ import annotations

import pytest

from tests.conformance.conftest import assert_conformant

pytestmark = pytest.mark.conformance

SLUG = "claude-code"
COMMAND = "sed -i 's/draft/final/' notes.txt"


def tool_uses(response: dict) -> list[tuple[str, dict]]:
    """(name, input) of each tool_use block of an Anthropic answer."""
    return [(block["name"], block["input"]) for block in response.get("content") or ()
            if block.get("type") == "tool_use"]


def test_claude_code_edits_the_file_and_every_call_trains_clean(run_template, conformance_row):
    result = run_template(SLUG)

    assert_conformant(result)
    assert result.verdict == "ok", result.reasons
    assert [(c.api, c.stream) for c in result.calls] == [("messages", True)] * 2
    assert tool_uses(result.calls[0].response) == [("Bash", {"command": COMMAND})]
    assert result.outcome["final_message"] == "DONE"
    assert result.build.drift == {0: "clean", 1: "clean"}
    assert [s.call_seqs for s in result.build.samples] == [(0, 1)]
    assert result.trained_tokens == result.engine_tokens
    conformance_row(SLUG, result)
