"""The run page's rollouts table (GET /runs/<id>/rollouts/): filtered, sorted and paged in SQL, constant queries."""
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Task
from proxy.types import RecordedCall
from runs import rollout_services
from runs.models import Rollout

pytestmark = pytest.mark.django_db


def make_rollout(run, task=None, *, step=1, split="train", group=0, attempt=0, status="succeeded", reward=None,
                 error="", seconds=None, calls=0):
    rollout, _ = rollout_services.create_rollout(run, task=task, split=split, step=step, group=group,
                                                 attempt=attempt)
    if calls:
        rollout_services.record_calls([call(rollout.pk, seq) for seq in range(calls)])
    if status != "pending":
        rollout_services.start_rollout(rollout.pk)
    if status not in ("pending", "running"):
        rollout_services.finish_rollout(rollout.pk, status=status, reward=reward, reward_detail={}, exit_code=0,
                                        error=error, failure_kind="infra" if status == "failed" else "")
    if seconds is not None:  # a known duration (the services stamp "now")
        start = timezone.now() - timedelta(hours=1)
        Rollout.objects.filter(pk=rollout.pk).update(started_at=start, finished_at=start + timedelta(seconds=seconds))
    return rollout


def call(rollout_id, seq, prompt=2000, completion=50):
    return RecordedCall(rollout_id=str(rollout_id), seq=seq, api="chat", request={"messages": []}, response={},
                        upstream_request={}, prompt_ids=list(range(prompt)), completion_ids=list(range(completion)),
                        logprobs=[0.0] * completion, finish_reason="stop", status_code=200, latency_ms=12.5,
                        policy_version=0, error=None, stream=False, started_at=0.0)


@pytest.fixture
def seeded(alice, make_run):
    run = make_run(alice)
    tasks = {t.external_id: t for t in Task.objects.filter(dataset=run.dataset)}
    rows = {
        "a": make_rollout(run, tasks["t1"], step=1, reward=0.0, seconds=5, calls=1),
        "b": make_rollout(run, tasks["t2"], step=1, group=1, reward=1.0, seconds=20, calls=3),
        "c": make_rollout(run, tasks["t3"], step=2, reward=0.5, seconds=1, calls=2),
        "d": make_rollout(run, tasks["t0"], step=2, split="val", status="failed", error="engine <b>died</b>",
                          seconds=60),
        "e": make_rollout(run, tasks["t4"], step=3, status="running"),
    }
    return run, rows


def ids(response, rows):
    by_pk = {r.pk: name for name, r in rows.items()}
    return [by_pk[r["id"]] for r in response.json()["results"]]


def test_it_lists_the_newest_first_with_the_row_fields(client, alice, seeded):
    run, rows = seeded
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/rollouts/")
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 5 and body["page"] == 1 and body["pages"] == 1
    assert ids(response, rows) == ["e", "d", "c", "b", "a"]
    b = next(r for r in body["results"] if r["id"] == rows["b"].pk)
    assert b["task"] == "t2" and b["step"] == 1 and b["group"] == 1 and b["calls"] == 3
    assert b["reward"] == 1.0 and b["duration_s"] == pytest.approx(20.0) and b["status"] == "succeeded"
    d = next(r for r in body["results"] if r["id"] == rows["d"].pk)
    assert d["error"] == "engine <b>died</b>" and d["failure_kind"] == "infra" and d["split"] == "val"
    e = next(r for r in body["results"] if r["id"] == rows["e"].pk)
    assert e["duration_s"] is None and e["reward"] is None and e["status"] == "running"


@pytest.mark.parametrize("query, expected", [
    ("step=1", ["b", "a"]),
    ("split=val", ["d"]),
    ("status=succeeded", ["c", "b", "a"]),
    ("reward_min=0.5", ["c", "b"]),
    ("reward_min=0.1&reward_max=0.9", ["c"]),
    ("q=T3", ["c"]),  # the task's external id, case-insensitive
    ("q=died", ["d"]),  # the error
    ("step=2&split=train", ["c"]),
])
def test_it_filters(client, alice, seeded, query, expected):
    run, rows = seeded
    client.force_login(alice)
    assert ids(client.get(f"/runs/{run.pk}/rollouts/?{query}"), rows) == expected


