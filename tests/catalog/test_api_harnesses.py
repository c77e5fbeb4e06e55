"""/api/v1/harnesses/: CRUD with validation, versions and ownership."""
import pytest

from catalog.models import Harness

pytestmark = pytest.mark.django_db
URL = "/api/v1/harnesses/"
GOOD = {"name": "mini", "command": ["mini", "-t", "{task_file}", "--out", "{output_file}"], "env": {"A": "1"}}


def test_it_creates_a_harness(alice_api, alice):
    response = alice_api.post(URL, GOOD, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["name"] == "mini" and body["version"] == 1 and body["executor"] == "local" and body["timeout_s"] == 600
    harness = Harness.objects.get(pk=body["id"])
    assert harness.owner == alice and harness.command == GOOD["command"] and harness.env == {"A": "1"}


@pytest.mark.parametrize("change, field, message", [
    ({"command": []}, "command", "non-empty list"),
    ({"command": "mini -t"}, "command", "non-empty list"),
    ({"command": ["mini", "{nope}"]}, "command", "unknown placeholder(s) ['nope']"),
    ({"command": ["mini", "{task_file"]}, "command", "write literal braces"),
    ({"env": {"1BAD": "x"}}, "env", "not a valid environment variable name"),
    ({"env": {"A": 1}}, "env", "must be a string"),
    ({"timeout_s": 0}, "timeout_s", "between 1 second and 7 days"),
    ({"executor": "kubernetes"}, "image", "needs a container image"),
    ({"executor": "ssh"}, "executor", "not a valid choice"),
])
def test_it_rejects_bad_harnesses_with_the_reason(alice_api, change, field, message):
    response = alice_api.post(URL, {**GOOD, **change}, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert field in error["fields"] and message in error["message"]
    assert Harness.objects.count() == 0


def test_a_kubernetes_harness_with_an_image_is_fine(alice_api):
    response = alice_api.post(URL, {**GOOD, "executor": "kubernetes", "image": "ghcr.io/me/agent:1",
                                    "resources": {"cpu": "1"}}, format="json")
    assert response.status_code == 201 and response.json()["image"] == "ghcr.io/me/agent:1"


def test_update_bumps_the_version_when_the_command_changes(alice_api, alice, make_harness):
    harness = make_harness(alice)
    response = alice_api.patch(f"{URL}{harness.pk}/", {"command": ["python", "v2.py"]}, format="json")
    assert response.status_code == 200 and response.json()["version"] == 2
    response = alice_api.patch(f"{URL}{harness.pk}/", {"description": "docs only"}, format="json")
    assert response.json()["version"] == 2
    assert Harness.objects.get(pk=harness.pk).command == ["python", "v2.py"]


def test_names_are_unique_per_owner(alice_api, bob_api):
    assert alice_api.post(URL, GOOD, format="json").status_code == 201
    response = alice_api.post(URL, GOOD, format="json")
    assert response.status_code == 400 and "already have a harness named 'mini'" in response.json()["error"]["message"]
    assert bob_api.post(URL, GOOD, format="json").status_code == 201
    assert Harness.objects.count() == 2


def test_other_users_cannot_see_change_or_delete(alice, bob_api, staff_api, make_harness):
    harness = make_harness(alice)
    assert bob_api.get(URL).json()["count"] == 0
    assert bob_api.get(f"{URL}{harness.pk}/").status_code == 404
    assert bob_api.patch(f"{URL}{harness.pk}/", {"name": "x"}, format="json").status_code == 404
    assert bob_api.delete(f"{URL}{harness.pk}/").status_code == 404
    assert Harness.objects.get(pk=harness.pk).name == "agent"
    assert staff_api.get(f"{URL}{harness.pk}/").status_code == 200
    assert staff_api.delete(f"{URL}{harness.pk}/").status_code == 204
    assert not Harness.objects.filter(pk=harness.pk).exists()


def test_anonymous_requests_are_refused(client):
    response = client.get(URL)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "not_authenticated"


@pytest.mark.parametrize("kind", ["harnesses", "datasets", "reward-scripts"])
def test_deleting_what_a_run_uses_is_refused_with_409_and_keeps_it(alice, alice_api, make_run, kind):
    from catalog.models import Dataset, Harness, RewardScript
    from runs.models import Run

    run = make_run(alice)
    model, obj = {"harnesses": (Harness, run.harness), "datasets": (Dataset, run.dataset),
                  "reward-scripts": (RewardScript, run.reward_script)}[kind]
    response = alice_api.delete(f"/api/v1/{kind}/{obj.pk}/")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "in_use" and "run" in response.json()["error"]["message"]
    assert model.objects.filter(pk=obj.pk).exists()
    Run.objects.filter(pk=run.pk).delete()
    assert alice_api.delete(f"/api/v1/{kind}/{obj.pk}/").status_code == 204
    assert not model.objects.filter(pk=obj.pk).exists()


def test_env_values_are_checked_for_placeholders_like_argv(alice_api):
    for value, says in (("{bogus}", "unknown placeholder(s) ['bogus']"), ("a {b", "write literal braces")):
        response = alice_api.post(URL, {"name": "h", "command": ["python"], "env": {"X": value}}, format="json")
        assert response.status_code == 400 and says in response.json()["error"]["message"], response.json()
    ok = alice_api.post(URL, {"name": "h", "command": ["python"], "env": {"URL": "{base_url}", "L": "{{x}}"}},
                        format="json")
    assert ok.status_code == 201 and ok.json()["env"] == {"URL": "{base_url}", "L": "{{x}}"}


def test_staff_renaming_a_users_harness_to_a_name_the_user_has_gets_a_field_error(alice, staff_api, make_harness):
    make_harness(alice, name="one")
    two = make_harness(alice, name="two")
    response = staff_api.patch(f"{URL}{two.pk}/", {"name": "one"}, format="json")
    assert response.status_code == 400 and "name" in response.json()["error"]["fields"]
    two.refresh_from_db()
    assert two.name == "two"
