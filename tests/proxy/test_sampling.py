"""The run's sampling parameters on every engine call, whatever the harness asked for; what it asked is recorded."""
from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest

from proxy.sampling import GREEDY, enforce_sampling, rollout_sampling
from proxy.types import RolloutInfo, UpstreamConfig
from tests.proxy.conftest import until

RUN = {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
ENGINE = {**RUN, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
"""What every engine call of the run samples with: the run's values, every other knob neutral."""
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def sampling() -> dict:
    return RUN


def _sampled(body: dict) -> dict:
    return {k: body.get(k) for k in ENGINE}


@pytest.fixture
async def sdk_http(proxy):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy)) as http:
        yield http


def test_it_pins_the_runs_values_neutralises_penalties_and_drops_masks():
    body = {"model": "m", "messages": MESSAGES, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "presence_penalty": 0.5,
            "repetition_penalty": 1.0, "logit_bias": {"50256": -100}, "min_tokens": 8, "bad_words": [], "seed": 7,
            "max_tokens": 16}

    out, overrides = enforce_sampling(body, RUN)

    assert out == {"model": "m", "messages": MESSAGES, "seed": 7, "max_tokens": 16, **ENGINE}
    # top_k 0 and -1 both mean "off"; an empty bad_words list and repetition_penalty 1.0 change nothing.
    assert overrides == {"temperature": 1.0, "presence_penalty": 0.5, "logit_bias": {"50256": -100}, "min_tokens": 8}
    assert body["temperature"] == 1.0 and "logit_bias" in body  # the harness's body is left as it was


def test_it_rejects_an_unknown_sampling_parameter_naming_the_valid_ones():
    with pytest.raises(ValueError, match="unknown key 'temprature'.*temperature, top_p, top_k"):
        UpstreamConfig(sampling={"temprature": 0.7})
    with pytest.raises(ValueError, match="sampling\\['top_k'\\] must be a number, got str"):
        UpstreamConfig(sampling={"top_k": "40"})


@pytest.mark.parametrize("stream", [False, True])
async def test_it_enforces_the_runs_sampling_on_chat_through_the_openai_sdk(proxy, sdk_http, fake, recorder, stream):
    sdk = openai.AsyncOpenAI(base_url="http://proxy/rollouts/r1/v1", api_key="s1", http_client=sdk_http)
    answer = await sdk.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, temperature=1.2, top_p=0.9, presence_penalty=0.5, stream=stream,
        logit_bias={"50256": -100}, extra_body={"min_p": 0.1, "top_k": 20})
    if stream:
        answer = [chunk async for chunk in answer]

    assert _sampled(fake.requests[-1]) == ENGINE and "logit_bias" not in fake.requests[-1]
    [call] = recorder.calls
    assert call.sampling_overrides == {"temperature": 1.2, "top_p": 0.9, "presence_penalty": 0.5, "min_p": 0.1,
                                       "top_k": 20, "logit_bias": {"50256": -100}}
    assert call.request["temperature"] == 1.2 and call.request["logit_bias"] == {"50256": -100}  # verbatim
    assert _sampled(call.upstream_request) == ENGINE and call.status_code == 200
    assert proxy.sampling_override_calls == 1


async def test_it_records_no_override_when_the_harness_sends_nothing_or_the_runs_values(proxy, client, fake, recorder):
    await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES})
    await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "temperature": 0.7, "top_p": 1,
                                                 "presence_penalty": 0, "seed": 3})
    await client.post("/completions", json={"model": "m", "prompt": "1+1=", "temperature": 0.7, "max_tokens": 4})

    assert [_sampled(body) for body in fake.requests] == [ENGINE] * 3
    assert fake.requests[1]["seed"] == 3
    assert [c.sampling_overrides for c in recorder.calls] == [{}, {}, {}]
    assert [c.status_code for c in recorder.calls] == [200, 200, 200] and proxy.sampling_override_calls == 0


