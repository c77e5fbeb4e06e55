"""The inspector in real Chromium on one real run of the tiny model whose harness calls a tool (issue 11, item 8).

A real Celery worker runs 2 steps on vLLM (tests/browser/inspector_run.py); the harness's calls carry a
`calculator` tool, so each rollout records system, user, assistant and tool turns. Then, on that one run: a
rollout's conversation shows the tool turns and the tool's "called" badge; the token view marks trained tokens
exactly where the sample's loss mask is 1; the validation grid shows the fail-to-pass flip the test writes into the
database, and the task opens side by side; the step page shows the groups and the timeline; the export downloads
and parses. Every view is screenshotted into test-output/screenshots/inspector-*.png.
"""
import json
import os
from pathlib import Path

import pytest

from runs.models import ModelCall, Rollout, Run, Sample
from tests.browser.conftest import browser, live_url, page  # noqa: F401  (the browser fixtures)
from tests.browser.inspector_run import models_dir, tool_run  # noqa: F401  (the real run's fixtures)
from tests.browser.test_pages_in_chromium import login
from tests.workers import REAL_RUN_MARKS, workers  # noqa: F401  (the workers fixture)

pytestmark = [pytest.mark.browser, *REAL_RUN_MARKS]
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop in this thread

SHOTS = Path(__file__).resolve().parents[2] / "test-output" / "screenshots"


def shot(page, name: str) -> None:  # noqa: F811
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"inspector-{name}.png"), full_page=True)


def check_rollout_page(page, live_url, run: Run) -> Rollout:  # noqa: F811
    """A trained rollout: its calls as a conversation with the tool turns, the tool listed with its badge, the raw
    JSON behind a toggle, its samples, and j to the next attempt of its group."""
    rollout = (Rollout.objects.filter(run=run, split="train", status="succeeded", attempt=0, samples__isnull=False)
               .order_by("id").first())
    calls = list(ModelCall.objects.filter(rollout=rollout).order_by("seq"))
    context = calls[-1].request["messages"]  # the harness resends the history: system, user, assistant, tool
    tool_call = next(m for m in context if m["role"] == "assistant")["tool_calls"][0]
    called = sum(len(c.response["choices"][0]["message"].get("tool_calls") or []) for c in calls)  # by the model
    page.goto(f"{live_url}/rollouts/{rollout.pk}/")
    page.wait_for_selector("#conversation")
    sections = page.locator("#conversation section.call")
    assert [sections.nth(i).get_attribute("data-seq") for i in range(sections.count())] == ["0", "1"]
    assert {sections.nth(i).get_attribute("data-api") for i in range(2)} == {"chat"}
    first, second = sections.nth(0), sections.nth(1)
    assert first.locator(".turn.turn-system .turn-text").inner_text() == context[0]["content"]
    assert first.locator(".turn.turn-user .turn-text").inner_text() == context[1]["content"]
    assert first.locator(".turn.turn-assistant").count() == 1  # the model's answer to call 0
    tool = second.locator(".tool-call[data-name=calculator]")
    assert tool.count() == 1 and tool.locator(".tool-name").inner_text() == "calculator"
    assert json.loads(tool.locator("pre.tool-args").inner_text()) == json.loads(tool_call["function"]["arguments"])
    result = second.locator(".turn.turn-tool")
    assert result.count() == 1 and result.get_attribute("data-tool-call-id") == tool_call["id"]
    assert result.locator(".turn-text").inner_text() == context[-1]["content"] == str(rollout.task.data["value"])
    # Call 1 resends system and user as call 0 had them: shown once, named; its own turns follow.
    assert second.locator(".turns-shared").inner_text().startswith("2 earlier turns as in call 0")
    assert second.locator(".turn").evaluate_all("els => els.map(e => e.classList[1])") == [
        "turn-assistant", "turn-tool", "turn-assistant"]
    badge = page.locator("#tool-defs li.tool-def[data-name=calculator] span.called-badge")
    assert badge.inner_text() == f"called {called} time{'' if called == 1 else 's'}"
    assert page.locator("#tool-defs li.tool-def").count() == 1

    raw = first.locator("pre.raw-request")
    assert not raw.is_visible()
    first.locator("button.raw-toggle").click()
    page.wait_for_function("document.querySelector('#call-0 pre.raw-request').textContent.length > 0")
    assert json.loads(raw.inner_text()) == calls[0].request
    assert json.loads(first.locator("pre.raw-response").inner_text()) == calls[0].response
    first.locator("button.raw-toggle").click()  # closed again for the screenshot

    samples = list(Sample.objects.filter(rollout=rollout).order_by("index").values_list("pk", flat=True))
    links = page.locator("#samples a.token-view-link")
    assert [links.nth(i).get_attribute("href") for i in range(links.count())] == [
        f"/samples/{pk}/tokens/" for pk in samples]
    assert page.locator("a#prev-in-group").count() == 0  # attempt 0 opens its group
    shot(page, "rollout")
    following = Rollout.objects.get(run=run, split="train", step=rollout.step, group=rollout.group, attempt=1)
    page.keyboard.press("j")
    page.wait_for_url(f"**/rollouts/{following.pk}/")
    assert page.locator("a#prev-in-group").get_attribute("href") == f"/rollouts/{rollout.pk}/"
    page.keyboard.press("k")
    page.wait_for_url(f"**/rollouts/{rollout.pk}/")
    return rollout


