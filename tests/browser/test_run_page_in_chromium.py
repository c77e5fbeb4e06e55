"""The run page in real Chromium: five chart panels that extend live and keep the zoom, EMA smoothing, the wall-time
axis, the rollouts table filling in live, the rollout page from a row, cancel, and the signal notice."""
import os
from pathlib import Path

import pytest
from django.db.models import Q

from catalog.models import Task
from runs import rollout_services, services
from runs.models import Run
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"
PANELS = ("run-chart", "chart-policy", "chart-data", "chart-system", "chart-signal")
TRACES = "(id) => document.getElementById(id).data.map(t => ({name: t.name, x: t.x, y: t.y}))"


def step_metrics(step: int) -> dict[str, float]:
    return {
        "reward/mean": 0.1 * step, "reward/std": 0.05, "loss/total": 1.0 / step, "actor/entropy": 2.0,
        "actor/grad_norm": 0.5, "actor/clip_frac": 0.1, "actor/ratio_mean": 1.0, "is/weight_mean": 0.98,
        "is/truncated_frac": 0.01, "train/logprob_mismatch_mean": 0.02, "mismatch/kl": 0.001,
        "length/completion_tokens_mean": 100.0 + step, "length/sample_tokens_mean": 300.0,
        "rollout/calls_mean": 2.0, "train/samples": 16.0, "groups/with_signal": 3.0,
        "samples/dropped_rollouts": 1.0, "rollout/policy_failures": 1.0, "drift/realign_count": 2.0,
        "drift/fork_count": 0.0, "drift/clean_count": 5.0, "time/step": 10.0, "time/generate": 6.0, "time/train": 2.0, "time/sync": 0.5,
        "time/build_samples": 0.2, "time/checkpoint": 0.1, "time/record": 0.1, "time/idle": 1.1,
        "rollout/generated_tokens_per_s": 800.0, "train/tokens_per_s": 5000.0, "staleness/mean": 0.5,
        # dynamic sampling: 4 groups trained (3 with signal), 2 dropped without signal (8 extra rollouts)
        "groups/sampled": 6.0, "groups/trained": 4.0, "groups/trained_with_signal": 3.0,
        "groups/dropped_no_signal": 2.0, "rollout/extra": 8.0, "groups/signal_share": 0.75,
        "groups/sampled_signal_share": 0.5,
    }


@pytest.fixture
def running_run(alice, make_run):
    run = make_run(alice, name="<i>live</i> run", config={"steps": 10})
    services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    services.record_metrics(run.pk, 0, {"eval/pass@1": 0.2, "eval/pass@1_greedy": 0.25})
    for step in (1, 2, 3):
        services.record_metrics(run.pk, step, step_metrics(step))
    Run.objects.filter(pk=run.pk).update(step=3, policy_version=3)
    return run


def shot(page, name):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def settle(page):
    """Wait for the page's own requests: one still in flight when the page closes can hold up daphne's exit."""
    page.wait_for_selector("#run-chart[data-ready='1']")
    page.wait_for_function("window.runPage.table.loads > 0 && !window.runPage.table.inFlight")


def traces(page, panel="run-chart"):
    return {t["name"]: t for t in page.evaluate(TRACES, panel)}


