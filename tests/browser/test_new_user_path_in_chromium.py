"""Item 9 of the dashboard: a new user's whole path in Chromium, without curl.

Log in; create a harness with the argv list editor; upload a dataset with one bad line (the error shows, nothing is
saved), then the fixed file; write a reward script in the editor and test it; start a run on the tiny model from
the new-run form; a real Celery worker runs it on vLLM; the charts gain points without a reload; open a rollout
from the table; cancel; clone; compare the two runs. Every page is screenshotted and any console error fails it.
"""
import os
from pathlib import Path

import pytest

from catalog.models import Dataset, Harness, RewardScript
from runs.models import Run
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login
from tests.workers import REAL_RUN_MARKS, Workers, wait_db, workers  # noqa: F401  (the workers fixture)

pytestmark = [pytest.mark.browser, *REAL_RUN_MARKS]
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

SHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"
EDITOR = "document.querySelector('#reward-form .django-ace-widget').editor"
AGENT = '''import json, os, sys, urllib.request
task = json.load(open(sys.argv[1]))
body = {"model": "policy", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 8}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"]
json.dump({"reply": reply}, open(sys.argv[2], "w"))
'''
# A continuous random reward: every group has a spread, so every step trains.
REWARD = '''import random

def reward(task, outcome):
    print("scoring", task["id"])
    return {"reward": random.random(), "words": len(str(outcome.get("reply", "")).split())}
'''
TASKS = [f'{{"id": "t{i}", "question": "say {i}", "split": "{"val" if i < 2 else "train"}"}}' for i in range(8)]
CONFIG = {"tasks_per_step": 2, "group_size": 2, "checkpoint_every": 1, "max_model_len": 512, "kv_cache_gb": 0.5,
          "eval_tasks": 2, "eval_samples": 1, "learning_rate": 0.01, "eval_every": 0}
REWARD_TRACE = ("(() => { const t = document.getElementById('run-chart').data"
                ".find(t => t.name.startsWith('train reward')); return t ? t.x.length : 0; })()")


@pytest.fixture
def models_dir(tmp_path, settings):
    """This test's own registry (the live server, the workers and this process all read it). The session's shared
    registry keeps its weightless `tiny`, which other tests rely on (tests/runs/test_worker.py fails a run on it)."""
    settings.LIGHTNING_MODELS_DIR = tmp_path / "registry"
    return settings.LIGHTNING_MODELS_DIR


@pytest.fixture
def tiny_registered(models_dir):
    from trainer.models import build_tiny_model

    return build_tiny_model(models_dir / "tiny", seed=0, name="tiny")


def shot(page, name: str) -> None:  # noqa: F811
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"path-{name}.png"), full_page=True)


def wait_page(page, condition: str, run: Run, workers: Workers, timeout: float) -> None:  # noqa: F811
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(condition, timeout=timeout * 1000)
    except PlaywrightTimeout:
        run.refresh_from_db()
        raise AssertionError(f"timed out waiting for {condition}: run {run.status} step {run.step} "
                             f"phase {run.phase!r} error {run.error!r}\n{workers.tails()}") from None


