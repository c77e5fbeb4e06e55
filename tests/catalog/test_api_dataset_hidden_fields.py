"""POST/GET /api/v1/datasets/ hidden_fields: reward-only fields set at upload, shown with the defaults."""
import io
import json

import pytest

from catalog.models import Dataset

pytestmark = pytest.mark.django_db
URL = "/api/v1/datasets/"
DEFAULTS = ["answer", "expected", "solution", "tests"]
CONTENT = json.dumps({"question": "2+2", "answer": 4, "rubric": "exact"}) + "\n"


def upload(client, name, **fields):
    file = io.BytesIO(CONTENT.encode())
    file.name = "tasks.jsonl"
    return client.post(URL, {"name": name, "file": file, **fields}, format="multipart")


@pytest.mark.parametrize("value", ['["rubric", "notes"]', "rubric, notes", ["rubric", "notes"]])
def test_it_stores_and_shows_hidden_fields_given_as_json_commas_or_repeated_keys(alice_api, value):
    response = upload(alice_api, "math", hidden_fields=value)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["hidden_fields"] == ["rubric", "notes"]
    assert body["reward_only_fields"] == ["answer", "expected", "notes", "rubric", "solution", "tests"]
    assert Dataset.objects.get(pk=body["id"]).hidden_fields == ["rubric", "notes"]
    shown = alice_api.get(f"{URL}{body['id']}/").json()
    assert shown["hidden_fields"] == ["rubric", "notes"] and shown["reward_only_fields"] == body["reward_only_fields"]


def test_without_hidden_fields_the_defaults_are_hidden(alice_api):
    body = upload(alice_api, "plain").json()
    assert body["hidden_fields"] == [] and body["reward_only_fields"] == DEFAULTS


@pytest.mark.parametrize("value, message", [
    ('["rubric", ""]', 'every field name must be a non-empty string, got ""'),
    ("[1, 2]", "every field name must be a non-empty string, got 1"),
    ('{"rubric": true}', "must be a list of field names, got an object"),
    ('["rubric"', "not a valid JSON list: Expecting ',' delimiter at column 10"),
    ("rubric,,notes", 'every field name must be a non-empty string, got ""'),
])
def test_a_bad_value_is_a_field_error_and_nothing_is_saved(alice_api, value, message):
    response = upload(alice_api, "bad", hidden_fields=value)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid" and error["fields"] == {"hidden_fields": [message]}
    assert error["message"] == f"hidden_fields: {message}"
    assert Dataset.objects.count() == 0


def test_hidden_fields_cannot_be_changed_after_upload(alice_api):
    body = upload(alice_api, "math", hidden_fields="rubric").json()
    response = alice_api.patch(f"{URL}{body['id']}/", {"hidden_fields": []}, format="json")
    assert response.status_code == 200 and response.json()["hidden_fields"] == ["rubric"]
    assert Dataset.objects.get(pk=body["id"]).hidden_fields == ["rubric"]
