"""The sweep: runs whose worker stopped beating are cancelled, re-queued from their checkpoint, or failed."""
import json
import logging
from datetime import timedelta

import pytest
from django.db.models import Q
from django.utils import timezone

from common import errors as common_errors
from runs import durability, services
from runs.models import ModelCall, Rollout, Run
from runs.tasks import sweep_lost_runs

pytestmark = pytest.mark.django_db


def held_run(make_run, owner, status="running", checkpoint="", silent_s=0.0, starts=1, name="run"):
    """A run claimed by worker generation `starts`, last heard of `silent_s` seconds ago."""
    run = make_run(owner, name=name)
    services.claim_run(run.pk, "task")
    if status in ("running", "cancelling"):
        services.transition_run(run.pk, "running")
    if status == "cancelling":
        services.transition_run(run.pk, "cancelling")
    Run.objects.filter(pk=run.pk).update(worker_starts=starts, checkpoint_path=checkpoint,
                                         heartbeat_at=timezone.now() - timedelta(seconds=silent_s))
    return Run.objects.get(pk=run.pk)


def rollout(run, status, step=0, group=0, calls=0):
    row = Rollout.objects.create(run=run, split="train", step=step, group=group, status=status)
    for seq in range(calls):
        ModelCall.objects.create(rollout=row, seq=seq, api="chat", request={}, status_code=200)
    return row


@pytest.mark.parametrize("status, has_checkpoint, starts, expected", [
    ("cancelling", True, 1, "cancelled"),
    ("cancelling", False, 9, "cancelled"),
    ("running", True, 1, "queued"),
    ("starting", True, 4, "queued"),
    ("running", True, 5, "failed"),  # the fifth worker lost it too: LIGHTNING_RUN_MAX_WORKER_STARTS=5
    ("running", False, 1, "failed"),
    ("starting", False, 1, "failed"),
])
def test_it_judges_each_kind_of_lost_run(status, has_checkpoint, starts, expected):
    verdict = durability.judge(status, has_checkpoint, starts, 75.4, max_starts=5)
    assert verdict.status == expected
    if expected == "failed":
        assert verdict.error.startswith("worker lost: no heartbeat for 75 s")
    if expected == "queued":
        assert verdict.error == ""


def test_a_run_that_beats_is_left_alone(alice, make_run):
    run = held_run(make_run, alice, silent_s=59)
    assert durability.sweep_lost_runs() == {}
    assert Run.objects.get(pk=run.pk).status == "running"


def test_a_lost_run_with_a_checkpoint_goes_back_to_the_queue_and_its_unfinished_rollouts_are_lost(
        alice, make_run, django_capture_on_commit_callbacks, test_redis):
    run = held_run(make_run, alice, checkpoint="/data/runs/run-1/checkpoints/step-000002", silent_s=61)
    running = rollout(run, "running", step=2, calls=2)
    done = rollout(run, "succeeded", step=1)
    with django_capture_on_commit_callbacks(execute=True):
        assert durability.sweep_lost_runs() == {run.pk: "queued"}
    run.refresh_from_db()
    assert run.status == "queued" and run.error == "" and run.finished_at is None and run.worker_starts == 1
    assert run.celery_task_id and test_redis.llen("runs") == 1  # enqueued again for the next worker
    running.refresh_from_db()
    assert running.status == "lost" and running.finished_at is not None
    assert running.error.startswith("lost with its worker")
    assert ModelCall.objects.filter(rollout=running).count() == 2  # the calls are kept
    assert Rollout.objects.get(pk=done.pk).status == "succeeded"
    assert list(run.events.filter(kind="run.status").values_list("payload__status", flat=True)) == [
        "queued", "starting", "running", "queued"]


def test_a_lost_run_without_a_checkpoint_fails_with_worker_lost(alice, make_run):
    run = held_run(make_run, alice, status="starting", silent_s=90)
    pending = rollout(run, "pending")
    assert durability.sweep_lost_runs() == {run.pk: "failed"}
    run.refresh_from_db()
    assert run.status == "failed" and run.finished_at is not None
    assert run.error == "worker lost: no heartbeat for 90 s; it had no checkpoint to resume from"
    assert Rollout.objects.get(pk=pending.pk).status == "lost"


def test_a_lost_cancelling_run_becomes_cancelled(alice, make_run):
    run = held_run(make_run, alice, status="cancelling", checkpoint="/x/step-000001", silent_s=61)
    assert durability.sweep_lost_runs() == {run.pk: "cancelled"}
    run.refresh_from_db()
    assert run.status == "cancelled"
    assert run.error == "cancelled by its owner; worker lost: no heartbeat for 61 s before it stopped"


def test_a_run_that_keeps_losing_its_worker_fails(alice, make_run, settings):
    settings.LIGHTNING_RUN_MAX_WORKER_STARTS = 3
    run = held_run(make_run, alice, checkpoint="/x/step-000001", silent_s=61, starts=3)
    assert durability.sweep_lost_runs() == {run.pk: "failed"}
    assert Run.objects.get(pk=run.pk).error == (
        "worker lost: no heartbeat for 61 s, after 3 worker starts (LIGHTNING_RUN_MAX_WORKER_STARTS=3); "
        "fix the cause (out of memory?) and resume it by hand")


def test_the_limit_is_a_setting(alice, make_run, settings):
    settings.LIGHTNING_RUN_LOST_AFTER_S = 120
    run = held_run(make_run, alice, silent_s=90)
    assert durability.sweep_lost_runs() == {}
    assert durability.sweep_lost_runs(now=timezone.now() + timedelta(seconds=31)) == {run.pk: "failed"}


