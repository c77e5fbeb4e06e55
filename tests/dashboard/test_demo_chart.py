"""The run page's learning curve in real Chromium: stored metrics drawn by the locally served plotly.js, new ones live."""
import base64
import os

import pytest

from catalog import services as catalog_services
from runs import services
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login
from tests.conftest import REWARD_SOURCE

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

TRACES = "() => document.getElementById('run-chart').data.map(t => ({name: t.name, x: t.x, y: t.y}))"


@pytest.fixture
def run_with_curve(alice):
    harness = catalog_services.create_harness(alice, name="h", command=["python", "a.py"])
    dataset = catalog_services.create_dataset(alice, name="d", content=b'{"q": 1}\n{"q": 2}\n', filename="t.jsonl")
    reward = catalog_services.create_reward_script(alice, name="r", source=REWARD_SOURCE)
    run = services.create_run(alice, name="<b>curve</b>", model="tiny", config={}, harness=harness, dataset=dataset,
                              reward_script=reward)
    services.record_metrics(run.pk, 0, {"eval/pass@1": 0.25, "eval/pass@1_greedy": 0.3, "eval/tasks": 100.0})
    for step, reward_mean in ((1, 0.2), (2, 0.4), (3, 0.5)):
        services.record_metrics(run.pk, step, {"reward/mean": reward_mean, "time/step": 40.0})
    services.record_metrics(run.pk, 3, {"eval/pass@1": 0.6, "eval/pass@1_greedy": 0.7})
    return run


def test_the_run_page_draws_the_stored_curve_and_follows_new_points(page, live_url, run_with_curve):  # noqa: F811
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run_with_curve.pk}/")
    page.wait_for_selector("#run-chart[data-ready='1']", timeout=30000)
    traces = {t["name"]: t for t in page.evaluate(TRACES)}
    reward = traces["train reward (mean of the step)"]
    assert reward["x"] == [1, 2, 3] and reward["y"] == pytest.approx([0.2, 0.4, 0.5])
    sampled = traces["val Pass@1 (mean of k samples)"]
    assert sampled["x"] == [0, 3] and sampled["y"] == pytest.approx([0.25, 0.6])
    assert traces["val Pass@1 (greedy)"]["y"] == pytest.approx([0.3, 0.7])
    title = page.locator("#run-chart .gtitle").text_content()
    assert title == "<b>curve</b>"  # the run's name as text, not markup

    services.record_metrics(run_with_curve.pk, 4, {"reward/mean": 0.75})  # arrives over the websocket
    page.wait_for_function("document.getElementById('run-chart').data[0].x.length === 4", timeout=15000)
    assert page.evaluate(TRACES)[0]["y"][-1] == pytest.approx(0.75)

    data_url = page.evaluate("() => Plotly.toImage(document.getElementById('run-chart'), "
                             "{format: 'png', width: 600, height: 300})")
    png = base64.b64decode(data_url.split(",", 1)[1])
    assert data_url.startswith("data:image/png;base64,") and png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert page.outside == []  # plotly.js came from this server, not a CDN


def test_a_run_without_metrics_shows_an_empty_chart(page, live_url, alice, make_run):  # noqa: F811
    run = make_run(alice)
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#run-chart[data-ready='1']", timeout=30000)
    assert [len(t["x"]) for t in page.evaluate(TRACES)] == [0, 0, 0]
    assert page.outside == []