def test_the_run_page_charts_extend_live_keep_the_zoom_smooth_and_switch_to_wall_time(
        page, live_url, running_run, console):
    run = running_run
    login(page, live_url)
    page.wait_for_function("window.lightningLive && window.lightningLive.state === 'live'")  # the runs list's own
    sockets = []
    page.on("websocket", lambda socket: sockets.append(socket.url))
    page.set_viewport_size({"width": 1300, "height": 1000})
    page.goto(f"{live_url}/runs/{run.pk}/")
    for panel in PANELS:
        page.wait_for_selector(f"#{panel}[data-ready='1']", timeout=30000)
    page.wait_for_function("window.lightningLive.state === 'live'")
    assert page.locator("#live-indicator").inner_text() == "live"

    reward = traces(page)
    assert reward["train reward (mean of the step)"]["x"] == [1, 2, 3]
    assert reward["val Pass@1 (mean of k samples)"]["x"] == [0]
    assert reward["train reward ± std"]["y"] == pytest.approx([0.15, 0.25, 0.35])
    policy, data, system, signal = (traces(page, p) for p in PANELS[1:])
    assert {"loss", "clip fraction", "importance ratio (mean)", "TIS weight (mean)", "engine–trainer |Δ logprob|",
            "entropy", "grad norm"} <= set(policy)
    assert data["groups with signal (rewards differ)"]["y"] == pytest.approx([3.0] * 3)
    assert data["dropped rollouts (no trained sample)"]["y"] == pytest.approx([1.0] * 3)
    assert data["drift: realigns"]["y"] == pytest.approx([2.0] * 3)
    assert {"response length (tokens, mean)", "calls per rollout", "samples per step", "drift: forks",
            "drift: clean appends", "policy failures"} <= set(data)
    assert system["samples, checkpoint, record"]["y"] == pytest.approx([0.4] * 3)
    assert {"generate", "train", "sync", "idle", "generated tokens/s", "staleness (mean)"} <= set(system)
    assert all(len(t["x"]) == 3 for t in policy.values())
    assert signal["signal share (trained groups)"]["y"] == pytest.approx([0.75] * 3)
    assert signal["signal share (all groups sampled)"]["y"] == pytest.approx([0.5] * 3)
    # Stacked bars that add up to the groups sampled: 3 trained with signal, 1 without, 2 dropped.
    assert signal["groups trained with signal"]["y"] == pytest.approx([3.0] * 3)
    assert signal["groups trained without signal"]["y"] == pytest.approx([1.0] * 3)
    assert signal["groups dropped (no signal, not trained)"]["y"] == pytest.approx([2.0] * 3)
    assert signal["extra rollouts spent"]["y"] == pytest.approx([8.0] * 3)
    page.wait_for_function("document.getElementById('run-eta').textContent === '1m 10s'")  # 10 s x 7 steps
    services.set_run_phase(run.pk, "step 4: generating rollouts")
    page.wait_for_function("document.getElementById('run-phase').textContent === 'step 4: generating rollouts'")
    services.set_run_phase(run.pk, "evaluating step 3: 2/4", 0.5)
    page.wait_for_function("document.getElementById('run-phase').textContent === 'evaluating step 3: 2/4 (50%)'")
    assert page.locator("#run-step").inner_text() == "3" and page.locator("#run-steps").inner_text() == "10"
    assert page.locator("#run-chart .gtitle").text_content() == "<i>live</i> run"  # text, not markup
    shot(page, "run_page")

    # A zoom survives new points, which arrive without a reload.
    page.evaluate("() => Plotly.relayout('run-chart', {'xaxis.range': [1, 2]})")
    page.evaluate("() => Plotly.relayout('chart-policy', {'xaxis.range': [2, 3]})")
    services.record_metrics(run.pk, 4, step_metrics(4))
    page.wait_for_function("document.getElementById('run-chart').data[0].x.length === 4", timeout=15000)
    page.wait_for_function("document.getElementById('chart-policy').data[0].x.length === 4", timeout=15000)
    assert page.evaluate("() => document.getElementById('run-chart').layout.xaxis.range") == [1, 2]
    assert page.evaluate("() => document.getElementById('chart-policy').layout.xaxis.range") == [2, 3]
    assert page.locator("#run-step").inner_text() == "4" and page.locator("#run-policy-version").inner_text() == "4"
    assert page.locator("#run-phase").inner_text() == "evaluating step 3: 2/4 (50%)"  # metrics do not guess a phase
    assert page.locator("#events li").last.inner_text().endswith("step 4: reward/mean 0.400 · reward/std 0.0500 · "
                                                                  "loss/total 0.250 · time/step 10 … (+35 more)")

    # EMA smoothing changes the drawn values (debiased: the first point stays as it was).
    raw = traces(page)["train reward (mean of the step)"]["y"]
    page.evaluate("""() => { const s = document.getElementById('chart-smoothing');
                             s.value = '0.5'; s.dispatchEvent(new Event('input')); }""")
    page.wait_for_function("document.getElementById('run-chart').data[0].y[1] !== 0.2", timeout=5000)
    smoothed = traces(page)["train reward (mean of the step)"]["y"]
    expected, total, weight = [], 0.0, 0.0
    for value in raw:
        total, weight = 0.5 * total + 0.5 * value, 0.5 * weight + 0.5
        expected.append(total / weight)
    assert smoothed == pytest.approx(expected) and smoothed != pytest.approx(raw)
    assert page.locator("#chart-smoothing-value").inner_text() == "0.50"
    assert page.evaluate("() => document.getElementById('run-chart').layout.xaxis.range") == [1, 2]

    # Back to the checkpoint of step 3: the points of step 4 go, to be trained again.
    services.rewind_run(run.pk, 3, Q(pk__in=[]), "resumed in a test")
    page.wait_for_function("document.getElementById('run-chart').data[0].x.length === 3", timeout=15000)
    assert page.locator("#run-step").inner_text() == "3"
    assert page.locator("#events li").last.inner_text().endswith(
        "resumed from the checkpoint of step 3: 0 rollouts lost, steps 4 to be redone")

    # By wall time: the x values become the times the points were recorded.
    page.check("input[name=chart-x][value=time]")
    page.wait_for_function("document.getElementById('run-chart').layout.xaxis.type === 'date'", timeout=5000)
    x = traces(page)["train reward (mean of the step)"]["x"]
    assert len(x) == 3 and all(isinstance(v, str) and v[:4].isdigit() for v in x)
    assert page.evaluate("() => document.getElementById('chart-system').layout.xaxis.type") == "date"
    shot(page, "run_page_wall_time")
    assert [url.split("?")[0].split("/", 3)[3] for url in sockets] == [f"ws/runs/{run.pk}/"]  # one socket for all
    assert console == [] and page.outside == []


