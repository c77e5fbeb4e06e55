"""Every dashboard page of a run costs as many queries for a big run as for a small one.

Small: 3 rollouts x 2 calls; big: 30 rollouts x 5 calls, both with samples, metrics and events; the runs list: 2
runs against 20. bench/dashboard_load.py times the same pages at 100 against 10,000 rollouts.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import NoReverseMatch, reverse

from catalog import services as catalog_services
from dashboard import rollout_queries
from proxy.types import RecordedCall
from runs import rollout_services, services
from runs.models import Rollout, RunStatus, Sample

pytestmark = pytest.mark.django_db

SLACK = 1
"""Queries a big run's page may cost beyond the small run's."""


@dataclass
class Side:
    client: Client
    run: int
    peer: int
    rollout: int
    dataset: int
    sample: int
    val_task: int


PAGES = {  # label: (a page's URL name, or None for a REST path; its argument; query string)
    "runs-list": ("runs-list", lambda s: None, ""),
    "runs-rows": ("runs-rows", lambda s: None, "?page=1"),
    "run-detail": ("run-detail", lambda s: s.run, ""),
    "run-metric-series": ("run-metric-series", lambda s: s.run, ""),
    "run-rollouts": ("run-rollouts-table", lambda s: s.run, ""),
    "run-rollouts sorted": ("run-rollouts-table", lambda s: s.run, "?sort=-reward&page=2&page_size=5"),
    "run-rollouts filtered": ("run-rollouts-table", lambda s: s.run,
                              "?step=1&split=train&status=succeeded&reward_min=0.5&q=t&sort=-duration"),
    "rollout-detail": ("rollout-detail", lambda s: s.rollout, ""),
    "rollout-call-raw": ("rollout-call-raw", lambda s: (s.rollout, 1), ""),
    "sample-tokens": ("sample-tokens", lambda s: s.sample, ""),
    "sample-tokens-data": ("sample-tokens-data", lambda s: s.sample, "?start=0&count=100"),
    "run-val-grid": ("run-val-grid", lambda s: s.run, ""),
    "val-task-compare": ("val-task-compare", lambda s: (s.run, s.val_task), "?a=1&b=2"),
    "run-steps": ("run-steps", lambda s: s.run, ""),
    "run-step": ("run-step", lambda s: (s.run, 1), ""),
    "run-step-data": ("run-step-data", lambda s: (s.run, 1), ""),
    "run-compare": ("run-compare", lambda s: None, "?ids={run},{peer}"),
    "dataset-detail": ("dataset-detail", lambda s: s.dataset, ""),
    "api run metrics": (None, lambda s: f"/api/v1/runs/{s.run}/metrics/", ""),
    "api run rollouts": (None, lambda s: f"/api/v1/runs/{s.run}/rollouts/", ""),
    "api run events": (None, lambda s: f"/api/v1/runs/{s.run}/events/", ""),
    "api rollout": (None, lambda s: f"/api/v1/rollouts/{s.rollout}/", ""),
}


def call(rollout_id: int, seq: int) -> RecordedCall:
    return RecordedCall(rollout_id=str(rollout_id), seq=seq, api="chat",
                        request={"messages": [{"role": "user", "content": f"turn {seq}"}]},
                        response={"choices": [{"message": {"role": "assistant", "content": "42"}}]},
                        upstream_request={}, prompt_ids=[1, 2, 3, seq], completion_ids=[4, 5], logprobs=[-0.5, -0.25],
                        finish_reason="stop", status_code=200, latency_ms=3.0, policy_version=0, error=None,
                        stream=False, started_at=0.0)


def running_run(owner, name, harness, dataset, reward, rollouts: int, calls: int) -> tuple[int, int]:
    """A running run with `rollouts` finished rollouts of `calls` calls, 3 a step, each step recorded with its
    samples and metrics; (run id, id of its first rollout)."""
    run = services.create_run(owner, name=name, model="tiny", config={"steps": 20}, harness=harness, dataset=dataset,
                              reward_script=reward)
    services.transition_run(run.pk, RunStatus.STARTING)
    services.transition_run(run.pk, RunStatus.RUNNING)
    tasks = list(dataset.tasks.order_by("index"))
    made = []
    for i in range(rollouts):
        rollout, _ = rollout_services.create_rollout(run, task=tasks[i % len(tasks)], split=tasks[i % len(tasks)].split,
                                                     step=1 + i // 3, group=i % 3, attempt=0)
        rollout_services.start_rollout(rollout.pk)
        rollout_services.record_calls([call(rollout.pk, seq) for seq in range(calls)])
        failed = i % 4 == 3
        rollout_services.finish_rollout(rollout.pk, status="failed" if failed else "succeeded",
                                        reward=None if failed else float(i % 2), reward_detail={"checked": True},
                                        exit_code=1 if failed else 0, error="exit 1" if failed else "",
                                        failure_kind="policy" if failed else "")
        made.append(rollout)
    for step in sorted({r.step for r in made}):
        samples = [{"rollout_id": r.pk, "token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.5, -0.2],
                    "advantage": 0.5, "call_seqs": list(range(calls)), "build": "merged", "policy_version": step}
                   for r in made if r.step == step]
        rollout_services.record_step(run.pk, step, step, samples, {}, {
            "reward/mean": 0.5, "reward/std": 0.1, "eval/pass@1": 0.25, "time/step": 2.0, "loss/policy": 0.1})
    return run.pk, made[0].pk


def side(django_user_model, make_dataset, name: str, rollouts: int, calls: int, runs: int = 2) -> Side:
    """A user with `runs` runs: the first has `rollouts` x `calls`, the others 3 x 2."""
    user = django_user_model.objects.create_user(name, password=f"{name}-password-123")
    harness = catalog_services.create_harness(user, name="agent", command=["python", "agent.py", "{task_file}"])
    dataset = make_dataset(user, tasks=[{"id": f"t{i}", "question": f"{i}+1", "answer": i + 1,
                                         "split": "val" if i % 5 == 0 else "train"} for i in range(rollouts + 1)])
    reward = catalog_services.create_reward_script(user, name="exact", source="def reward(task, outcome):\n    return 1.0\n")
    run, rollout = running_run(user, "main", harness, dataset, reward, rollouts, calls)
    others = [running_run(user, f"other {i}", harness, dataset, reward, 3, 2)[0] for i in range(runs - 1)]
    client = Client()
    client.force_login(user)
    sample = Sample.objects.filter(rollout_id=rollout).values_list("pk", flat=True).first()
    val_task = Rollout.objects.filter(run_id=run, split="val").values_list("task_id", flat=True).first()
    return Side(client, run, others[0], rollout, dataset.pk, sample, val_task)


@pytest.fixture
def small(django_user_model, make_dataset):
    return side(django_user_model, make_dataset, "small", rollouts=3, calls=2)


@pytest.fixture
def big(django_user_model, make_dataset):
    return side(django_user_model, make_dataset, "big", rollouts=30, calls=5)


def url(label: str, s: Side) -> str:
    name, argument, query = PAGES[label]
    if name is None:
        path = argument(s)
    else:
        arg = argument(s)
        try:
            path = reverse(name, args=[] if arg is None else list(arg) if isinstance(arg, tuple) else [arg])
        except NoReverseMatch:
            pytest.fail(f"no dashboard page named {name!r}")
    return path + query.format(run=s.run, peer=s.peer)


def queries(s: Side, address: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = s.client.get(address, HTTP_ACCEPT="text/html,application/json")
    assert response.status_code == 200, (address, response.content[:500])
    return len(captured)


@pytest.mark.parametrize("label", [label for label in PAGES if label not in ("runs-list", "runs-rows")])
def test_a_run_page_costs_the_same_queries_for_a_big_run(label, small, big):
    small_url, big_url = url(label, small), url(label, big)
    small_count, big_count = queries(small, small_url), queries(big, big_url)
    assert small_count <= big_count <= small_count + SLACK, (label, small_count, big_count)


@pytest.mark.parametrize("label", ["runs-list", "runs-rows"])
def test_the_runs_list_costs_the_same_queries_for_20_runs_as_for_2(label, django_user_model, make_dataset):
    few = side(django_user_model, make_dataset, "few", rollouts=3, calls=2, runs=2)
    many = side(django_user_model, make_dataset, "many", rollouts=3, calls=2, runs=20)
    few_count, many_count = queries(few, url(label, few)), queries(many, url(label, many))
    assert few_count <= many_count <= few_count + SLACK, (label, few_count, many_count)
    assert b"other 18" in many.client.get(url(label, many)).content  # the 20 runs are on the page


@pytest.mark.parametrize("sort", list(rollout_queries.SORTS))
def test_the_rollouts_table_reads_a_page_in_its_order_from_an_index(sort, alice, make_run):
    """runs.models' Rollout indexes: no sort of every rollout of the run (SQLite plans without statistics, so its
    plan is the same at 10 rows as at 10,000; bench/dashboard_load.py --explain shows PostgreSQL's at size)."""
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL's plan depends on the table's size; bench/dashboard_load.py --explain shows it")
    run = make_run(alice)
    for group in range(10):
        rollout_services.create_rollout(run, task=None, split="train", step=1, group=group, attempt=0)
    with CaptureQueriesContext(connection) as captured:
        page = rollout_queries.rollouts_page(run, rollout_queries.RolloutQuery(sort=sort, page=2, page_size=3))
    assert page["count"] == 10 and len(page["results"]) == 3
    [select] = [q["sql"] for q in captured if "ORDER BY" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + select)
        plan = " / ".join(row[-1] for row in cursor.fetchall())
    assert "USING" in plan and "INDEX" in plan and "TEMP B-TREE" not in plan, plan
