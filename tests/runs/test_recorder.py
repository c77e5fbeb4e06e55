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
from tests.proxy.fake_upstream import IM_END, FakeVLLM, encode, render_chat

pytestmark = pytest.mark.django_db(transaction=True)
MESSAGES = [{"role": "user", "content": "what is 2+2?"}]


@pytest.fixture
def rollouts(alice, make_run):
    run = make_run(alice)
    return run, [rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=i)
                 for i in range(3)]


@pytest.fixture
async def proxy():
    fake = FakeVLLM()
    app = create_app(cached_directory(ttl_s=0.05), DjangoRecorder(), UpstreamConfig(base_url="http://engine/v1",
                     served_model="tiny"), policy_version=2, transport=httpx.ASGITransport(app=fake))
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


async def test_a_finished_rollout_gets_409(proxy, rollouts):
    _, [(rollout, secret), *_] = rollouts
    await sync_to_async(Rollout.objects.filter(pk=rollout.pk).update)(status="succeeded")
    await asyncio.sleep(0.1)  # past the directory cache
    with pytest.raises(openai.ConflictError):
        await sdk(proxy, rollout.pk, secret).chat.completions.create(model="tiny", messages=MESSAGES)


async def test_a_cancelled_run_closes_its_rollouts(proxy, rollouts, alice):
    run, [(rollout, secret), *_] = rollouts
    await sync_to_async(services.cancel_run)(run, alice)
    info = await DjangoDirectory().get(str(rollout.pk))
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
    _, [(rollout, _), *_] = rollouts
    await DjangoRecorder().record(_call(rollout.pk, 0))
    await DjangoRecorder().record(_call(rollout.pk, 1))
    info = await DjangoDirectory().get(str(rollout.pk))
    assert info.next_seq == 2 and info.secret_hash == rollout.secret_hash and info.finished is False
    assert await DjangoDirectory().get("not-a-number") is None


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


def _call(rollout_id, seq, status=200, error=None, text="ok"):
    return RecordedCall(rollout_id=str(rollout_id), seq=seq, api="chat", request={"messages": MESSAGES},
                        response=None if error else {"text": text}, upstream_request={}, prompt_ids=[1, 2],
                        completion_ids=[3] if not error else [], logprobs=[-0.5] if not error else [],
                        finish_reason="stop" if not error else None, status_code=status, latency_ms=3.0,
                        policy_version=1, error=error, stream=False, started_at=0.0)