def test_queued_and_finished_runs_are_never_swept(alice, make_run):
    queued = make_run(alice, name="q")
    done = held_run(make_run, alice, silent_s=1000)
    services.transition_run(done.pk, "succeeded")
    Run.objects.filter(pk=queued.pk).update(updated_at=timezone.now() - timedelta(days=1))
    assert durability.sweep_lost_runs() == {}


def test_a_run_claimed_before_heartbeats_existed_is_judged_by_its_last_update(alice, make_run):
    run = held_run(make_run, alice)
    Run.objects.filter(pk=run.pk).update(heartbeat_at=None, updated_at=timezone.now() - timedelta(seconds=300))
    assert durability.sweep_lost_runs() == {run.pk: "failed"}


def test_a_worker_that_beats_after_the_sweep_looked_keeps_its_run(alice, make_run):
    run = held_run(make_run, alice, silent_s=61)
    seen = Q(heartbeat_at__lt=timezone.now() - timedelta(seconds=60), worker_starts=1, status="running")
    assert services.beat_run(run.pk, 1) is True  # the beat lands between the sweep's query and its update
    with pytest.raises(common_errors.InvalidTransition, match="changed meanwhile"):
        services.reclaim_lost_run(run.pk, "failed", error="worker lost", still_lost=seen)
    assert Run.objects.get(pk=run.pk).status == "running"


def test_the_celery_task_sweeps(alice, make_run):
    run = held_run(make_run, alice, silent_s=61)
    assert sweep_lost_runs.apply().get() == {str(run.pk): "failed"}


def test_a_sweep_with_nothing_to_do_logs_nothing(alice, make_run, caplog):
    """Beat runs the sweep every LIGHTNING_SWEEP_EVERY_S: finding nothing, it must not reach `./lw up`'s console."""
    held_run(make_run, alice, silent_s=5, name="beating")
    make_run(alice, name="queued")  # fresh: its queue message may still be on its way
    done = held_run(make_run, alice, silent_s=1000, name="done")
    services.transition_run(done.pk, "succeeded")
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    assert sweep_lost_runs() == {}
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO] == []


def test_a_sweep_that_reclaims_a_run_says_so_at_warning(alice, make_run, caplog):
    run = held_run(make_run, alice, status="starting", silent_s=90)
    caplog.clear()
    caplog.set_level(logging.INFO)
    assert sweep_lost_runs() == {str(run.pk): "failed"}
    said = [r.getMessage() for r in caplog.records if r.name == "runs.durability" and r.levelno == logging.WARNING]
    assert len(said) == 1 and said[0].startswith(f"run {run.pk} (starting, worker start 1): no heartbeat for ")
    assert said[0].endswith("; now failed")


# ---------------------------------------------------------------- runs whose queue message never left


@pytest.fixture
def broker_down(monkeypatch):
    """Celery's broker is a port nobody listens on (as when Redis is down) until the test calls the returned `up`."""
    from common.procs import free_port
    from lightning_web.celery import app as celery_app

    def use(url):  # new connection pools for the URL (the test's own are put back afterwards)
        monkeypatch.setattr(celery_app.conf, "broker_url", url)
        monkeypatch.setattr(celery_app, "_pool", None)
        monkeypatch.setattr(celery_app.amqp, "_producer_pool", None)

    real = celery_app.conf.broker_url
    use(f"redis://127.0.0.1:{free_port()}/0")
    yield lambda: use(real)


def test_a_run_created_while_the_broker_is_down_is_created_and_queued_by_the_sweep_once_it_is_back(
        test_redis, alice, alice_api, make_harness, make_dataset, make_reward, broker_down,
        django_capture_on_commit_callbacks):
    body = {"name": "unsent", "model": "tiny", "harness": make_harness(alice).pk,
            "dataset": make_dataset(alice).pk, "reward_script": make_reward(alice).pk}
    with django_capture_on_commit_callbacks(execute=True):
        created = alice_api.post("/api/v1/runs/", body, format="json")
    assert created.status_code == 201, created.content
    run = Run.objects.get(pk=created.json()["id"])
    assert (run.status, run.celery_task_id) == ("queued", "")
    logged = [e.payload["line"] for e in run.events.filter(kind="run.log")]
    assert len(logged) == 1 and logged[0].startswith("could not reach the run queue (OperationalError")

    # A fresh one is left alone (its message may be on its way); the broker still down sends nothing.
    assert durability.requeue_unsent() == []
    later = timezone.now() + timedelta(seconds=durability.UNSENT_AFTER_S + 1)
    assert durability.requeue_unsent(now=later) == []
    assert Run.objects.get(pk=run.pk).celery_task_id == ""

    broker_down()  # Redis is back: the beat's next sweep hands the run over
    Run.objects.filter(pk=run.pk).update(updated_at=timezone.now() - timedelta(seconds=durability.UNSENT_AFTER_S + 1))
    assert sweep_lost_runs.apply().get() == {str(run.pk): "queued (handed to the queue again)"}
    run.refresh_from_db()
    assert run.status == "queued" and run.celery_task_id
    queued = [json.loads(m) for m in test_redis.lrange("runs", 0, -1)]
    assert [m["headers"]["id"] for m in queued] == [run.celery_task_id]
    assert [m["headers"]["argsrepr"] for m in queued] == [f"[{run.pk}]"]
    # Sent once: the next sweep has nothing to do.
    assert durability.requeue_unsent(now=later) == []