def test_a_new_user_does_everything_in_the_browser(page, live_url, alice, tiny_registered, workers,  # noqa: F811
                                                   tmp_path):
    errors = []
    page.on("console", lambda m: errors.append(f"{m.location.get('url')}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    (tmp_path / "agent.py").write_text(AGENT)
    workers.start("control", "default")  # as ./lw up: it scores the reward test panel's tests
    login(page, live_url)
    shot(page, "runs-empty")

    # A harness, its argv edited as a list.
    page.click("nav >> text=Harnesses")
    page.click("#harness-new-link")
    page.wait_for_selector("form.list-editors-ready")
    rows = page.locator("#argv-rows .list-row")
    rows.nth(0).locator("input").fill("python3")
    for value in (str(tmp_path / "agent.py"), "{task_file}", "{output_file}"):
        page.click("#argv-add")
        page.locator("#argv-rows .list-row").last.locator("input").fill(value)
    page.fill("#id_name", "echo-agent")
    page.fill("#id_timeout_s", "120")
    shot(page, "harness-new")
    page.click("#harness-save")
    page.wait_for_selector("#harness-version")
    harness = Harness.objects.get(name="echo-agent")
    assert harness.command == ["python3", str(tmp_path / "agent.py"), "{task_file}", "{output_file}"]
    shot(page, "harness-detail")

    # A dataset: one bad line is reported with its number and nothing is saved; then the fixed file.
    bad, good = tmp_path / "bad.jsonl", tmp_path / "tasks.jsonl"
    bad.write_text("\n".join(TASKS[:3] + ['{"id": "t3", "question": '] + TASKS[4:]) + "\n")
    good.write_text("\n".join(TASKS) + "\n")
    page.click("nav >> text=Datasets")
    page.click("#dataset-upload-link")
    page.set_input_files("#id_file", str(bad))
    page.fill("#id_name", "words")
    page.check("input[name=split_by][value=field]")
    page.fill("#id_split_field", "split")
    page.click("#dataset-upload button[type=submit]")
    page.wait_for_selector("#line-errors")
    assert "line 4" in page.locator("#line-errors").inner_text()
    assert Dataset.objects.count() == 0
    shot(page, "dataset-bad-line")
    page.set_input_files("#id_file", str(good))
    page.click("#dataset-upload button[type=submit]")
    page.wait_for_selector("#dataset-facts")
    dataset = Dataset.objects.get(name="words")
    assert (dataset.train_count, dataset.val_count) == (6, 2)
    shot(page, "dataset-detail")

    # A reward script written in the editor and tested on a task.
    page.click("nav >> text=Reward scripts")
    page.click("#reward-new-link")
    page.wait_for_selector("#reward-test[data-ready='1']")
    page.evaluate(f"source => {EDITOR}.setValue(source, 1)", REWARD)
    page.fill("#id_name", "random")
    page.select_option("#test-dataset", str(dataset.pk))
    page.wait_for_function("document.querySelectorAll('#test-task-options option').length > 0")
    page.fill("#test-task", "t5")
    page.fill("#test-outcome", '{"reply": "five it is"}')
    page.click("#test-run")
    page.wait_for_selector("#test-result:not([hidden])")
    assert 0 <= float(page.locator("#test-reward").inner_text()) <= 1
    assert page.locator("#test-output").text_content() == "scoring t5\n"
    shot(page, "reward-tested")
    page.click("#reward-save")
    page.wait_for_selector("#reward-version")
    assert RewardScript.objects.filter(name="random").exists()

    # A run on the tiny model from the form.
    workers.start("runner", "runs")
    page.click("nav >> text=New run")
    page.fill("#id_name", "first run")
    page.select_option("#id_model", "tiny")
    page.select_option("#id_harness", label="echo-agent")
    page.select_option("#id_dataset", label="words")
    page.select_option("#id_reward_script", label="random")
    page.fill("#id_steps", "1000")  # runs on until cancelled: a tiny step takes about a second
    page.click("#group-advanced > summary")
    for name, value in CONFIG.items():
        page.fill(f"#id_{name}", str(value))
    if page.locator("#id_eval_greedy").is_checked():
        page.uncheck("#id_eval_greedy")
    shot(page, "run-new")
    page.click("#new-run button[type=submit]")
    page.wait_for_selector("#run-chart[data-ready='1']")
    run = Run.objects.get(name="first run")
    assert page.url.endswith(f"/runs/{run.pk}/") and run.config["steps"] == 1000

    # The charts gain points without a reload.
    wait_page(page, f"{REWARD_TRACE} >= 2", run, workers, timeout=300)
    points = page.evaluate(REWARD_TRACE)
    wait_page(page, f"{REWARD_TRACE} > {points}", run, workers, timeout=120)
    assert page.locator("#run-status").inner_text() == "running"
    assert page.evaluate("window.lightningLive.state") == "live"
    shot(page, "run-live")

    # A rollout from the live table.
    page.wait_for_selector("#rollouts-body tr a")
    page.locator("#rollouts-body tr a").first.click()
    page.wait_for_url("**/rollouts/*/")
    shot(page, "rollout")
    page.go_back()
    page.wait_for_selector("#run-chart[data-ready='1']")

    # Cancel.
    page.click("#cancel-button")
    wait_db(lambda: Run.objects.get(pk=run.pk).status == "cancelled", "the run to be cancelled", workers)
    page.wait_for_selector("#run-status:has-text('cancelled')", timeout=30000)
    shot(page, "run-cancelled")

    # Clone and edit: the form comes filled; the clone is launched, then cancelled while queued or starting.
    page.click("#clone-link")
    page.wait_for_selector("#clone-of")
    assert page.locator("#id_name").input_value() == "first run (clone)"
    assert page.locator("#id_steps").input_value() == "1000"
    shot(page, "run-clone-form")
    page.click("#new-run button[type=submit]")
    page.wait_for_selector("#run-chart[data-ready='1']")
    clone = Run.objects.get(name="first run (clone)")
    assert clone.cloned_from_id == run.pk and clone.config == run.config
    page.click("#cancel-button")
    wait_db(lambda: Run.objects.get(pk=clone.pk).status == "cancelled", "the clone to be cancelled", workers)

    # Compare the two from the runs list.
    page.click("nav >> text=Runs")
    for pk in (run.pk, clone.pk):
        page.check(f"#runs-body tr[data-run='{pk}'] input[type=checkbox]")
    shot(page, "runs-list")
    page.click("#compare-selected")
    page.wait_for_selector("#compare-summary")
    assert page.locator("#compare-summary").inner_text().count("first run") == 2
    shot(page, "compare")
    assert errors == [], errors
    assert page.outside == []
