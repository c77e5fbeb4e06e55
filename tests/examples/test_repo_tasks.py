"""The repository task suite (examples/repo_tasks): an honest split by template, tasks that fail as given and pass
once fixed, and a reward that scores them inside the real sandbox within its limits."""
import difflib
import importlib.util
import json
import re
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings

from catalog.datasets import DEFAULT_HIDDEN_FIELDS
from sandbox.scoring import Limits, score

SUITE = settings.BASE_DIR / "examples" / "repo_tasks"
TASK_FIELDS = {"id", "template", "kind", "split", "prompt", "files", "tests"}


def load(name):
    spec = importlib.util.spec_from_file_location(f"repo_tasks_{name}", SUITE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


make_tasks, reward = load("make_tasks"), load("reward")
REWARD_SOURCE = (SUITE / "reward.py").read_text()
TASKS = [json.loads(line) for line in (SUITE / "tasks.jsonl").read_text().splitlines() if line.strip()]
TEMPLATES = make_tasks.TEMPLATES_BY_ID
ONE_PER_TEMPLATE = list({task["template"]: task for task in reversed(TASKS)}.values())
ONE_PER_CODE_KIND = list({task["kind"]: task for task in reversed(TASKS) if task["kind"] != "file_value"}.values())


def unchanged():
    return {"final_message": "", "diff": "", "files": {}, "exit_code": 0, "timed_out": False}


def edited(task, files):
    """An outcome whose changed files are those that differ from the task's."""
    return {**unchanged(), "files": {p: t for p, t in files.items() if task["files"].get(p) != t}}


def changed_modules(task):
    """The Python files a correct fix changes."""
    return [path for path, text in make_tasks.solve(task).items()
            if path.endswith(".py") and task["files"].get(path) != text]


def broken(task):
    """The solved repository with every changed module made unparsable."""
    return {path: text + ("def broken(:\n" if path in changed_modules(task) else "")
            for path, text in make_tasks.solve(task).items()}


def looping(task):
    """The solved repository with the first function of each changed module stuck in a loop."""
    files = make_tasks.solve(task)
    for path in changed_modules(task):
        files[path] = re.sub(r"^(def .*:\n)", r"\1    while True:\n        pass\n", files[path], count=1, flags=re.M)
    return files


def wording_words(template):
    return re.sub(r"\{\w+\}", " ", template.wording).lower().replace(".", " ").replace(",", " ").split()


def test_the_committed_file_is_the_default_output(capsys):
    make_tasks.main([])
    assert capsys.readouterr().out == (SUITE / "tasks.jsonl").read_text()
    assert TASKS == make_tasks.make()


def test_it_is_deterministic_by_seed():
    assert make_tasks.make(5) == make_tasks.make(5)
    assert make_tasks.make(5) != make_tasks.make(0)


def test_300_tasks_with_unique_ids_and_only_the_task_fields():
    assert len(TASKS) >= 300 and len({task["id"] for task in TASKS}) == len(TASKS)
    assert all(set(task) == TASK_FIELDS for task in TASKS)
    assert {task["split"] for task in TASKS} == {"train", "val"}
    splits = [task["split"] for task in TASKS]
    assert splits.count("train") >= 220 and splits.count("val") >= 80
    assert "tests" in DEFAULT_HIDDEN_FIELDS  # the harness never sees the checks


def test_tasks_are_small_and_their_prompt_names_the_files_to_touch():
    for task in TASKS:
        assert 1 <= len(task["files"]) <= 3 and all(len(text.splitlines()) <= 15 for text in task["files"].values())
        assert 2 <= len(task["tests"]) <= 5 and len({check["name"] for check in task["tests"]}) == len(task["tests"])
        assert not {check["name"] for check in task["tests"]} & {"reward", "checks_passed", "checks_total", "error"}
        touched = [path for path, text in make_tasks.solve(task).items() if task["files"].get(path) != text]
        assert touched and all(path in task["prompt"] for path in touched), task["id"]


def test_the_split_goes_by_template():
    splits = defaultdict(set)
    for task in TASKS:
        splits[task["template"]].add(task["split"])
        template = TEMPLATES[task["template"]]
        assert (task["kind"], task["split"]) == (template.kind, template.split)
    assert set(splits) == set(TEMPLATES) and all(len(found) == 1 for found in splits.values())
    counts = defaultdict(int)
    for task in TASKS:
        counts[task["template"]] += 1
    assert all(counts[t.id] == t.count for t in make_tasks.TEMPLATES)


def test_every_kind_is_in_both_splits_and_val_wordings_are_new():
    train = [t for t in make_tasks.TEMPLATES if t.split == "train"]
    val = [t for t in make_tasks.TEMPLATES if t.split == "val"]
    assert 12 <= len(train) <= 16 and 5 <= len(val) <= 8
    assert {t.kind for t in train} == {t.kind for t in val} == set(make_tasks.KINDS)
    for new in val:
        for old in train:
            assert new.wording != old.wording
            ratio = difflib.SequenceMatcher(None, wording_words(new), wording_words(old)).ratio()
            assert ratio < 0.5, (new.id, old.id, ratio)  # not a train wording with a few words swapped


def test_no_val_task_repeats_a_train_task_and_val_scenarios_are_new():
    def text(task):
        return json.dumps([task["prompt"], task["files"]], sort_keys=True)

    def names(task):
        return ({path for path in task["files"] if path.endswith(".py")},
                set(re.findall(r"^def (\w+)", "\n".join(task["files"].values()), flags=re.M)))

    by_split = defaultdict(list)
    for task in TASKS:
        by_split[task["split"]].append(task)
    train, val = by_split["train"], by_split["val"]
    assert not {text(t) for t in val} & {text(t) for t in train}
    assert len({text(t) for t in TASKS}) == len(TASKS)
    assert not {json.dumps(t["files"], sort_keys=True) for t in val} & {json.dumps(t["files"], sort_keys=True)
                                                                         for t in train}
    train_files, train_funcs = set(), set()
    for task in train:
        files, funcs = names(task)
        train_files |= files
        train_funcs |= funcs
    for task in val:
        files, funcs = names(task)
        assert not files & train_files and not funcs & train_funcs, task["id"]


def test_the_original_files_fail_and_the_solution_passes_for_every_task():
    def scores(task):
        return (reward.reward(task, unchanged())["reward"],
                reward.reward(task, edited(task, make_tasks.solve(task)))["reward"])

    with ThreadPoolExecutor(4) as pool:
        for task, (before, after) in zip(TASKS, pool.map(scores, TASKS)):
            assert before < 1 and after == 1.0, (task["id"], before, after)
            assert (before > 0) == (task["kind"] != "file_value"), (task["id"], before)  # the import check


def test_solve_refuses_a_task_it_did_not_make():
    with pytest.raises(KeyError):
        make_tasks.solve({**TASKS[0], "prompt": "something else"})


def test_the_repository_is_rebuilt_from_the_diff_and_the_files():
    task = next(t for t in TASKS if t["kind"] == "file_value")
    solved = make_tasks.solve(task)
    target = next(iter(set(solved) - set(task["files"])))
    extra = next(iter(task["files"]))
    diff = (f"diff --git a/{extra} b/{extra}\ndeleted file mode 100644\nindex 1111111..0000000\n--- a/{extra}\n"
            f"+++ /dev/null\n@@ -1 +0,0 @@\n-x\n")
    outcome = {**unchanged(), "diff": diff, "files": {target: solved[target], "../escape.txt": "x", "n": 4}}
    assert reward.final_files(task, outcome) == {target: solved[target], "../escape.txt": "x"}
    assert reward.reward(task, outcome)["reward"] == 1.0
    assert reward.deleted_paths("diff --git a/old.py b/new.py\nsimilarity index 90%\nrename from old.py\n"
                                "rename to new.py\n") == {"old.py"}


def test_a_missing_outcome_scores_zero():
    for outcome in (None, "crashed"):
        result = reward.reward(TASKS[0], outcome)
        assert result["reward"] == 0.0 and result["checks_passed"] == 0


def test_a_module_that_exits_early_passes_nothing():
    task = next(t for t in TASKS if t["kind"] == "operator")
    module = changed_modules(task)[0]
    result = reward.reward(task, edited(task, {module: "import sys\nsys.exit(0)\n"}))
    assert result["reward"] == 0.0 and all(value.startswith("fail: the check ended before")
                                           for key, value in result.items() if key not in
                                           ("reward", "checks_passed", "checks_total", "format_credit"))


@pytest.mark.parametrize("task", ONE_PER_TEMPLATE, ids=lambda task: task["template"])
def test_the_reward_in_the_real_sandbox(task):
    before = score(REWARD_SOURCE, task, unchanged(), Limits())
    assert before.ok, before.error
    assert before.reward < 1 and (before.reward > 0) == (task["kind"] != "file_value")
    assert before.detail["checks_total"] == len(task["tests"])
    assert any(value.startswith("fail: ") for value in before.detail.values() if isinstance(value, str))
    after = score(REWARD_SOURCE, task, edited(task, make_tasks.solve(task)), Limits())
    assert after.ok and after.reward == 1.0, after.detail
    assert after.duration_ms < 5000
    if task["kind"] != "file_value":
        broke = score(REWARD_SOURCE, task, edited(task, broken(task)), Limits())
        assert broke.ok and broke.reward == 0.0, broke.detail


@pytest.mark.parametrize("task", ONE_PER_CODE_KIND, ids=lambda task: task["kind"])
def test_a_hanging_check_times_out_and_the_score_stays_in_time(task):
    result = score(REWARD_SOURCE, task, edited(task, looping(task)), Limits())
    assert result.ok, result.error
    assert 0 < result.reward < 1
    assert "fail: timed out after 2 s" in result.detail.values()
    assert result.duration_ms < 6000  # every check runs at once: one check timeout, not one per check


@pytest.mark.parametrize("commands, errors, credit", [(2, 0, 0.1), (0, 0, 0.0), (3, 1, 0.0), (None, None, 0.0)])
def test_a_well_formed_episode_earns_partial_credit_below_a_pass(commands, errors, credit):
    """The format credit rewards an agent whose replies were all accepted and which ran a command; it never lifts
    a failing rollout to 1.0 (Pass@1 means every check passed), and a full pass gets nothing on top."""
    task = next(t for t in TASKS if t["kind"] == "operator")
    counts = {} if commands is None else {"commands": commands, "format_errors": errors}
    before = reward.reward(task, {**unchanged(), **counts})
    fraction = before["checks_passed"] / before["checks_total"]
    assert (before["format_credit"], before["reward"]) == (credit, pytest.approx(fraction + credit))
    after = reward.reward(task, {**edited(task, make_tasks.solve(task)), **counts})
    assert (after["reward"], after["format_credit"]) == (1.0, 0.0)
    worst = max(reward.reward(t, {**edited(t, {}), "commands": 1, "format_errors": 0})["reward"] for t in TASKS[:40])
    assert worst < 1.0


def test_no_task_has_so_many_checks_that_credit_could_reach_a_pass():
    assert max(len(t["tests"]) for t in TASKS) <= 5  # (n - 1) / n + FORMAT_CREDIT < 1 for n <= 5
    assert (4 / 5) + reward.FORMAT_CREDIT < 1
