"""Failed logins are rate-limited by django-axes per username and address: the login page, the admin's and the API
token endpoint; a lock holds even for the right password until the cool-off ends, and touches no one else."""
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db
LOGIN, TOKEN = "/accounts/login/", "/api/v1/auth/token/"
LIMIT = settings.AXES_FAILURE_LIMIT


@pytest.fixture(autouse=True)
def fast_hashing(settings):
    """Dozens of logins per test: a cheap hasher (autouse, so the users are created with it too)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def test_the_defaults_are_ten_failures_and_fifteen_minutes():
    assert (settings.AXES_FAILURE_LIMIT, settings.AXES_COOLOFF_TIME) == (10, timedelta(minutes=15))
    assert settings.AXES_LOCKOUT_PARAMETERS == [["username", "ip_address"]]


def page_login(client, username, password, address="10.0.0.1"):
    return client.post(LOGIN, {"username": username, "password": password}, REMOTE_ADDR=address)


def token_login(username, password, address="10.0.0.1"):
    return APIClient().post(TOKEN, {"username": username, "password": password}, format="json", REMOTE_ADDR=address)


def attempt(username, address="10.0.0.1"):
    return AccessAttempt.objects.get(username=username, ip_address=address)


def test_the_page_locks_after_the_limit_and_refuses_even_the_right_password(client, alice):
    for i in range(LIMIT - 1):
        response = page_login(client, "alice", f"wrong-{i}")
        assert response.status_code == 200 and "didn't match" in response.content.decode()
    assert attempt("alice").failures_since_start == LIMIT - 1

    locked = page_login(client, "alice", "wrong-last")
    page = locked.content.decode()
    assert locked.status_code == 429 and 'id="lockout"' in page and "Too many failed logins" in page
    assert "blocked for 15 minutes" in page and locked["Retry-After"] == "900"
    assert 'name="username"' in page  # still the login page, with the form

    right = page_login(client, "alice", "alice-password-123")
    assert right.status_code == 429 and "Too many failed logins" in right.content.decode()
    assert "_auth_user_id" not in client.session
    row = attempt("alice")
    assert row.failures_since_start == LIMIT + 1 and row.path_info == LOGIN
    assert "alice-password-123" not in str(row.post_data) and "wrong" not in str(row.post_data)


def test_the_api_token_endpoint_answers_429_in_the_api_error_format(alice):
    for i in range(LIMIT - 1):
        response = token_login("alice", f"wrong-{i}")
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid"
    locked = token_login("alice", "wrong-last")
    assert locked.status_code == 429 and int(locked["Retry-After"]) == 900
    error = locked.json()["error"]
    assert error["status"] == 429 and error["code"] == "throttled" and "Too many failed logins" in error["message"]

    right = token_login("alice", "alice-password-123")
    assert right.status_code == 429 and right.json()["error"]["code"] == "throttled" and "token" not in right.json()
    assert not Token.objects.filter(user=alice).exists()
    assert attempt("alice").failures_since_start == LIMIT + 1 and attempt("alice").path_info == TOKEN


def test_a_lock_touches_neither_another_user_nor_another_address(client, alice, bob):
    for i in range(LIMIT):
        token_login("alice", f"wrong-{i}")
    assert token_login("alice", "alice-password-123").status_code == 429

    bob_token = token_login("bob", "bob-password-123")  # same address, another user
    assert bob_token.status_code == 200 and bob_token.json()["token"] == Token.objects.get(user=bob).key
    elsewhere = token_login("alice", "alice-password-123", address="10.0.0.2")  # alice from another address
    assert elsewhere.status_code == 200 and elsewhere.json()["token"] == Token.objects.get(user=alice).key
    assert page_login(client, "bob", "bob-password-123").status_code == 302
    assert list(AccessAttempt.objects.values_list("username", "ip_address", "failures_since_start")) == [
        ("alice", "10.0.0.1", LIMIT + 1)]  # successes reset their own pair only (alice@10.0.0.2 had none)


def test_after_the_cool_off_the_right_password_works_and_resets_the_count(client, alice):
    for i in range(LIMIT):
        page_login(client, "alice", f"wrong-{i}")
    assert page_login(client, "alice", "alice-password-123").status_code == 429

    # The cool-off runs from the last failure: move that back past it instead of waiting 15 minutes.
    AccessAttempt.objects.filter(username="alice").update(
        attempt_time=timezone.now() - settings.AXES_COOLOFF_TIME - timedelta(seconds=1))

    response = page_login(client, "alice", "alice-password-123")
    assert response.status_code == 302 and response.url == "/" and int(client.session["_auth_user_id"]) == alice.pk
    assert not AccessAttempt.objects.filter(username="alice").exists()  # AXES_RESET_ON_SUCCESS


def test_a_success_before_the_limit_resets_the_count(client, alice):
    for i in range(LIMIT - 1):
        page_login(client, "alice", f"wrong-{i}")
    assert page_login(client, "alice", "alice-password-123").status_code == 302
    assert not AccessAttempt.objects.exists()
    for i in range(LIMIT - 1):
        page_login(client, "alice", f"again-{i}")
    assert page_login(client, "alice", "alice-password-123").status_code == 302


def test_the_admin_login_is_limited_too(client, staff):
    for i in range(LIMIT):
        client.post("/admin/login/", {"username": "sam", "password": f"wrong-{i}"}, REMOTE_ADDR="10.0.0.1")
    locked = client.post("/admin/login/", {"username": "sam", "password": "sam-password-123"}, REMOTE_ADDR="10.0.0.1")
    assert locked.status_code == 429 and "Too many failed logins" in locked.content.decode()
    assert attempt("sam").failures_since_start == LIMIT + 1


def test_the_locked_page_keeps_the_content_security_policy(client, alice):
    for i in range(LIMIT):
        page_login(client, "alice", f"wrong-{i}")
    locked = page_login(client, "alice", "alice-password-123")
    assert locked.status_code == 429 and "script-src 'self'" in locked["Content-Security-Policy"]
    assert "unsafe-inline" not in locked["Content-Security-Policy"].split("script-src")[1].split(";")[0]


def test_the_schema_documents_429_on_the_token_endpoint(alice_api):
    schema = alice_api.get("/api/schema/?format=json").json()
    responses = schema["paths"][TOKEN]["post"]["responses"]
    assert "429" in responses and responses["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/Error")


@pytest.mark.django_db(transaction=True)  # the views run in another thread, on another connection
async def test_the_lockout_answers_the_same_through_the_asgi_handler(alice):
    """daphne runs the middleware chain async (axes' __acall__ path): the page and the API lock out the same."""
    from asgiref.sync import sync_to_async
    from django.test import AsyncClient

    client = AsyncClient()
    for i in range(LIMIT):
        await client.post(LOGIN, {"username": "alice", "password": f"wrong-{i}"})
    page = await client.post(LOGIN, {"username": "alice", "password": "alice-password-123"})
    assert page.status_code == 429 and "Too many failed logins" in page.content.decode()
    api = await client.post(TOKEN, {"username": "alice", "password": "alice-password-123"},
                            content_type="application/json")
    assert api.status_code == 429 and api.json()["error"]["code"] == "throttled"
    rows = await sync_to_async(list)(AccessAttempt.objects.values_list("username", "failures_since_start"))
    assert rows == [("alice", LIMIT + 2)]
