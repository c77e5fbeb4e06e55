"""The proxy recording into the database: rollout auth from rows, batched ModelCall writes, events, rewards."""
import asyncio

import httpx
import openai
import pytest
from asgiref.sync import sync_to_async

from proxy.app import create_app
from proxy.types import RecordedCall, UpstreamConfig
from runs import rollout_services, services
from runs.models import ModelCall, Rollout, RunEvent
from runs.recorder import DjangoDirectory, DjangoRecorder, cached_directory
from tests.proxy.fake_n_choices import NChoiceVLLM, logprob, text
from tests.proxy.fake_upstream import IM_END, FakeVLLM, encode, render_chat

pytestmark = pytest.mark.django_db(transaction=True)
MESSAGES = [{"role": "user", "content": "what is 2+2?"}]


@pytest.fixture
def rollouts(alice, make_run):
    run = make_run(alice)
    return run, [rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=i)
                 for i in range(3)]


def run_proxy(run, **kwargs):
    """Run `run`'s proxy as the orchestrator wires it (its directory knows that run's rollouts only)."""
    return create_app(cached_directory(run.pk, ttl_s=0.05), DjangoRecorder(), UpstreamConfig(
        base_url="http://engine/v1", served_model="tiny"), policy_version=2,
        transport=httpx.ASGITransport(app=FakeVLLM()), **kwargs)


@pytest.fixture
async def proxy(rollouts):
    app = run_proxy(rollouts[0])
    yield app
    await app.aclose()


def sdk(proxy, rollout_id, secret):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy))
    return openai.AsyncOpenAI(base_url=f"http://proxy/rollouts/{rollout_id}/v1", api_key=secret, http_client=http)


async def test_calls_are_stored_with_token_ids_in_seq_order(proxy, rollouts):
    run, [(rollout, secret), *_] = rollouts
    client = sdk(proxy, rollout.pk, secret)
    answers = await asyncio.gather(*(client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
                                     for _ in range(6)))
    assert all(a.choices[0].message.content for a in answers)
    calls = await sync_to_async(lambda: list(ModelCall.objects.filter(rollout=rollout).order_by("seq")))()
    assert [c.seq for c in calls] == list(range(6))
    first = calls[0]
    assert first.api == "chat" and first.status_code == 200 and first.policy_version == 2
    assert first.prompt_ids == render_chat(MESSAGES)
    assert first.completion_ids == encode(answers[0].choices[0].message.content) + [IM_END]
    assert len(first.logprobs) == len(first.completion_ids) and first.finish_reason == "stop"
    assert first.request["model"] == "gpt-4o" and first.response["choices"][0]["message"]["content"]
    assert (await sync_to_async(Rollout.objects.get)(pk=rollout.pk)).call_count == 6
    recorded = await sync_to_async(lambda: [e.payload for e in RunEvent.objects.filter(run=run, kind="call.recorded")])()
    assert sorted(c["seq"] for p in recorded for c in p["calls"]) == list(range(6))


async def test_one_rollouts_key_cannot_write_into_another(proxy, rollouts):
    _, [(first, first_secret), (second, _), _] = rollouts
    with pytest.raises(openai.AuthenticationError):
        await sdk(proxy, second.pk, first_secret).chat.completions.create(model="tiny", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        await sdk(proxy, 999999, first_secret).chat.completions.create(model="tiny", messages=MESSAGES)
    assert await sync_to_async(ModelCall.objects.count)() == 0


async def test_a_rollouts_key_opens_its_own_runs_proxy_only(alice, bob, make_run, rollouts):
    """Issue 26.1: a harness of one run (here another user's) calls the proxy of a run that is not its own with its
    own rollout id and key: the proxy does not know that rollout (404), nothing reaches that run's engine or its
    records; the same key on its own run's proxy works."""
    run, [(rollout, secret), *_] = rollouts
    other_run = await sync_to_async(make_run)(bob, name="bobs")
    others_proxy = run_proxy(other_run)
    try:
        with pytest.raises(openai.NotFoundError):
            await sdk(others_proxy, rollout.pk, secret).chat.completions.create(model="tiny", messages=MESSAGES)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=others_proxy), base_url="http://proxy") as http:
            reward = await http.post(f"/rollouts/{rollout.pk}/v1/reward", json={"reward": 1.0},
                                     headers={"Authorization": f"Bearer {secret}"})
        assert reward.status_code == 404
        assert await sync_to_async(ModelCall.objects.count)() == 0
        assert await DjangoDirectory(other_run.pk).get(str(rollout.pk)) is None
    finally:
        await others_proxy.aclose()
    own = run_proxy(run)
    try:
        answer = await sdk(own, rollout.pk, secret).chat.completions.create(model="tiny", messages=MESSAGES)
        assert answer.choices[0].message.content
        assert await sync_to_async(ModelCall.objects.filter(rollout=rollout).count)() == 1
    finally:
        await own.aclose()


