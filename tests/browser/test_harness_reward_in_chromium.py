"""Real Chromium on the harness and reward-script pages: argv rows edited as a list, a new version on edit, the ace
editor's test panel showing a reward and an error's line."""
import os

import pytest

from catalog.models import Harness, RewardScript
from tests.browser.conftest import ROOT, browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.test_pages_in_chromium import login

pytestmark = pytest.mark.browser
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

SHOTS = ROOT / "test-output" / "screenshots"
EDITOR = "document.querySelector('#reward-form .django-ace-widget').editor"
SOURCE = '''def reward(task, outcome):
    print("checking", task["id"])
    right = outcome.get("answer") == task["answer"]
    return {"reward": float(right), "right": right}
'''


def shot(page, name: str) -> None:  # noqa: F811
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def argv_values(page):  # noqa: F811
    return page.locator("#argv-rows input[name=argv]").evaluate_all("inputs => inputs.map(i => i.value)")


def test_create_and_edit_a_harness_with_the_argv_list_editor(page, live_url, alice, console):  # noqa: F811
    login(page, live_url)
    page.goto(live_url + "/harnesses/")
    shot(page, "harness_list_empty")
    page.click("#harness-new-link")
    page.wait_for_selector("form.list-editors-ready")  # the list editor's script ran
    assert page.locator("#placeholders [data-placeholder='{task_file}']").count() == 1
    shot(page, "harness_new")

    rows = page.locator("#argv-rows .list-row")
    rows.nth(0).locator("input").fill("python")
    page.click("#argv-add")
    rows.nth(1).locator("input").fill("--task=")
    page.click("#placeholders [data-placeholder='{task_file}']")  # goes where the caret is
    page.click("#argv-add")
    rows.nth(2).locator("input").fill("agent.py")
    rows.nth(2).locator("[data-action=up]").click()  # agent.py before --task=...
    page.click("#argv-add")
    rows.nth(3).locator("input").fill("--drop-me")
    rows.nth(3).locator("[data-action=remove]").click()
    page.click("#argv-add")
    rows.nth(3).locator("input").fill("{bogus}")
    assert argv_values(page) == ["python", "agent.py", "--task={task_file}", "{bogus}"]
    assert rows.nth(0).locator("[data-action=up]").is_disabled()
    page.locator("#env-rows input[name=env_key]").first.fill("MODE")
    page.locator("#env-rows input[name=env_value]").first.fill("fast")
    page.fill("#id_name", "solver")
    page.fill("#id_timeout_s", "90")
    page.click("#harness-save")

    page.wait_for_selector("#id_argv_error")  # an unknown placeholder: refused beside the list
    assert "unknown placeholder(s) ['bogus']" in page.locator("#field-argv #id_argv_error").inner_text()
    assert argv_values(page)[:4] == ["python", "agent.py", "--task={task_file}", "{bogus}"]  # kept as typed
    assert page.locator("#id_name").input_value() == "solver" and Harness.objects.count() == 0
    shot(page, "harness_new_error")
    page.locator("#argv-rows .list-row").nth(3).locator("[data-action=remove]").click()
    page.click("#harness-save")

    page.wait_for_selector("#harness-version")
    harness = Harness.objects.get(name="solver")
    assert harness.command == ["python", "agent.py", "--task={task_file}"] and harness.env == {"MODE": "fast"}
    assert harness.timeout_s == 90 and harness.version == 1
    assert page.locator("#harness-version").inner_text() == "version 1"
    shot(page, "harness_detail")

    rows = page.locator("#argv-rows .list-row")
    rows.nth(2).locator("[data-action=up]").click()  # --task=... before agent.py
    page.click("#argv-add")
    rows.nth(3).locator("input").fill("--out")
    page.click("#argv-add")
    page.click("#placeholders [data-placeholder='{output_file}']")  # into the last (empty) row
    page.click("#harness-save")
    page.wait_for_selector("#messages")
    harness.refresh_from_db()
    assert harness.command == ["python", "--task={task_file}", "agent.py", "--out", "{output_file}"]
    assert harness.version == 2 and page.locator("#harness-version").inner_text() == "version 2"
    assert page.locator("#messages").inner_text() == "Saved as version 2."
    shot(page, "harness_edited")

    page.goto(live_url + "/harnesses/")
    assert page.locator(f"#harnesses tr[data-harness='{harness.pk}'] td").nth(1).inner_text() == "v2"
    shot(page, "harness_list")
    page.click(f"#harnesses tr[data-harness='{harness.pk}'] a")
    page.click("#harness-delete-button")
    page.wait_for_selector("#no-harnesses")
    assert not Harness.objects.exists()
    assert console == [] and page.outside == []


