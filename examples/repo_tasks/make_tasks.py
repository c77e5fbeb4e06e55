"""Generate the repository task suite for coding agents as JSONL (standard library only, deterministic by seed).

Each task is a tiny git repository (`files`), what the agent is told (`prompt`) and hidden checks (`tests`, Python
that raises on failure, run by reward.py on the agent's final repository). A template is one prompt wording, one
bug kind and one code scenario; the split is by template, so a val gain means the policy learnt to fix code under
wordings and scenarios it never trained on (README.md: the table and the rules). `solve(task)` gives the fixed
files of a task this module generated: for the tests, never written to the JSONL.

    python examples/repo_tasks/make_tasks.py > examples/repo_tasks/tasks.jsonl
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.append(str(HERE))  # its sibling modules, also when it is loaded from its path (the tests)

import train_templates as train  # noqa: E402
import val_templates as val  # noqa: E402
from task_builders import Built  # noqa: E402

DEFAULT_SEED = 0
KINDS = ("operator", "off_by_one", "failing_test", "missing_return", "file_value", "rename")


@dataclass(frozen=True)
class Template:
    id: str
    kind: str
    split: str
    wording: str  # the prompt, with {placeholders} filled from Built.values
    count: int
    build: Callable[[random.Random], Built]


TEMPLATES = (
    Template("fee-operator", "operator", "train",
             "In {file}, {func}(price) should add a fee of {fee} to the price, but it subtracts it. "
             "Fix the operator.", 15, train.fee_operator),
    Template("area-operator", "operator", "train",
             "{call} in {file} gives {got}, but it should give {want}. One operator is wrong; please fix it.",
             15, train.area_operator),
    Template("calc-operator", "operator", "train", "Fix the bug in {file}: {func} uses the wrong operator.",
             15, train.calc_operator),
    Template("range-off-by-one", "off_by_one", "train",
             "{func}(n) in {file} should return the numbers from 1 to n inclusive, but {func}({n}) stops at {nm1}. "
             "Fix the off-by-one error.", 15, train.range_off_by_one),
    Template("slice-off-by-one", "off_by_one", "train",
             "{file}: {func}(items, n) is supposed to return the first n items, but {func}({example}, {n}) gives "
             "{got}. Please fix it.", 15, train.slice_off_by_one),
    Template("loop-off-by-one", "off_by_one", "train",
             "{func}(n) in {file} must add up 1 + 2 + ... + n (so {func}({n}) is {want}), but the loop misses the "
             "last number. Fix it.", 15, train.loop_off_by_one),
    Template("test-operator", "failing_test", "train",
             "The test in {test_file} fails. Fix {file} so that it passes, without changing the test.",
             15, train.test_operator),
    Template("test-constant", "failing_test", "train",
             "Running `python {test_file}` raises an AssertionError. Make the test pass by correcting {file}.",
             15, train.test_constant),
    Template("scale-missing-return", "missing_return", "train",
             "{file}: {func}() computes its result but never returns it, so callers get None. "
             "Add the missing return.", 15, train.scale_missing_return),
    Template("greet-missing-return", "missing_return", "train",
             "{func}('{name}') in {file} returns None instead of '{greeting}, {name}!'. Make it return the message.",
             15, train.greet_missing_return),
    Template("predicate-missing-return", "missing_return", "train",
             "{file}: {func}(n) always gives None. It should return True when {desc} and False otherwise.",
             15, train.predicate_missing_return),
    Template("file-sum", "file_value", "train",
             "Create a file {target} that holds the sum of {a} and {b} (just the number).", 15, train.file_sum),
    Template("file-product", "file_value", "train", "Write the product of {a} and {b} into {target}.",
             15, train.file_product),
    Template("file-difference", "file_value", "train",
             "Put the result of {a} minus {b} in {target}; the file should contain only that number.",
             15, train.file_difference),
    Template("rename-function", "rename", "train",
             "Rename the function {old} to {new} in {lib_file} and update the call in {main_file}.",
             15, train.rename_function),
    Template("rename-helper", "rename", "train",
             "The helper {old} in {lib_file} should be called {new}. Rename it everywhere it appears "
             "({lib_file} and {main_file}).", 15, train.rename_helper),
    Template("val-bank-operator", "operator", "val",
             "Bug report: after {func}({b}, {a}) the balance went up to {wrong} instead of down to {right}. "
             "The code lives in {file}.", 13, val.bank_operator),
    Template("val-pages-off-by-one", "off_by_one", "val",
             "{func}({first}, {last}) says {wrong}, yet pages {first} through {last} are {right} pages when you "
             "count both ends. Correct the function in {file}.", 13, val.pages_off_by_one),
    Template("val-test-missing-return", "failing_test", "val",
             "{test_file} is red. Find out why and repair {file}; the test itself is correct.",
             13, val.test_missing_return),
    Template("val-fahrenheit-missing-return", "missing_return", "val",
             "Nothing comes back from {func}() in {file}: {func}({c}) is None, not {f}. It has to hand back the "
             "converted value.", 13, val.fahrenheit_missing_return),
    Template("val-file-minutes", "file_value", "val",
             "How many minutes are in {hours} hours? Save only the number in {target}.", 13, val.file_minutes),
    Template("val-file-from-data", "file_value", "val",
             "{data_file} lists some numbers, one per line. Store their total in {target}.", 13, val.file_from_data),
    Template("val-rename-style", "rename", "val",
             "Our style guide wants the name {new} instead of {old}. Update {lib_file}, where it is defined, and "
             "{main_file}, where it is called.", 13, val.rename_style),
)
TEMPLATES_BY_ID = {template.id: template for template in TEMPLATES}


def generate(seed: int = DEFAULT_SEED) -> list[tuple[dict, dict]]:
    """(task, fixed files) for every task: each template's tasks distinct, then shuffled and numbered by seed."""
    pairs = []
    for template in TEMPLATES:
        rng, seen = random.Random(f"{seed}:{template.id}"), set()
        while len(seen) < template.count:
            built = template.build(rng)
            prompt = template.wording.format(**built.values)
            key = json.dumps([prompt, built.files], sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            task = {"template": template.id, "kind": template.kind, "split": template.split, "prompt": prompt,
                    "files": built.files, "tests": built.tests}
            pairs.append((task, built.fixed))
    random.Random(seed).shuffle(pairs)
    return [({"id": f"repo-{index:04d}", **task}, fixed) for index, (task, fixed) in enumerate(pairs, start=1)]


def make(seed: int = DEFAULT_SEED) -> list[dict]:
    return [task for task, _ in generate(seed)]


@functools.lru_cache(maxsize=4)
def _solutions(seed: int) -> dict[str, dict]:
    return {_key(task): fixed for task, fixed in generate(seed)}


def _key(task: dict) -> str:
    return json.dumps([task["template"], task["prompt"], task["files"]], sort_keys=True)


def solve(task: dict, seed: int = DEFAULT_SEED) -> dict[str, str]:
    """The repository after a correct fix ({path: text}, every file) of a task `make(seed)` generated."""
    fixed = _solutions(seed).get(_key(task))
    if fixed is None:
        raise KeyError(f"task {task.get('id')} is not one make(seed={seed}) generates")
    return {**task["files"], **fixed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    for task in make(args.seed):
        sys.stdout.write(json.dumps(task) + "\n")


if __name__ == "__main__":
    main()