"""Dashboard pages: login required, own runs only, model text escaped."""
import pytest

from runs import services

pytestmark = pytest.mark.django_db


def test_the_login_page_is_served(client):
    response = client.get("/accounts/login/")
    assert response.status_code == 200 and b'name="username"' in response.content


def test_pages_redirect_to_login(client, alice, make_run):
    run = make_run(alice)
    for url in ("/", f"/runs/{run.pk}/"):
        response = client.get(url)
        assert response.status_code == 302 and response.url.startswith("/accounts/login/")


def test_login_then_see_own_runs(client, alice, bob, make_run):
    make_run(alice, name="alice-run")
    make_run(bob, name="bob-run")
    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-password-123"})
    assert response.status_code == 302
    page = client.get("/").content.decode()
    assert "alice-run" in page and "bob-run" not in page


def test_a_run_page_escapes_untrusted_text(client, alice, make_run):
    run = make_run(alice, name="<script>alert(1)</script>")
    services.fail_run(run.pk, "<img src=x onerror=alert(2)>")
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<img src=x" not in page


def test_another_users_run_page_is_not_found(client, alice, bob, make_run):
    run = make_run(bob)
    client.force_login(alice)
    assert client.get(f"/runs/{run.pk}/").status_code == 404


def test_a_run_page_shows_what_the_run_is_doing(client, alice, make_run):
    run = make_run(alice)
    services.set_run_phase(run.pk, "starting the engine: loading weights <now>", 0.25)
    client.force_login(alice)
    page = client.get(f"/runs/{run.pk}/").content.decode()
    assert '<span id="run-phase">starting the engine: loading weights &lt;now&gt;</span>' in page
    assert '<progress id="run-phase-progress" max="1" hidden></progress>' in page  # filled in by the live events
