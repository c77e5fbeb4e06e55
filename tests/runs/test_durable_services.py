"""Durable-run services: the new transitions, resume and continue, the generation guard, rewinding to a checkpoint."""
import json

import pytest

from common import errors as common_errors
from health.models import RunAlarm
from runs import durability, services
from runs.models import Metric, ModelCall, Rollout, Run, Sample

pytestmark = pytest.mark.django_db


def finished_run(make_run, owner, status, checkpoint="/data/runs/run-1/checkpoints/step-000002", name="run"):
    run = make_run(owner, name=name, config={"steps": 2})
    services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    services.transition_run(run.pk, "cancelling" if status == "cancelled" else status, error="boom")
    if status == "cancelled":
        services.transition_run(run.pk, "cancelled")
    Run.objects.filter(pk=run.pk).update(checkpoint_path=checkpoint, step=2)
    return Run.objects.get(pk=run.pk)


@pytest.mark.parametrize("path", [
    ["starting", "queued"],  # the sweep re-queues a run lost while starting (a resume whose engine start died)
    ["starting", "running", "queued"],  # ... or while running
    ["starting", "running", "succeeded", "queued"],  # continue
    ["starting", "running", "failed", "queued"],  # resume
    ["starting", "running", "cancelling", "cancelled", "queued"],  # resume
    ["failed", "queued"],
])
def test_the_table_allows_going_back_to_the_queue(alice, make_run, path):
    run = make_run(alice)
    for status in path:
        run = services.transition_run(run.pk, status)
    assert run.status == "queued"


@pytest.mark.parametrize("path", [[], ["starting", "running", "cancelling"]])
def test_the_table_refuses_queued_from_queued_and_from_cancelling(alice, make_run, path):
    run = make_run(alice)
    for status in path:
        services.transition_run(run.pk, status)
    with pytest.raises(common_errors.InvalidTransition, match="cannot go from"):
        services.transition_run(run.pk, "queued")


def test_a_resumed_run_keeps_its_first_start(alice, make_run):
    run = finished_run(make_run, alice, "failed")
    first = run.started_at
    services.resume_run(run, alice)
    services.claim_run(run.pk, "again")
    assert services.transition_run(run.pk, "running").started_at == first


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_resume_puts_a_failed_or_cancelled_run_back_in_the_queue(alice, make_run, status,
                                                                 django_capture_on_commit_callbacks, test_redis):
    run = finished_run(make_run, alice, status)
    with django_capture_on_commit_callbacks(execute=True):
        run = services.resume_run(run, alice)
    assert run.status == "queued" and run.error == "" and run.finished_at is None and run.config["steps"] == 2
    run.refresh_from_db()
    assert run.celery_task_id and test_redis.llen("runs") == 1  # the message id of the new enqueue
    assert run.events.filter(kind="run.log").last().payload == {
        "line": "resumed by its owner from checkpoint step-000002"}


def test_resume_refuses_a_run_without_a_checkpoint(alice, make_run):
    run = finished_run(make_run, alice, "failed", checkpoint="")
    with pytest.raises(common_errors.InvalidTransition, match="has no checkpoint to go on from .*clone it"):
        services.resume_run(run, alice)
    assert Run.objects.get(pk=run.pk).status == "failed"


@pytest.mark.parametrize("status, message", [
    ("succeeded", "is succeeded; only failed or cancelled runs can be resumed; continue it for more steps instead"),
    ("running", "is running; only failed or cancelled runs can be resumed$"),
])
def test_resume_refuses_other_states(alice, make_run, status, message):
    run = make_run(alice)
    services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    if status == "succeeded":
        services.transition_run(run.pk, "succeeded", checkpoint_path="/x/step-000001")
    with pytest.raises(common_errors.InvalidTransition, match=message):
        services.resume_run(Run.objects.get(pk=run.pk), alice)
    assert Run.objects.get(pk=run.pk).status == status


def test_continue_adds_steps_to_a_succeeded_run(alice, make_run, django_capture_on_commit_callbacks, test_redis):
    run = finished_run(make_run, alice, "succeeded")
    with django_capture_on_commit_callbacks(execute=True):
        run = services.continue_run(run, alice, 3)
    assert run.status == "queued" and run.config["steps"] == 5 and test_redis.llen("runs") == 1
    assert run.events.filter(kind="run.log").last().payload == {"line": "continued by its owner to 5 steps"}


