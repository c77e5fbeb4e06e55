"""Real Chromium on a harness check: the ready-made templates on the list, the check form on the harness page, the
check page following the check from queued to its report (verdict, drift classes, trained text, outcome, reward)."""
import json
import os
import threading

import pytest
from django.db import connection

from catalog import harness_templates
from runs.check_tasks import run_harness_check
from runs.models import CheckStatus, HarnessCheck
from tests.browser.conftest import ROOT, browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login
from tests.runs.test_harness_check_api import models_dir, tokenizer_registry  # noqa: F401  (a real tokenizer)
from tests.runs.test_harness_check_pages import REWARD, TASK, agent_harness  # noqa: F401  (an openai-SDK agent)

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

SHOTS = ROOT / "test-output" / "screenshots"


def run_task(check_id: int) -> str:
    """The worker's task, run here in a thread of its own: Playwright holds an event loop in the test's thread."""
    statuses = []

    def work():
        try:
            statuses.append(run_harness_check(check_id))
        finally:
            connection.close()

    thread = threading.Thread(target=work, name="harness-check")
    thread.start()
    thread.join()
    return statuses[0]


def test_check_a_harness_and_read_its_report(page, live_url, alice, agent_harness, make_reward,  # noqa: F811
                                             console):
    make_reward(alice, name="files", source=REWARD)
    login(page, live_url)
    page.goto(live_url + "/harnesses/")
    templates = harness_templates.templates()
    assert page.locator("#templates tr[data-template]").count() == len(templates) > 0
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "harness-templates.png"), full_page=True)

    page.click(f"#harnesses tr[data-harness='{agent_harness.pk}'] a")
    page.check("#check-source-json")
    page.fill("#check_task_json", json.dumps(TASK))
    page.select_option("#check_model", "tiny")
    page.select_option("#check_reward_script", label="files")
    page.screenshot(path=str(SHOTS / "harness-check-form.png"), full_page=True)
    page.click("#check-run")

    page.wait_for_selector("#check-status[data-status='queued']")
    check = HarnessCheck.objects.get()
    assert page.url == f"{live_url}/harnesses/{agent_harness.pk}/checks/{check.pk}/"
    assert page.locator("#check-waiting").is_visible()
    assert run_task(check.pk) == CheckStatus.SUCCEEDED

    page.wait_for_selector("#check-verdict")  # the page polled the API and reloaded with the report
    assert page.locator("#verdict-word").inner_text() == "ok"
    assert page.locator("#check-status").inner_text() == "succeeded"
    assert page.locator("#calls tbody td.drift").all_inner_texts() == ["clean", "clean"]
    assert page.locator("#check-drift").inner_text() == "Drift classes: clean 2"
    assert page.locator("#check-samples .tok.trained").first.inner_text() != ""
    assert page.locator("#check-samples .tok.trained").last.inner_text().startswith("DONE")
    assert json.loads(page.locator("#check-outcome-json").inner_text())["files"] == TASK["expected"]
    assert page.locator("#check-reward-value").inner_text() == "1.0"
    page.screenshot(path=str(SHOTS / "harness-check.png"), full_page=True)

    page.click(f"a[href='/harnesses/{agent_harness.pk}/']")
    assert page.locator(f"#checks tr[data-check='{check.pk}'] .verdict").inner_text() == "ok"
    assert console == [] and page.outside == []
