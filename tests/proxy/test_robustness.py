"""Arbitrary JSON bodies on every endpoint: a 200 or a 4xx in the caller's format, never a crash or a leaked slot."""
from __future__ import annotations

import json

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

FIELDS = ["model", "messages", "input", "prompt", "instructions", "system", "tools", "tool_choice", "stream",
          "max_tokens", "max_output_tokens", "stop_sequences", "text", "stream_options", "n", "logprobs", "content",
          "role", "type", "call_id", "tool_use_id", "name", "arguments", "output"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.text(max_size=6), st.sampled_from(FIELDS))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)),
                      max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), values, max_size=6)
ENDPOINTS = ["/chat/completions", "/completions", "/responses", "/messages"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, endpoint=st.sampled_from(ENDPOINTS))
async def test_it_answers_every_json_body_without_crashing(client, proxy, recorder, body, endpoint):
    before = len(recorder.calls)
    r = await client.post(endpoint, content=json.dumps(body), headers={"content-type": "application/json"})

    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert len(recorder.calls) == before
    else:
        assert len(recorder.calls) == before + 1 and recorder.calls[-1].status_code == 200
    assert proxy.gate.in_flight == 0
