"""Calls asking for n > 1 choices (Chat Completions and Completions): every choice recorded as its own call."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from proxy.recording import per_choice
from proxy.types import RecordedCall
from tests.proxy.conftest import headers
from tests.proxy.fake_n_choices import NChoiceVLLM, logprob, text
from tests.proxy.fake_upstream import IM_END, encode, render_chat
from trainer.samples import CLEAN, FORK, CallRecord, build_samples

MESSAGES = [{"role": "user", "content": "pick a number"}]
BOTH = pytest.mark.parametrize("upstream_stream", [True, False], ids=["engine-streams", "engine-whole"])


@pytest.fixture
def fake() -> NChoiceVLLM:
    return NChoiceVLLM()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


def assert_one_record_per_choice(calls: list[RecordedCall], prompt_ids: list[int], n: int, first_seq: int = 0):
    assert [(c.seq, c.choice) for c in calls] == [(first_seq + k, k) for k in range(n)]
    for k, call in enumerate(calls):
        assert call.status_code == 200 and call.error is None and call.finish_reason == "stop"
        assert call.prompt_ids == prompt_ids
        assert call.completion_ids == encode(text(k)) + [IM_END]
        assert call.logprobs == pytest.approx([logprob(k, i) for i in range(len(call.completion_ids))])
        assert call.request == calls[0].request and call.response == calls[0].response


@BOTH
async def test_it_records_each_chat_choice_as_its_own_call(client, fake, recorder, upstream_stream):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "n": 3})

    assert r.status_code == 200
    body = r.json()
    assert [c["message"]["content"] for c in body["choices"]] == [text(k) for k in range(3)]
    assert all("token_ids" not in c and c["logprobs"] is None for c in body["choices"])
    assert fake.requests[-1]["n"] == 3
    assert_one_record_per_choice(recorder.calls, render_chat(MESSAGES), 3)
    assert recorder.calls[0].response == body

    await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES})  # n = 1: the next seq
    assert [c.seq for c in recorder.calls] == [0, 1, 2, 3] and recorder.calls[3].choice == 0


@BOTH
async def test_it_streams_interleaved_chat_choices_and_records_each(client, recorder, upstream_stream):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "n": 2, "stream": True})

    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    events = sse_events(r.text)
    content: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            content[choice["index"]] = content.get(choice["index"], "") + (choice["delta"].get("content") or "")
            assert "token_ids" not in choice
    assert content == {0: text(0), 1: text(1)}
    assert all("usage" not in e and "prompt_token_ids" not in e for e in events)
    assert_one_record_per_choice(recorder.calls, render_chat(MESSAGES), 2)
    assert [c["message"]["content"] for c in recorder.calls[1].response["choices"]] == [text(0), text(1)]


@BOTH
async def test_it_records_each_completions_choice_streamed_or_whole(client, recorder, upstream_stream):
    whole = await client.post("/completions", json={"model": "m", "prompt": "Once", "n": 2, "logprobs": 0})
    streamed = await client.post("/completions", json={"model": "m", "prompt": "Once", "n": 2, "stream": True})

    assert whole.status_code == 200 and [c["text"] for c in whole.json()["choices"]] == [text(0), text(1)]
    assert whole.json()["choices"][1]["logprobs"]["token_logprobs"] == pytest.approx(
        [logprob(1, i) for i in range(len(encode(text(1))) + 1)])
    texts: dict[int, str] = {}
    for event in sse_events(streamed.text):
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: text(0), 1: text(1)}
    assert_one_record_per_choice(recorder.calls[:2], encode("Once"), 2)
    assert_one_record_per_choice(recorder.calls[2:], encode("Once"), 2, first_seq=2)
    assert [c.stream for c in recorder.calls] == [False, False, True, True]


async def test_the_openai_sdk_sees_every_choice(live, recorder):
    _, base = live
    sdk = openai.AsyncOpenAI(base_url=base + "/v1", api_key="s1", max_retries=0)
    answer = await sdk.chat.completions.create(model="gpt-4o", messages=MESSAGES, n=2)
    await sdk.close()

    assert [c.message.content for c in answer.choices] == [text(0), text(1)]
    assert_one_record_per_choice(recorder.calls, render_chat(MESSAGES), 2)


async def test_each_choice_becomes_a_sample_and_the_chosen_one_is_continued_clean(client, recorder):
    await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "n": 3})
    follow = MESSAGES + [{"role": "assistant", "content": text(1)}, {"role": "user", "content": "why?"}]
    await client.post("/chat/completions", json={"model": "m", "messages": follow})

    calls = [CallRecord(c.seq, tuple(c.prompt_ids), tuple(c.completion_ids), tuple(c.logprobs)) for c in recorder.calls]
    built = build_samples(calls)
    assert built.drift == {0: CLEAN, 1: FORK, 2: FORK, 3: CLEAN}
    by_seqs = {s.call_seqs: s for s in built.samples}
    assert set(by_seqs) == {(0,), (1, 3), (2,)}
    for k, seqs in enumerate([(0,), (1, 3), (2,)]):
        sample = by_seqs[seqs]
        prompt = render_chat(MESSAGES)
        assert sample.token_ids[: len(prompt) + len(text(k)) + 1] == tuple(prompt + encode(text(k)) + [IM_END])
        sampled = [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m]
        assert sampled[: len(text(k)) + 1] == pytest.approx([logprob(k, i) for i in range(len(text(k)) + 1)])


@pytest.mark.parametrize("fake", [NChoiceVLLM(fail_with=503)], ids=["engine-503"])
async def test_a_failed_call_still_fills_every_reserved_seq(client, recorder):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "n": 2})

    assert r.status_code == 503 and r.json()["error"]["message"] == "engine busy"
    assert [(c.seq, c.choice, c.status_code, c.completion_ids) for c in recorder.calls] == [(0, 0, 503, []), (1, 1, 503, [])]
    assert all(c.error == "503: engine busy" for c in recorder.calls)


async def test_it_rejects_n_below_one_before_calling_the_engine(client, fake, recorder):
    r = await client.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "n": 0})

    assert r.status_code == 400 and r.json()["error"]["message"] == "field 'n' must be at least 1, got 0"
    assert fake.requests == [] and recorder.calls == []


async def test_responses_and_messages_calls_are_one_record_whatever_n_says(proxy, recorder):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy/rollouts/r1/v1",
                                 headers=headers()) as http:
        r = await http.post("/responses", json={"model": "m", "input": "hi", "n": 2})

    assert r.status_code == 200
    assert [(c.seq, c.choice) for c in recorder.calls] == [(0, 0)]


def test_a_token_gap_in_one_choice_marks_every_record():
    answer = {"choices": [{"index": 0, "token_ids": [5, 6], "logprobs": {"content": [{"logprob": -1.0}]}},
                          {"index": 1, "token_ids": [7], "logprobs": {"content": [{"logprob": -2.0}]}}],
              "prompt_token_ids": [1], "usage": {"completion_tokens": 3}}
    call = RecordedCall("r1", 4, "chat", {"n": 2}, {}, {}, [1], [5, 6], [-1.0], "stop", 200, 1.0, 0, None, False, 0.0,
                        upstream_response=answer)

    parts = per_choice(call)

    assert [(p.seq, p.completion_ids, p.logprobs) for p in parts] == [(4, [5, 6], [-1.0]), (5, [7], [-2.0])]
    assert all(p.error and p.error.startswith("incomplete token capture") for p in parts)