def check_token_view(page, live_url, rollout: Rollout) -> None:  # noqa: F811
    """Every token rendered; the trained ones exactly where the sample's loss mask is 1; a boundary per call span."""
    sample = Sample.objects.filter(rollout=rollout).order_by("index").first()
    page.click(f"#samples a.token-view-link[href='/samples/{sample.pk}/tokens/']")
    page.wait_for_selector("#token-view span.tok")
    rendered = page.evaluate("window.tokenView.renderAll()")
    total = len(sample.token_ids)
    assert rendered == total and page.locator("#token-view").get_attribute("data-rendered") == str(total)
    assert page.locator("#token-view").get_attribute("data-total") == str(total)
    assert page.locator("#token-view span.tok").count() == total
    trained = page.eval_on_selector_all("#token-view span.tok.trained", "els => els.map(e => Number(e.dataset.i))")
    assert trained == [i for i, mask in enumerate(sample.loss_mask) if mask == 1]
    assert len(trained) > 0 and 1 in sample.loss_mask and 0 in sample.loss_mask
    context = page.eval_on_selector_all("#token-view span.tok.context", "els => els.map(e => Number(e.dataset.i))")
    assert sorted(trained + context) == list(range(total))
    boundaries = page.eval_on_selector_all(
        "#token-view .span-boundary", "els => els.map(e => [Number(e.dataset.callSeq), Number(e.dataset.start)])")
    assert boundaries == [[seq, start] for seq, start, _end, _sampled in sample.spans]
    assert {seq for seq, *_ in sample.spans} == set(sample.call_seqs) and 0 in sample.call_seqs  # forks split calls
    assert page.locator("#sample-advantage").inner_text() == f"{sample.advantage:.4f}"
    # The behaviour and trainer logprobs the tokens carry are the sample's, the trainer's on the trained ones only.
    recorded = [(i, lp) for i, lp in enumerate(sample.trainer_logprobs) if lp is not None]
    assert [i for i, _ in recorded] == trained
    tlps = page.eval_on_selector_all("#token-view span.tok[data-tlp]",
                                     "els => els.map(e => [Number(e.dataset.i), Number(e.dataset.tlp)])")
    assert [i for i, _ in tlps] == trained and [lp for _, lp in tlps] == pytest.approx([lp for _, lp in recorded])
    lps = page.eval_on_selector_all("#token-view span.tok[data-lp]",
                                    "els => els.map(e => [Number(e.dataset.i), Number(e.dataset.lp)])")
    assert dict(lps) == pytest.approx({i: sample.logprobs[i] for i in trained})
    # Call 0's sampled tokens were trained in the context the engine sampled them in: the trainer's logprobs agree
    # with the engine's (under a tenth of a nat on average here; an off-by-one would be nats apart).
    seq, start, end, _sampled = next(span for span in sample.spans if span[3])
    assert seq == 0
    first_call = [abs(tlp - sample.logprobs[i]) for i, tlp in recorded if start <= i < end]
    assert len(first_call) == end - start and sum(first_call) / len(first_call) < 0.3, first_call
    assert page.locator("#count-trained").inner_text() == str(len(trained))
    shot(page, "tokens")


