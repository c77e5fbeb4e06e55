"""Real Chromium on the new-run form: an error shows beside its field with the values kept; clone and edit."""
import os

import pytest

from runs.models import Run
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread


def test_the_new_run_form_shows_errors_beside_fields_and_clones(page, live_url, alice, make_run, tmp_path):
    # No valid form is submitted here: the daphne process would enqueue the run on the app's own queue.
    source = make_run(alice, name="base", config={"steps": 7, "mode": "async"})
    console = []
    page.on("console", lambda msg: console.append(f"{msg.location.get('url')}: {msg.text}")
            if msg.type == "error" else None)
    login(page, live_url)

    page.goto(live_url + "/runs/new/")
    assert page.locator("#group-basic legend").inner_text() == "Basic"
    assert page.locator("#id_steps").input_value() == "10"
    assert not page.locator("#id_kl_coef").is_visible()  # advanced starts folded
    page.fill("#id_name", "typed by hand")
    page.select_option("#id_harness", str(source.harness_id))
    page.select_option("#id_dataset", str(source.dataset_id))
    page.select_option("#id_reward_script", str(source.reward_script_id))
    page.fill("#id_steps", "0")
    page.fill("#id_learning_rate", "0.00003")
    page.click("#new-run button[type=submit]")
    page.wait_for_selector("#id_steps_error")
    assert page.locator("#id_steps_error").inner_text().startswith("steps must be at least 1, got 0")
    assert page.locator("#field-steps #id_steps_error").count() == 1  # beside the field
    assert page.locator("#id_steps").input_value() == "0" and page.locator("#id_name").input_value() == "typed by hand"
    assert page.locator("#id_learning_rate").input_value() == "0.00003"  # as typed
    page.screenshot(path=str(tmp_path / "new_run_error.png"), full_page=True)
    assert Run.objects.count() == 1

    page.goto(f"{live_url}/runs/{source.pk}/")
    page.click("#clone-link")
    page.wait_for_selector("#clone-of")
    assert page.url.endswith(f"/runs/new/?clone={source.pk}")
    assert page.locator("#id_name").input_value() == "base (clone)"
    assert page.locator("#id_steps").input_value() == "7" and page.locator("#id_mode").input_value() == "async"
    assert page.locator("#id_harness").input_value() == str(source.harness_id)
    page.screenshot(path=str(tmp_path / "new_run_clone.png"), full_page=True)
    assert console == [] and page.outside == []
