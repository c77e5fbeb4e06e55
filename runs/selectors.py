"""Non-trivial reads: what a user may see, event replay, metric queries, the runs that use a folder as their model."""
from __future__ import annotations

import os
from typing import Any

from django.db.models import Count, Q, QuerySet

from catalog.models import Split, Task
from catalog.selectors import owned
from runs import events
from runs.models import FailureKind, Metric, Rollout, RolloutStatus, Run, RunEvent
from trainer.config import TrainerConfig


def user_can_see_run(user, run_id: int) -> bool:
    return owned(Run.objects.filter(pk=run_id), user).exists()


def run_events_after(run_id: int, after: int, limit: int = 500) -> list[dict[str, Any]]:
    rows = RunEvent.objects.filter(run_id=run_id, seq__gt=after).order_by("seq")[:limit]
    return [events.from_row(row) for row in rows]


def run_metrics(run: Run, names: list[str] | None = None, step_min: int | None = None,
                step_max: int | None = None) -> QuerySet:
    rows = Metric.objects.filter(run=run)
    if names:
        rows = rows.filter(name__in=names)
    if step_min is not None:
        rows = rows.filter(step__gte=step_min)
    if step_max is not None:
        rows = rows.filter(step__lte=step_max)
    return rows.order_by("name", "step", "id")


def validation_grid(run: Run) -> dict[str, Any]:
    """The run's evaluations task by task: rows are val tasks (dataset order), columns the evaluated steps.

    A cell counts the task's sampled attempts at that step: `attempts` that count (finished, not an
    infrastructure failure), how many `passed` (succeeded with reward >= the run's pass_threshold, the rule of
    runs.evaluation), their `pass_fraction` (None before any counts), `greedy`: whether the greedy attempt
    passed (None without one that counts), `infra_failures`, and `unscored` attempts (pending, running,
    cancelled or lost), so a grid read during an evaluation shows what is still to come. A task not evaluated
    at a step has None there.
    """
    threshold = float((run.config or {}).get("pass_threshold", TrainerConfig.pass_threshold))
    scored = Q(status__in=(RolloutStatus.SUCCEEDED, RolloutStatus.FAILED)) & ~Q(failure_kind=FailureKind.INFRA)
    groups = (Rollout.objects.filter(run=run, split=Split.VAL, task__isnull=False).order_by()
              .values("task_id", "step", "greedy")
              .annotate(counted=Count("id", filter=scored),
                        passed=Count("id", filter=Q(status=RolloutStatus.SUCCEEDED, reward__gte=threshold)),
                        infra=Count("id", filter=Q(failure_kind=FailureKind.INFRA)),
                        total=Count("id")))
    cells: dict[tuple[int, int], dict[str, Any]] = {}
    for g in groups:
        cell = cells.setdefault((g["task_id"], g["step"]), {"attempts": 0, "passed": 0, "pass_fraction": None,
                                                            "greedy": None, "infra_failures": 0, "unscored": 0})
        cell["infra_failures"] += g["infra"]
        cell["unscored"] += g["total"] - g["counted"] - g["infra"]
        if g["greedy"]:
            cell["greedy"] = bool(g["passed"]) if g["counted"] else None
        else:
            cell["attempts"], cell["passed"] = g["counted"], g["passed"]
            cell["pass_fraction"] = g["passed"] / g["counted"] if g["counted"] else None
    steps = sorted({step for _, step in cells})
    tasks = Task.objects.filter(pk__in={task for task, _ in cells}).order_by("index").values("pk", "external_id",
                                                                                              "index")
    return {"pass_threshold": threshold, "steps": steps,
            "tasks": [{"task": t["pk"], "external_id": t["external_id"], "index": t["index"],
                       "cells": [cells.get((t["pk"], step)) for step in steps]} for t in tasks]}


def runs_with_models_in(folder: str | os.PathLike) -> QuerySet:
    """Runs whose model is the folder `folder` or one under it (a run's checkpoints). A run stores its model's real
    path (catalog.registry.check_model_path), so `folder` is resolved the same way."""
    root = os.path.realpath(folder)
    return Run.objects.filter(Q(model_info__path=root) | Q(model_info__path__startswith=os.path.join(root, "")))
