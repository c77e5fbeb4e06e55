"""The validation grid, the steps list and the step page in real Chromium: a flip set up in the data is shown and
filtered, a new evaluation arrives live, the step page draws a bar per rollout over the phase bands."""
import os
from pathlib import Path

import pytest

from runs import services
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login
from tests.dashboard.test_inspect_queries import evaluate, evaluated, run, stepped  # noqa: F401  (the data fixtures)

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"

ROWS = "() => [...document.querySelectorAll('#val-grid tr.val-row')].map(r => r.dataset.externalId)"
CELLS = ("(id) => [...document.querySelectorAll(`#val-grid tr.val-row[data-external-id='${id}'] td.val-cell`)]"
         ".map(c => [Number(c.dataset.step), c.classList[1], c.firstChild.textContent])")


def shot(page, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_the_grid_shows_and_filters_a_flip_and_follows_a_new_evaluation(  # noqa: F811
        page, live_url, evaluated, stepped):  # noqa: F811
    run, rollouts = stepped
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#val-grid tr.val-row")
    assert page.evaluate(ROWS) == ["v0", "v1", "v2", "v3", "v4"]
    assert page.evaluate(CELLS, "v0") == [[0, "fail", "✗"], [2, "partial", "1/2"], [4, "pass", "✓"]]
    page.select_option("#val-grid-filter", "fail_to_pass")
    assert page.evaluate(ROWS) == ["v0"]
    v0 = run.dataset.tasks.get(external_id="v0")
    assert page.get_attribute("a.val-task-link", "href") == f"/runs/{run.pk}/val/{v0.pk}/?a=0&b=4"
    page.select_option("#val-grid-filter", "never_solved")
    assert page.evaluate(ROWS) == ["v2", "v4"]
    page.select_option("#val-grid-filter", "all")
    page.select_option("#val-grid-sort", "-last")
    assert page.evaluate(ROWS)[:2] == ["v0", "v3"]
    shot(page, "inspect_val_grid")

    evaluate(run, 6, {"v1": ((1.0, 1.0), 1.0)})  # a new evaluation: v1 passes again
    services.record_metrics(run.pk, 6, {"eval/pass@1": 0.2})  # its event reloads the grid
    page.wait_for_function("document.querySelectorAll('#val-grid-head th[data-step]').length === 4")
    assert page.evaluate(CELLS, "v1")[-1] == [6, "pass", "✓"]

    links = page.eval_on_selector_all("a.step-link", "links => links.map(a => a.getAttribute('href'))")
    assert links == [f"/runs/{run.pk}/steps/2/", f"/runs/{run.pk}/steps/1/"]
    page.click("a.step-link >> text='step 2'")
    page.wait_for_selector("#timeline[data-drawn]")
    bars = page.eval_on_selector_all("#timeline [data-rollout]", "bars => bars.map(b => Number(b.dataset.rollout))")
    assert bars == [rollouts[k].pk for k in ("c0", "c1", "c2", "d0", "d1")]
    assert page.eval_on_selector_all("#timeline .band", "bands => bands.map(b => b.dataset.kind)") == [
        "eval", "generate", "train"]
    assert page.locator("#timeline .straggler").count() == 1
    assert page.locator("tbody.group.group-no-signal").count() == 1
    assert page.locator("#dropped li.dropped").count() == 2
    shot(page, "inspect_step")
    assert page.outside == []
