"""The run's sampling parameters on every engine call, whatever the harness asked for; what it asked is recorded."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from proxy.sampling import enforce_sampling
from proxy.types import UpstreamConfig

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
