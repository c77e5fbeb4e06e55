"""/api/v1/runs/: create (validated, snapshotted, enqueued), cancel, clone, metrics, events, rollouts, delete."""
import pytest
from django.db import transaction

from runs import rollout_services, services
from runs.models import Run, RunEvent

pytestmark = pytest.mark.django_db
URL = "/api/v1/runs/"


@pytest.fixture
def parts(alice, make_harness, make_dataset, make_reward):
    return {"harness": make_harness(alice).pk, "dataset": make_dataset(alice).pk, "reward_script": make_reward(alice).pk}


def test_it_creates_and_enqueues_a_run(alice_api, alice, parts, django_capture_on_commit_callbacks, test_redis):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = alice_api.post(URL, {"name": "first", "model": "tiny", "config": {"steps": 2}, **parts},
                                  format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["status"] == "queued" and body["config"]["steps"] == 2 and body["config"]["mode"] == "sync"
    assert body["harness_snapshot"]["id"] == parts["harness"]
    run = Run.objects.get(pk=body["id"])
    assert run.owner == alice and run.celery_task_id  # set by enqueue after commit
    assert len(callbacks) == 2  # the status event's publish and the enqueue
    assert test_redis.llen("runs") == 1  # the message waits in the `runs` queue of the real broker


@pytest.mark.parametrize("config, message", [
    ({"steps": 0}, "steps must be at least 1"),
    ({"mode": "fast"}, "mode must be"),
    ({"learning_rate": "high"}, "learning_rate must be float"),
    ({"bogus": 1}, "unknown config field(s) ['bogus']"),
    ({"tasks_per_step": 100000}, "tasks_per_step must be at most 4096, got 100000"),
    ({"eval_concurrency": 5000}, "eval_concurrency must be at most 1024"),
    ([1, 2], "must be an object of TrainerConfig fields"),
])
def test_it_refuses_a_bad_config(alice_api, parts, config, message):
    response = alice_api.post(URL, {"name": "x", "model": "tiny", "config": config, **parts}, format="json")
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert Run.objects.count() == 0


def test_it_refuses_objects_of_another_user(alice_api, bob, parts, make_harness):
    response = alice_api.post(URL, {"name": "x", "model": "tiny", **parts, "harness": make_harness(bob).pk},
                              format="json")
    assert response.status_code == 400
    assert "harness" in response.json()["error"]["fields"] and "does not exist" in response.json()["error"]["message"]
    assert Run.objects.count() == 0


def test_missing_fields_are_named(alice_api):
    response = alice_api.post(URL, {}, format="json")
    assert response.status_code == 400
    assert set(response.json()["error"]["fields"]) == {"name", "model", "harness", "dataset", "reward_script"}


def test_cancel_a_queued_run(alice_api, alice, make_run):
    run = make_run(alice)
    response = alice_api.post(f"{URL}{run.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    assert Run.objects.get(pk=run.pk).status == "cancelled"
    response = alice_api.post(f"{URL}{run.pk}/cancel/")
    assert response.status_code == 409 and response.json()["error"]["code"] == "invalid_transition"


def test_cancel_a_running_run_asks_for_cancelling(alice_api, alice, make_run):
    run = make_run(alice)
    services.transition_run(run.pk, "starting")
    services.transition_run(run.pk, "running")
    assert alice_api.post(f"{URL}{run.pk}/cancel/").json()["status"] == "cancelling"


def test_others_cannot_cancel_or_see(alice, bob_api, make_run):
    run = make_run(alice)
    assert bob_api.post(f"{URL}{run.pk}/cancel/").status_code == 404
    assert bob_api.get(f"{URL}{run.pk}/").status_code == 404
    assert bob_api.get(URL).json()["count"] == 0
    assert Run.objects.get(pk=run.pk).status == "queued"


def test_finish_makes_the_step_in_progress_the_last(alice_api, alice, bob_api, make_run):
    run = make_run(alice, config={"steps": 50})
    assert alice_api.post(f"{URL}{run.pk}/finish/").status_code == 409  # queued: nothing trains yet (cancel it)
    services.transition_run(run.pk, "starting")
    services.transition_run(run.pk, "running")
    Run.objects.filter(pk=run.pk).update(step=6)
    assert bob_api.post(f"{URL}{run.pk}/finish/").status_code == 404
    assert Run.objects.get(pk=run.pk).config["steps"] == 50

    response = alice_api.post(f"{URL}{run.pk}/finish/")
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["status"] == "running" and body["config"]["steps"] == 7  # step 7 is being trained: it is the last
    run.refresh_from_db()
    assert run.config["steps"] == 7 and run.config["mode"] == body["config"]["mode"]  # the rest as it was
    event = RunEvent.objects.filter(run=run, kind="run.log").latest("seq")
    assert event.payload == {"line": "finish requested by its owner: the run ends after step 7 (of 50) with an "
                                     "evaluation", "steps": 7}
    # Asked again: already on its last step, nothing changes and no second line.
    assert alice_api.post(f"{URL}{run.pk}/finish/").json()["config"]["steps"] == 7
    assert RunEvent.objects.filter(run=run, kind="run.log").count() == 1

    services.transition_run(run.pk, "succeeded")
    response = alice_api.post(f"{URL}{run.pk}/finish/")
    assert response.status_code == 409 and "only starting or running runs can be finished" in \
        response.json()["error"]["message"]


def test_clone(alice_api, alice, make_run):
    run = make_run(alice, config={"steps": 5})
    response = alice_api.post(f"{URL}{run.pk}/clone/", {"name": "again"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["name"] == "again" and body["cloned_from"] == run.pk and body["config"]["steps"] == 5
    assert body["status"] == "queued" and Run.objects.count() == 2


def test_metrics_filter_by_name_and_step_range(alice_api, alice, make_run):
    run = make_run(alice)
    for step in range(5):
        services.record_metrics(run.pk, step, {"reward/mean": step / 10, "loss/policy": -step})
    body = alice_api.get(f"{URL}{run.pk}/metrics/", {"name": "reward/mean", "step_min": 1, "step_max": 3}).json()
    assert [(m["name"], m["step"], m["value"]) for m in body["results"]] == [
        ("reward/mean", 1, 0.1), ("reward/mean", 2, 0.2), ("reward/mean", 3, 0.3)]
    both = alice_api.get(f"{URL}{run.pk}/metrics/", {"name": "reward/mean,loss/policy", "step_min": 4}).json()
    assert sorted((m["name"], m["value"]) for m in both["results"]) == [("loss/policy", -4.0), ("reward/mean", 0.4)]
    bad = alice_api.get(f"{URL}{run.pk}/metrics/", {"step_min": "two"})
    assert bad.status_code == 400 and "step_min: must be an integer" in bad.json()["error"]["message"]


def test_events_after_a_seq(alice_api, alice, make_run):
    run = make_run(alice)
    for i in range(4):
        services.emit_event(run.pk, "run.log", {"line": i})
    body = alice_api.get(f"{URL}{run.pk}/events/", {"after": 3}).json()
    assert [(e["seq"], e["payload"]) for e in body["results"]] == [(4, {"line": 2}), (5, {"line": 3})]
    assert alice_api.get(f"{URL}{run.pk}/events/").json()["count"] == 5


def test_rollouts_of_a_run(alice_api, alice, make_run):
    run = make_run(alice)
    task = run.dataset.tasks.first()
    for attempt in range(3):
        rollout_services.create_rollout(run, task=task, split="train", step=0, group=0, attempt=attempt)
    rollout_services.create_rollout(run, task=task, split="val", step=1, group=0, attempt=0)
    body = alice_api.get(f"{URL}{run.pk}/rollouts/", {"split": "train"}).json()
    assert body["count"] == 3 and [r["attempt"] for r in body["results"]] == [0, 1, 2]
    assert body["results"][0]["task_external_id"] == task.external_id
    assert "secret_hash" not in body["results"][0]


def test_delete_only_finished_runs(alice_api, alice, make_run):
    run = make_run(alice)
    response = alice_api.delete(f"{URL}{run.pk}/")
    assert response.status_code == 409 and "cancel it before deleting" in response.json()["error"]["message"]
    services.cancel_run(run, alice)
    assert alice_api.delete(f"{URL}{run.pk}/").status_code == 204
    assert not Run.objects.filter(pk=run.pk).exists() and not RunEvent.objects.filter(run_id=run.pk).exists()


def test_staff_sees_all_runs(alice, bob, staff_api, make_run):
    make_run(alice, name="a")
    make_run(bob, name="b")
    assert {r["name"] for r in staff_api.get(URL).json()["results"]} == {"a", "b"}


def test_list_filters_by_status(alice_api, alice, make_run):
    make_run(alice, name="a")
    services.cancel_run(make_run(alice, name="b"), alice)
    assert [r["name"] for r in alice_api.get(URL, {"status": "cancelled"}).json()["results"]] == ["b"]


def test_enqueue_happens_only_after_commit(alice, make_harness, make_dataset, make_reward, test_redis,
                                           django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        with transaction.atomic():
            services.create_run(alice, name="x", model="tiny", config={}, harness=make_harness(alice),
                                dataset=make_dataset(alice), reward_script=make_reward(alice))
            assert test_redis.llen("runs") == 0
    assert test_redis.llen("runs") == 0 and len(callbacks) == 2