def test_continue_refuses_a_failed_run_and_points_to_resume(alice, make_run):
    run = finished_run(make_run, alice, "failed")
    with pytest.raises(common_errors.InvalidTransition, match="only succeeded runs can be continued; resume it instead"):
        services.continue_run(run, alice, 3)
    assert Run.objects.get(pk=run.pk).config["steps"] == 2


def test_only_the_owner_or_staff_may_resume(alice, bob, staff, make_run):
    run = finished_run(make_run, alice, "failed")
    with pytest.raises(common_errors.NotOwned):
        services.resume_run(run, bob)
    assert services.resume_run(run, staff).status == "queued"


def test_a_worker_generation_that_lost_the_run_can_no_longer_write_it(alice, make_run):
    run = make_run(alice)
    assert services.claim_run(run.pk, "first") == 1
    Run.objects.filter(pk=run.pk).update(worker_starts=2)  # another worker took it up meanwhile
    assert services.beat_run(run.pk, 1) is False and services.beat_run(run.pk, 2) is True
    assert services.record_checkpoint(run.pk, 1, "/x/step-000001", 1) is False
    with pytest.raises(common_errors.InvalidTransition, match="changed meanwhile"):
        services.fail_run(run.pk, "crash", generation=1)
    run.refresh_from_db()
    assert run.status == "starting" and run.checkpoint_path == ""
    assert services.record_checkpoint(run.pk, 2, "/x/step-000001", 1) is True
    assert Run.objects.get(pk=run.pk).checkpoint_path == "/x/step-000001"


def test_a_finished_run_stops_the_heartbeat(alice, make_run):
    run = make_run(alice)
    generation = services.claim_run(run.pk, "first")
    services.fail_run(run.pk, "crash", generation=generation)
    assert services.beat_run(run.pk, generation) is False


# ---------------------------------------------------------------- rewinding to a checkpoint


def checkpoint(folder, step, counters):
    path = folder / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    if counters is not None:
        (path / "scheduler_state.json").write_text(json.dumps(counters))
    return path


def train_rollout(run, group, step, status="succeeded", samples=1):
    """A rollout of `group` launched at version `step`; trained by step `step` + 1 when it has samples."""
    trained = step + 1 if samples else None
    rollout = Rollout.objects.create(run=run, split="train", group=group, step=step, status=status,
                                     batch_step=trained, trained_step=trained)
    ModelCall.objects.create(rollout=rollout, seq=0, api="chat", request={}, status_code=200)
    for index in range(samples):
        Sample.objects.create(rollout=rollout, index=index, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0, -1])
    return rollout


