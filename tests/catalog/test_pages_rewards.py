"""Reward-script pages: the code editor (django-ace, served locally), save as a new version, delete when unused, and
the test panel's endpoint scoring the editor's source in the sandbox."""
import json
import tempfile
from pathlib import Path

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils.html import escape

from catalog.models import RewardScript
from catalog.pages.resource_forms import outcome_from_text
from catalog.reward_tests import run_reward_test
from sandbox.executors.base import read_outcome

pytestmark = pytest.mark.django_db

SOURCE = '''def reward(task, outcome):
    print("checking", task["id"])
    right = outcome.get("answer") == task["answer"]
    return {"reward": float(right), "right": right}
'''


def reward_post(**overrides):
    data = {"name": "exact", "description": "", "source": SOURCE, "timeout_s": "5"}
    data.update(overrides)
    return data


def test_the_list_shows_own_scripts_escaped(client, alice, bob, make_reward):
    make_reward(alice, name="<i>mine</i>")
    make_reward(bob, name="theirs")
    client.force_login(alice)
    response = client.get("/reward-scripts/")
    page = response.content.decode()
    assert response.status_code == 200
    assert "&lt;i&gt;mine&lt;/i&gt;" in page and "<i>mine</i>" not in page and "theirs" not in page


def test_the_editor_is_ace_in_python_mode_served_locally(client, alice):
    client.force_login(alice)
    page = client.get("/reward-scripts/new/").content.decode()
    assert 'class="django-ace-widget loading"' in page and 'data-mode="python"' in page
    for path in ("django_ace/ace/ace.js", "django_ace/widget.js", "django_ace/ace/mode-python.js"):
        assert f'src="/static/{path}"' in page
        assert client.get(f"/static/{path}").status_code == 200
    assert "def reward(task, outcome):" in page  # a starter script
    assert 'id="reward-test"' in page and 'data-test-url="/reward-scripts/test/"' in page


def test_create_and_edit_make_versions_and_runs_keep_their_snapshot(client, alice, make_run):
    client.force_login(alice)
    response = client.post("/reward-scripts/new/", reward_post())
    script = RewardScript.objects.get(name="exact")
    assert response.status_code == 302 and response.url == f"/reward-scripts/{script.pk}/"
    assert script.source == SOURCE and script.timeout_s == 5 and script.version == 1 and script.owner == alice

    run = make_run(alice)
    used = run.reward_script
    before = dict(run.reward_snapshot)
    response = client.post(f"/reward-scripts/{used.pk}/", reward_post(name=used.name, source=SOURCE))
    assert response.status_code == 302
    used.refresh_from_db()
    run.refresh_from_db()
    assert used.version == 2 and used.source == SOURCE
    assert run.reward_snapshot == before and run.reward_snapshot["version"] == 1
    page = client.get(f"/reward-scripts/{used.pk}/").content.decode()
    assert "Saved as version 2." in page and f'href="/runs/{run.pk}/"' in page and "<td>v1</td>" in page


@pytest.mark.parametrize("overrides, field, message", [
    ({"source": "def reward(task, outcome)\n    return 1\n"}, "source", "SyntaxError: expected &#x27;:&#x27; (line 1)"),
    ({"source": "def score(task, outcome):\n    return 1\n"}, "source", "must define a top-level function reward"),
    ({"source": ""}, "source", "This field is required."),
    ({"timeout_s": "900"}, "timeout_s", "must be between 1 and 300 seconds"),
    ({"name": ""}, "name", "This field is required."),
])
def test_an_error_shows_beside_its_field_and_nothing_is_saved(client, alice, overrides, field, message):
    client.force_login(alice)
    response = client.post("/reward-scripts/new/", reward_post(description="typed <text>", **overrides))
    page = response.content.decode()
    assert response.status_code == 200 and RewardScript.objects.count() == 0
    error = page.split(f'id="field-{field}"')[1].split('id="field-')[0]
    assert f'id="id_{field}_error"' in error and message in error
    assert "typed &lt;text&gt;</textarea>" in page  # what was typed is kept


def test_the_source_typed_is_kept_after_an_error(client, alice):
    client.force_login(alice)
    page = client.post("/reward-scripts/new/", reward_post(name="")).content.decode()
    assert escape(SOURCE) in page


def test_a_duplicate_name_is_a_field_error(client, alice, make_reward):
    make_reward(alice, name="exact")
    client.force_login(alice)
    response = client.post("/reward-scripts/new/", reward_post())
    assert response.status_code == 200 and RewardScript.objects.count() == 1
    assert "you already have a reward script named &#x27;exact&#x27;" in response.content.decode()


def test_delete_when_unused_and_refused_when_used(client, alice, make_reward, make_run):
    unused = make_reward(alice, name="spare")
    run = make_run(alice)
    client.force_login(alice)
    response = client.post(f"/reward-scripts/{run.reward_script_id}/delete/")
    assert response.status_code == 409 and "is used by 1 run(s) and cannot be deleted" in response.content.decode()
    assert RewardScript.objects.filter(pk=run.reward_script_id).exists()
    response = client.post(f"/reward-scripts/{unused.pk}/delete/")
    assert response.status_code == 302 and response.url == "/reward-scripts/"
    assert not RewardScript.objects.filter(pk=unused.pk).exists()


