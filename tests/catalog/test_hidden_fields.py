"""Reward-only task fields: left out of everything a harness can read, given whole to the reward script."""
import json
import sys

import pytest

from catalog import services as catalog_services
from catalog.datasets import DEFAULT_HIDDEN_FIELDS, field_names, harness_view, hidden_fields
from common import errors as common_errors
from runs import services
from runs.harness_source import HarnessSource
from runs.models import Rollout, Run

GOLD = "GOLD-4242"
TASK = {"id": "t1", "split": "train", "question": "VISIBLE-7777: what is 6 * 7?", "hint": {"unit": "VISIBLE-units"},
        "answer": f"{GOLD}-answer", "solution": f"{GOLD}-solution", "tests": [f"assert f() == '{GOLD}-tests'"],
        "expected": {"stdout": f"{GOLD}-expected"}, "rubric": f"{GOLD}-rubric"}


def test_the_defaults_are_always_hidden_and_a_datasets_own_fields_extend_them():
    assert DEFAULT_HIDDEN_FIELDS == ("answer", "expected", "solution", "tests")
    assert hidden_fields() == ["answer", "expected", "solution", "tests"]
    assert hidden_fields(["rubric", "answer"]) == ["answer", "expected", "rubric", "solution", "tests"]


def test_the_harness_view_leaves_out_top_level_hidden_fields_only():
    view = harness_view(TASK, hidden_fields(["rubric"]))
    assert view == {"id": "t1", "split": "train", "question": "VISIBLE-7777: what is 6 * 7?",
                    "hint": {"unit": "VISIBLE-units"}}
    assert GOLD not in json.dumps(view)
    assert "answer" in TASK  # the stored task is untouched


def test_field_names_accept_a_list_a_json_list_or_commas():
    assert field_names(["rubric", " notes "]) == ["rubric", "notes"]
    assert field_names('["rubric", "notes", "rubric"]') == ["rubric", "notes"]
    assert field_names("rubric, notes") == ["rubric", "notes"]
    assert field_names("") == [] and field_names([]) == []


@pytest.mark.parametrize("value, message", [
    (["ok", ""], 'every field name must be a non-empty string, got ""'),
    ([1], "every field name must be a non-empty string, got 1"),
    ("a,,b", 'every field name must be a non-empty string, got ""'),
    ('{"a": 1}', "must be a list of field names, got an object"),
    ({"a": 1}, "must be a list of field names, got an object"),
    ('["a", ', "not a valid JSON list: Expecting value at column 6"),
])
def test_field_names_refuse_anything_but_non_empty_strings(value, message):
    with pytest.raises(ValueError) as error:
        field_names(value)
    assert str(error.value) == message


def test_a_run_hides_what_its_dataset_snapshot_says_and_the_defaults_without_one():
    assert Run(dataset_snapshot={"hidden_fields": ["answer", "rubric"]}).harness_task(TASK).keys() == {
        "id", "split", "question", "hint"}
    assert Run(dataset_snapshot={}).harness_task(TASK).keys() == {"id", "split", "question", "hint", "rubric"}


@pytest.mark.django_db
def test_the_run_snapshot_records_the_hidden_fields(alice, make_dataset, make_harness, make_reward):
    dataset = make_dataset(alice, tasks=[TASK], hidden_fields=["rubric"])
    assert dataset.hidden_fields == ["rubric"]
    run = services.create_run(alice, name="r", model="tiny", config={}, harness=make_harness(alice), dataset=dataset,
                              reward_script=make_reward(alice))
    assert run.dataset_snapshot["hidden_fields"] == ["answer", "expected", "rubric", "solution", "tests"]


@pytest.mark.django_db
def test_the_service_refuses_bad_hidden_fields(alice, make_dataset):
    with pytest.raises(common_errors.ServiceError, match='hidden_fields: every field name must be a non-empty string'):
        make_dataset(alice, hidden_fields=["rubric", ""])