def test_write_a_reward_script_in_the_editor_and_test_it(page, live_url, alice, make_dataset, console,  # noqa: F811
                                                        control_worker):
    dataset = make_dataset(alice, name="arith")  # tasks t0..t4, answer i + 1
    login(page, live_url)
    page.goto(live_url + "/reward-scripts/")
    shot(page, "reward_list_empty")
    page.click("#reward-new-link")
    page.wait_for_selector("#reward-test[data-ready='1']")  # the ace editor is up
    assert page.locator("#reward-form .ace_editor").count() == 1
    assert page.locator("#reward-form textarea[name=source]").is_hidden()
    shot(page, "reward_new")

    page.evaluate(f"source => {EDITOR}.setValue(source, 1)", SOURCE)
    assert page.locator("#reward-form .ace_keyword", has_text="def").count() >= 1  # highlighted as Python
    page.fill("#id_name", "exact")
    page.select_option("#test-dataset", str(dataset.pk))
    page.wait_for_function("document.querySelectorAll('#test-task-options option').length === 5")  # the search
    page.fill("#test-task", "t2")
    page.wait_for_function("[...document.querySelectorAll('#test-task-options option')].map(o => o.value)"
                           ".join() === 't2'")
    page.fill("#test-outcome", '{"answer": 3}')
    page.click("#test-run")
    page.wait_for_selector("#test-result:not([hidden])")
    assert page.locator("#test-reward").inner_text() == "1"
    assert page.locator("#test-status").inner_text() == "ok"
    assert '"right": true' in page.locator("#test-detail").inner_text()
    assert page.locator("#test-output").text_content() == "checking t2\n"
    assert page.locator("#test-error").is_hidden()
    shot(page, "reward_test_ok")

    # Break line 3 by typing in the editor: the error and its line show, the gutter marks it.
    page.evaluate(f"() => {{ {EDITOR}.focus(); {EDITOR}.gotoLine(3, 0, false); }}")
    page.keyboard.press("End")
    page.keyboard.type(" +")
    assert page.evaluate(f"{EDITOR}.session.getLine(2)").endswith('task["answer"] +')
    page.click("#test-run")
    page.wait_for_selector("#test-error:not([hidden])")
    assert page.locator("#test-error-line").inner_text() == "line 3:"
    assert page.locator("#test-error-text").inner_text().startswith("SyntaxError:")
    assert page.locator("#test-status").inner_text() == "syntax"
    assert page.evaluate(f"{EDITOR}.session.getAnnotations().map(a => a.row)") == [2]
    page.wait_for_selector("#reward-form .ace_gutter-cell.ace_error")
    shot(page, "reward_test_syntax_error")

    page.evaluate(f"source => {EDITOR}.setValue(source, 1)", SOURCE.replace('task["id"]', 'task["nope"]'))
    page.click("#test-run")
    page.wait_for_function("document.getElementById('test-error-text').textContent.startsWith('KeyError')")
    assert page.locator("#test-error-line").inner_text() == "line 2:"
    assert page.locator("#test-error-text").inner_text() == "KeyError: 'nope' (line 2)"
    shot(page, "reward_test_exception")

    page.evaluate(f"source => {EDITOR}.setValue(source, 1)", SOURCE)
    page.click("#test-source-json")
    page.fill("#test-task-json", '{"id": "pasted", "answer": 7}')
    page.fill("#test-outcome", '{"answer": 8}')
    page.click("#test-run")
    page.wait_for_function("document.getElementById('test-output').textContent === 'checking pasted\\n'")
    assert page.locator("#test-reward").inner_text() == "0" and page.locator("#test-error").is_hidden()

    page.click("#reward-save")
    page.wait_for_selector("#reward-version")
    script = RewardScript.objects.get(name="exact")
    assert script.source == SOURCE and script.version == 1 and script.owner == alice
    page.wait_for_selector("#reward-test[data-ready='1']")
    assert page.evaluate(f"{EDITOR}.getValue()") == SOURCE
    shot(page, "reward_detail")

    page.evaluate(f"source => {EDITOR}.setValue(source, 1)", SOURCE.replace("float(right)", "1.0 if right else 0.0"))
    page.click("#reward-save")
    page.wait_for_selector("#messages")
    script.refresh_from_db()
    assert script.version == 2 and "1.0 if right else 0.0" in script.source
    assert page.locator("#reward-version").inner_text() == "version 2"
    page.goto(live_url + "/reward-scripts/")
    shot(page, "reward_list")
    assert console == [] and page.outside == []
