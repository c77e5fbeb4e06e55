"""Item 8 of the dashboard: CSRF on every form and every page that writes, and a user sees only their own objects.

Every dashboard URL that takes a POST is listed here; a POST without the CSRF token is refused (403) and changes
nothing. Every page of an object answers 404 to another user and 200 to its owner and to staff.
"""
import pytest
from django.test import Client
from django.urls import reverse

from catalog.models import Dataset, Harness, RewardScript
from runs import rollout_services
from runs.models import ModelCall, Run, RunStatus

pytestmark = pytest.mark.django_db


@pytest.fixture
def objects(alice, make_run):
    run = make_run(alice)
    Run.objects.filter(pk=run.pk).update(name="alice-secret-run")
    run.refresh_from_db()
    other = make_run(alice, name="second")
    rollout, _ = rollout_services.create_rollout(run, task=run.dataset.tasks.first(), split="train", step=0, group=0,
                                                 attempt=0)
    ModelCall.objects.create(rollout=rollout, seq=0, api="chat", request={"messages": []}, status_code=200)
    rollout_services.record_step(run.pk, 1, 1, [{
        "rollout_id": rollout.pk, "token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.5, -0.2],
        "advantage": 0.5, "call_seqs": [0], "build": "single", "policy_version": 0, "step": 1}], {}, {},
        {rollout.pk: ""})
    val_task = run.dataset.tasks.filter(split="val").first()
    return {"run": run, "other": other, "rollout": rollout, "harness": run.harness, "dataset": run.dataset,
            "reward": run.reward_script, "sample": rollout.samples.get(), "val_task": val_task}


def pages(o):
    """(name, url) of every page that shows one of alice's objects."""
    return [
        ("run-detail", reverse("run-detail", args=[o["run"].pk])),
        ("run-rollouts", reverse("run-rollouts-table", args=[o["run"].pk])),
        ("run-metric-series", reverse("run-metric-series", args=[o["run"].pk])),
        ("rollout-detail", reverse("rollout-detail", args=[o["rollout"].pk])),
        ("rollout-call-raw", reverse("rollout-call-raw", args=[o["rollout"].pk, 0])),
        ("sample-tokens", reverse("sample-tokens", args=[o["sample"].pk])),
        ("sample-tokens-data", reverse("sample-tokens-data", args=[o["sample"].pk])),
        ("run-val-grid", reverse("run-val-grid", args=[o["run"].pk])),
        ("val-task-compare", reverse("val-task-compare", args=[o["run"].pk, o["val_task"].pk]) + "?a=0&b=1"),
        ("run-steps", reverse("run-steps", args=[o["run"].pk])),
        ("run-step", reverse("run-step", args=[o["run"].pk, 1])),
        ("run-step-data", reverse("run-step-data", args=[o["run"].pk, 1])),
        ("run-export", reverse("run-export", args=[o["run"].pk])),
        ("run-compare", reverse("run-compare") + f"?ids={o['run'].pk},{o['other'].pk}"),
        ("harness-detail", reverse("harness-detail", args=[o["harness"].pk])),
        ("dataset-detail", reverse("dataset-detail", args=[o["dataset"].pk])),
        ("reward-detail", reverse("reward-detail", args=[o["reward"].pk])),
        ("run-new (clone)", reverse("run-new") + f"?clone={o['run'].pk}"),
    ]


