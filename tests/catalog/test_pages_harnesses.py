"""Harness pages: list, create from argv rows, edit (a new version; runs keep their snapshot), delete when unused."""
import asyncio

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils.html import escape

from api.catalog_serializers import HARNESS_PLACEHOLDERS
from catalog import services as catalog_services
from catalog.models import Harness
from common import errors as common_errors
from runs import services
from sandbox.executors.base import PLACEHOLDERS as PLACEHOLDER_MEANINGS
from sandbox.executors.base import Attempt
from sandbox.executors.local import LocalExecutor

pytestmark = pytest.mark.django_db


def harness_post(**overrides):
    data = {"name": "solver", "description": "answers arithmetic",
            "argv": ["python", "agent.py", "--task", "{task_file}", "--out", "{output_file}", ""],
            "env_key": ["MODE", ""], "env_value": ["fast", ""], "executor": "local", "image": "",
            "resources": '{"cpu": "1"}', "timeout_s": "120"}
    data.update(overrides)
    return data


def test_it_requires_login(client, alice, make_harness):
    harness = make_harness(alice)
    for url in ("/harnesses/", "/harnesses/new/", f"/harnesses/{harness.pk}/"):
        response = client.get(url)
        assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_the_list_shows_own_harnesses_with_their_run_counts(client, alice, bob, make_harness, make_run):
    make_harness(alice, name="<b>mine</b>")
    make_harness(bob, name="theirs")
    run = make_run(alice, name="r")
    client.force_login(alice)
    response = client.get("/harnesses/")
    page = response.content.decode()
    assert response.status_code == 200
    assert "&lt;b&gt;mine&lt;/b&gt;" in page and "<b>mine</b>" not in page and "theirs" not in page
    row = page.split(f'data-harness="{run.harness_id}"')[1].split("</tr>")[0]
    assert "<td>1</td>" in row  # the run's harness is used once


def test_staff_see_every_harness(client, alice, staff, make_harness):
    make_harness(alice, name="alice-h")
    client.force_login(staff)
    assert "alice-h" in client.get("/harnesses/").content.decode()


def test_the_new_page_lists_every_placeholder_with_its_meaning(client, alice):
    client.force_login(alice)
    page = client.get("/harnesses/new/").content.decode()
    for name in HARNESS_PLACEHOLDERS:
        assert f'data-placeholder="{{{name}}}"' in page
        assert escape(PLACEHOLDER_MEANINGS[name]) in page
    assert page.count('name="argv"') == 1  # one blank row to type in


def test_the_placeholders_listed_are_the_ones_the_executor_fills(tmp_path):
    class Recording(str):
        """An argv entry that records the names the executor formats it with."""
        seen: set = set()

        def format(self, *args, **values):
            Recording.seen = set(values)
            return str(self)

    attempt = Attempt(command=[Recording("true")], env={}, timeout_s=10, workdir=tmp_path, task_id="t", task={},
                      rollout_id="1", base_url="http://127.0.0.1:1/rollouts/1/v1", api_key="k")
    out = asyncio.run(LocalExecutor().run(attempt))
    assert out.exit_code == 0
    assert Recording.seen == set(HARNESS_PLACEHOLDERS) == set(PLACEHOLDER_MEANINGS)


def test_create_from_argv_rows(client, alice):
    client.force_login(alice)
    response = client.post("/harnesses/new/", harness_post())
    harness = Harness.objects.get(owner=alice)
    assert response.status_code == 302 and response.url == f"/harnesses/{harness.pk}/"
    assert harness.command == ["python", "agent.py", "--task", "{task_file}", "--out", "{output_file}"]
    assert harness.env == {"MODE": "fast"} and harness.resources == {"cpu": "1"}
    assert harness.timeout_s == 120 and harness.version == 1 and harness.description == "answers arithmetic"
    page = client.get(response.url).content.decode()
    assert "Harness &#x27;solver&#x27; created (version 1)." in page
    assert page.count('name="argv"') == 7  # six arguments and a spare row, in order
    assert page.index('value="--task"') < page.index('value="{task_file}"') < page.index('value="--out"')


