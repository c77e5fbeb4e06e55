"""Run state machine, ownership and events, through runs.services."""
import pytest

from catalog import services as catalog_services
from common import errors as common_errors
from proxy.auth import key_matches
from runs import rollout_services, services
from runs.models import Rollout, Run, RunEvent, RunStatus

pytestmark = pytest.mark.django_db


def test_it_creates_a_queued_run_with_snapshots_and_a_first_event(alice, make_run):
    run = make_run(alice, config={"steps": 3})
    run.refresh_from_db()
    assert run.status == RunStatus.QUEUED
    assert run.config["steps"] == 3 and run.config["group_size"] == 4  # defaults filled in
    assert run.harness_snapshot["name"] == "run-h" and run.harness_snapshot["version"] == 1
    assert run.dataset_snapshot["train_count"] == 4 and run.dataset_snapshot["val_count"] == 1
    assert "def reward" in run.reward_snapshot["source"]
    assert list(RunEvent.objects.filter(run=run).values_list("seq", "kind", "payload")) == [
        (1, "run.status", {"status": "queued", "error": ""})]
    assert run.event_seq == 1


@pytest.mark.parametrize("path", [
    ["starting", "running", "succeeded"],
    ["starting", "running", "failed"],
    ["starting", "running", "cancelling", "cancelled"],
    ["starting", "cancelling", "cancelled"],
    ["starting", "failed"],
    ["cancelled"],
    ["failed"],
])
def test_it_allows_the_transitions_of_the_table(alice, make_run, path):
    run = make_run(alice)
    for status in path:
        run = services.transition_run(run.pk, status)
        assert run.status == status
    assert list(run.events.values_list("payload__status", flat=True)) == ["queued", *path]
    assert run.is_finished == (path[-1] in ("succeeded", "failed", "cancelled"))


@pytest.mark.parametrize("path, bad", [
    ([], "running"), ([], "succeeded"), ([], "cancelling"), (["starting"], "succeeded"),
    (["starting", "running"], "starting"), (["starting", "running", "succeeded"], "failed"),
    (["cancelled"], "starting"), (["starting", "running", "cancelling"], "succeeded"),
])
def test_it_refuses_transitions_outside_the_table(alice, make_run, path, bad):
    run = make_run(alice)
    for status in path:
        services.transition_run(run.pk, status)
    before = Run.objects.get(pk=run.pk)
    with pytest.raises(common_errors.InvalidTransition, match=f"cannot go from {before.status} to {bad}"):
        services.transition_run(run.pk, bad)
    after = Run.objects.get(pk=run.pk)
    assert after.status == before.status and after.event_seq == before.event_seq


def test_it_sets_timestamps_and_error_on_finish(alice, make_run):
    run = make_run(alice)
    services.transition_run(run.pk, "starting")
    run = services.transition_run(run.pk, "running")
    assert run.started_at is not None and run.finished_at is None
    run = services.fail_run(run.pk, "engine died: exit 137")
    assert run.status == "failed" and run.error == "engine died: exit 137" and run.finished_at >= run.started_at
    assert run.events.last().payload == {"status": "failed", "error": "engine died: exit 137"}


def test_it_lets_exactly_one_worker_claim_a_run(alice, make_run):
    run = make_run(alice)
    assert services.claim_run(run.pk, "task-1") == 1  # the worker generation
    assert services.claim_run(run.pk, "task-2") is None
    run.refresh_from_db()
    assert run.status == "starting" and run.celery_task_id == "task-1"
    assert run.worker_starts == 1 and run.heartbeat_at is not None


def test_cancel_of_a_queued_run_ends_it_at_once(alice, make_run):
    run = services.cancel_run(make_run(alice), alice)
    assert run.status == "cancelled" and run.error == "cancelled before it started" and run.finished_at
    assert services.claim_run(run.pk, "late-worker") is None


def test_cancel_of_a_running_run_asks_the_worker(alice, make_run):
    run = make_run(alice)
    services.transition_run(run.pk, "starting")
    services.transition_run(run.pk, "running")
    run = services.cancel_run(run, alice)
    assert run.status == "cancelling"
    with pytest.raises(common_errors.InvalidTransition, match="only queued, starting or running"):
        services.cancel_run(run, alice)


def test_cancel_of_a_finished_run_is_refused(alice, make_run):
    run = make_run(alice)
    services.transition_run(run.pk, "failed")
    with pytest.raises(common_errors.InvalidTransition):
        services.cancel_run(run, alice)
    assert Run.objects.get(pk=run.pk).status == "failed"


def test_only_the_owner_or_staff_may_cancel(alice, bob, staff, make_run):
    run = make_run(alice)
    with pytest.raises(common_errors.NotOwned):
        services.cancel_run(run, bob)
    assert Run.objects.get(pk=run.pk).status == "queued"
    assert services.cancel_run(run, staff).status == "cancelled"


def test_a_run_cannot_use_another_users_objects(alice, bob, make_harness, make_dataset, make_reward):
    harness = make_harness(bob)
    with pytest.raises(common_errors.NotOwned, match="does not belong to you"):
        services.create_run(alice, name="x", model="tiny", config={}, harness=harness,
                            dataset=make_dataset(alice), reward_script=make_reward(alice))
    assert Run.objects.count() == 0


