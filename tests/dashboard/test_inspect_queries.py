"""dashboard.inspect_queries: the validation grid's cells and flips, a step's groups, drops and timeline, fixed queries."""
from __future__ import annotations

import pytest

from dashboard import inspect_queries
from proxy.types import RecordedCall
from runs import rollout_services, services
from runs.models import Rollout, RunEvent, RunStatus

pytestmark = pytest.mark.django_db

VAL = [{"id": f"v{i}", "question": f"{i}+1", "answer": i + 1, "split": "val"} for i in range(5)]
TRAIN = [{"id": f"t{i}", "question": f"{i}+2", "answer": i + 2, "split": "train"} for i in range(4)]


@pytest.fixture
def run(alice, make_harness, make_dataset, make_reward):
    run = services.create_run(alice, name="inspect", model="tiny",
                              config={"pass_threshold": 0.5, "eval_samples": 2, "failure_reward": -1.0, "steps": 4,
                                      "mode": "async", "max_staleness": 1},
                              harness=make_harness(alice), dataset=make_dataset(alice, tasks=VAL + TRAIN),
                              reward_script=make_reward(alice))
    services.transition_run(run.pk, RunStatus.STARTING)
    services.transition_run(run.pk, RunStatus.RUNNING)
    return run


def val_attempt(run, external_id, step, attempt, reward, status="succeeded", failure_kind="", greedy=False):
    task = run.dataset.tasks.get(external_id=external_id)
    rollout, _ = rollout_services.create_rollout(run, task=task, split="val", step=step, group=task.index,
                                                 attempt=attempt, greedy=greedy)
    rollout_services.finish_rollout(rollout.pk, status=status, reward=reward, reward_detail={}, exit_code=0,
                                    failure_kind=failure_kind)
    return rollout


def evaluate(run, step, outcomes):
    """One evaluation: task -> (sampled rewards, greedy reward or None)."""
    for task, (rewards, greedy) in outcomes.items():
        for i, reward in enumerate(rewards):
            val_attempt(run, task, step, i, reward)
        if greedy is not None:
            val_attempt(run, task, step, len(rewards), greedy, greedy=True)


@pytest.fixture
def evaluated(run):
    """Three evaluations (steps 0, 2, 4) set up with a flip each way, a task never solved and a partial cell."""
    evaluate(run, 0, {"v0": ((0.0, 0.0), 0.0), "v1": ((1.0, 1.0), 1.0), "v2": ((0.0, 0.0), None),
                      "v3": ((1.0, 0.0), 1.0), "v4": ((0.0, 0.0), 0.0)})
    evaluate(run, 2, {"v0": ((0.0, 1.0), 0.0), "v1": ((1.0, 1.0), 1.0), "v2": ((0.2, 0.0), None),
                      "v3": ((0.0, 0.0), 0.0), "v4": ((0.0, 0.0), 0.0)})
    evaluate(run, 4, {"v0": ((1.0, 1.0), 1.0), "v1": ((0.0, 0.0), 0.0), "v2": ((0.0, 0.4), None),
                      "v3": ((1.0, 1.0), 1.0)})  # v4 not evaluated at step 4
    val_attempt(run, "v4", 4, 0, 1.0, status="failed", failure_kind="policy")  # a policy failure never passes
    return run


def by_task(grid):
    return {t["external_id"]: t for t in grid["tasks"]}


def test_the_grid_has_a_state_and_text_per_cell(evaluated):
    grid = inspect_queries.val_grid(evaluated)
    tasks = by_task(grid)
    assert grid["steps"] == [0, 2, 4]
    assert tasks["v0"]["states"] == ["fail", "partial", "pass"] and tasks["v0"]["texts"] == ["✗", "1/2", "✓"]
    assert tasks["v2"]["states"] == ["fail", "fail", "fail"]  # 0.2 and 0.4 are below the threshold 0.5
    assert tasks["v4"]["states"] == ["fail", "fail", "fail"]  # step 4: one attempt, a policy failure rewarded 1.0
    assert tasks["v1"]["cells"][0] == {"attempts": 2, "passed": 2, "pass_fraction": 1.0, "greedy": True,
                                       "infra_failures": 0, "unscored": 0}