def set_up_flip(run: Run) -> tuple[Rollout, Rollout, int]:
    """The first val task whose first and last attempts made both calls fails at every evaluation but the last,
    where it passes (pass threshold 1.0); the other never passes. Returns the flip's two rollouts and the other
    task's id. (The run's own val rewards stay below 1; a rare harness failure changes no cell's state here.)"""
    val = Rollout.objects.filter(run=run, split="val")
    steps = sorted(set(val.values_list("step", flat=True)))
    assert steps == [0, 1, 2] and val.count() == 6
    tasks = sorted(set(val.values_list("task__index", "task_id")))
    flipped = next((task for _, task in tasks if {val.get(task_id=task, step=s).call_count for s in (0, 2)} == {2}),
                   None)
    assert flipped is not None, list(val.values("id", "task_id", "step", "status", "error", "call_count"))
    val.update(status="succeeded", reward=0.0, failure_kind="")
    before, after = val.get(task_id=flipped, step=0), val.get(task_id=flipped, step=2)
    Rollout.objects.filter(pk=after.pk).update(reward=1.0)
    return before, after, next(task for _, task in tasks if task != flipped)


def check_val_grid(page, live_url, run: Run) -> tuple[Rollout, Rollout]:  # noqa: F811
    """On the run page: the flip the test set up shows in the grid and in each filter."""
    before, after, never_solved = set_up_flip(run)
    flipped = before.task_id
    page.goto(f"{live_url}/runs/{run.pk}/")
    page.wait_for_selector("#val-grid tr.val-row")
    rows = page.locator("#val-grid tr.val-row")
    assert [rows.nth(i).get_attribute("data-external-id") for i in range(rows.count())] == ["sum-0", "sum-1"]
    assert {rows.nth(i).get_attribute("data-task-id") for i in range(2)} == {str(flipped), str(never_solved)}
    row = page.locator(f"#val-grid tr.val-row[data-task-id='{flipped}']")
    cells = row.locator("td.val-cell")
    assert [cells.nth(i).get_attribute("data-step") for i in range(cells.count())] == ["0", "1", "2"]
    assert [cells.nth(i).get_attribute("class").split() for i in range(3)] == [["val-cell", "fail"]] * 2 + [
        ["val-cell", "pass"]]
    assert [cells.nth(i).inner_text().strip() for i in range(3)] == ["✗", "✗", "✓"]
    other = page.locator(f"#val-grid tr.val-row[data-task-id='{never_solved}'] td.val-cell")
    assert [other.nth(i).get_attribute("class").split() for i in range(3)] == [["val-cell", "fail"]] * 3

    def shown(value: str) -> list[str]:
        page.select_option("#val-grid-filter", value)
        page.wait_for_function("document.getElementById('val-grid-count').textContent.startsWith("
                               "document.querySelectorAll('#val-grid tr.val-row').length + ' of ')")
        return page.eval_on_selector_all("#val-grid tr.val-row", "els => els.map(e => e.dataset.taskId)")

    assert shown("flipped") == [str(flipped)]
    assert shown("pass_to_fail") == []
    assert shown("never_solved") == [str(never_solved)]
    assert shown("fail_to_pass") == [str(flipped)]
    page.locator("#validation").screenshot(path=str(SHOTS / "inspector-val-grid.png"))
    shot(page, "run-page")
    return before, after


def check_export(page, run: Run, tmp_path: Path) -> None:  # noqa: F811
    """On the run page: the button's href follows the table's filters; the file holds one parsable line per kept
    rollout, with its calls and samples as the database has them."""
    page.wait_for_selector("#rollouts[data-loads]")
    page.select_option("#rollouts-filter select[name=split]", "train")
    page.wait_for_function("document.getElementById('export-rollouts').href.includes('split=train')")
    with page.expect_download() as download:
        page.click("a#export-rollouts")
    path = tmp_path / "export.jsonl"
    download.value.save_as(path)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    train = Rollout.objects.filter(run=run, split="train").order_by("id")
    assert [r["rollout"]["id"] for r in records] == list(train.values_list("pk", flat=True)) and len(records) == 8
    assert {r["rollout"]["split"] for r in records} == {"train"} and {r["run"]["id"] for r in records} == {run.pk}
    for record in records:
        calls = list(ModelCall.objects.filter(rollout_id=record["rollout"]["id"]).order_by("seq"))
        assert [c["seq"] for c in record["calls"]] == [c.seq for c in calls] == [0, 1]
        assert [c["request"] for c in record["calls"]] == [c.request for c in calls]
        assert [c["completion_ids"] for c in record["calls"]] == [c.completion_ids for c in calls]
        samples = Sample.objects.filter(rollout_id=record["rollout"]["id"]).order_by("index")
        assert [(s["token_ids"], s["loss_mask"], s["advantage"]) for s in record["samples"]] == [
            (s.token_ids, s.loss_mask, s.advantage) for s in samples]
    assert sum(len(r["samples"]) for r in records) >= 1