@pytest.mark.parametrize("sort, expected", [
    ("-reward", ["b", "c", "a", "e", "d"]),  # no reward: last, either way
    ("reward", ["a", "c", "b", "d", "e"]),
    ("-duration", ["d", "b", "a", "c", "e"]),
    ("duration", ["c", "a", "b", "d", "e"]),
    ("-calls", ["b", "c", "a", "e", "d"]),
    ("calls", ["d", "e", "a", "c", "b"]),
    ("oldest", ["a", "b", "c", "d", "e"]),
])
def test_it_sorts(client, alice, seeded, sort, expected):
    run, rows = seeded
    client.force_login(alice)
    assert ids(client.get(f"/runs/{run.pk}/rollouts/?sort={sort}"), rows) == expected


def test_it_pages(client, alice, seeded):
    run, rows = seeded
    client.force_login(alice)
    first = client.get(f"/runs/{run.pk}/rollouts/?page_size=2&sort=oldest").json()
    assert first["pages"] == 3 and first["count"] == 5
    third = client.get(f"/runs/{run.pk}/rollouts/?page_size=2&sort=oldest&page=3")
    assert ids(third, rows) == ["e"]
    past = client.get(f"/runs/{run.pk}/rollouts/?page_size=2&sort=oldest&page=9").json()
    assert past["page"] == 3  # a page past the end shows the last one


@pytest.mark.parametrize("query, message", [
    ("step=x", "step must be an integer, got 'x'"),
    ("reward_min=nan", "reward_min must be a finite number"),
    ("split=test", "split must be one of"),
    ("status=done", "status must be one of"),
    ("sort=name", "sort must be one of"),
    ("page=0", "page must be at least 1"),
])
def test_a_bad_filter_is_refused_with_a_reason(client, alice, seeded, query, message):
    run, _ = seeded
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/rollouts/?{query}")
    assert response.status_code == 400 and message in response.json()["error"]


def test_another_users_rollouts_are_not_found(client, bob, seeded):
    run, _ = seeded
    client.force_login(bob)
    assert client.get(f"/runs/{run.pk}/rollouts/").status_code == 404


def test_login_is_required(client, seeded):
    run, _ = seeded
    response = client.get(f"/runs/{run.pk}/rollouts/")
    assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_the_query_count_does_not_grow_and_no_call_is_read(client, alice, make_run):
    run = make_run(alice)
    client.force_login(alice)

    def measure():
        with CaptureQueriesContext(connection) as queries:
            response = client.get(f"/runs/{run.pk}/rollouts/?sort=-duration&q=t&reward_min=0")
        assert response.status_code == 200
        return response.json()["count"], [q["sql"] for q in queries.captured_queries]

    make_rollout(run, step=1, reward=1.0, seconds=3, calls=2)
    count_small, small = measure()
    for step in range(2, 40):
        make_rollout(run, step=step, reward=1.0, seconds=step, calls=3)
    count_big, big = measure()
    assert (count_small, count_big) == (0, 0)  # no task matches "t": the filter ran in SQL
    assert len(small) == len(big) <= 5
    assert not any("modelcall" in sql.lower() for sql in big)
    _, unfiltered = measure_all(client, run)
    assert not any("modelcall" in sql.lower() for sql in unfiltered)


def measure_all(client, run):
    with CaptureQueriesContext(connection) as queries:
        response = client.get(f"/runs/{run.pk}/rollouts/?page_size=200")
    assert response.status_code == 200 and response.json()["count"] == 39
    return response, [q["sql"] for q in queries.captured_queries]
