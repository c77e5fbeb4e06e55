"""Token and session auth, the OpenAPI schema and the offline Swagger UI."""
import pytest
import yaml
from django.contrib.staticfiles import finders

pytestmark = pytest.mark.django_db


def test_a_token_is_issued_for_a_username_and_password(client, alice):
    response = client.post("/api/v1/auth/token/", {"username": "alice", "password": "alice-password-123"})
    assert response.status_code == 200 and len(response.json()["token"]) == 40
    bad = client.post("/api/v1/auth/token/", {"username": "alice", "password": "wrong"})
    assert bad.status_code == 400 and "Unable to log in" in bad.json()["error"]["message"]


def test_the_token_authenticates_api_calls(client, alice):
    token = client.post("/api/v1/auth/token/", {"username": "alice", "password": "alice-password-123"}).json()["token"]
    response = client.get("/api/v1/harnesses/", HTTP_AUTHORIZATION=f"Token {token}")
    assert response.status_code == 200 and response.json() == {"count": 0, "next": None, "previous": None,
                                                                "results": []}
    assert client.get("/api/v1/harnesses/", HTTP_AUTHORIZATION="Token nope").status_code == 401


def test_a_session_authenticates_api_calls(client, alice):
    client.force_login(alice)
    assert client.get("/api/v1/runs/").status_code == 200


def test_session_writes_need_csrf(alice):
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice)
    response = strict.post("/api/v1/harnesses/", {"name": "x", "command": ["a"]}, content_type="application/json")
    assert response.status_code == 403 and "CSRF" in response.json()["error"]["message"]


def test_the_schema_lists_every_resource(client, alice):
    client.force_login(alice)
    response = client.get("/api/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    paths = schema["paths"]
    for path in ("/api/v1/harnesses/", "/api/v1/datasets/", "/api/v1/tasks/", "/api/v1/reward-scripts/{id}/test/",
                 "/api/v1/runs/", "/api/v1/runs/{id}/cancel/", "/api/v1/runs/{id}/clone/",
                 "/api/v1/runs/{id}/metrics/", "/api/v1/runs/{id}/events/", "/api/v1/runs/{id}/rollouts/",
                 "/api/v1/rollouts/{id}/"):
        assert path in paths, path
    assert "multipart/form-data" in paths["/api/v1/datasets/"]["post"]["requestBody"]["content"]


def test_swagger_ui_is_served_from_local_static_files(client, alice):
    client.force_login(alice)
    response = client.get("/api/docs/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in html
    assert "cdn" not in html.lower() and "https://" not in html
    assert finders.find("drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    static = client.get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert static.status_code == 200