def check_side_by_side(page, run: Run, before: Rollout, after: Rollout) -> None:  # noqa: F811
    """From the grid's task link: the first and the last evaluation of the flipped task, turn beside turn."""
    page.select_option("#val-grid-filter", "all")
    page.click(f"#val-grid tr.val-row[data-task-id='{before.task_id}'] a.val-task-link")
    page.wait_for_selector("#side-by-side")
    assert page.url.endswith(f"/runs/{run.pk}/val/{before.task_id}/?a=0&b=2")
    side_a, side_b = page.locator("#side-by-side th.side-a"), page.locator("#side-by-side th.side-b")
    assert (side_a.get_attribute("data-rollout"), side_b.get_attribute("data-rollout")) == (str(before.pk),
                                                                                            str(after.pk))
    assert side_a.locator(".side-pass").get_attribute("class").split() == ["side-pass", "fail"]
    assert side_b.locator(".side-pass").get_attribute("class").split() == ["side-pass", "pass"]
    assert page.locator("#compare-a").input_value() == "0" and page.locator("#compare-b").input_value() == "2"
    # Turn i of A beside turn i of B: call 0's system, user and answer, then call 1's tool call, result, answer.
    roles = ["turn-system", "turn-user", "turn-assistant", "turn-assistant", "turn-tool", "turn-assistant"]
    for side in ("turn-a", "turn-b"):
        assert page.eval_on_selector_all(f"#side-by-side tr.turn-row td.{side}",
                                         "tds => tds.map(td => td.querySelector('.turn').classList[1])") == roles
        assert page.locator(f"#side-by-side td.{side} .tool-call[data-name=calculator]").count() == 1
    shot(page, "side-by-side")


def check_step_page(page, live_url, run: Run, step_href: str) -> None:  # noqa: F811
    """Step 1 trained the 2 groups launched first: their 4 attempts, rewards and advantages, and a timeline bar each."""
    batch = Rollout.objects.filter(run=run, split="train", batch_step=1)
    assert batch.count() == 4 and set(batch.values_list("group", flat=True)) == {0, 1}
    page.goto(live_url + step_href)
    page.wait_for_selector("#groups")
    groups = page.eval_on_selector_all("#groups tbody.group", "els => els.map(e => e.dataset.group)")
    assert groups == ["0", "1"]
    for rollout in batch:
        row = page.locator(f"#groups tr.attempt[data-rollout='{rollout.pk}']")
        assert float(row.locator(".reward").inner_text()) == pytest.approx(rollout.reward, abs=5e-4)
        advantages = [s.advantage for s in rollout.samples.all()]
        shown = [float(t) for t in row.locator(".advantage .sample-adv").all_inner_texts()]
        assert shown == pytest.approx(advantages, abs=5e-4) and len(shown) >= 1
    assert page.locator("#groups tr.attempt").count() == 4
    assert page.locator("#groups tbody.group-no-signal").count() == 0  # random rewards differ in each group
    page.wait_for_selector("#timeline [data-rollout]")
    bars = page.eval_on_selector_all("#timeline [data-rollout]", "els => els.map(e => Number(e.dataset.rollout))")
    assert sorted(bars) == sorted(batch.values_list("pk", flat=True))
    assert page.locator("#dropped li.dropped").count() == 0
    shot(page, "step")


def test_the_inspector_on_a_real_tool_calling_run(page, live_url, tool_run, workers, tmp_path):  # noqa: F811
    run = tool_run
    errors = []
    page.on("console", lambda m: errors.append(f"{m.location.get('url')}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.set_viewport_size({"width": 1300, "height": 1000})
    login(page, live_url)
    rollout = check_rollout_page(page, live_url, run)
    check_token_view(page, live_url, rollout)
    before, after = check_val_grid(page, live_url, run)  # the run page, loaded once
    check_export(page, run, tmp_path)
    page.wait_for_selector("a.step-link")
    step_links = page.eval_on_selector_all("a.step-link", "links => links.map(a => a.getAttribute('href'))")
    assert sorted(step_links) == [f"/runs/{run.pk}/steps/{n}/" for n in (1, 2)]
    check_side_by_side(page, run, before, after)
    check_step_page(page, live_url, run, f"/runs/{run.pk}/steps/1/")
    assert errors == [], errors
    assert page.outside == []
    assert workers.engines() == []