def test_a_flip_set_up_in_the_data_shows_as_flipped(evaluated):
    tasks = by_task(inspect_queries.val_grid(evaluated))
    flags = {name: {f: t[f] for f in inspect_queries.FLAGS} for name, t in tasks.items()}
    assert flags["v0"] == {"flipped": True, "fail_to_pass": True, "pass_to_fail": False, "never_solved": False}
    assert flags["v1"] == {"flipped": True, "fail_to_pass": False, "pass_to_fail": True, "never_solved": False}
    assert flags["v2"] == {"flipped": False, "fail_to_pass": False, "pass_to_fail": False, "never_solved": True}
    # solved, unsolved, solved: it flipped twice, but first and last agree
    assert flags["v3"] == {"flipped": True, "fail_to_pass": False, "pass_to_fail": False, "never_solved": False}
    assert flags["v4"]["never_solved"] and not flags["v4"]["flipped"]


def test_the_grid_counts_each_filter(evaluated):
    counts = inspect_queries.val_grid(evaluated)["counts"]
    assert counts == {"all": 5, "flipped": 3, "fail_to_pass": 1, "pass_to_fail": 1, "never_solved": 2}


def test_a_missing_cell_is_skipped_by_the_flags(run):
    evaluate(run, 0, {"v0": ((0.0, 0.0), None)})
    evaluate(run, 4, {"v0": ((1.0, 0.0), None), "v1": ((0.0, 0.0), None)})
    tasks = by_task(inspect_queries.val_grid(run))
    assert tasks["v1"]["states"] == ["missing", "fail"] and tasks["v1"]["texts"][0] == "·"
    assert tasks["v1"]["never_solved"] and not tasks["v1"]["flipped"]
    assert tasks["v0"]["fail_to_pass"] and tasks["v0"]["flipped"]


def test_the_greedy_attempt_decides_only_a_cell_without_sampled_attempts(run):
    evaluate(run, 0, {"v0": ((), 1.0), "v1": ((0.0, 0.0), 1.0)})
    tasks = by_task(inspect_queries.val_grid(run))
    assert tasks["v0"]["states"] == ["pass"] and tasks["v1"]["states"] == ["fail"]


@pytest.mark.parametrize("tasks, evaluations", [(2, 2), (5, 8)])
def test_the_grid_costs_the_same_queries_whatever_its_size(run, django_assert_max_num_queries, tasks, evaluations):
    for step in range(evaluations):
        evaluate(run, step, {f"v{i}": ((float((i + step) % 2), 0.0), 1.0) for i in range(tasks)})
    with django_assert_max_num_queries(2):
        grid = inspect_queries.val_grid(run)
    assert len(grid["tasks"]) == tasks and len(grid["steps"]) == evaluations


# ---- steps ------------------------------------------------------------------------------------------------------

def recorded(rollout_id, seq, *, prompt=(1, 2, 3), completion=(4, 5), status=200, finish="stop", error=None):
    return RecordedCall(rollout_id=str(rollout_id), seq=seq, api="chat",
                        request={"messages": [{"role": "user", "content": "q"}]},
                        response={"choices": [{"message": {"role": "assistant", "content": "a"}}]} if status == 200
                        else None, upstream_request={}, prompt_ids=list(prompt), completion_ids=list(completion),
                        logprobs=[-0.5] * len(completion), finish_reason=finish, status_code=status, latency_ms=3.0,
                        policy_version=0, error=error, stream=False, started_at=0.0)


def train_rollout(run, task, version, group, attempt, reward, *, failure_kind="", calls=None):
    rollout, _ = rollout_services.create_rollout(run, task=run.dataset.tasks.get(external_id=task), split="train",
                                                 step=version, group=group, attempt=attempt)
    rollout_services.start_rollout(rollout.pk)
    rollout_services.record_calls(calls(rollout.pk) if calls else [recorded(rollout.pk, 0)])
    status = "failed" if failure_kind else "succeeded"
    rollout_services.finish_rollout(rollout.pk, status=status, reward=reward, reward_detail={}, exit_code=0,
                                    failure_kind=failure_kind, error="engine down" if failure_kind == "infra" else "")
    return rollout


def sample(rollout, advantage, step, version):
    return {"rollout_id": rollout.pk, "token_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 0, 1, 1],
            "logprobs": [0, 0, 0, -0.5, -0.5], "advantage": advantage, "call_seqs": [0], "build": "single",
            "step": step, "policy_version": version, "spans": [[0, 0, 3, False], [0, 3, 5, True]],
            "trainer_logprobs": [None, None, None, -0.4, -0.6]}


def phase(run, text):
    services.set_run_phase(run.pk, text)


