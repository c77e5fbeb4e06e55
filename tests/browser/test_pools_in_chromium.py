"""Worker pools in real Chromium: a queued run says what it waits for until a worker takes it (live), and the
workers page renders under the site's CSP."""
import os

import pytest

from runs import services
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread


def test_the_wait_for_a_pool_shows_until_a_worker_takes_the_run(page, live_url, alice, make_run, console):
    make_run(alice, name="ahead")
    run = make_run(alice, name="behind")
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#run-chart[data-ready='1']")
    assert page.locator("#run-waiting").inner_text() == "waiting for pool default (1 ahead)"
    assert page.locator("#run-worker").inner_text() == "not started yet"
    services.claim_run(run.pk, "task", {"worker": "w@h", "pool": "default", "device_set": 0, "devices": "",
                                        "where": "w@h, device set 0 (all devices)"})
    page.wait_for_function("document.getElementById('run-status').textContent === 'starting'", timeout=15000)
    assert not page.locator("#run-waiting").is_visible()
    page.reload()
    assert page.locator("#run-worker").inner_text() == "w@h, device set 0 (all devices)"
    page.click("nav a[href='/workers/']")
    page.wait_for_selector("#workers-checked")
    assert page.locator("#no-workers").inner_text().startswith("No workers answered within 1.0 s")
    assert console == [] and page.outside == []