# A harness that looks everywhere it can: every file under the run's folder (its own working folder and its
# neighbours'), its whole environment and its argv, and reports all of it in its output file.
SNOOP = '''
import json, os, sys
from pathlib import Path

root = Path.cwd().parent.parent  # <run workdir>/rollouts/<id>: look at the whole run folder
files = {str(p): p.read_text(errors="replace") for p in sorted(root.rglob("*")) if p.is_file()}
task = json.load(open(sys.argv[1]))
dump = {"cwd": os.getcwd(), "argv": sys.argv, "env": dict(os.environ), "files": files}
with open(os.environ["LIGHTNING_OUTPUT_FILE"], "w") as out:
    json.dump({"answer": "a guess", "question": task["question"], "dump": dump}, out)
'''
REWARD = '''
def reward(task, outcome):
    seen = [task["answer"], task["solution"], task["tests"][0], task["expected"]["stdout"], task["rubric"]]
    return {"reward": float(task["answer"] == "GOLD-4242-answer"), "seen": seen}
'''


class Endpoint:
    """Where the proxy would serve the rollout; nothing listens, the snooping harness makes no calls."""

    def base_url(self, rollout_id: str) -> str:
        return f"http://127.0.0.1:9/rollouts/{rollout_id}/v1"

    def settled(self, rollout_id: str, timeout: float) -> int:
        return 0  # no call was made, so none is unstored


PLACEHOLDERS = ["{task_file}", "{output_file}", "{task_id}", "{workdir}", "{base_url}", "{api_key}", "{model}",
                "{rollout_id}"]


@pytest.fixture
def snoop_run(alice, tmp_path):
    """A run whose harness snoops (every placeholder in argv and env) on a dataset with gold in five fields."""
    (tmp_path / "snoop.py").write_text(SNOOP)
    harness = catalog_services.create_harness(alice, name="snoop", command=[sys.executable, str(tmp_path / "snoop.py"),
                                                                    *PLACEHOLDERS],
                                      env={f"COPY_{i}": p for i, p in enumerate(PLACEHOLDERS)}, timeout_s=60)
    dataset = catalog_services.create_dataset(alice, name="gold", content=json.dumps(TASK).encode(), filename="t.jsonl",
                                      hidden_fields=["rubric"])
    reward = catalog_services.create_reward_script(alice, name="gold", source=REWARD)
    run = services.create_run(alice, name="snoop", model="tiny", config={}, harness=harness, dataset=dataset,
                              reward_script=reward)
    return run, dataset.tasks.get()


@pytest.mark.django_db(transaction=True)
async def test_a_harness_finds_no_gold_anywhere_while_the_reward_gets_it(snoop_run, tmp_path, monkeypatch):
    run, task = snoop_run
    # Its workdir would go once the rollout is recorded (runs.disk): kept here to read what the harness found.
    monkeypatch.setattr("runs.disk.reclaim_workdir", lambda workdir, failed: None)
    source = HarnessSource(run, config=None, server=Endpoint(), workdir=tmp_path / "run", train_ids=[task.pk])

    result = await source.attempt(task, "train", 0, 0, 0)

    assert not result.failed and result.error == "" and result.reward == 1.0
    rollout = await Rollout.objects.aget(pk=int(result.rollout_id))
    assert rollout.status == "succeeded" and rollout.reward == 1.0
    assert rollout.reward_detail["seen"] == [f"{GOLD}-{name}" for name in ("answer", "solution")] + [
        f"assert f() == '{GOLD}-tests'", f"{GOLD}-expected", f"{GOLD}-rubric"]
    output = tmp_path / "run" / "rollouts" / result.rollout_id / "output.json"
    dump = json.loads(output.read_text())["dump"]
    task_file = str(tmp_path / "run" / "rollouts" / result.rollout_id / "task.json")
    # It looked: the visible fields are in the task file, and argv and env carry the filled placeholders.
    assert json.loads(dump["files"][task_file]) == {"id": "t1", "split": "train", "question": TASK["question"],
                                                     "hint": {"unit": "VISIBLE-units"}}
    assert dump["argv"][1:] == [task_file, str(output.parent / "output.json"), "t1", str(output.parent),
                                f"http://127.0.0.1:9/rollouts/{result.rollout_id}/v1", dump["env"]["OPENAI_API_KEY"],
                                "policy", result.rollout_id]
    assert [dump["env"][f"COPY_{i}"] for i in range(len(PLACEHOLDERS))] == dump["argv"][1:]
    assert "VISIBLE-7777" in json.dumps(dump["files"]) and "VISIBLE-units" in json.dumps(dump["files"])
    # ... and found no gold value in any file, variable or argument.
    for where in ("files", "env", "argv"):
        assert GOLD not in json.dumps(dump[where]), where
    assert GOLD not in output.read_text()