@pytest.mark.parametrize("overrides, field, message", [
    ({"argv": ["", ""]}, "argv", "must be a non-empty list"),
    ({"argv": ["python", "{task}"]}, "argv", "unknown placeholder(s) ['task']"),
    ({"env_key": ["1BAD"], "env_value": ["x"]}, "env", "'1BAD' is not a valid environment variable name"),
    ({"env_key": ["A", "A"], "env_value": ["1", "2"]}, "env", "A is set twice"),
    ({"env_key": [""], "env_value": ["orphan"]}, "env", "has no variable name"),
    ({"resources": "[1, 2]"}, "resources", "must be an object"),
    ({"resources": "{not json"}, "resources", "Enter a valid JSON."),
    ({"timeout_s": "0"}, "timeout_s", "must be between 1 second and 7 days"),
    ({"executor": "kubernetes"}, "image", "a kubernetes harness needs a container image"),
    ({"name": ""}, "name", "This field is required."),
])
def test_an_error_shows_beside_its_field_and_nothing_is_saved(client, alice, overrides, field, message):
    client.force_login(alice)
    response = client.post("/harnesses/new/", harness_post(**overrides))
    page = response.content.decode()
    assert response.status_code == 200 and Harness.objects.count() == 0
    error = page.split(f'id="field-{field}"')[1].split('id="field-')[0]
    assert f'id="id_{field}_error"' in error and escape(message) in error
    assert "Nothing was saved" in page
    assert 'value="answers arithmetic"' not in page and "answers arithmetic</textarea>" in page  # kept as typed


def test_everything_typed_is_kept_after_an_error(client, alice):
    client.force_login(alice)
    page = client.post("/harnesses/new/", harness_post(timeout_s="0", env_key=["MODE", "X"],
                                                       env_value=["fast", "<y>"])).content.decode()
    assert 'value="solver"' in page and 'value="{output_file}"' in page and 'value="&lt;y&gt;"' in page
    assert page.index('value="python"') < page.index('value="agent.py"') < page.index('value="{output_file}"')
    assert "{&quot;cpu&quot;: &quot;1&quot;}" in page and 'value="0"' in page


def test_a_duplicate_name_is_a_field_error(client, alice, bob, make_harness):
    make_harness(alice, name="solver")
    make_harness(bob, name="other")
    client.force_login(alice)
    response = client.post("/harnesses/new/", harness_post())
    assert response.status_code == 200 and Harness.objects.filter(owner=alice).count() == 1
    assert "you already have a harness named &#x27;solver&#x27;" in response.content.decode().split(
        'id="field-name"')[1].split('id="field-')[0]
    client.force_login(bob)  # names are unique per owner
    assert client.post("/harnesses/new/", harness_post()).status_code == 302


def test_editing_makes_a_new_version_and_runs_keep_their_snapshot(client, alice, make_run):
    run = make_run(alice)
    harness = run.harness
    before = dict(run.harness_snapshot)
    client.force_login(alice)
    page = client.get(f"/harnesses/{harness.pk}/").content.decode()
    assert "version 1" in page and f'href="/runs/{run.pk}/"' in page and "<td>v1</td>" in page
    response = client.post(f"/harnesses/{harness.pk}/", harness_post(name=harness.name, argv=["python", "v2.py"]))
    assert response.status_code == 302
    harness.refresh_from_db()
    run.refresh_from_db()
    assert harness.version == 2 and harness.command == ["python", "v2.py"]
    assert run.harness_snapshot == before and run.harness_snapshot["version"] == 1
    page = client.get(f"/harnesses/{harness.pk}/").content.decode()
    assert "Saved as version 2." in page and "version 2" in page and "<td>v1</td>" in page


def test_renaming_alone_keeps_the_version(client, alice, make_harness):
    harness = make_harness(alice, name="old")
    client.force_login(alice)
    post = harness_post(name="new", argv=harness.command, env_key=[], env_value=[], resources="{}",
                        timeout_s=str(harness.timeout_s), description="")
    assert client.post(f"/harnesses/{harness.pk}/", post).status_code == 302
    harness.refresh_from_db()
    assert harness.name == "new" and harness.version == 1


def test_a_refused_edit_saves_nothing(client, alice, make_harness):
    harness = make_harness(alice, name="keep")
    client.force_login(alice)
    response = client.post(f"/harnesses/{harness.pk}/", harness_post(name="keep", timeout_s="-5"))
    assert response.status_code == 200 and 'id="id_timeout_s_error"' in response.content.decode()
    harness.refresh_from_db()
    assert harness.version == 1 and harness.timeout_s == 600 and harness.description == ""


