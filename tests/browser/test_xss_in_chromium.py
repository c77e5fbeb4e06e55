"""Item 8 of the dashboard: text from users, tasks, models and harnesses is shown as text on every page.

`<script>` and `"><img onerror=...>` payloads are planted in a task, a model completion, a harness name and
description, a dataset, a reward script, a run name, a reward detail, harness output and the event log. Every
page that can show them is opened in Chromium: no payload runs (a run would bump window.__xss, open a dialog or
fetch /x), the payload text is visible where the page shows that field, and the console stays clean.
"""
import json
import os
from pathlib import Path

import pytest
from django.urls import reverse

from catalog import services as catalog_services
from runs import rollout_services, services
from runs.models import CallApi, ModelCall
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

SCRIPT = "<script>window.__xss=(window.__xss||0)+1</script>"
IMG = '"><img src=/x onerror="window.__xss=(window.__xss||0)+1">'
PAYLOAD = SCRIPT + IMG
SHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"
REWARD = ("def reward(task, outcome):\n"
          f"    print({PAYLOAD!r})\n"
          f"    return {{'reward': 1.0, 'note': {PAYLOAD!r}}}\n")


@pytest.fixture
def planted(alice):
    harness = catalog_services.create_harness(alice, name="h" + PAYLOAD, description=PAYLOAD, command=["python", PAYLOAD],
                                      env={"X": PAYLOAD})
    tasks = [{"id": f"t{i}" + PAYLOAD, "question": PAYLOAD, "answer": PAYLOAD, "split": "val" if i == 0 else "train"}
             for i in range(3)]
    dataset = catalog_services.create_dataset(alice, name="d" + PAYLOAD, description=PAYLOAD, filename="x.jsonl",
                                      content="\n".join(json.dumps(t) for t in tasks).encode())
    reward = catalog_services.create_reward_script(alice, name="r" + PAYLOAD, description=PAYLOAD, source=REWARD)
    runs = [services.create_run(alice, name=f"run{i}" + PAYLOAD, model="tiny", config={}, harness=harness,
                                dataset=dataset, reward_script=reward) for i in range(2)]
    run = runs[0]
    task = dataset.tasks.filter(split="train").first()
    rollout, _ = rollout_services.create_rollout(run, task=task, split="train", step=0, group=0, attempt=0)
    rollout_services.start_rollout(rollout.pk)
    ModelCall.objects.create(
        rollout=rollout, seq=0, api=CallApi.CHAT, status_code=200, prompt_ids=[1, 2], completion_ids=[3],
        logprobs=[-0.5], finish_reason="stop",
        request={"model": "policy", "messages": [{"role": "user", "content": PAYLOAD}]},
        response={"choices": [{"message": {"role": "assistant", "content": PAYLOAD}}]})
    rollout_services.finish_rollout(rollout.pk, status="succeeded", reward=1.0, reward_detail={"note": PAYLOAD},
                                    exit_code=0, stdout_tail=PAYLOAD, stderr_tail=PAYLOAD, error=PAYLOAD)
    services.emit_event(run.pk, "run.log", {"line": PAYLOAD})
    services.record_metrics(run.pk, 1, {"reward/mean": 0.5, "reward/std": 0.1})
    services.set_run_phase(run.pk, PAYLOAD)
    return {"run": run, "runs": runs, "rollout": rollout, "harness": harness, "dataset": dataset, "reward": reward}


def test_no_planted_payload_runs_on_any_page(page, live_url, planted):  # noqa: F811
    errors, dialogs = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    fetched_x = []
    page.on("request", lambda r: fetched_x.append(r.url) if r.url.endswith("/x") else None)
    login(page, live_url)
    run, p = planted["run"], planted
    pages = {
        "runs-list": reverse("runs-list"),
        "run-detail": reverse("run-detail", args=[run.pk]),
        "rollout-detail": reverse("rollout-detail", args=[p["rollout"].pk]),
        "run-compare": reverse("run-compare") + f"?ids={p['runs'][0].pk},{p['runs'][1].pk}",
        "harness-list": reverse("harness-list"),
        "harness-detail": reverse("harness-detail", args=[p["harness"].pk]),
        "dataset-list": reverse("dataset-list"),
        "dataset-detail": reverse("dataset-detail", args=[p["dataset"].pk]),
        "dataset-search": reverse("dataset-detail", args=[p["dataset"].pk]) + "?q=script",
        "reward-list": reverse("reward-list"),
        "reward-detail": reverse("reward-detail", args=[p["reward"].pk]),
        "run-new-clone": reverse("run-new") + f"?clone={run.pk}",
    }
    SHOTS.mkdir(parents=True, exist_ok=True)
    for name, path in pages.items():
        page.goto(live_url + path)
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(700)  # live updates and JS-rendered tables land
        page.screenshot(path=str(SHOTS / f"xss-{name}.png"), full_page=True)
        assert page.evaluate("window.__xss") is None, f"a payload ran on {name}"
        assert "window.__xss" in page.locator("body").inner_text() or name in ("run-new-clone",), \
            f"{name} shows none of the planted text"
    assert dialogs == [] and fetched_x == [], (dialogs, fetched_x)
    assert not [e for e in errors if "favicon" in e or "Uncaught" in e or "Error" in e], errors
