"""Item 6 of the dashboard: a run page left open for an hour keeps up.

Chromium's clock is Playwright's fake one, so an hour passes in seconds: the page's timers (elapsed and ETA ticks,
the reconnect backoff, the socket watchdog) all run on it. Over the hour a metric arrives every 5 minutes, and
every third time the socket is cut first: what arrives while it is down is replayed after the reconnect. At the end
the chart holds every point once, the header shows an hour gone, and the indicator says live.
"""
import os
import time

import pytest
from django.utils import timezone

from runs import services
from runs.models import Run
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

POINTS = ("(() => { const t = document.getElementById('run-chart').data"
          ".find(t => t.name.startsWith('train reward')); return t ? t.x.length : 0; })()")


def wait_on_fake_clock(page, condition: str, seconds: float = 15) -> None:  # noqa: F811
    """Poll `condition`, moving the fake clock 100 ms a try: redraws wait for animation frames, which it drives."""
    deadline = time.monotonic() + seconds
    while not page.evaluate(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        page.clock.run_for(100)
        time.sleep(0.05)


def test_a_run_page_open_for_an_hour_gets_every_point_through_reconnects(page, live_url, alice, make_run):  # noqa: F811
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    run = make_run(alice, name="an hour", config={"steps": 100})
    services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    Run.objects.filter(pk=run.pk).update(started_at=timezone.now())
    page.clock.install()
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#run-chart[data-ready='1']")
    page.wait_for_function("window.lightningLive && window.lightningLive.state === 'live'")
    reconnects = 0
    for step in range(1, 13):
        page.clock.run_for(5 * 60 * 1000)  # five minutes of the page's timers
        cut = step % 3 == 0
        if cut:
            page.evaluate("window.lightningLive.socket.close()")
            wait_on_fake_clock(page, "window.lightningLive.state === 'reconnecting'")
        services.record_metrics(run.pk, step, {"reward/mean": step / 100, "time/step": 300.0})
        Run.objects.filter(pk=run.pk).update(step=step, policy_version=step)
        if cut:
            page.clock.run_for(20_000)  # past the backoff: the socket reconnects and replays what it missed
            reconnects += 1
        wait_on_fake_clock(page, f"{POINTS} === {step}")
    assert page.evaluate("window.lightningLive.state") == "live"
    assert page.evaluate("window.lightningLive.reconnects") >= reconnects
    y = page.evaluate("document.getElementById('run-chart').data.find(t => t.name.startsWith('train reward')).y")
    assert y == pytest.approx([step / 100 for step in range(1, 13)])  # each point once, in order
    assert page.locator("#run-step").inner_text() == "12"
    assert page.locator("#run-elapsed").inner_text().startswith("1h")
    assert errors == [], errors
