"""Real Chromium on the dataset pages: a bad upload lists its bad line and saves nothing, the fixed file is
uploaded, the task browser searches; the models page follows an import until the new model is listed.
A clean console and a screenshot of each page."""
import json
import os
import shutil
from pathlib import Path

import pytest

from catalog import model_imports
from catalog.models import Dataset, Task
from catalog import tasks
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"


def shoot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def test_upload_a_bad_file_then_the_fixed_one_and_search_its_tasks(page, live_url, alice, tmp_path):  # noqa: F811
    console = []
    page.on("console", lambda msg: console.append(f"{msg.location.get('url')}: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: console.append(f"page error: {exc}"))
    tasks = [{"id": f"q{i:02d}", "question": f"What is {i} + {i}?", "answer": 2 * i} for i in range(40)]
    tasks[33]["question"] = "How many <b>apples</b>?"
    lines = [json.dumps(t) for t in tasks]
    bad = tmp_path / "arith.jsonl"
    bad.write_text("\n".join(lines[:2] + ['{"id": "q02", "question": "What is 2 + 2?", "answer": '] + lines[3:]))
    login(page, live_url)

    page.click("nav >> text=Datasets")
    page.wait_for_selector("#no-datasets")
    shoot(page, "datasets_empty")
    page.click("#dataset-upload-link")
    page.wait_for_selector("#dataset-upload")
    page.set_input_files("#id_file", str(bad))
    page.fill("#id_name", "arith <demo>")
    page.fill("#id_description", "sums of a number with itself")
    page.fill("#id_val_ratio", "0.25")
    page.fill("#id_seed", "5")
    page.click("#dataset-upload button[type=submit]")
    page.wait_for_selector("#line-errors")
    assert page.locator("#line-errors li").count() == 1
    assert page.locator("#line-errors li").inner_text() == "line 3: invalid JSON: Expecting value at column 55"
    assert page.locator("#id_file_error").inner_text().startswith("1 bad line(s), listed below: nothing was saved")
    assert page.locator("#id_name").input_value() == "arith <demo>"  # the other fields stay filled
    assert page.locator("#id_val_ratio").input_value() == "0.25" and page.locator("#id_seed").input_value() == "5"
    shoot(page, "dataset_upload_bad_line")
    assert Dataset.objects.count() == 0 and Task.objects.count() == 0

    good = tmp_path / "arith-fixed.jsonl"
    good.write_text("\n".join(lines) + "\n")
    page.set_input_files("#id_file", str(good))
    page.click("#dataset-upload button[type=submit]")
    page.wait_for_selector("#dataset-facts")
    dataset = Dataset.objects.get()
    assert page.locator("#dataset-name").inner_text() == "arith <demo>"
    assert page.locator("#train-count").inner_text() == str(dataset.train_count)
    assert page.locator("#val-count").inner_text() == str(dataset.val_count)
    assert dataset.train_count + dataset.val_count == 40 and dataset.val_count > 0
    assert page.locator("#source-file").inner_text() == "arith-fixed.jsonl"
    assert page.locator("#tasks li.task").count() == 25 and page.locator("#task-pages a").count() == 1
    assert page.locator("#tasks li.task").first.locator("mark.reward-only").inner_text() == '  "answer": 0'
    shoot(page, "dataset_detail")

    page.fill("#task-search", "<b>apples")
    page.click("#task-filter button[type=submit]")
    page.wait_for_selector("#task-filter-clear")
    assert page.locator("#tasks li.task").count() == 1
    assert page.locator("#tasks li.task").get_attribute("data-external-id") == "q33"
    assert "How many <b>apples</b>?" in page.locator("#tasks pre").inner_text()  # shown as text
    assert page.locator("#tasks b").count() == 0
    shoot(page, "dataset_search")

    page.goto(live_url + "/datasets/")
    assert page.locator("#datasets tbody tr").count() == 1
    shoot(page, "datasets_list")
    page.goto(live_url + "/models/")
    page.wait_for_selector("#models tr[data-model=tiny]")
    shoot(page, "models")
    assert console == [] and page.outside == []


@pytest.fixture
def import_data_dir(settings, tmp_path):
    """A private data dir for this process and the live server (import statuses), set before the server starts."""
    settings.DATA_DIR = tmp_path / "data"
    settings.DATA_DIR.mkdir()
    return settings.DATA_DIR


def test_the_models_page_follows_an_import_until_the_model_is_listed(import_data_dir, page, live_url, alice,  # noqa: F811
                                                                      models_dir, monkeypatch):
    console = []
    page.on("console", lambda msg: console.append(f"{msg.location.get('url')}: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda exc: console.append(f"page error: {exc}"))
    # Queued from this process (the live server would send it to the app's own broker); run here below.
    sent = []
    monkeypatch.setattr(model_imports, "send_task", lambda name, args, queue: sent.append(args))
    status = model_imports.start_import(alice, "tiny", name="tiny-live", seed=4)
    try:
        login(page, live_url)
        page.goto(live_url + "/models/")
        row = page.locator("#imports li[data-import='tiny-live']")
        assert row.get_attribute("data-state") == "queued"
        assert row.locator(".import-message").inner_text() == "waiting for a worker on the default queue"
        assert page.locator("#models tr[data-model='tiny-live']").count() == 0
        shoot(page, "models_import_queued")
        assert tasks.import_model(*sent[0]) == "done" and sent[0][1] == status["id"]  # builds the tiny model
        page.wait_for_selector("#models tr[data-model='tiny-live']", timeout=20000)  # polled, then reloaded
        assert page.locator("#imports li[data-import='tiny-live'] .import-state").inner_text() == "done"
        assert page.locator("#models tr[data-model='tiny-live'] td").nth(3).inner_text() == "tiny"
        shoot(page, "models_import_done")

        page.fill("#id_name", "tiny-live")
        page.click("#import-tiny button[type=submit]")
        page.wait_for_selector("#import-tiny-error")
        assert "a model named 'tiny-live' is already in the registry" in page.locator("#import-tiny-error").inner_text()
        shoot(page, "models_import_refused")
    finally:
        shutil.rmtree(models_dir / "tiny-live", ignore_errors=True)  # the registry is shared by the session
    assert console == [] and page.outside == []
