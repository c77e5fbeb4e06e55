"""Real Chromium against a real daphne: log in, Swagger UI renders offline, a run page updates live."""
import os

import pytest

from catalog import services as catalog_services
from runs import services
from tests.conftest import REWARD_SOURCE

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread


def login(page, live_url):
    page.goto(live_url + "/")
    assert "/accounts/login/" in page.url
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "alice-password-123")
    page.click("button[type=submit]")
    page.wait_for_selector("h1:has-text('Runs')")


def test_swagger_ui_renders_offline(page, live_url, alice):
    login(page, live_url)
    page.goto(live_url + "/api/docs/")
    page.wait_for_selector(".opblock", timeout=20000)
    assert page.locator(".opblock").count() > 20
    assert page.locator("text=/api/v1/runs/{id}/cancel/").count() >= 1
    assert page.outside == []  # nothing fetched from outside this server


def test_a_run_page_shows_events_live(page, live_url, alice):
    harness = catalog_services.create_harness(alice, name="h", command=["python", "a.py"])
    dataset = catalog_services.create_dataset(alice, name="d", content=b'{"q": 1}\n{"q": 2}\n', filename="t.jsonl")
    reward = catalog_services.create_reward_script(alice, name="r", source=REWARD_SOURCE)
    run = services.create_run(alice, name="<b>live</b>", model="tiny", config={}, harness=harness,
                              dataset=dataset, reward_script=reward)
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#events li")  # the replayed 'queued' event
    assert page.locator("h1").inner_text().startswith("<b>live</b>")  # shown as text, not markup
    services.transition_run(run.pk, "starting")
    services.fail_run(run.pk, "engine exited with code 1")
    page.wait_for_function("document.getElementById('run-status').textContent === 'failed'", timeout=15000)
    assert page.locator("#run-error").inner_text() == "engine exited with code 1"
    assert page.locator("#events li").count() == 3
    assert page.outside == []


def test_a_run_page_shows_the_phase_and_its_progress_live(page, live_url, alice):
    harness = catalog_services.create_harness(alice, name="h", command=["python", "a.py"])
    dataset = catalog_services.create_dataset(alice, name="d", content=b'{"q": 1}\n{"q": 2}\n', filename="t.jsonl")
    reward = catalog_services.create_reward_script(alice, name="r", source=REWARD_SOURCE)
    run = services.create_run(alice, name="phases", model="tiny", config={}, harness=harness, dataset=dataset,
                              reward_script=reward)
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#events li")
    services.set_run_phase(run.pk, "starting the engine: <b>loading weights</b>", 0.25)
    page.wait_for_function("document.getElementById('run-phase').textContent.endsWith('(25%)')", timeout=15000)
    assert page.locator("#run-phase").inner_text() == "starting the engine: <b>loading weights</b> (25%)"  # text
    assert page.locator("#run-phase-progress").is_visible()
    assert page.locator("#run-phase-progress").evaluate("bar => bar.value") == 0.25
    services.set_run_phase(run.pk, "evaluating step 0: 3/8")  # no fraction: no bar
    page.wait_for_function("document.getElementById('run-phase').textContent === 'evaluating step 0: 3/8'",
                           timeout=15000)
    assert not page.locator("#run-phase-progress").is_visible()
    assert page.locator("#events li").count() == 1  # phases are shown in place, not listed with the events
    assert page.outside == []