def test_another_users_script_is_not_found(client, alice, bob, make_reward):
    script = make_reward(bob)
    client.force_login(alice)
    assert client.get(f"/reward-scripts/{script.pk}/").status_code == 404
    assert client.post(f"/reward-scripts/{script.pk}/", reward_post()).status_code == 404
    assert client.post(f"/reward-scripts/{script.pk}/delete/").status_code == 404
    script.refresh_from_db()
    assert script.name == "exact" and script.version == 1


def test_csrf_is_enforced(alice, make_reward, make_dataset):
    script = make_reward(alice)
    make_dataset(alice)
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    assert client.post("/reward-scripts/new/", reward_post(name="x")).status_code == 403
    assert client.post(f"/reward-scripts/{script.pk}/", reward_post()).status_code == 403
    assert client.post(f"/reward-scripts/{script.pk}/delete/").status_code == 403
    test = {"source": SOURCE, "task_source": "json", "task_json": '{"id": 1, "answer": 2}', "outcome": "{}"}
    assert client.post("/reward-scripts/test/", test, content_type="application/json").status_code == 403
    assert RewardScript.objects.count() == 1 and RewardScript.objects.get().version == 1
    client.get("/reward-scripts/new/")  # sets the csrf cookie the page's script sends back as a header
    token = client.cookies["csrftoken"].value
    response = client.post("/reward-scripts/test/", test, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 202 and response.json()["status"] == "queued"


# ---------------------------------------------------------------- the test panel's endpoint


def score(client, **body):
    """What the panel does: queue the test, (the control worker scores it), then read the result."""
    queued = client.post("/reward-scripts/test/", body, content_type="application/json")
    if queued.status_code != 202:
        return queued
    assert run_reward_test(queued.json()["test"]) == "done"  # as the control worker runs it
    return client.get(queued.json()["url"])


def test_the_web_process_only_queues_the_test_a_worker_scores_it(client, alice, bob, test_redis, monkeypatch):
    """Issue 26.9: the web tier runs no user code. The request is queued on the control worker's queue; the result
    is there once the task ran; another user cannot read it."""
    from catalog import services

    def no_user_code_here(*args, **kwargs):
        raise AssertionError("the web process scored user code")

    client.force_login(alice)
    with monkeypatch.context() as patched:
        patched.setattr(services, "score_reward", no_user_code_here)
        queued = client.post("/reward-scripts/test/", {"source": SOURCE, "task_source": "json", "outcome": "{}",
                                                       "task_json": '{"id": "t1", "answer": 2}'},
                             content_type="application/json")
        assert queued.status_code == 202 and queued.json()["status"] == "queued"
        url = queued.json()["url"]
        waiting = client.get(url)
        assert waiting.status_code == 202 and waiting.json()["status"] == "queued"
    assert test_redis.llen("default") == 1  # the message waits in the control worker's queue
    other = Client()
    other.force_login(bob)
    assert other.get(url).status_code == 404
    assert client.get("/reward-scripts/test/0123abcd/").status_code == 404
    assert run_reward_test(queued.json()["test"]) == "done"
    assert run_reward_test(queued.json()["test"]) == "done"  # a redelivered task leaves it as it is
    body = client.get(url).json()
    assert body["ok"] is True and body["task"] == {"id": "t1", "answer": 2} and body["kind"] == ""


def test_it_scores_a_dataset_task_by_id_or_index_with_its_reward_only_fields(client, alice, make_dataset):
    dataset = make_dataset(alice)  # tasks t0..t4 with answer i + 1; "answer" is reward-only
    client.force_login(alice)
    for ref in ("t2", "2"):
        response = score(client, source=SOURCE, task_source="dataset", dataset=dataset.pk, task=ref,
                         outcome='{"answer": 3}')
        body = response.json()
        assert response.status_code == 200
        assert body["ok"] is True and body["reward"] == 1.0 and body["detail"] == {"right": True}
        assert body["output"] == "checking t2\n" and body["error"] == "" and body["line"] is None
        assert body["task"] == {"id": "t2", "question": "2+1", "answer": 3, "split": "train"}
        assert body["outcome"] == {"answer": 3, "exit_code": 0, "stdout": ""}
        assert body["task_label"] == "tasks / t2 (index 2, train)"


def test_it_scores_the_source_sent_not_the_saved_one(client, alice, make_reward):
    make_reward(alice, source="def reward(task, outcome):\n    return 0\n")
    client.force_login(alice)
    body = score(client, source="def reward(task, outcome):\n    return 0.25\n", task_source="json",
                 task_json="{}", outcome="").json()
    assert body["ok"] is True and body["reward"] == 0.25 and body["outcome"] == {"exit_code": 0, "stdout": ""}


def test_plain_text_and_other_json_outcomes_are_wrapped_as_a_run_wraps_them(client, alice):
    client.force_login(alice)
    echo = "def reward(task, outcome):\n    return {'reward': 1, 'seen': outcome}\n"
    body = score(client, source=echo, task_source="json", task_json="{}", outcome="the answer is 4").json()
    assert body["detail"]["seen"] == {"output_raw": "the answer is 4", "exit_code": 0, "stdout": ""}
    body = score(client, source=echo, task_source="json", task_json="{}", outcome="[4]").json()
    assert body["detail"]["seen"] == {"output": [4], "exit_code": 0, "stdout": ""}


@pytest.mark.parametrize("text", ['{"answer": 4}', '{"answer": 4, "exit_code": 3}', "[1, 2]", '"4"', "plain text", ""])
def test_the_outcome_rule_is_the_executors(text):
    """outcome_from_text(text) is what sandbox.executors.local reads from an output file holding `text` (exit code 0)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "output.json"
        if text:
            path.write_text(text)
        assert outcome_from_text(text) == read_outcome(path, 0, "")


def test_a_syntax_error_shows_its_line(client, alice):
    client.force_login(alice)
    source = "def reward(task, outcome):\n    x = 1\n    return (x\n"
    body = score(client, source=source, task_source="json", task_json="{}", outcome="{}").json()
    assert body["ok"] is False and body["kind"] == "syntax" and body["reward"] is None
    assert body["line"] == 3 and body["error"].startswith("SyntaxError:") and "(line 3)" in body["error"]


def test_an_exception_shows_its_line_and_the_prints_before_it(client, alice):
    client.force_login(alice)
    source = "def reward(task, outcome):\n    print('before')\n    return task['missing']\n"
    body = score(client, source=source, task_source="json", task_json='{"q": 1}', outcome="{}").json()
    assert body["ok"] is False and body["kind"] == "exception"
    assert body["line"] == 3 and body["error"] == "KeyError: 'missing' (line 3)" and body["output"] == "before\n"


@pytest.mark.parametrize("body, field, message", [
    ({"task_source": "json", "task_json": "{nope"}, "task_json", "not JSON"),
    ({"task_source": "json", "task_json": "[1]"}, "task_json", "a task is a JSON object"),
    ({"task_source": "dataset", "task": "t1"}, "dataset", "choose one of your datasets"),
    ({"task_source": "dataset", "dataset": "DATASET", "task": ""}, "task", "give the task's id or its index"),
    ({"task_source": "dataset", "dataset": "DATASET", "task": "t99"}, "task", "has no task with id or index 't99'"),
    ({"task_source": "dataset", "dataset": "BOBS", "task": "t1"}, "dataset", "choose one of your datasets"),
    ({"task_source": "json", "task_json": "{}", "source": ""}, "source", "the editor is empty"),
])
def test_a_bad_request_names_the_field(client, alice, bob, make_dataset, body, field, message):
    ids = {"DATASET": make_dataset(alice).pk, "BOBS": make_dataset(bob).pk}
    client.force_login(alice)
    body = {"source": SOURCE, "outcome": "{}", **body}
    body = {key: ids.get(value, value) for key, value in body.items()}
    response = score(client, **body)
    assert response.status_code == 400
    assert any(message in error for error in response.json()["errors"][field])


def test_the_task_search_finds_own_tasks_only(client, alice, bob, make_dataset):
    mine, theirs = make_dataset(alice), make_dataset(bob)
    client.force_login(alice)
    body = client.get(f"/reward-scripts/tasks/?dataset={mine.pk}&q=3").json()
    assert body["tasks"] == [{"index": 3, "external_id": "t3", "split": "train"}] and body["count"] == 5
    assert len(client.get(f"/reward-scripts/tasks/?dataset={mine.pk}").json()["tasks"]) == 5
    assert client.get(f"/reward-scripts/tasks/?dataset={theirs.pk}").status_code == 404


def test_the_test_endpoint_needs_login_and_post(client, alice):
    response = score(client, source=SOURCE, task_source="json", task_json="{}", outcome="{}")
    assert response.status_code == 302 and response.url.startswith("/accounts/login/")
    client.force_login(alice)
    assert client.get("/reward-scripts/test/").status_code == 405
    assert json.loads(client.post("/reward-scripts/test/", "nope", content_type="application/json").content)[
        "errors"]["__all__"] == ["the request body is not JSON"]


def test_the_source_is_stored_with_the_line_breaks_typed(client, alice):
    """A browser posts a textarea's line breaks as CRLF; the script keeps plain newlines."""
    client.force_login(alice)
    client.post("/reward-scripts/new/", reward_post(source=SOURCE.replace("\n", "\r\n")))
    assert RewardScript.objects.get().source == SOURCE


def test_the_task_search_answers_404_for_a_bad_dataset_id(client, alice):
    client.force_login(alice)
    assert client.get("/reward-scripts/tasks/?dataset=abc").status_code == 404
    assert client.get("/reward-scripts/tasks/").status_code == 404


def test_the_list_takes_the_same_queries_for_many_scripts(client, alice, make_reward):
    client.force_login(alice)
    make_reward(alice, name="one")

    def queries():
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/reward-scripts/").status_code == 200
        return len(captured)

    few = queries()
    for i in range(8):
        make_reward(alice, name=f"more-{i}")
    assert queries() == few
