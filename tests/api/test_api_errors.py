"""The API's one error shape, for validation, refusals, conflicts and unknown routes."""
import pytest
from django.db import IntegrityError

from api.errors import exception_handler

pytestmark = pytest.mark.django_db


def test_a_database_conflict_is_a_409_not_a_500():
    response = exception_handler(IntegrityError("UNIQUE constraint failed: runs_harness.owner_id, runs_harness.name"), {})
    assert response.status_code == 409
    assert response.data["error"]["code"] == "conflict" and "reload and try again" in response.data["error"]["message"]


def test_unknown_objects_are_404_in_the_same_shape(alice_api):
    response = alice_api.get("/api/v1/runs/424242/")
    assert response.status_code == 404
    assert response.json() == {"error": {"status": 404, "code": "not_found", "message": "No Run matches the given query."}}


def test_a_wrong_method_is_405_in_the_same_shape(alice_api):
    response = alice_api.put("/api/v1/tasks/")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"


def test_malformed_json_is_a_readable_400(alice_api):
    response = alice_api.post("/api/v1/harnesses/", "{not json", content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "parse_error"
    assert "JSON parse error" in response.json()["error"]["message"]
