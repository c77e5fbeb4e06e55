"""Conformance: the Codex CLI template (codex exec over the Responses API) against the scripted engine.

Measured with codex 0.171.0 and the tiny Qwen2 tokenizer: two streamed POST /v1/responses calls and no side
request (update checks, analytics, plugins and web search are off). The first offers exec_command (arguments
{"cmd": string}), write_stdin, request_user_input, view_image, the multi_agent_v1 namespace (flattened by the
proxy) and the goal tools, with the system prompt as `developer` messages, and gets the exec_command call; the
second sends the whole history back (the call's arguments string verbatim, its output as function_call_output)
and gets DONE. So the second prompt extends the first prompt + completion token for token: both calls are clean,
one merged sample, and every token the engine produced is trained.
"""
from __future__ import annotations

import json

import pytest

from tests.conformance.conftest import assert_conformant

pytestmark = pytest.mark.conformance

SLUG = "codex"
COMMAND = "sed -i 's/draft/final/' notes.txt"


def function_calls(response: dict) -> list[tuple[str, dict]]:
    """(name, arguments) of each function_call item of a Responses answer."""
    return [(item["name"], json.loads(item["arguments"])) for item in response.get("output") or ()
            if item.get("type") == "function_call"]


def test_codex_edits_the_file_and_every_call_trains_clean(run_template, conformance_row):
    result = run_template(SLUG)

    assert_conformant(result)
    assert result.verdict == "ok", result.reasons
    assert [(c.api, c.stream) for c in result.calls] == [("responses", True)] * 2
    assert function_calls(result.calls[0].response) == [("exec_command", {"cmd": COMMAND})]
    assert result.outcome["final_message"] == "DONE"
    assert result.build.drift == {0: "clean", 1: "clean"}
    assert [s.call_seqs for s in result.build.samples] == [(0, 1)]
    assert result.trained_tokens == result.engine_tokens
    conformance_row(SLUG, result)
