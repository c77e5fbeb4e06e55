"""The runs list in real Chromium against daphne: rows follow metrics and status changes live, a dropped socket
reconnects and backfills what it missed, two selected runs open the comparison, bulk cancel cancels queued runs."""
import os
from pathlib import Path

import pytest

from runs import rollout_services, services
from runs.models import Run
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread
SHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"
XSS_NAME = '<img src=x onerror="window.__xss=1">'


def train(run, step, metrics):
    rollout_services.record_step(run.pk, step, step, samples=[], drift={}, metrics=metrics)


def cell(run, name):
    return f"document.querySelector('tr[data-run=\"{run.pk}\"] .{name}')"


def wait_text(page, run, name, text):  # noqa: F811
    page.wait_for_function(f"{cell(run, name)}?.textContent === {text!r}", timeout=15000)


@pytest.fixture
def runs(alice, make_harness, make_dataset, make_reward):
    kit = {"harness": make_harness(alice, name="agent-h"), "dataset": make_dataset(alice, name="math-d"),
           "reward_script": make_reward(alice, name="exact-r")}

    def new(name, **config):
        return services.create_run(alice, name=name, model="tiny", config={"steps": 10, **config}, **kit)

    trained, other = new("trained", learning_rate=1e-6), new(XSS_NAME, learning_rate=1e-5)
    for run, rewards in ((trained, (0.1, 0.3, 0.5)), (other, (0.2, 0.25))):
        services.transition_run(run.pk, "starting")
        services.transition_run(run.pk, "running")
        for step, reward in enumerate(rewards, start=1):
            train(run, step, {"reward/mean": reward, "loss/total": 1.0 / step})
    services.record_metrics(trained.pk, 3, {"eval/pass@1": 0.25})
    return {"trained": trained, "other": other, "queued": [new("wait-1"), new("wait-2")], "later": new("later")}


