"""POST /rollouts/<id>/v1/completions: legacy completions with token capture, streaming, the openai SDK."""
from __future__ import annotations

import openai
import pytest

from tests.proxy.conftest import SERVED
from tests.proxy.fake_upstream import IM_END, Reply, encode


async def test_it_records_prompt_and_completion_ids(client, fake, recorder):
    fake.replies.append(Reply(text=" 42"))
    r = await client.post("/completions", json={"model": "m", "prompt": "6*7 =", "max_tokens": 8})

    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"] == " 42" and choice["logprobs"] is None and "token_ids" not in choice
    assert fake.requests[-1]["logprobs"] == 0 and fake.requests[-1]["model"] == SERVED
    [call] = recorder.calls
    assert call.api == "completions"
    assert call.prompt_ids == encode("6*7 =") and call.completion_ids == encode(" 42") + [IM_END]
    assert call.logprobs == [fake.logprob(i) for i in range(4)]


async def test_it_accepts_token_id_prompts(client, recorder):
    r = await client.post("/completions", json={"model": "m", "prompt": [11, 12, 13], "max_tokens": 2})

    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert recorder.calls[0].prompt_ids == [11, 12, 13] and len(recorder.calls[0].completion_ids) == 2


async def test_it_rejects_a_prompt_of_the_wrong_type(client, recorder):
    r = await client.post("/completions", json={"model": "m", "prompt": {"text": "x"}})

    assert r.status_code == 400 and r.json()["error"]["message"] == "field 'prompt' must be a string or an array, got dict"
    assert recorder.calls == []


@pytest.mark.parametrize("upstream_stream", [True, False], ids=["engine-streams", "engine-whole"])
async def test_it_streams_through_the_openai_sdk(live, recorder, upstream_stream):
    _, base = live
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s1", max_retries=0)

    stream = await sdk.completions.create(model="davinci", prompt="Say hi", stream=True, logprobs=0)
    pieces = [chunk async for chunk in stream]
    plain = await sdk.completions.create(model="davinci", prompt="Say hi")
    await sdk.close()

    text = "".join(c.choices[0].text for c in pieces if c.choices)
    assert text == plain.choices[0].text == "Hello! You said: Say hi"
    assert [c.stream for c in recorder.calls] == [True, False]
    assert recorder.calls[0].completion_ids == recorder.calls[1].completion_ids == encode(text) + [IM_END]
    assert recorder.calls[0].prompt_ids == encode("Say hi")
    lps = [lp for c in pieces if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert lps == recorder.calls[0].logprobs