def test_a_bad_config_is_refused_with_the_field_named(alice, make_harness, make_dataset, make_reward):
    with pytest.raises(common_errors.ServiceError, match="config: .*stepz"):
        services.create_run(alice, name="x", model="tiny", config={"stepz": 3}, harness=make_harness(alice),
                            dataset=make_dataset(alice), reward_script=make_reward(alice))
    assert Run.objects.count() == 0


def test_a_dataset_without_train_tasks_cannot_run(alice, make_harness, make_dataset, make_reward):
    dataset = make_dataset(alice, tasks=[{"q": 1, "split": "val"}])
    with pytest.raises(common_errors.ServiceError, match="no train tasks"):
        services.create_run(alice, name="x", model="tiny", config={}, harness=make_harness(alice), dataset=dataset,
                            reward_script=make_reward(alice))


def test_clone_copies_settings_and_takes_current_versions(alice, make_run):
    run = make_run(alice, config={"steps": 7})
    catalog_services.update_harness(run.harness, command=["python", "agent2.py"])
    clone = services.clone_run(run, alice)
    assert clone.pk != run.pk and clone.status == "queued" and clone.cloned_from_id == run.pk
    assert clone.name == "run (clone)" and clone.config == run.config
    assert clone.harness_snapshot["version"] == 2 and clone.harness_snapshot["command"] == ["python", "agent2.py"]
    assert run.harness_snapshot["version"] == 1


def test_versions_go_up_only_when_snapshotted_fields_change(alice, make_harness):
    harness = make_harness(alice)
    assert catalog_services.update_harness(harness, description="renamed docs").version == 1
    assert catalog_services.update_harness(harness, timeout_s=5).version == 2
    assert catalog_services.update_harness(harness, timeout_s=5).version == 2


def test_event_seqs_are_gapless_per_run(alice, make_run):
    one, two = make_run(alice, name="one"), make_run(alice, name="two")
    for i in range(3):
        services.emit_event(one.pk, "run.log", {"line": i})
    services.emit_event(two.pk, "run.log", {"line": "x"})
    assert list(one.events.values_list("seq", flat=True)) == [1, 2, 3, 4]
    assert list(two.events.values_list("seq", flat=True)) == [1, 2]
    assert Run.objects.get(pk=one.pk).event_seq == 4


def test_rollout_secrets_are_stored_hashed(alice, make_run):
    run = make_run(alice)
    rollout, secret = rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=0)
    assert len(secret) >= 40 and secret not in rollout.secret_hash and len(rollout.secret_hash) == 64
    # The proxy checks a presented key against the stored hash (runs.recorder hands it the hash).
    assert key_matches(secret, rollout.secret_hash) is True
    assert key_matches(secret + "x", rollout.secret_hash) is False
    assert key_matches("", rollout.secret_hash) is False


def test_metrics_are_stored_and_announced(alice, make_run):
    run = make_run(alice)
    services.record_metrics(run.pk, 2, {"reward/mean": 0.5, "loss/policy": -0.1})
    assert sorted(run.metrics.values_list("step", "name", "value")) == [(2, "loss/policy", -0.1), (2, "reward/mean", 0.5)]
    assert run.events.last().kind == "run.metrics"
    assert run.events.last().payload == {"step": 2, "values": {"reward/mean": 0.5, "loss/policy": -0.1}}


def test_a_non_finite_metric_is_left_out_and_named_not_a_crash(alice, make_run):
    run = make_run(alice)  # PostgreSQL's json refuses NaN: a step with a diverged loss failed the whole run
    services.record_metrics(run.pk, 3, {"reward/mean": 0.25, "loss/policy": float("nan"), "grad/norm": float("inf")})
    assert list(run.metrics.values_list("step", "name", "value")) == [(3, "reward/mean", 0.25)]
    assert run.events.last().payload == {"step": 3, "values": {"reward/mean": 0.25},
                                         "non_finite": ["grad/norm", "loss/policy"]}


def test_a_harness_output_holding_nul_characters_still_finishes_the_rollout(alice, make_run):
    """PostgreSQL refuses NUL in text and JSON: a harness printing the model's raw bytes left rollouts running."""
    run = make_run(alice)
    rollout, _ = rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=0)
    rollout_services.finish_rollout(rollout.pk, status="succeeded", reward=0.5, reward_detail={"seen": "x\x00y"},
                                    exit_code=0, stdout_tail="a\x00b", stderr_tail="\x00", error="bad\x00")
    stored = Rollout.objects.get(pk=rollout.pk)
    assert (stored.status, stored.reward, stored.stdout_tail, stored.stderr_tail, stored.error) == (
        "succeeded", 0.5, "a\ufffdb", "\ufffd", "bad\ufffd")
    assert stored.reward_detail == {"seen": "x\ufffdy"}
    assert run.events.filter(kind="rollout.status").last().payload["error"] == "bad\ufffd"