def test_the_runs_list_is_live_reconnects_compares_and_bulk_cancels(page, live_url, runs):  # noqa: F811
    SHOTS.mkdir(parents=True, exist_ok=True)
    errors = []
    page.on("console", lambda msg: errors.append(f"{msg.location.get('url')}: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    trained, other, later = runs["trained"], runs["other"], runs["later"]
    login(page, live_url)
    page.wait_for_selector("#live-indicator[data-state=live]", timeout=15000)
    assert page.locator("#runs tbody tr").count() == 5
    assert page.locator(f"tr[data-run='{other.pk}'] .name a").inner_text() == XSS_NAME  # text, not markup
    assert page.evaluate("window.__xss") is None
    assert page.locator(f"tr[data-run='{trained.pk}'] .reward").inner_text() == "0.500"
    assert page.locator(f"tr[data-run='{trained.pk}'] .pass1").inner_text() == "0.250"
    assert page.locator(f"tr[data-run='{trained.pk}'] svg.sparkline").get_attribute("data-points") == "3"
    assert page.locator(f"tr[data-run='{trained.pk}'] .step").inner_text() == "3/10"
    page.screenshot(path=str(SHOTS / "runs_list.png"), full_page=True)

    # A metric and a status change appear in their rows without a reload.
    train(trained, 4, {"reward/mean": 0.9, "eval/pass@1": 0.5})
    wait_text(page, trained, "reward", "0.900")
    assert page.locator(f"tr[data-run='{trained.pk}'] .pass1").inner_text() == "0.500"
    assert page.locator(f"tr[data-run='{trained.pk}'] .step").inner_text() == "4/10"
    assert page.locator(f"tr[data-run='{trained.pk}'] svg.sparkline").get_attribute("data-points") == "4"
    services.transition_run(later.pk, "starting")
    wait_text(page, later, "state span", "starting")
    services.set_run_phase(later.pk, "starting the engine: <b>loading</b>")
    wait_text(page, later, "phase", "starting the engine: <b>loading</b>")
    fresh = services.clone_run(runs["queued"][0], runs["queued"][0].owner, name="new arrival")  # not shown yet
    page.wait_for_selector(f"tr[data-run='{fresh.pk}'] .name a:has-text('new arrival')", timeout=15000)
    assert page.locator("#runs tbody tr").count() == 6 and page.locator("#runs-count").inner_text() == "6 runs"

    # The socket drops; a change made meanwhile is backfilled when it is back.
    received = page.evaluate("window.lightningLive.received")
    page.evaluate("window.lightningLive.socket.close()")
    page.wait_for_selector("#live-indicator[data-state=reconnecting]", timeout=5000)
    train(trained, 5, {"reward/mean": 0.95})
    services.transition_run(later.pk, "failed", error="engine exited")
    page.wait_for_selector("#live-indicator[data-state=live]", timeout=15000)
    wait_text(page, trained, "reward", "0.950")
    assert page.locator(f"tr[data-run='{trained.pk}'] .step").inner_text() == "5/10"
    wait_text(page, later, "state span", "failed")
    assert page.evaluate("window.lightningLive.received") == received + 1  # only the feed's hello: a backfill
    assert page.evaluate("window.lightningLive.reconnects") >= 1
    page.screenshot(path=str(SHOTS / "runs_list_reconnected.png"), full_page=True)

    # Two selected runs open the comparison: charts overlaid, the config diff.
    assert page.locator("#compare-selected").is_disabled()
    page.check(f"tr[data-run='{trained.pk}'] input[type=checkbox]")
    page.check(f"tr[data-run='{other.pk}'] input[type=checkbox]")
    assert page.locator("#selected-count").inner_text() == "2 selected"
    page.click("#compare-selected")
    page.wait_for_selector("body[data-charts-ready='1']", timeout=30000)
    assert page.url.endswith(f"/runs/compare/?ids={trained.pk},{other.pk}")
    traces = page.evaluate("() => Object.fromEntries([...document.querySelectorAll('.compare-chart')]"
                           ".map(el => [el.dataset.metric, el.data.map(t => [t.name, t.x.length])]))")
    escaped = XSS_NAME.replace("<", "&lt;").replace(">", "&gt;")
    assert traces["reward/mean"] == [[f"trained (#{trained.pk})", 5], [f"{escaped} (#{other.pk})", 2]]
    assert traces["loss/total"] == [[f"trained (#{trained.pk})", 3], [f"{escaped} (#{other.pk})", 2]]
    assert traces["eval/pass@1"] == [[f"trained (#{trained.pk})", 2]]
    assert page.locator("#config-diff tr.config").evaluate_all("rows => rows.map(r => r.dataset.key)") == [
        "learning_rate"]
    assert page.evaluate("window.__xss") is None
    # Live: a new point of a compared run extends its trace without a reload (the runs feed).
    page.wait_for_selector("#live-indicator[data-state=live]", timeout=15000)
    services.record_metrics(trained.pk, 50, {"reward/mean": 0.99})
    page.wait_for_function("document.querySelector(\".compare-chart[data-metric='reward/mean']\").data[0].x"
                           ".length === 6", timeout=15000)
    assert page.evaluate("document.querySelector(\".compare-chart[data-metric='reward/mean']\").data[0].y.at(-1)"
                         ) == pytest.approx(0.99)
    page.screenshot(path=str(SHOTS / "runs_compare.png"), full_page=True)

    # Bulk cancel two queued runs.
    page.goto(live_url + "/")
    page.wait_for_selector("#live-indicator[data-state=live]", timeout=15000)
    waiting = runs["queued"]
    for run in waiting:
        page.check(f"tr[data-run='{run.pk}'] input[type=checkbox]")
    page.click("#cancel-selected")
    page.wait_for_selector(".notice-success")
    notice = page.locator(".notice-success").inner_text()  # in the table's order: newest first
    assert notice == f"Cancelled 2: #{waiting[1].pk} wait-2 (cancelled), #{waiting[0].pk} wait-1 (cancelled)"
    assert set(Run.objects.filter(pk__in=[r.pk for r in waiting]).values_list("status", flat=True)) == {"cancelled"}
    wait_text(page, waiting[0], "state span", "cancelled")
    page.screenshot(path=str(SHOTS / "runs_list_bulk_cancel.png"), full_page=True)

    # Choosing a status filter applies it (in SQL, on the server).
    page.select_option("#filter-status", "cancelled")
    page.wait_for_url(lambda url: "status=cancelled" in url)
    page.wait_for_selector("#live-indicator[data-state=live]", timeout=15000)
    names = page.locator("#runs tbody tr .name a").all_inner_texts()
    assert sorted(names) == ["wait-1", "wait-2"] and page.locator("#runs-count").inner_text() == "2 runs"
    assert errors == [] and page.outside == []