async def test_it_enforces_the_runs_sampling_on_responses_through_the_openai_sdk(proxy, sdk_http, fake, recorder):
    sdk = openai.AsyncOpenAI(base_url="http://proxy/rollouts/r1/v1", api_key="s1", http_client=sdk_http)
    response = await sdk.responses.create(model="gpt-5", input="hi", temperature=0.2, top_p=0.5)

    assert response.output_text == "Hello! You said: hi"
    assert _sampled(fake.requests[-1]) == ENGINE
    assert recorder.calls[0].sampling_overrides == {"temperature": 0.2, "top_p": 0.5}
    assert recorder.calls[0].request["temperature"] == 0.2 and proxy.sampling_override_calls == 1


async def test_it_enforces_the_runs_sampling_on_messages_through_the_anthropic_sdk(live, fake, recorder):
    proxy, base = live  # over a socket: this SDK brings its own HTTP client
    sdk = anthropic.AsyncAnthropic(base_url=base, api_key="s1", max_retries=0)
    # This SDK version types no sampling parameters; harnesses still send them at the top level of the body.
    same = await sdk.messages.create(model="claude", max_tokens=64, messages=MESSAGES, extra_body={"temperature": 0.7})
    other = await sdk.messages.create(model="claude", max_tokens=64, messages=MESSAGES,
                                      extra_body={"temperature": 0.3, "top_k": 40})
    await sdk.close()

    assert same.content[0].text == other.content[0].text == "Hello! You said: hi"
    assert [_sampled(body) for body in fake.requests] == [ENGINE, ENGINE]
    assert [c.sampling_overrides for c in recorder.calls] == [{}, {"temperature": 0.3, "top_k": 40}]
    assert recorder.calls[1].request["top_k"] == 40  # verbatim
    assert proxy.sampling_override_calls == 1


@pytest.mark.parametrize("sampling", [None])
async def test_it_passes_the_harness_sampling_through_when_the_run_sets_none(proxy, client, fake, recorder, sampling):
    await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "temperature": 1.2,
                                                 "logit_bias": {"5": 1}})

    assert fake.requests[-1]["temperature"] == 1.2 and fake.requests[-1]["logit_bias"] == {"5": 1}
    assert "presence_penalty" not in fake.requests[-1]
    assert recorder.calls[0].sampling_overrides == {} and proxy.sampling_override_calls == 0


# --- a rollout's own sampling: greedy evaluation attempts ---------------------------------------------------

def rollout_client(proxy, rollout_id: str, secret: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy),
                             base_url=f"http://proxy/rollouts/{rollout_id}/v1",
                             headers={"authorization": f"Bearer {secret}"})


def test_a_rollouts_own_knobs_go_over_the_runs():
    assert rollout_sampling(RUN, GREEDY) == {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    assert rollout_sampling(RUN, {}) is RUN  # every other rollout: exactly the run's
    assert rollout_sampling(None, GREEDY) == {"temperature": 0.0} and rollout_sampling(None, {}) is None


def test_a_rollout_with_an_unknown_knob_is_refused_naming_it():
    with pytest.raises(ValueError, match="rollout g1's sampling has unknown key 'temp'"):
        RolloutInfo("g1", "hash", finished=False, sampling={"temp": 0.0})


@pytest.mark.parametrize("upstream_stream", [False, True])
async def test_a_greedy_rollout_is_served_at_temperature_0_and_its_neighbours_at_the_runs(
        proxy, directory, fake, recorder, upstream_stream):
    directory.add("g1", "sg", sampling=GREEDY, split="val")
    directory.add("v1", "sv", split="val")
    body = {"model": "m", "messages": MESSAGES, "temperature": 1.0, "stream": upstream_stream}
    for rollout_id, secret in (("g1", "sg"), ("v1", "sv"), ("r1", "s1")):
        async with rollout_client(proxy, rollout_id, secret) as http:
            assert (await http.post("/chat/completions", json=body)).status_code == 200

    greedy, sampled, train = fake.requests
    assert _sampled(greedy) == {**ENGINE, "temperature": 0.0} and greedy["logprobs"] is True
    assert _sampled(sampled) == _sampled(train) == ENGINE
    assert [(c.rollout_id, c.status_code, c.upstream_request["temperature"], c.sampling_overrides)
            for c in recorder.calls] == [("g1", 200, 0.0, {"temperature": 1.0}), ("v1", 200, 0.7, {"temperature": 1.0}),
                                         ("r1", 200, 0.7, {"temperature": 1.0})]
    assert recorder.calls[0].logprobs and len(recorder.calls[0].logprobs) == len(recorder.calls[0].completion_ids)


async def test_evaluation_calls_count_neither_as_generation_time_nor_as_overridden(proxy, directory, recorder):
    directory.add("g1", "sg", sampling=GREEDY, split="val")
    async with rollout_client(proxy, "g1", "sg") as http:
        for _ in range(3):
            await http.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "temperature": 1.0})
    assert [c.status_code for c in recorder.calls] == [200] * 3
    assert proxy.busy_seconds == 0.0 and proxy.sampling_override_calls == 0 and proxy.gate.in_flight == 0

    async with rollout_client(proxy, "r1", "s1") as http:
        await http.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "temperature": 1.0})
    assert proxy.busy_seconds > 0 and proxy.sampling_override_calls == 1


