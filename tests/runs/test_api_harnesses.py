"""/api/v1/harnesses/: CRUD with validation, versions and ownership."""
import pytest

from runs.models import Harness

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
