"""Security headers and Content-Security-Policy on pages, API and login; secure cookies behind LIGHTNING_HTTPS."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import override_settings

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
POLICY = {
    "default-src": "'self'",
    "script-src": "'self'",
    "style-src": "'self' 'unsafe-inline'",
    "img-src": "'self' data: blob:",
    "connect-src": "'self' ws://testserver wss://testserver",  # the dashboard's websocket, to this host alone
    "worker-src": "'self' blob:",
    "frame-ancestors": "'none'",
    "form-action": "'self'",
    "base-uri": "'self'",
    "object-src": "'none'",
}
# An inline <script> is one without src (json_script blocks are data, not code); handlers are on*= attributes.
INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
INLINE_HANDLER = re.compile(r"<[^>]*\son[a-z]+\s*=", re.I)


def directives(response) -> dict[str, str]:
    """The response's CSP header as {directive: sources}."""
    parts = (part.strip().split(None, 1) for part in response["Content-Security-Policy"].split(";") if part.strip())
    return {part[0]: part[1] if len(part) > 1 else "" for part in parts}


def assert_secured(response):
    assert directives(response) == POLICY
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"
    assert response["Cross-Origin-Opener-Policy"] == "same-origin"


def test_it_secures_a_dashboard_page(client, alice, make_run):
    run = make_run(alice)
    client.force_login(alice)
    response = client.get(f"/runs/{run.pk}/")
    assert response.status_code == 200
    assert_secured(response)
    assert b'<script type="module" src="/static/js/pages/run_detail.js"></script>' in response.content


@override_settings(ALLOWED_HOSTS=["lightning.example", "testserver"])
def test_the_websocket_may_reach_the_pages_own_host_and_port_only(client, alice):
    """Issue 40.9: `connect-src ws: wss:` let a script open a websocket to any host. 'self' alone does not cover
    ws: to the same host in every browser, so the page's own host and port are named, from its request."""
    client.force_login(alice)
    response = client.get("/", HTTP_HOST="lightning.example:8443", secure=True)
    assert response.status_code == 200
    assert directives(response)["connect-src"] == "'self' ws://lightning.example:8443 wss://lightning.example:8443"
    assert {"ws:", "wss:"}.isdisjoint(directives(response)["connect-src"].split())
    assert_secured(client.get("/"))  # the test client's own host, testserver


def test_a_host_not_allowed_gets_no_websocket_source():
    """CommonMiddleware answers such a request 400 before a view runs; the policy still names no host it was not
    allowed to name."""
    from django.http import HttpResponse
    from django.test import RequestFactory

    from lightning_web.security import SameHostCSPMiddleware

    request = RequestFactory().get("/", HTTP_HOST="evil.example")
    response = SameHostCSPMiddleware(lambda r: HttpResponse("ok"))(request)
    assert directives(response)["connect-src"] == "'self'"


def test_it_secures_an_api_response(alice_api):
    response = alice_api.get("/api/v1/runs/")
    assert response.status_code == 200 and response.json()["count"] == 0
    assert_secured(response)


def test_it_secures_the_login_page(client):
    response = client.get("/accounts/login/")
    assert response.status_code == 200 and b'name="username"' in response.content
    assert_secured(response)
    assert "Strict-Transport-Security" not in response  # plain HTTP by default


def test_the_api_docs_load_their_init_script_from_a_file(client, alice):
    client.force_login(alice)
    page = client.get("/api/docs/")
    assert page.status_code == 200
    assert_secured(page)
    html = page.content.decode()
    assert not INLINE_SCRIPT.search(html), "Swagger UI's init script must be served as a file"
    script = client.get("/api/docs/?script=")
    assert script.status_code == 200 and script["Content-Type"].startswith("application/javascript")
    assert "SwaggerUIBundle" in script.content.decode()


@override_settings(SESSION_COOKIE_SECURE=True, CSRF_COOKIE_SECURE=True)
def test_it_sets_secure_session_and_csrf_cookies_over_https(client, alice):
    form = client.get("/accounts/login/", secure=True)
    assert form.cookies["csrftoken"]["secure"] is True
    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-password-123",
                                                "csrfmiddlewaretoken": form.cookies["csrftoken"].value}, secure=True)
    assert response.status_code == 302 and response.cookies["sessionid"]["secure"] is True


def test_cookies_stay_plain_over_http_by_default(client, alice):
    response = client.post("/accounts/login/", {"username": "alice", "password": "alice-password-123"})
    assert response.status_code == 302 and response.cookies["sessionid"]["secure"] == ""


def _settings_under(env: dict[str, str]) -> dict:
    """The security settings as a fresh process with `env` reads them (settings are read once, at import)."""
    code = ("import json, django; django.setup(); from django.conf import settings as s; print(json.dumps(["
            "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_PROXY_SSL_HEADER, s.SECURE_HSTS_SECONDS]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, check=True,
                         capture_output=True, text=True).stdout
    session, csrf, proxy_header, hsts = json.loads(out.strip().splitlines()[-1])
    return {"session": session, "csrf": csrf, "proxy_header": proxy_header, "hsts": hsts}


def test_lightning_https_switches_cookie_security_on():
    env = {"DJANGO_SETTINGS_MODULE": "lightning_web.settings"}
    assert _settings_under({**env, "LIGHTNING_HTTPS": "1"}) == {
        "session": True, "csrf": True, "proxy_header": ["HTTP_X_FORWARDED_PROTO", "https"], "hsts": 365 * 24 * 3600}
    assert _settings_under({**env, "LIGHTNING_HTTPS": "0"}) == {
        "session": False, "csrf": False, "proxy_header": None, "hsts": 0}


def test_no_template_holds_inline_script_or_handlers():
    found = []
    for path in sorted((ROOT / "templates").rglob("*.html")):
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {m.group(0)[:60]}" for m in INLINE_SCRIPT.finditer(text)]
        found += [f"{path.relative_to(ROOT)}: {m.group(0)[:60]}" for m in INLINE_HANDLER.finditer(text)]
        found += [f"{path.relative_to(ROOT)}: javascript: URL" for _ in re.finditer(r"javascript:", text, re.I)]
    assert found == []