def posts(o):
    """(name, url, data) of every dashboard POST: each must refuse a request without the CSRF token."""
    run, harness, dataset, reward = o["run"], o["harness"], o["dataset"], o["reward"]
    return [
        ("run-new", reverse("run-new"), {"name": "x"}),
        ("run-demo", reverse("run-demo"), {}),
        ("run-cancel", reverse("run-cancel", args=[run.pk]), {}),
        ("run-resume", reverse("run-resume", args=[run.pk]), {}),
        ("run-continue", reverse("run-continue", args=[run.pk]), {"steps": 2}),
        ("runs-bulk-cancel", reverse("runs-bulk-cancel"), {"ids": [run.pk]}),
        ("harness-new", reverse("harness-new"), {"name": "h2", "argv": ["python"]}),
        ("harness-detail", reverse("harness-detail", args=[harness.pk]), {"name": "renamed", "argv": ["python"]}),
        ("harness-delete", reverse("harness-delete", args=[harness.pk]), {}),
        ("dataset-new", reverse("dataset-new"), {"name": "d2"}),
        ("dataset-delete", reverse("dataset-delete", args=[dataset.pk]), {}),
        ("reward-new", reverse("reward-new"), {"name": "r2", "source": "def reward(t, o):\n    return 1\n"}),
        ("reward-detail", reverse("reward-detail", args=[reward.pk]), {"name": "r3", "source": "x"}),
        ("reward-delete", reverse("reward-delete", args=[reward.pk]), {}),
        ("reward-test", reverse("reward-test"), {"source": "def reward(t, o):\n    return 1\n"}),
        ("model-import-tiny", reverse("model-import-tiny"), {"name": "t2"}),
        ("model-import-smollm2", reverse("model-import-smollm2"), {}),
        ("model-import-gemma3", reverse("model-import-gemma3"), {}),
        ("logout", reverse("logout"), {}),
    ]


def snapshot():
    return (list(Run.objects.order_by("pk").values_list("pk", "status", "name")),
            list(Harness.objects.order_by("pk").values_list("pk", "name", "version")),
            list(Dataset.objects.order_by("pk").values_list("pk", "name")),
            list(RewardScript.objects.order_by("pk").values_list("pk", "name", "version")))


def test_every_post_without_the_csrf_token_is_refused_and_changes_nothing(alice, objects):
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    before = snapshot()
    for name, url, data in posts(objects):
        response = client.post(url, data)
        assert response.status_code == 403, f"{name}: {response.status_code}"
        assert b"CSRF" in response.content, name
    assert snapshot() == before
    assert Run.objects.get(pk=objects["run"].pk).status == RunStatus.QUEUED


def test_every_page_with_a_form_carries_the_csrf_token(alice, objects):
    client = Client()
    client.force_login(alice)
    form_pages = [("runs-list", reverse("runs-list")), ("run-new", reverse("run-new")),
                  ("harness-new", reverse("harness-new")), ("dataset-new", reverse("dataset-new")),
                  ("reward-new", reverse("reward-new")), ("model-list", reverse("model-list"))]
    for name, url in form_pages + pages(objects):
        response = client.get(url)
        if response.streaming:  # the export: a download, no form
            continue
        body = response.content.decode()
        if "<form" in body and 'method="post"' in body:
            assert body.count('name="csrfmiddlewaretoken"') >= body.count('method="post"'), name


def test_another_user_gets_404_on_every_object_page_and_cannot_post(alice, bob, staff, objects):
    for user, expected in ((bob, 404), (alice, 200), (staff, 200)):
        client = Client()
        client.force_login(user)
        for name, url in pages(objects):
            assert client.get(url).status_code == expected, f"{user.username} {name}"
    client = Client()
    client.force_login(bob)
    before = snapshot()
    for name, url, data in posts(objects):
        if name in ("run-new", "harness-new", "dataset-new", "reward-new", "reward-test", "run-demo", "logout",
                    "model-import-tiny", "model-import-smollm2", "model-import-gemma3", "runs-bulk-cancel"):
            continue  # not about one of alice's objects (bulk cancel: below)
        assert client.post(url, data).status_code == 404, f"bob {name}"
    response = client.post(reverse("runs-bulk-cancel"), {"ids": [objects["run"].pk]})
    assert response.status_code in (200, 302, 400, 404)
    assert snapshot() == before


def test_lists_show_only_the_users_own_objects(alice, bob, objects, make_run):
    make_run(bob, name="bobsrun")
    client = Client()
    client.force_login(bob)
    for name, mine, theirs in (("runs-list", "bobsrun", "alice-secret-run"), ("harness-list", "bobsrun-h", "run-h"),
                               ("dataset-list", "bobsrun-d", "run-d"), ("reward-list", "bobsrun-r", "run-r")):
        body = client.get(reverse(name)).content.decode()
        assert mine in body, name
        assert f">{theirs}<" not in body and "alice-secret-run" not in body, name
    assert "alice-secret-run" not in client.get(reverse("runs-rows")).content.decode()
