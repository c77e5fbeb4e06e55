"""A rollout's page (/rollouts/<id>/): what it ran on, how it ended, its calls; escaped; owner only."""
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from runs import rollout_services
from runs.models import Task
from tests.runs.test_rollouts_table import call

pytestmark = pytest.mark.django_db

XSS = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


@pytest.fixture
def rollout(alice, make_run, make_dataset, make_harness, make_reward):
    from runs import services

    dataset = make_dataset(alice, name="xss", tasks=[
        {"id": "t-xss", "question": XSS, "answer": "secret-gold-answer", "split": "train"}])
    run = services.create_run(alice, name=f"run {XSS}", model="tiny", config={}, harness=make_harness(alice),
                              dataset=dataset, reward_script=make_reward(alice))
    task = Task.objects.get(dataset=dataset)
    rollout, _ = rollout_services.create_rollout(run, task=task, split="train", step=3, group=2, attempt=1)
    rollout_services.record_calls([call(rollout.pk, 0, prompt=120, completion=7),
                                   call(rollout.pk, 1, prompt=140, completion=9)])
    rollout_services.start_rollout(rollout.pk)
    return rollout_services.finish_rollout(
        rollout.pk, status="failed", reward=0.0, reward_detail={"note": XSS, "checked": True}, exit_code=3,
        stdout_tail=f"out {XSS}", stderr_tail=f"err {XSS}", error=f"harness exited {XSS}", failure_kind="policy")


def test_it_shows_the_rollout(client, alice, rollout):
    client.force_login(alice)
    response = client.get(f"/rollouts/{rollout.pk}/")
    html = response.content.decode()
    assert response.status_code == 200
    assert f'href="/runs/{rollout.run_id}/"' in html
    for fact in ("<dt>Step</dt><dd>3</dd>", "<dt>Group · attempt</dt><dd>2 · 1</dd>",
                 "<dt>Failure kind</dt><dd>policy</dd>", "<dt>Exit code</dt><dd>3</dd>", "<dt>Task</dt><dd>t-xss</dd>",
                 '<dd id="rollout-reward">0.0</dd>', "<dt>Calls</dt><dd>2</dd>"):
        assert fact in html
    assert 'class="status status-failed">failed</span>' in html
    assert "&quot;checked&quot;: true" in html  # the reward detail as pretty JSON


def test_it_lists_the_calls_with_token_counts_counted_in_sql(client, alice, rollout):
    client.force_login(alice)
    with CaptureQueriesContext(connection) as queries:
        html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    table = html[html.index('id="rollout-calls"'):]
    rows = table.split("<tr>")[2:]
    assert len(rows) == 2
    assert "<td>0</td><td>chat</td><td>200</td>" in rows[0] and "<td>120</td>" in rows[0] and "<td>7</td>" in rows[0]
    assert "<td>140</td>" in rows[1] and "<td>9</td>" in rows[1] and "<td>stop</td>" in rows[1]
    call_queries = [q["sql"] for q in queries.captured_queries if "modelcall" in q["sql"].lower()]
    assert len(call_queries) == 1
    columns = call_queries[0].split(" FROM ")[0].lower()
    assert 'array_length("runs_modelcall"."prompt_ids")' in columns  # counted by the database
    assert 'array_length("runs_modelcall"."completion_ids")' in columns
    read = re.sub(r'array_length\("runs_modelcall"\."\w+"\)', "", columns)
    for blob in ("request", "response", "logprobs", "prompt_ids", "completion_ids"):
        assert f'"runs_modelcall"."{blob}"' not in read  # the arrays and bodies themselves are never read


def test_it_escapes_everything_and_hides_reward_only_fields(client, alice, rollout):
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "<script>alert(1)" not in html and "<img src=x" not in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 6  # task, reward detail, out, err, error, name
    assert "secret-gold-answer" not in html  # the task as the harness saw it


def test_another_users_rollout_is_not_found(client, bob, rollout):
    client.force_login(bob)
    assert client.get(f"/rollouts/{rollout.pk}/").status_code == 404


def test_staff_see_any_rollout(client, staff, rollout):
    client.force_login(staff)
    assert client.get(f"/rollouts/{rollout.pk}/").status_code == 200


def test_login_is_required(client, rollout):
    response = client.get(f"/rollouts/{rollout.pk}/")
    assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_a_rollout_without_calls_or_task(client, alice, make_run):
    run = make_run(alice)
    rollout, _ = rollout_services.create_rollout(run, task=None, split="val", step=0, group=0, attempt=0)
    client.force_login(alice)
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert 'id="rollout-no-calls"' in html and "The task was deleted." in html
    assert 'class="status status-pending">pending</span>' in html