async def test_a_pause_still_drains_evaluation_calls(proxy, directory, fake, recorder):
    """Evaluation calls leave the generation time, not the gate: a weight update waits for them too."""
    directory.add("v1", "sv", split="val")
    fake.latency_s = 0.3
    async with rollout_client(proxy, "v1", "sv") as http:
        call = asyncio.create_task(http.post("/chat/completions", json={"model": "m", "messages": MESSAGES}))
        await until(lambda: proxy.gate.in_flight == 1, "the evaluation call is admitted")
        await proxy.pause(timeout=10)
        assert [c.status_code for c in recorder.calls] == [200] and proxy.gate.in_flight == 0  # drained: recorded
        await proxy.resume()
        assert (await call).status_code == 200


TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}]
SCHEMA = {"name": "answer", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


@pytest.mark.parametrize("extra, constraint", [
    ({}, ""),
    ({"response_format": {"type": "text"}}, ""),
    ({"tools": TOOLS, "tool_choice": "auto"}, ""),
    ({"response_format": {"type": "json_schema", "json_schema": SCHEMA}}, "response_format json_schema"),
    ({"response_format": {"type": "json_object"}}, "response_format json_object"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "run"}}}, "tool_choice named"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
])
async def test_a_call_under_a_grammar_or_schema_is_recorded_as_constrained(proxy, client, fake, recorder, extra,
                                                                           constraint):
    """Issue 26.7: structured outputs still reach the engine (harnesses need them), and the record says the engine
    forced the call's tokens, so the trainer does not train them (trainer.samples)."""
    response = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, **extra})
    assert response.status_code == 200
    [call] = recorder.calls
    assert call.constraint == constraint
    for key in extra:
        assert fake.requests[-1][key] == extra[key]  # passed through to the engine unchanged


async def test_the_responses_and_messages_apis_record_their_constraints(proxy, sdk_http, live, recorder):
    sdk = openai.AsyncOpenAI(base_url="http://proxy/rollouts/r1/v1", api_key="s1", http_client=sdk_http)
    await sdk.responses.create(model="gpt-5", input="hi", text={"format": {"type": "json_schema", **SCHEMA}})
    _, base = live
    claude = anthropic.AsyncAnthropic(base_url=base, api_key="s1", max_retries=0)
    await claude.messages.create(model="claude", max_tokens=64, messages=MESSAGES, tool_choice={"type": "any"},
                                 tools=[{"name": "run", "input_schema": {"type": "object", "properties": {}}}])
    await claude.close()
    assert [c.constraint for c in recorder.calls] == ["response_format json_schema", "tool_choice required"]
