"""A run's steps count the train calls its proxy refused at the weight-update gate (`rollout/gate_refusals`, issue
40.6): a 429 drops a rollout as an infrastructure failure, more often the longer its trajectory, so the count shows
what bias is left."""
import asyncio
from types import SimpleNamespace

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from proxy.app import create_app
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from runs import orchestrator, services
from runs.models import RunStatus
from trainer.scheduler import StepReport

pytestmark = pytest.mark.django_db(transaction=True)  # the run's writes go through runs.reconnect's thread


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def refuse(app, calls: int) -> None:
    """`calls` train calls arrive while a weight update holds the gate past its wait: each gets a 429."""
    await app.pause()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy/rollouts/r1/v1",
                                 headers={"authorization": "Bearer s1"}) as client:
        for _ in range(calls):
            assert (await client.post("/chat/completions", json=CHAT)).status_code == 429
    await app.resume()


def record_steps(run_id: int, generation: int, refusals_before_each: list[int]) -> None:
    """Record one empty step per entry through the run's RunPhases, the gate having refused that many calls before."""
    directory = InMemoryDirectory()
    directory.add("r1", "s1")
    app = create_app(directory, InMemoryRecorder(), UpstreamConfig(base_url="http://engine/v1"), pause_wait_s=0.01)
    ctx = SimpleNamespace(run_id=run_id, generation=generation, server=SimpleNamespace(app=app),
                          last_step=lambda: len(refusals_before_each))

    async def go():
        phases = orchestrator.RunPhases(ctx)
        for step, refused in enumerate(refusals_before_each, start=1):
            await refuse(app, refused)
            await phases.record(StepReport(step=step, policy_version=step, rollouts=(), samples=(), drift={},
                                           metrics={"reward/mean": 0.5}))
        await sync_to_async(lambda: connections.close_all())()

    asyncio.run(go())


def test_each_step_records_the_calls_refused_since_the_last_one(alice, make_run):
    run = make_run(alice)
    generation = services.claim_run(run.pk, "task")
    services.transition_run(run.pk, RunStatus.RUNNING)

    record_steps(run.pk, generation, [0, 3, 1])

    refusals = dict(run.metrics.filter(name="rollout/gate_refusals").values_list("step", "value"))
    assert refusals == {1: 0.0, 2: 3.0, 3: 1.0}
    run.refresh_from_db()
    assert run.step == 3
