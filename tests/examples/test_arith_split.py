"""The arithmetic demo's tasks (examples/arith): an honest val split, by wording, and the committed file up to date."""
import importlib.util
import json
from collections import defaultdict

from django.conf import settings

ARITH = settings.BASE_DIR / "examples" / "arith"


def load_make_tasks():
    spec = importlib.util.spec_from_file_location("arith_make_tasks", ARITH / "make_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tasks = load_make_tasks()
TASKS = [json.loads(line) for line in (ARITH / "tasks.jsonl").read_text().splitlines() if line.strip()]
OP_OF = {template: op for op, splits in make_tasks.TEMPLATES.items() for wordings in splits.values()
         for template in wordings}


def operands(task):
    """(op, a, b) read back from the question: the wording's first number is {a} unless it names {b} first."""
    op = OP_OF[task["template"]]
    split = task["split"]
    wording = make_tasks.TEMPLATES[op][split][task["template"]]
    numbers = [int(word.strip(".,?")) for word in task["question"].split() if word.strip(".,?").isdigit()]
    assert len(numbers) == 2, task
    first, second = numbers if wording.index("{a}") < wording.index("{b}") else numbers[::-1]
    assert wording.format(a=first, b=second) == task["question"]
    return op, first, second


def test_the_committed_file_is_the_default_output():
    assert TASKS == list(make_tasks.make())
    assert [json.dumps(task) for task in make_tasks.make(500, 0)] == \
        (ARITH / "tasks.jsonl").read_text().splitlines()


def test_it_is_deterministic_by_seed():
    assert list(make_tasks.make(500, 7)) == list(make_tasks.make(500, 7))
    assert list(make_tasks.make(500, 7)) != list(make_tasks.make(500, 0))


def test_500_tasks_100_of_them_val_with_the_fields_the_demo_reads():
    assert len(TASKS) == 500 and sum(task["split"] == "val" for task in TASKS) == 100
    assert all(set(task) == {"id", "question", "answer", "split", "template"} for task in TASKS)
    assert len({task["id"] for task in TASKS}) == 500


def test_the_split_goes_by_wording():
    splits = defaultdict(set)
    for task in TASKS:
        splits[task["template"]].add(task["split"])
        assert task["template"] in make_tasks.TEMPLATES[OP_OF[task["template"]]][task["split"]]
    assert all(len(found) == 1 for found in splits.values()), splits
    train = {t for t, s in splits.items() if s == {"train"}}
    val = {t for t, s in splits.items() if s == {"val"}}
    assert not train & val
    for op in "*+-":
        assert len({t for t in train if OP_OF[t] == op}) >= 3
        assert len({t for t in val if OP_OF[t] == op}) >= 2


def test_no_val_task_repeats_a_train_task_and_none_repeats_within_a_split():
    by_split = defaultdict(list)
    for task in TASKS:
        op, a, b = operands(task)
        by_split[task["split"]].append((task["question"], (op, a, b) if op == "-" else (op, *sorted((a, b)))))
    for rows in by_split.values():
        assert len({question for question, _ in rows}) == len(rows)
        assert len({key for _, key in rows}) == len(rows)
    assert not {q for q, _ in by_split["val"]} & {q for q, _ in by_split["train"]}
    assert not {k for _, k in by_split["val"]} & {k for _, k in by_split["train"]}


def test_the_answers_are_right_and_the_numbers_in_range():
    for task in TASKS:
        op, a, b = operands(task)
        assert task["answer"] == {"*": a * b, "+": a + b, "-": a - b}[op]
        low, high = (12, 99) if op == "*" else (100, 999)
        assert low <= a <= high and low <= b <= high
        assert task["question"].endswith("?") and task["answer"] >= 0
