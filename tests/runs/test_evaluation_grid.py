"""GET /api/v1/runs/{id}/validation/: the validation grid, val tasks by evaluated steps, owner-only."""
import pytest

from runs import rollout_services, selectors, services
from runs.models import Rollout
from runs.recorder import _rollout_info

pytestmark = pytest.mark.django_db
TASKS = [{"id": f"v{i}", "question": f"{i}+1", "answer": i + 1, "split": "val"} for i in range(3)] + [
    {"id": "t0", "question": "0+1", "answer": 1, "split": "train"}]


@pytest.fixture
def run(alice, make_harness, make_dataset, make_reward):
    return services.create_run(alice, name="grid", model="tiny", config={"pass_threshold": 0.5, "eval_samples": 2},
                               harness=make_harness(alice), dataset=make_dataset(alice, tasks=TASKS),
                               reward_script=make_reward(alice))


def attempt(run, external_id, step, attempt, status="succeeded", reward=None, failure_kind="", greedy=False,
            split="val"):
    """One rollout row as the Evaluator leaves it (status 'pending' or 'running': still under way)."""
    task = run.dataset.tasks.get(external_id=external_id)
    rollout, _ = rollout_services.create_rollout(run, task=task, split=split, step=step, group=task.index,
                                                 attempt=attempt, greedy=greedy)
    if status == "running":
        rollout_services.start_rollout(rollout.pk)
    elif status != "pending":
        rollout_services.finish_rollout(rollout.pk, status=status, reward=reward, reward_detail={}, exit_code=0,
                                        failure_kind=failure_kind)
    return rollout


def cell(attempts, passed, greedy, infra=0, unscored=0):
    return {"attempts": attempts, "passed": passed, "pass_fraction": passed / attempts if attempts else None,
            "greedy": greedy, "infra_failures": infra, "unscored": unscored}


@pytest.fixture
def evaluated(run, alice, make_run):
    """Two evaluations of run: step 0 whole, step 4 under way; plus rows the grid must leave out."""
    for task, rewards, greedy in (("v0", (1.0, 0.0), 1.0), ("v1", (0.5, 0.7), 0.0), ("v2", (0.0, 0.0), 0.2)):
        for i, reward in enumerate(rewards):
            attempt(run, task, 0, i, reward=reward)
        attempt(run, task, 0, 2, reward=greedy, greedy=True)
    attempt(run, "v0", 4, 0, reward=1.0)
    attempt(run, "v0", 4, 1, status="failed", reward=None, failure_kind="infra")
    attempt(run, "v0", 4, 2, status="failed", reward=0.0, failure_kind="infra", greedy=True)
    attempt(run, "v1", 4, 0, status="failed", reward=1.0, failure_kind="policy")  # a policy failure never passes
    attempt(run, "v1", 4, 1, status="running")
    attempt(run, "v1", 4, 2, status="pending", greedy=True)
    attempt(run, "t0", 4, 0, reward=1.0, split="train")  # training rollouts are not the grid's
    other = make_run(alice, name="other")
    attempt(other, other.dataset.tasks.filter(split="val").first().external_id, 0, 0, reward=1.0)
    return run


def test_the_grid_has_a_row_per_val_task_and_a_column_per_evaluated_step(evaluated):
    grid = selectors.validation_grid(evaluated)
    assert grid["pass_threshold"] == 0.5 and grid["steps"] == [0, 4]
    assert [(t["external_id"], t["index"]) for t in grid["tasks"]] == [("v0", 0), ("v1", 1), ("v2", 2)]
    assert [t["cells"] for t in grid["tasks"]] == [
        [cell(2, 1, True), cell(1, 1, None, infra=2)],  # step 4: the greedy attempt was lost to infrastructure
        [cell(2, 2, False), cell(1, 0, None, unscored=2)],  # step 4: one running, the greedy one pending
        [cell(2, 0, False), None],  # not evaluated at step 4 (yet)
    ]


def test_the_endpoint_returns_the_grid_to_its_owner(alice_api, evaluated):
    rows = Rollout.objects.count()
    response = alice_api.get(f"/api/v1/runs/{evaluated.pk}/validation/")
    assert response.status_code == 200
    body = response.json()
    assert body == selectors.validation_grid(evaluated)
    assert body["tasks"][0]["cells"][0] == {"attempts": 2, "passed": 1, "pass_fraction": 0.5, "greedy": True,
                                            "infra_failures": 0, "unscored": 0}
    assert Rollout.objects.count() == rows  # a read: nothing written


def test_a_run_never_evaluated_has_an_empty_grid(alice_api, run):
    response = alice_api.get(f"/api/v1/runs/{run.pk}/validation/")
    assert response.status_code == 200 and response.json() == {"pass_threshold": 0.5, "steps": [], "tasks": []}


def test_others_cannot_see_the_grid(bob_api, staff_api, client, evaluated):
    url = f"/api/v1/runs/{evaluated.pk}/validation/"
    assert bob_api.get(url).status_code == 404
    assert staff_api.get(url).status_code == 200
    assert client.get(url).status_code in (401, 403)
    assert bob_api.get("/api/v1/runs/999999/validation/").status_code == 404


def test_the_grid_is_in_the_schema_and_rollouts_say_which_attempt_was_greedy(alice_api, evaluated):
    import yaml

    schema = yaml.safe_load(alice_api.get("/api/schema/").content)
    assert "/api/v1/runs/{id}/validation/" in schema["paths"]
    listed = alice_api.get("/api/v1/rollouts/", {"run": evaluated.pk, "split": "val", "step": 0}).json()["results"]
    assert sorted((r["task_external_id"], r["attempt"], r["greedy"]) for r in listed) == [
        (t, a, a == 2) for t in ("v0", "v1", "v2") for a in range(3)]
    greedy = alice_api.get("/api/v1/rollouts/", {"run": evaluated.pk, "greedy": "true"}).json()["results"]
    assert sorted((r["step"], r["task_external_id"]) for r in greedy) == [
        (0, "v0"), (0, "v1"), (0, "v2"), (4, "v0"), (4, "v1")]


def test_the_proxy_directory_serves_a_greedy_rollout_at_temperature_0(evaluated):
    greedy = Rollout.objects.get(run=evaluated, step=4, greedy=True, task__external_id="v1")
    sampled = Rollout.objects.get(run=evaluated, step=4, attempt=1, task__external_id="v1")
    train = Rollout.objects.get(run=evaluated, split="train")
    assert (_rollout_info(evaluated.pk, greedy.pk).sampling, _rollout_info(evaluated.pk, greedy.pk).split) == ({"temperature": 0.0}, "val")
    assert (_rollout_info(evaluated.pk, sampled.pk).sampling, _rollout_info(evaluated.pk, sampled.pk).split) == ({}, "val")
    assert (_rollout_info(evaluated.pk, train.pk).sampling, _rollout_info(evaluated.pk, train.pk).split) == ({}, "train")