@pytest.fixture
def stepped(run):
    """Step 1 (two groups: one with signal, one without) and step 2 (a policy failure, an infrastructure failure,
    a rollout whose only call failed before any token, a truncated call, a sample one version stale), with the
    phases the scheduler and the evaluator write between their records."""
    services.record_metrics(run.pk, 0, {"eval/pass@1": 0.2})
    phase(run, "step 1: generating rollouts")
    r = {}
    r["a0"] = train_rollout(run, "t0", 0, 0, 0, 1.0)
    r["a1"] = train_rollout(run, "t0", 0, 0, 1, 0.0)
    r["b0"] = train_rollout(run, "t1", 0, 1, 0, 0.5)
    r["b1"] = train_rollout(run, "t1", 0, 1, 1, 0.5)
    phase(run, "step 1: training on 4 rollouts")
    phase(run, "step 1: syncing weights to the engine")
    phase(run, "step 1: recording")
    rollout_services.record_step(
        run.pk, 1, 1, [sample(r["a0"], 1.0, 1, 0), sample(r["a1"], -1.0, 1, 0), sample(r["b0"], 0.0, 1, 0),
                       sample(r["b1"], 0.0, 1, 0)], {},
        {"reward/mean": 0.5, "groups/total": 2.0, "groups/with_signal": 1.0, "samples/dropped_rollouts": 0.0},
        {r[k].pk: "" for k in ("a0", "a1", "b0", "b1")})
    for done in (0, 4, 8):
        services.set_run_phase(run.pk, f"evaluating step 1: {done}/8", done / 8)
    services.record_metrics(run.pk, 1, {"eval/pass@1": 0.4})
    phase(run, "step 2: generating rollouts")
    r["c0"] = train_rollout(run, "t2", 1, 2, 0, 1.0)
    r["c1"] = train_rollout(run, "t2", 1, 2, 1, 1.0, failure_kind="policy")
    r["c2"] = train_rollout(run, "t2", 1, 2, 2, None, failure_kind="infra")
    r["d0"] = train_rollout(run, "t3", 0, 3, 0, 0.0, calls=lambda pk: [
        recorded(pk, 0, finish="length"), recorded(pk, 1, prompt=(), completion=(), status=500, error="upstream 500")])
    r["d1"] = train_rollout(run, "t3", 0, 3, 1, 0.0, calls=lambda pk: [
        recorded(pk, 0, prompt=(), completion=(), status=502, error="bad gateway")])
    phase(run, "step 2: training on 5 rollouts")
    rollout_services.record_step(
        run.pk, 2, 2, [sample(r["c0"], 1.0, 2, 1), sample(r["c1"], -1.0, 2, 1), sample(r["d0"], 0.0, 2, 0)], {},
        {"reward/mean": 0.2, "groups/total": 2.0, "groups/with_signal": 1.0, "samples/dropped_rollouts": 2.0},
        {r["c0"].pk: "", r["c1"].pk: "", r["c2"].pk: "infra_failure: engine down", r["d0"].pk: "",
         r["d1"].pk: "no_sampled_tokens"})
    run.refresh_from_db()
    return run, r


def test_a_step_lists_its_groups_with_rewards_and_advantages(stepped):
    run, r = stepped
    data = inspect_queries.step_data(run, 1)
    assert not data["legacy"] and [g["group"] for g in data["groups"]] == [0, 1]
    first, second = data["groups"]
    assert first["task_external_id"] == "t0" and [a["rollout"] for a in first["attempts"]] == [r["a0"].pk, r["a1"].pk]
    assert [a["reward"] for a in first["attempts"]] == [1.0, 0.0]
    assert [a["advantages"] for a in first["attempts"]] == [[1.0], [-1.0]]
    assert first["no_signal"] is False and second["no_signal"] is True
    assert data["dropped"] == [] and data["failed_calls"] == [] and data["truncated"] == []


def test_a_policy_failure_is_trained_with_the_failure_reward_and_an_infra_failure_not_counted(stepped):
    run, r = stepped
    groups = {g["group"]: g for g in inspect_queries.step_data(run, 2)["groups"]}
    c = {a["rollout"]: a for a in groups[2]["attempts"]}
    assert c[r["c1"].pk]["reward"] == 1.0 and c[r["c1"].pk]["trained_reward"] == -1.0
    assert c[r["c2"].pk]["counted"] is False and c[r["c2"].pk]["trained_reward"] is None
    assert groups[2]["rewards"] == [1.0, -1.0] and groups[2]["no_signal"] is False
    assert groups[3]["rewards"] == [0.0, 0.0] and groups[3]["no_signal"] is True