async def test_a_finished_rollout_gets_409(proxy, rollouts):
    _, [(rollout, secret), *_] = rollouts
    await sync_to_async(Rollout.objects.filter(pk=rollout.pk).update)(status="succeeded")
    await asyncio.sleep(0.1)  # past the directory cache
    with pytest.raises(openai.ConflictError):
        await sdk(proxy, rollout.pk, secret).chat.completions.create(model="tiny", messages=MESSAGES)


async def test_a_cancelled_run_closes_its_rollouts(proxy, rollouts, alice):
    run, [(rollout, secret), *_] = rollouts
    await sync_to_async(services.cancel_run)(run, alice)
    info = await DjangoDirectory(run.pk).get(str(rollout.pk))
    assert info.finished is True


async def test_a_harness_reward_is_kept(proxy, rollouts):
    _, [(rollout, secret), *_] = rollouts
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy") as http:
        response = await http.post(f"/rollouts/{rollout.pk}/v1/reward", json={"reward": 0.75, "detail": {"tests": 3}},
                                   headers={"authorization": f"Bearer {secret}"})
    assert response.status_code == 200, response.text
    detail = (await sync_to_async(Rollout.objects.get)(pk=rollout.pk)).reward_detail
    assert detail == {"harness": {"reward": 0.75, "detail": {"tests": 3}}}


async def test_the_directory_reads_next_seq_after_a_restart(rollouts):
    run, [(rollout, _), *_] = rollouts
    await DjangoRecorder().record(_call(rollout.pk, 0))
    await DjangoRecorder().record(_call(rollout.pk, 1))
    info = await DjangoDirectory(run.pk).get(str(rollout.pk))
    assert info.next_seq == 2 and info.secret_hash == rollout.secret_hash and info.finished is False
    assert await DjangoDirectory(run.pk).get("not-a-number") is None


async def test_recording_is_idempotent_for_retries(rollouts):
    _, [(rollout, _), *_] = rollouts
    recorder = DjangoRecorder()
    await recorder.record(_call(rollout.pk, 0))
    await recorder.record(_call(rollout.pk, 0))
    assert await sync_to_async(ModelCall.objects.filter(rollout=rollout).count)() == 1


async def test_failed_calls_are_recorded_too(rollouts):
    _, [(rollout, _), *_] = rollouts
    await DjangoRecorder().record(_call(rollout.pk, 0, status=504, error="engine timed out"))
    call = await sync_to_async(ModelCall.objects.get)(rollout=rollout)
    assert call.status_code == 504 and call.error == "engine timed out" and call.response is None


async def test_nul_characters_are_stored_safely(rollouts):
    _, [(rollout, _), *_] = rollouts
    await DjangoRecorder().record(_call(rollout.pk, 0, text="bad\x00byte"))
    call = await sync_to_async(ModelCall.objects.get)(rollout=rollout)
    assert call.response["text"] in ("bad\x00byte", "bad\ufffdbyte")


async def test_a_failing_write_reaches_the_caller(rollouts, monkeypatch):
    _, [(rollout, _), *_] = rollouts

    def broken(calls):
        raise RuntimeError("database is down")

    monkeypatch.setattr(rollout_services, "record_calls", broken)
    with pytest.raises(RuntimeError, match="database is down"):
        await DjangoRecorder().record(_call(rollout.pk, 0))


