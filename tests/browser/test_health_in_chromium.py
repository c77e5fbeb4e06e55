"""Run health in real Chromium: an alarm raised while the run page is open shows in its panel without a reload, the
runs list's badge counts it live, Acknowledge takes it off the count, and a re-scoring started from the page runs on
a real Celery worker (the default queue) while its page shows its progress, then old and new rewards side by side
(screenshots in test-output/screenshots: health-panel.png, rescore.png)."""
import os

import pytest

from health import services as health_services
from health.models import Rescore, RunAlarm
from runs import services
from tests.browser.test_pages_in_chromium import login
from tests.browser.test_run_page_in_chromium import SCREENSHOTS
from tests.health.steps import Attempt, clean_attempts, store_step

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread


def test_alarms_arrive_live_are_acknowledged_and_a_rescore_shows_old_and_new(page, live_url, alice, make_run,
                                                                            make_reward, console, control_worker):
    run = make_run(alice, name="health run", config={"steps": 10})
    services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    store_step(run, 1, clean_attempts())
    health_services.check_step(run.pk, 1)
    script = make_reward(alice, name="lenient", source="def reward(task, outcome):\n    return 0.5\n")
    login(page, live_url)
    page.wait_for_function("window.lightningLive && window.lightningLive.state === 'live'")
    badge = page.locator(f"tr[data-run='{run.pk}'] .alarm-badge")
    assert badge.is_hidden()

    store_step(run, 2, [[Attempt(reward=1.0, tool_call=False) for _ in range(4)] for _ in range(4)])
    health_services.check_step(run.pk, 2)  # no tool calls, no signal, reward collapse
    badge.wait_for(state="visible")
    page.wait_for_function(f"document.querySelector(\"tr[data-run='{run.pk}'] .alarm-count\").textContent === '3'")

    page.set_viewport_size({"width": 1300, "height": 1000})
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_function("window.lightningLive.state === 'live'")
    assert page.locator("#health .alarm").count() == 3
    store_step(run, 3, clean_attempts(), metrics={"train/logprob_mismatch_mean": 0.9})
    health_services.check_step(run.pk, 3)
    page.wait_for_function("window.runPage.health.reloads > 0 && "
                           "document.querySelectorAll('#health .alarm').length === 4")
    assert page.locator("#health-open").inner_text() == "4 open alarms"
    first = page.locator("#health .alarm").first
    assert "Step 3 · Train/engine logprob mismatch" in first.inner_text()
    assert "mean=0.9" in first.inner_text()
    page.locator("#health .alarm[data-kind='reward_collapse'] .alarm-examples a").first.wait_for()
    page.locator("#health").screenshot(path=str(_shots() / "health-panel.png"))

    page.locator("#health .alarm[data-kind='reward_collapse'] button:has-text('Acknowledge')").click()
    page.wait_for_selector("#health .alarm-acknowledged[data-kind='reward_collapse']")
    assert page.locator("#health-open").inner_text() == "3 open alarms"
    assert RunAlarm.objects.get(run=run, kind="reward_collapse").acknowledged_by == alice

    page.locator("#rescore-box summary").click()
    page.select_option("#rescore-form select[name=reward_script]", str(script.pk))
    page.select_option("#rescore-form select[name=scope]", "step")
    page.fill("#rescore-form input[name=step]", "2")
    page.click("#rescore-form button[type=submit]")
    page.wait_for_selector("#rescore-page")
    # The control worker (the default queue, as `./lw up` starts it) runs health.tasks.rescore; the page refreshes
    # itself while the job is queued or running.
    page.wait_for_selector("#rescore-status:has-text('succeeded')", timeout=90000)
    assert Rescore.objects.get(run=run).summary["changed"] == 16
    assert "16 of 16 rewards changed" in page.locator("#rescore-changed").inner_text()
    assert page.locator("#rescore-results tr.changed").count() == 16
    page.locator("#rescore-page").screenshot(path=str(_shots() / "rescore.png"))
    assert console == []


def _shots():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