def test_rollouts_fill_in_live_and_open_their_page_then_cancel(page, live_url, running_run, console):
    run = running_run
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#rollouts[data-loads]")
    assert page.locator("#rollouts-body").inner_text().strip() == "No rollouts yet."

    task = Task.objects.filter(dataset=run.dataset, split="train").first()
    made = []
    xss = '<img src=x onerror="window.pwned = 1">'
    for attempt, reward in enumerate((1.0, 0.0, 0.5)):
        rollout, _ = rollout_services.create_rollout(run, task=task, split="train", step=4, group=0, attempt=attempt)
        rollout_services.start_rollout(rollout.pk)
        failed = reward == 0.0
        rollout_services.finish_rollout(rollout.pk, status="failed" if failed else "succeeded", reward=reward,
                                        reward_detail={"why": "<b>payload</b>"}, exit_code=1 if failed else 0,
                                        error=f"harness said {xss}" if failed else "",
                                        failure_kind="policy" if failed else "")
        made.append(rollout)
    page.wait_for_function("document.querySelectorAll('#rollouts-body tr[data-rollout]').length === 3", timeout=15000)
    assert page.locator("#rollouts-count").inner_text() == "3 rollouts"
    failed_row = page.locator(f"#rollouts-body tr[data-rollout='{made[1].pk}']")
    assert failed_row.locator("td.error").inner_text() == f"harness said {xss}"  # text, not markup
    assert failed_row.locator(".status").inner_text() == "failed (policy)"
    assert page.locator("#rollouts-body img").count() == 0 and page.evaluate("window.pwned") is None
    page.click("#rollouts button.sort[data-sort=reward]")  # highest first
    page.wait_for_function(f"document.querySelector('#rollouts-body tr').dataset.rollout === '{made[0].pk}'")
    page.click("#rollouts button.sort[data-sort=reward]")  # lowest first
    page.wait_for_function(f"document.querySelector('#rollouts-body tr').dataset.rollout === '{made[1].pk}'")
    page.fill("#rollouts-filter input[name=reward_min]", "0.4")
    page.wait_for_function("document.querySelectorAll('#rollouts-body tr[data-rollout]').length === 2")
    # The table alone: a full-page shot resizes the viewport, and the scroll it restores afterwards moves the rows.
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#rollouts").screenshot(path=str(SCREENSHOTS / "run_page_rollouts.png"))
    page.wait_for_function("!window.runPage.table.timer && !window.runPage.table.inFlight")  # the rows hold still
    page.click(f"#rollouts-body tr[data-rollout='{made[2].pk}'] a")
    page.wait_for_selector("#rollout-page")
    assert page.url.endswith(f"/rollouts/{made[2].pk}/")
    assert page.locator("h1").inner_text().startswith(f"Rollout {made[2].pk}")
    assert '"why": "<b>payload</b>"' in page.locator("#rollout-reward-detail").inner_text()  # text, not markup
    shot(page, "rollout_page")
    page.click("#rollout-run-link")
    page.wait_for_selector("#cancel-button")

    page.click("#cancel-button")
    page.wait_for_function("document.getElementById('run-status').textContent === 'cancelling'", timeout=15000)
    assert Run.objects.get(pk=run.pk).status == "cancelling"
    settle(page)
    assert console == [] and page.outside == []


