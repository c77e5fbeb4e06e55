"""The heartbeat thread and the run's watcher (runs.watch): a worker beats while it holds a run and lets go once not."""
import asyncio
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from runs import durability, services
from runs import watch as run_watch
from runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)  # the heartbeat writes from a thread of its own


def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition never held")
        time.sleep(0.02)


def test_it_beats_while_the_run_is_held_and_stops_once_it_is_not(alice, make_run):
    run = make_run(alice)
    generation = services.claim_run(run.pk, "task")
    claimed_at = Run.objects.get(pk=run.pk).heartbeat_at
    with durability.Heartbeat(run.pk, generation, every_s=0.02) as heartbeat:
        wait_until(lambda: Run.objects.get(pk=run.pk).heartbeat_at > claimed_at)
        first = Run.objects.get(pk=run.pk).heartbeat_at
        wait_until(lambda: Run.objects.get(pk=run.pk).heartbeat_at > first)  # and again
        Run.objects.filter(pk=run.pk).update(worker_starts=generation + 1)  # the sweep and another worker took it
        wait_until(lambda: not heartbeat._thread.is_alive())
        last = Run.objects.get(pk=run.pk).heartbeat_at
    assert Run.objects.get(pk=run.pk).heartbeat_at == last  # nothing written once let go


def watch(run_id, generation):
    async def go():
        work = asyncio.create_task(asyncio.sleep(3600))
        reason = await run_watch.watch(run_id, generation, work)
        await asyncio.sleep(0)
        await sync_to_async(lambda: connections.close_all())()  # the watcher's database thread lets go of it
        return reason, work.cancelled()

    return asyncio.run(go())


def test_the_watcher_stops_the_work_of_a_worker_that_no_longer_holds_its_run(alice, make_run):
    run = make_run(alice)
    generation = services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    Run.objects.filter(pk=run.pk).update(status="queued")  # re-queued by the sweep while this worker was silent
    assert watch(run.pk, generation) == (run_watch.LOST, True)


def test_the_watcher_stops_the_work_of_a_run_resumed_by_another_worker(alice, make_run):
    run = make_run(alice)
    generation = services.claim_run(run.pk, "task")
    Run.objects.filter(pk=run.pk).update(worker_starts=generation + 1)
    assert watch(run.pk, generation) == (run_watch.LOST, True)


def test_the_watcher_stops_the_work_of_a_cancelled_run(alice, make_run):
    run = make_run(alice)
    generation = services.claim_run(run.pk, "task")
    services.cancel_run(Run.objects.get(pk=run.pk), alice)
    assert watch(run.pk, generation) == (run_watch.CANCEL, True)
