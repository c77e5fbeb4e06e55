"""Moving harnesses, datasets, tasks and reward scripts from the runs app to the catalog keeps every table and row."""
from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from catalog.models import Dataset, Harness, RewardScript, Task
from runs.models import HarnessCheck, Rollout, Run

BEFORE = [("runs", "0010_model_call_constraint_choice"), ("catalog", None)]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets if targets else executor.loader.graph.leaf_nodes())
    return executor


@pytest.mark.django_db(transaction=True)
def test_it_keeps_every_row_and_relation_from_the_schema_before_the_move():
    old = _migrate(BEFORE).loader.project_state([BEFORE[0]]).apps  # the state the runs app had then
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
    assert {"runs_harness", "runs_dataset", "runs_task", "runs_rewardscript"} <= tables
    user = old.get_model("auth", "User").objects.create(username="ada")
    harness = old.get_model("runs", "Harness").objects.create(owner=user, name="agent", command=["python", "a.py"],
                                                                env={"K": "v"}, version=3)
    dataset = old.get_model("runs", "Dataset").objects.create(owner=user, name="arith", train_count=1, val_count=1,
                                                                hidden_fields=["secret"])
    task = old.get_model("runs", "Task").objects.create(dataset=dataset, index=0, external_id="t0", split="train",
                                                          data={"q": "1+1", "answer": "2"})
    script = old.get_model("runs", "RewardScript").objects.create(owner=user, name="exact", source="def reward(t, o): 1")
    run = old.get_model("runs", "Run").objects.create(owner=user, name="r", model="tiny", config={}, harness=harness,
                                                        dataset=dataset, reward_script=script)
    rollout = old.get_model("runs", "Rollout").objects.create(run=run, task=task, step=0)
    check = old.get_model("runs", "HarnessCheck").objects.create(owner=user, harness=harness, harness_version=3,
                                                                   task={"q": "x"}, reward_script=script, model="tiny")
    old_type = ContentType.objects.get_or_create(app_label="runs", model="harness")[0]

    _migrate(None)

    assert Harness._meta.db_table == "runs_harness" and Task._meta.db_table == "runs_task"
    moved = Harness.objects.get(pk=harness.pk)
    assert (moved.name, moved.command, moved.env, moved.version, moved.owner_id) == (
        "agent", ["python", "a.py"], {"K": "v"}, 3, user.pk)
    assert Dataset.objects.get(pk=dataset.pk).hidden_fields == ["secret"]
    assert Task.objects.get(pk=task.pk).data == {"q": "1+1", "answer": "2"} and Task.objects.get(pk=task.pk).dataset_id == dataset.pk
    assert RewardScript.objects.get(pk=script.pk).source == "def reward(t, o): 1"
    assert (Run.objects.get(pk=run.pk).harness, Run.objects.get(pk=run.pk).dataset) == (moved, Dataset.objects.get(pk=dataset.pk))
    assert Rollout.objects.get(pk=rollout.pk).task.external_id == "t0"
    assert HarnessCheck.objects.get(pk=check.pk).reward_script.name == "exact"
    assert list(moved.runs.values_list("pk", flat=True)) == [run.pk]  # reverse relations work across the apps
    relabelled = ContentType.objects.get(pk=old_type.pk)
    assert (relabelled.app_label, relabelled.model) == ("catalog", "harness")
    assert not ContentType.objects.filter(app_label="runs", model="harness").exists()


@pytest.mark.django_db(transaction=True)
def test_it_migrates_back_to_the_runs_app_and_forward_again():
    _migrate(BEFORE)
    with connection.cursor() as cursor:
        assert "runs_harness" in connection.introspection.table_names(cursor)  # nothing was dropped going back
    _migrate(None)
    with connection.cursor() as cursor:
        assert {"runs_harness", "runs_dataset", "runs_task", "runs_rewardscript"} <= set(
            connection.introspection.table_names(cursor))
    executor = MigrationExecutor(connection)
    assert executor.migration_plan(executor.loader.graph.leaf_nodes()) == []  # fully migrated
