"""The inspector's pages: run-val-grid, run-steps, run-step and run-step-data (owner-only, fixed queries), and the
run page's Validation and Steps sections."""
from __future__ import annotations

import json
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dashboard import inspect_queries
from runs import rollout_services, services
from runs.models import Metric, Rollout, Sample
from tests.dashboard.test_inspect_queries import (  # noqa: F401 (fixtures)
    TRAIN,
    VAL,
    evaluate,
    evaluated,
    fill_step,
    recorded,
    run,
    stepped,
    train_rollout,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice_client(client, alice):
    client.force_login(alice)
    return client


@pytest.fixture
def bob_client(client, bob):
    client.force_login(bob)
    return client


def test_the_grid_json_gives_its_owner_the_cells_and_flags(alice_client, evaluated):
    rows = Rollout.objects.count()
    response = alice_client.get(reverse("run-val-grid", args=[evaluated.pk]))
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    body = response.json()
    assert body["run"] == evaluated.pk and body["steps"] == [0, 2, 4]
    tasks = {t["external_id"]: t for t in body["tasks"]}
    assert tasks["v0"]["fail_to_pass"] and tasks["v0"]["flipped"] and tasks["v1"]["pass_to_fail"]
    assert tasks["v2"]["never_solved"] and tasks["v0"]["states"] == ["fail", "partial", "pass"]
    assert body["counts"]["flipped"] == 3
    assert Rollout.objects.count() == rows  # a read: nothing written


@pytest.mark.parametrize("name, args", [("run-val-grid", []), ("run-steps", []), ("run-step", [1]),
                                        ("run-step-data", [1])])
def test_another_user_gets_404_and_a_visitor_the_login_page(client, bob, stepped, name, args):
    run, _ = stepped
    url = reverse(name, args=[run.pk, *args])
    response = client.get(url)
    assert response.status_code == 302 and "/login" in response["Location"]
    client.force_login(bob)
    assert client.get(url).status_code == 404


def test_the_run_page_has_the_validation_and_steps_sections(alice_client, evaluated):
    response = alice_client.get(reverse("run-detail", args=[evaluated.pk]))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="val-grid"' in html and 'id="step-list"' in html and "css/inspect.css" in html
    select = re.search(r'<select id="val-grid-filter">(.*?)</select>', html, re.S).group(1)
    assert re.findall(r'value="(\w+)"', select) == ["all", "flipped", "fail_to_pass", "pass_to_fail", "never_solved"]
    assert 'id="val-grid-sort"' in html
    assert f'data-url="{reverse("run-val-grid", args=[evaluated.pk])}"' in html
    assert f'data-url="{reverse("run-steps", args=[evaluated.pk])}"' in html
    assert f'data-step-template="/runs/{evaluated.pk}/steps/999999999/"' in html
    assert 'js/pages/run_detail.js' in html  # its entry, which imports run_page.js
    assert "val_grid.js fills" not in html and "{%" not in html  # the template's comment stays out of the page


def test_the_steps_json_lists_the_trained_steps(alice_client, stepped):
    run, _ = stepped
    response = alice_client.get(reverse("run-steps", args=[run.pk]))
    assert response.status_code == 200
    steps = response.json()["steps"]
    assert [s["step"] for s in steps] == [1, 2] and steps[0]["metrics"]["groups/with_signal"] == 1.0


def test_the_step_page_shows_groups_no_signal_and_advantages(alice_client, stepped):
    run, r = stepped
    response = alice_client.get(reverse("run-step", args=[run.pk, 1]))
    assert response.status_code == 200
    html = response.content.decode()
    groups = re.findall(r'<tbody class="group( group-no-signal)?" data-group="(\d+)">', html)
    assert groups == [("", "0"), (" group-no-signal", "1")]
    for key in ("a0", "a1", "b0", "b1"):
        assert f'<tr class="attempt" data-rollout="{r[key].pk}">' in html
    advantage = Sample.objects.get(rollout=r["a1"]).advantage
    assert f'data-sample="{Sample.objects.get(rollout=r["a1"]).pk}">{advantage:.3f}</span>' in html
    assert 'id="timeline"' in html and 'js/pages/step.js' in html
    config = json.loads(re.search(r'id="step-page-config" type="application/json">(.*?)</script>', html).group(1))
    assert [b["rollout"] for b in config["timeline"]["bars"]] == [r[k].pk for k in ("a0", "a1", "b0", "b1")]
    assert [b["kind"] for b in config["timeline"]["bands"]] == ["generate", "train", "sync", "record"]
    assert f'href="{reverse("run-step", args=[run.pk, 2])}"' in html  # the next step


def test_the_step_page_lists_what_was_dropped_with_the_reason(alice_client, stepped):
    run, r = stepped
    html = alice_client.get(reverse("run-step", args=[run.pk, 2])).content.decode()
    dropped = re.findall(r'<li class="dropped" data-rollout="(\d+)" data-reason="([\w_]+)">', html)
    assert dropped == [(str(r["c2"].pk), "infra_failure"), (str(r["d1"].pk), "no_sampled_tokens")]
    assert "infra_failure: engine down" in html
    assert f'<li class="failed-call" data-rollout="{r["d1"].pk}" data-seq="0">' in html
    assert f'<li class="truncated" data-rollout="{r["d0"].pk}" data-seq="0">' in html
    assert f'<tr class="attempt dropped-attempt" data-rollout="{r["c2"].pk}">' in html
    assert "staleness never drops a sample" in html.lower()


def test_the_step_json_is_the_step_data(alice_client, stepped):
    run, _ = stepped
    response = alice_client.get(reverse("run-step-data", args=[run.pk, 2]))
    assert response.status_code == 200
    assert response.json() == json.loads(json.dumps(inspect_queries.step_data(run, 2)))
    assert Metric.objects.filter(run=run).count() == 10  # a read: nothing written


def test_text_from_the_run_is_escaped_on_the_step_page(alice_client, run):
    rollout = train_rollout(run, "t0", 0, 0, 0, None, failure_kind="infra", calls=lambda pk: [
        recorded(pk, 0, prompt=(), completion=(), status=500, error="<script>alert(1)</script>")])
    rollout_services.record_step(run.pk, 1, 1, [], {}, {"reward/mean": 0.0},
                                 {rollout.pk: "infra_failure: <img src=x onerror=alert(1)>"})
    html = alice_client.get(reverse("run-step", args=[run.pk, 1])).content.decode()
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def count_queries(client, url) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200
    return len(captured)


@pytest.mark.parametrize("name", ["run-step", "run-step-data"])
def test_the_step_pages_cost_the_same_queries_for_a_bigger_step(client, django_user_model, make_harness,
                                                                 make_dataset, make_reward, name):
    counts = []
    for size, groups in (("small", 1), ("big", 15)):
        user = django_user_model.objects.create_user(size, password=f"{size}-password-123")
        run = services.create_run(user, name=size, model="tiny", config={}, harness=make_harness(user),
                                  dataset=make_dataset(user, tasks=VAL + TRAIN), reward_script=make_reward(user))
        fill_step(run, groups)
        client.force_login(user)
        counts.append(count_queries(client, reverse(name, args=[run.pk, 1])))
    assert counts[0] == counts[1] <= 10, counts


def test_the_grid_json_costs_the_same_queries_for_a_bigger_grid(client, django_user_model, make_harness,
                                                                 make_dataset, make_reward):
    counts = []
    for size, tasks, evaluations in (("small", 1, 1), ("big", 30, 10)):
        user = django_user_model.objects.create_user(size, password=f"{size}-password-123")
        val = [{"id": f"v{i}", "question": "q", "answer": i, "split": "val"} for i in range(tasks)] + TRAIN
        run = services.create_run(user, name=size, model="tiny", config={}, harness=make_harness(user),
                                  dataset=make_dataset(user, tasks=val), reward_script=make_reward(user))
        for step in range(evaluations):
            evaluate(run, step, {f"v{i}": ((float((i + step) % 2),), None) for i in range(tasks)})
        client.force_login(user)
        counts.append(count_queries(client, reverse("run-val-grid", args=[run.pk])))
    assert counts[0] == counts[1] <= 5, counts