def test_cancel_ends_a_queued_run_and_the_header_follows(page, live_url, alice, make_run, console):
    run = make_run(alice, name="queued")
    for i in range(510):  # replayed on load: the log keeps the last 500 lines
        services.emit_event(run.pk, "run.log", {"line": f"line {i}"})
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#run-chart[data-ready='1']")
    page.wait_for_function("document.querySelector('#events li:last-child')?.textContent.endsWith(' line 509')")
    assert page.locator("#events li").count() == 500
    assert page.locator("#events li").first.inner_text().endswith(" line 10")
    assert page.locator("#run-eta").inner_text() == "–"
    page.click("#cancel-button")
    page.wait_for_function("document.getElementById('run-status').textContent === 'cancelled'", timeout=15000)
    assert Run.objects.get(pk=run.pk).status == "cancelled"
    assert not page.locator("#cancel-form").is_visible()
    # The cancel reloads the page: its status is rendered at once, its event log fills from the replay after.
    page.wait_for_function("document.querySelector('#events li:last-child')?.textContent"
                           ".endsWith('status → cancelled: cancelled before it started')", timeout=15000)
    settle(page)
    shot(page, "run_page_cancelled")
    assert console == [] and page.outside == []


def test_the_header_shows_the_host_worker_and_isolation_when_a_worker_starts_the_run(page, live_url, alice, make_run, console):
    run = make_run(alice, name="starting")
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#run-chart[data-ready='1']")
    for field in ("#run-host", "#run-worker", "#run-isolation"):
        assert page.locator(field).inner_text() == "not started yet"
    line = ("CPU: AVX2, no native bf16 (2 cores, 23.5 GiB) -> engine float32, trainer float32 "
            "(auto (engine and trainer): the CPU has no native bf16)")
    worker = {"worker": "runs-default@box", "pool": "default", "device_set": 0, "devices": [],
              "where": "runs-default@box, CPU"}
    services.claim_run(run.pk, "task", worker)  # the "starting" event names the worker
    page.wait_for_function("document.getElementById('run-worker').textContent === 'runs-default@box, CPU'",
                           timeout=15000)
    isolation = "bubblewrap: own mount, pid and network namespaces"
    Run.objects.filter(pk=run.pk).update(host={"summary": line}, isolation=isolation)  # as the orchestrator does
    services.transition_run(run.pk, "running", note={"host": line, "isolation": isolation})
    page.wait_for_function("document.getElementById('run-status').textContent === 'running'", timeout=15000)
    # From the status events, without a reload (the worker and isolation lines said "not started yet" until one).
    assert page.locator("#run-host").inner_text() == line
    assert page.locator("#run-isolation").inner_text() == isolation
    page.reload()
    page.wait_for_selector("#run-chart[data-ready='1']")
    assert page.locator("#run-host").inner_text() == line  # as the server draws it
    assert page.locator("#run-worker").inner_text() == "runs-default@box, CPU"
    assert page.locator("#run-isolation").inner_text() == isolation
    assert console == [] and page.outside == []


def test_the_header_warns_live_when_groups_lose_their_signal_and_says_what_dynamic_sampling_did(
        page, live_url, alice, make_run, console):
    run = make_run(alice, name="losing signal", config={"steps": 10, "dynamic_sampling": True})
    services.claim_run(run.pk, "task")
    services.transition_run(run.pk, "running")
    services.record_metrics(run.pk, 1, {"groups/sampled": 6.0, "groups/with_signal": 4.0,
                                        "groups/sampled_signal_share": 4 / 6, "groups/dropped_no_signal": 2.0})
    login(page, live_url)
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#chart-signal[data-ready='1']")
    assert page.locator("#run-signal").is_hidden()
    # Step 2: a quarter of the groups sampled had signal; with step 1's two thirds, 0.46 on average: under 0.5.
    services.record_metrics(run.pk, 2, {"groups/sampled": 12.0, "groups/with_signal": 3.0,
                                        "groups/sampled_signal_share": 0.25, "groups/dropped_no_signal": 8.0})
    page.wait_for_selector("#run-signal", state="visible", timeout=15000)
    text = page.locator("#run-signal").inner_text()
    assert text.startswith("Groups are losing their learning signal: in steps 1-2, 46% of the groups sampled")
    assert text.endswith("Dynamic sampling dropped 10 groups without signal in these steps.")
    services.record_metrics(run.pk, 3, {"groups/sampled": 8.0, "groups/with_signal": 7.0,
                                        "groups/sampled_signal_share": 0.875, "groups/dropped_no_signal": 0.0})
    page.wait_for_selector("#run-signal", state="hidden", timeout=15000)  # steps 2-3 average 0.56
    page.reload()
    page.wait_for_selector("#chart-signal[data-ready='1']")
    assert page.locator("#run-signal").is_hidden()  # as the server draws it
    assert console == [] and page.outside == []