async def test_a_restarted_proxy_resolves_previous_response_id_from_the_stored_calls(proxy, rollouts):
    run, [(rollout, secret), (other, other_secret), _] = rollouts
    first = await sdk(proxy, rollout.pk, secret).responses.create(model="m", input="hi", instructions="Be brief.")
    restarted = create_app(cached_directory(run.pk), DjangoRecorder(), UpstreamConfig(base_url="http://engine/v1",
                           served_model="tiny"), transport=httpx.ASGITransport(app=FakeVLLM()))
    second = await sdk(restarted, rollout.pk, secret).responses.create(model="m", input="more",
                                                                       previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError, match=first.id):
        await sdk(restarted, other.pk, other_secret).responses.create(model="m", input="x", previous_response_id=first.id)
    await restarted.aclose()

    assert second.previous_response_id == first.id
    calls = await sync_to_async(lambda: list(ModelCall.objects.filter(rollout=rollout).order_by("seq")))()
    assert [c.seq for c in calls] == [0, 1] and calls[1].request["previous_response_id"] == first.id
    assert calls[1].prompt_ids == render_chat([{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "Hello! You said: hi"},
                                               {"role": "user", "content": "more"}])
    assert await sync_to_async(ModelCall.objects.filter(rollout=other).count)() == 0


async def test_find_response_reads_only_the_rollouts_answered_responses_calls(rollouts):
    _, [(rollout, _), (other, _), _] = rollouts
    recorder = DjangoRecorder()
    answered = _call(rollout.pk, 0, api="responses", response={"id": "resp_a", "output": []})
    await recorder.record(answered)
    await recorder.record(_call(rollout.pk, 1, api="responses", status=499, error="client disconnected",
                                response={"id": "resp_b", "output": []}))
    await recorder.record(_call(rollout.pk, 2, api="chat", response={"id": "resp_c"}))

    assert await recorder.find_response(str(rollout.pk), "resp_a") == (answered.request, answered.response)
    assert await recorder.find_response(str(rollout.pk), "resp_b") is None  # the harness never had it
    assert await recorder.find_response(str(rollout.pk), "resp_c") is None  # not a Responses call
    assert await recorder.find_response(str(other.pk), "resp_a") is None
    assert await recorder.find_response("not-a-number", "resp_a") is None


async def test_each_choice_of_an_n_call_is_stored_as_a_call(rollouts):
    run, [(rollout, secret), *_] = rollouts
    app = create_app(cached_directory(run.pk), DjangoRecorder(), UpstreamConfig(base_url="http://engine/v1",
                     served_model="tiny"), transport=httpx.ASGITransport(app=NChoiceVLLM()))
    client = sdk(app, rollout.pk, secret)
    single = await client.chat.completions.create(model="tiny", messages=MESSAGES)
    double = await client.chat.completions.create(model="tiny", messages=MESSAGES, n=2)
    await app.aclose()

    assert single.choices[0].message.content == text(0)
    assert [c.message.content for c in double.choices] == [text(0), text(1)]
    calls = await sync_to_async(lambda: list(ModelCall.objects.filter(rollout=rollout).order_by("seq")))()
    assert [c.seq for c in calls] == [0, 1, 2] and all(c.status_code == 200 and c.error == "" for c in calls)
    assert calls[1].prompt_ids == calls[2].prompt_ids == render_chat(MESSAGES)
    assert [c.completion_ids for c in calls[1:]] == [encode(text(0)) + [IM_END], encode(text(1)) + [IM_END]]
    assert calls[2].logprobs == pytest.approx([logprob(1, i) for i in range(len(text(1)) + 1)])
    assert calls[1].request == calls[2].request and calls[1].request["n"] == 2
    assert [c.choice for c in calls] == [0, 0, 1]  # stored, so the trainer knows the siblings (issue 26.10)
    assert (await sync_to_async(Rollout.objects.get)(pk=rollout.pk)).call_count == 3
    from runs.harness_source import calls_of

    records, _ = await sync_to_async(calls_of)(rollout.pk)
    assert [(r.seq, r.choice) for r in records] == [(0, 0), (1, 0), (2, 1)]