def test_the_dropped_rollouts_calls_and_truncations_are_listed_with_their_reason(stepped):
    run, r = stepped
    data = inspect_queries.step_data(run, 2)
    assert [(d["rollout"], d["reason"], d["kind"]) for d in data["dropped"]] == [
        (r["c2"].pk, "infra_failure: engine down", "infra_failure"),
        (r["d1"].pk, "no_sampled_tokens", "no_sampled_tokens")]
    assert [(c["rollout"], c["seq"], c["status_code"], c["error"]) for c in data["failed_calls"]] == [
        (r["d0"].pk, 1, 500, "upstream 500"), (r["d1"].pk, 0, 502, "bad gateway")]
    assert [(c["rollout"], c["seq"]) for c in data["truncated"]] == [(r["d0"].pk, 0)]
    assert "never drops" in data["staleness_note"]


def test_staleness_counts_versions_behind_the_trainer(stepped):
    run, r = stepped
    attempts = {a["rollout"]: a for g in inspect_queries.step_data(run, 2)["groups"] for a in g["attempts"]}
    assert [s["staleness"] for s in attempts[r["c0"].pk]["samples"]] == [0]  # sampled at version 1, trained at 2
    assert [s["staleness"] for s in attempts[r["d0"].pk]["samples"]] == [1]  # sampled at version 0


def test_the_timeline_has_a_bar_per_rollout_and_the_phases_of_the_step(stepped):
    run, r = stepped
    timeline = inspect_queries.step_data(run, 2)["timeline"]
    assert [b["rollout"] for b in timeline["bars"]] == [r[k].pk for k in ("c0", "c1", "c2", "d0", "d1")]
    assert [(b["name"], b["kind"]) for b in timeline["bands"]] == [
        ("evaluating step 1", "eval"), ("step 2: generating rollouts", "generate"),
        ("step 2: training on 5 rollouts", "train")]
    assert all(b["start"] <= b["end"] for b in timeline["bands"])
    assert [b["rollout"] for b in timeline["bars"] if b["straggler"]] == [r["d1"].pk]  # the last to finish
    step1 = inspect_queries.step_data(run, 1)["timeline"]
    assert [b["kind"] for b in step1["bands"]] == ["generate", "train", "sync", "record"]
    events = RunEvent.objects.filter(run=run, kind="run.metrics").order_by("seq")
    assert step1["window"]["start"] == events[0].created_at.isoformat()


def test_a_run_recorded_before_trained_step_falls_back_to_the_launch_version(stepped):
    run, r = stepped
    Rollout.objects.filter(run=run).update(batch_step=None, trained_step=None, drop_reason="")
    data = inspect_queries.step_data(run, 2)
    assert data["legacy"] is True
    assert {a["rollout"] for g in data["groups"] for a in g["attempts"]} == {r["c0"].pk, r["c1"].pk, r["c2"].pk}
    assert [(d["rollout"], d["reason"]) for d in data["dropped"]] == [(r["c2"].pk, "infra_failure: engine down")]


def test_the_step_list_reads_the_step_metrics(stepped):
    run, _ = stepped
    steps = inspect_queries.step_list(run)
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[1]["metrics"] == {"reward/mean": 0.2, "groups/total": 2.0, "groups/with_signal": 1.0,
                                   "samples/dropped_rollouts": 2.0}


def fill_step(run, groups: int) -> None:
    """Step 1 of `groups` groups of 3 attempts, each with a good, a truncated and a failed call; one dropped."""
    rollouts = [train_rollout(run, f"t{g % 4}", 0, g, a, float(a), calls=lambda pk: [
        recorded(pk, 0), recorded(pk, 1, finish="length"), recorded(pk, 2, prompt=(), completion=(), status=500)])
        for g in range(groups) for a in range(3)]
    phase(run, "step 1: training")
    rollout_services.record_step(run.pk, 1, 1, [sample(x, 0.5, 1, 0) for x in rollouts[1:]], {}, {"reward/mean": 1.0},
                                 {x.pk: "" if i else "no_sampled_tokens" for i, x in enumerate(rollouts)})


@pytest.mark.parametrize("groups", [1, 12])
def test_step_data_costs_the_same_queries_whatever_the_step_size(run, django_assert_max_num_queries, groups):
    fill_step(run, groups)
    with django_assert_max_num_queries(6):
        data = inspect_queries.step_data(run, 1)
    assert len(data["groups"]) == groups and len(data["truncated"]) == 3 * groups
    assert len(data["failed_calls"]) == 3 * groups and len(data["dropped"]) == 1