def test_prepare_resume_rewinds_to_the_checkpoint(alice, make_run, tmp_path):
    """Async run, 1 group a step: groups 0-2 trained at steps 1-3 except group 3, in flight at checkpoint 2, which
    steps 3 trained with group 4; group 5 was running when the worker died. Eval at steps 0 and 3."""
    run = make_run(alice, config={"steps": 5, "mode": "async", "tasks_per_step": 1})
    services.claim_run(run.pk, "task")
    folder = tmp_path / "checkpoints"
    kept_checkpoint = checkpoint(folder, 2, {"next_group_id": 4, "untrained_groups": [2]})
    checkpoint(folder, 1, {"next_group_id": 3, "untrained_groups": [0]})
    checkpoint(folder, 3, {"next_group_id": 5, "untrained_groups": []})  # saved, never recorded: abandoned
    (folder / "step-000004.partial").mkdir()
    trained = [train_rollout(run, 0, 0), train_rollout(run, 1, 0), train_rollout(run, 3, 1),
               train_rollout(run, 3, 1, status="failed")]
    lost = [train_rollout(run, 2, 0), train_rollout(run, 4, 2), train_rollout(run, 5, 3, status="running", samples=0)]
    cancelled = train_rollout(run, 6, 3, status="cancelled", samples=0)
    val_kept = Rollout.objects.create(run=run, split="val", step=0, status="succeeded")
    val_lost = Rollout.objects.create(run=run, split="val", step=3, status="succeeded")
    for step in range(4):
        services.record_metrics(run.pk, step, {"reward/mean": 0.5} if step else {"eval/pass@1": 0.1})
    services.record_metrics(run.pk, 3, {"eval/pass@1": 0.2})
    for step in (2, 3):  # health alarms: the redone step 3 raises its own again
        RunAlarm.objects.create(run=run, step=step, kind="no_signal", message="flat")
    Run.objects.filter(pk=run.pk).update(step=3, policy_version=3, checkpoint_path=str(kept_checkpoint))

    point = durability.prepare_resume(Run.objects.get(pk=run.pk), kept_checkpoint, 2)

    assert (point.step, point.next_group_id, point.lost_rollouts, point.dropped_steps) == (2, 4, 4, (3,))
    for row in lost + [val_lost]:
        row.refresh_from_db()
        assert row.status == "lost" and not row.samples.exists() and row.calls.count() == (row.split == "train")
    assert lost[0].error.startswith("lost: the run resumed from the checkpoint of step 2")
    # group 4, trained by the abandoned step 3: that training is undone, the redone step 3 samples anew
    assert [(r.batch_step, r.trained_step) for r in lost] == [(None, None)] * 3
    for row in trained + [val_kept]:
        assert Rollout.objects.get(pk=row.pk).status == row.status and row.samples.count() == (row.split == "train")
        assert Rollout.objects.get(pk=row.pk).trained_step == (row.step + 1 if row.split == "train" else None)
    assert Rollout.objects.get(pk=cancelled.pk).status == "cancelled"
    assert sorted(Metric.objects.filter(run=run).values_list("step", "name")) == [
        (0, "eval/pass@1"), (1, "reward/mean"), (2, "reward/mean")]
    assert list(RunAlarm.objects.filter(run=run).values_list("step", flat=True)) == [2]
    run.refresh_from_db()
    assert (run.step, run.policy_version) == (2, 2)
    assert run.events.filter(kind="run.resumed").get().payload == {"step": 2, "lost_rollouts": 4, "dropped_steps": [3]}
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001", "step-000002"]


def test_a_checkpoint_from_before_counters_counts_every_finished_group_as_trained(alice, make_run, tmp_path):
    run = make_run(alice)
    services.claim_run(run.pk, "task")
    done = [train_rollout(run, 0, 0), train_rollout(run, 1, 0)]
    unfinished = train_rollout(run, 2, 1, status="running", samples=0)
    point = durability.prepare_resume(run, checkpoint(tmp_path, 1, None), 1)
    assert (point.next_group_id, point.lost_rollouts) == (3, 1)
    assert [Rollout.objects.get(pk=r.pk).status for r in done + [unfinished]] == ["succeeded", "succeeded", "lost"]


@pytest.mark.parametrize("counters, first", [
    ({"next_group_id": 4, "untrained_groups": []}, 4),
    ({"next_group_id": 4, "untrained_groups": [2, 3]}, 2),  # sync: the next step's groups, admitted before the save
    ({"next_group_id": 4, "untrained_groups": [3]}, 3),
    ({"next_group_id": 4, "untrained_groups": [2]}, 4),  # async: a straggler among trained groups is skipped
    ({"next_group_id": 5, "untrained_groups": [1, 3, 4]}, 5),
])
def test_a_resume_launches_the_tail_of_untrained_groups_again_under_their_ids(counters, first):
    assert durability.first_group_id(counters) == first


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path, settings):
    settings.LIGHTNING_CHECKPOINTS_KEPT = 2
    for step in (5, 10, 15):
        checkpoint(tmp_path, step, {})
    (tmp_path / "step-000020.partial").mkdir()
    deleted = durability.prune_checkpoints(tmp_path)
    assert [p.name for p in deleted] == ["step-000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010", "step-000015", "step-000020.partial"]


def test_checkpoint_step_reads_the_folder_name():
    assert durability.checkpoint_step("/a/b/step-000012") == 12
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        durability.checkpoint_step("/a/b/final")



@pytest.mark.parametrize("steps", [0, -3])
def test_continue_refuses_fewer_than_one_more_step(alice, make_run, steps, test_redis):
    run = finished_run(make_run, alice, "succeeded")
    with pytest.raises(common_errors.ServiceError, match=f"steps must be at least 1, got {steps}"):
        services.continue_run(run, alice, steps)
    run.refresh_from_db()
    assert (run.status, run.config["steps"]) == ("succeeded", 2) and test_redis.llen("runs") == 0
    assert not run.events.filter(kind="run.log", payload__line__startswith="continued").exists()