def test_delete_an_unused_harness(client, alice, make_harness):
    harness = make_harness(alice)
    client.force_login(alice)
    response = client.post(f"/harnesses/{harness.pk}/delete/")
    assert response.status_code == 302 and response.url == "/harnesses/"
    assert not Harness.objects.filter(pk=harness.pk).exists()


def test_delete_is_refused_while_a_run_uses_it(client, alice, make_run):
    run = make_run(alice)
    client.force_login(alice)
    response = client.post(f"/harnesses/{run.harness_id}/delete/")
    page = response.content.decode()
    assert response.status_code == 409 and "is used by 1 run(s) and cannot be deleted" in page
    assert Harness.objects.filter(pk=run.harness_id).exists()
    assert 'id="harness-delete-button"' not in page  # the page says why instead of offering the button


def test_delete_needs_post(client, alice, make_harness):
    harness = make_harness(alice)
    client.force_login(alice)
    assert client.get(f"/harnesses/{harness.pk}/delete/").status_code == 405
    assert Harness.objects.filter(pk=harness.pk).exists()


def test_another_users_harness_is_not_found(client, alice, bob, make_harness):
    harness = make_harness(bob)
    client.force_login(alice)
    assert client.get(f"/harnesses/{harness.pk}/").status_code == 404
    assert client.post(f"/harnesses/{harness.pk}/", harness_post()).status_code == 404
    assert client.post(f"/harnesses/{harness.pk}/delete/").status_code == 404
    harness.refresh_from_db()
    assert harness.name == "agent" and harness.version == 1


def test_staff_may_edit_a_users_harness_and_names_stay_unique_per_owner(client, alice, staff, make_harness):
    harness = make_harness(alice, name="a")
    make_harness(alice, name="taken")
    make_harness(staff, name="b")  # staff's own names do not matter for alice's harness
    client.force_login(staff)
    response = client.post(f"/harnesses/{harness.pk}/", harness_post(name="taken"))
    assert response.status_code == 200 and "you already have a harness named" in response.content.decode()
    assert client.post(f"/harnesses/{harness.pk}/", harness_post(name="b")).status_code == 302
    harness.refresh_from_db()
    assert harness.name == "b" and harness.owner == alice and harness.version == 2


def test_csrf_is_enforced(alice, make_harness):
    harness = make_harness(alice)
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    assert client.post("/harnesses/new/", harness_post()).status_code == 403
    assert client.post(f"/harnesses/{harness.pk}/", harness_post(name="x")).status_code == 403
    assert client.post(f"/harnesses/{harness.pk}/delete/").status_code == 403
    assert Harness.objects.count() == 1 and Harness.objects.get().name == "agent"
    page = client.get("/harnesses/new/").content.decode()
    token = page.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
    response = client.post("/harnesses/new/", {**harness_post(), "csrfmiddlewaretoken": token})
    assert response.status_code == 302 and Harness.objects.count() == 2


def test_the_list_and_a_page_take_the_same_queries_for_many_harnesses_and_runs(client, alice, make_harness,
                                                                               make_run):
    client.force_login(alice)
    run = make_run(alice, name="first")

    def queries(url):
        with CaptureQueriesContext(connection) as captured:
            assert client.get(url).status_code == 200
        return len(captured)

    few = queries("/harnesses/"), queries(f"/harnesses/{run.harness_id}/")
    for i in range(6):
        make_harness(alice, name=f"more-{i}")
    for i in range(4):
        services.clone_run(run, alice)
    assert (queries("/harnesses/"), queries(f"/harnesses/{run.harness_id}/")) == few


def test_argv_env_and_description_are_escaped(client, alice, make_harness):
    payload = '"><img src=x onerror=alert(1)>'
    harness = make_harness(alice, name=payload, command=["python", payload], env={"X": payload}, description=payload)
    client.force_login(alice)
    for url in ("/harnesses/", f"/harnesses/{harness.pk}/"):
        page = client.get(url).content.decode()
        assert "<img src=x" not in page and "&quot;&gt;&lt;img src=x onerror=alert(1)&gt;" in page


def test_the_delete_services_refuse_another_users_object(alice, bob, make_harness, make_reward):
    harness, script = make_harness(alice), make_reward(alice)
    with pytest.raises(common_errors.NotOwned):
        catalog_services.delete_harness(harness, bob)
    with pytest.raises(common_errors.NotOwned):
        catalog_services.delete_reward_script(script, bob)
    assert Harness.objects.filter(pk=harness.pk).exists() and type(script).objects.filter(pk=script.pk).exists()