def _call(rollout_id, seq, status=200, error=None, text="ok", api="chat", response=None):
    if response is None and not error:
        response = {"text": text}
    return RecordedCall(rollout_id=str(rollout_id), seq=seq, api=api, request={"messages": MESSAGES},
                        response=response, upstream_request={}, prompt_ids=[1, 2],
                        completion_ids=[3] if not error else [], logprobs=[-0.5] if not error else [],
                        finish_reason="stop" if not error else None, status_code=status, latency_ms=3.0,
                        policy_version=1, error=error, stream=False, started_at=0.0)


def test_a_batch_over_two_runs_writes_one_event_per_rollout_in_gapless_order(alice, make_run,
                                                                            django_assert_max_num_queries):
    """The recorder's batch: one UPDATE for all rollouts' call counts, one counter update and one insert of events
    per run, whatever the number of rollouts (the load run's batches held up to 64)."""
    runs = [make_run(alice, name=f"run{i}") for i in range(2)]
    made = {run.pk: [rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=a)[0]
                     for a in range(3)] for run in runs}
    first, second = runs
    services.emit_event(first.pk, "run.log", {"line": "before"})  # the counter does not start at 0
    before = {run.pk: RunEvent.objects.filter(run=run).count() for run in runs}
    a, b, c = made[first.pk]
    d, e, _ = made[second.pk]
    batch = [_call(a.pk, 0), _call(a.pk, 1), _call(b.pk, 0), _call(d.pk, 0), _call(c.pk, 2), _call(e.pk, 0),
             _call(e.pk, 1), _call(e.pk, 2)]
    with django_assert_max_num_queries(5 + 2 * 3):  # lookup, BEGIN, calls, counts, COMMIT; 3 for each run
        rollout_services.record_calls(batch)
    assert ModelCall.objects.count() == len(batch)
    counts = dict(Rollout.objects.filter(run__in=runs).values_list("pk", "call_count"))
    assert counts == {a.pk: 2, b.pk: 1, c.pk: 3, d.pk: 1, e.pk: 3, made[second.pk][2].pk: 0}
    for run in runs:
        rows = list(RunEvent.objects.filter(run=run).order_by("seq"))
        assert [r.seq for r in rows] == list(range(1, len(rows) + 1))
        run.refresh_from_db()
        assert run.event_seq == len(rows)
        recorded = [r.payload for r in rows[before[run.pk]:]]
        assert all(r.kind == "call.recorded" for r in rows[before[run.pk]:])
        expected = {first.pk: {a.pk: [0, 1], b.pk: [0], c.pk: [2]}, second.pk: {d.pk: [0], e.pk: [0, 1, 2]}}[run.pk]
        assert {p["rollout"]: [call["seq"] for call in p["calls"]] for p in recorded} == expected
        assert [p["rollout"] for p in recorded] == sorted(expected)
    # A retried batch stores nothing twice and never lowers a count.
    rollout_services.record_calls([_call(a.pk, 0)])
    assert ModelCall.objects.count() == len(batch)
    assert Rollout.objects.get(pk=a.pk).call_count == 2


async def test_a_constrained_call_is_stored_so_and_reaches_the_trainer_untrained(proxy, rollouts):
    """Issue 26.7 through the database: the call's constraint is stored and shown by the API, and the trainer's
    CallRecord (harness_source.calls_of) carries it, so its tokens join the sample as context only."""
    from runs.harness_source import calls_of
    from trainer.samples import build_samples

    _, [(rollout, secret), *_] = rollouts
    client = sdk(proxy, rollout.pk, secret)
    schema = {"name": "a", "schema": {"type": "object"}}
    await client.chat.completions.create(model="m", messages=MESSAGES,
                                         response_format={"type": "json_schema", "json_schema": schema})
    await asyncio.sleep(0.2)  # the recorder's batch
    row = await sync_to_async(ModelCall.objects.get)(rollout=rollout, seq=0)
    assert row.constraint == "response_format json_schema"
    calls, trouble = await sync_to_async(calls_of)(rollout.pk)
    assert trouble == "" and [c.constrained for c in calls] == [True]
    assert build_samples(calls).samples == ()  # its only call was forced: nothing to train
