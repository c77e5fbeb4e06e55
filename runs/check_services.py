"""Harness checks: queue one run of a harness on one task, claim it in a worker, store its report (runs.check_tasks
runs it through runs.harness_check). The one write path of HarnessCheck rows, as runs.services is of the rest."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from catalog.datasets import hidden_fields as reward_only_fields
from catalog.models import Executor, Harness, RewardScript, Task
from catalog.registry import registered_models
from catalog.services import check_owner
from catalog.tokenizers import VOCABULARY_FILES
from common.errors import ServiceError
from common.tasks import send_task
from runs.models import CheckEngine, CheckStatus, HarnessCheck

logger = logging.getLogger(__name__)

RUN_HARNESS_CHECK = "runs.check_tasks.run_harness_check"
"""The Celery task of a check (runs.check_tasks), enqueued by name."""


def start_harness_check(user, harness: Harness, *, task: Task | dict[str, Any], model: str,
                        reward_script: RewardScript | None = None,
                        engine: str = CheckEngine.SCRIPTED) -> HarnessCheck:
    """Queue one run of the harness on `task` (a dataset's Task, or a typed task object) through the proxy.

    `model` is a registry model with tokenizer files: the scripted engine renders with them, and the vLLM engine
    serves the model itself.
    """
    for obj in (harness, reward_script):
        check_owner(user, obj)
    if isinstance(task, Task):
        check_owner(user, task.dataset)
        data = task.data
        source = {"dataset": task.dataset_id, "dataset_name": task.dataset.name, "task_id": task.external_id,
                  "hidden_fields": task.dataset.reward_only_fields}
    elif isinstance(task, dict):
        data, source = task, {"typed": True, "hidden_fields": reward_only_fields()}
    else:
        raise ServiceError("task must be a JSON object, as in a dataset")
    check_tokenizer_model(model)
    if engine not in CheckEngine.values:
        raise ServiceError(f"engine {engine!r} is not one of {CheckEngine.values}")
    with transaction.atomic():
        check = HarnessCheck.objects.create(
            owner=user, harness=harness, harness_version=harness.version, task=data, task_source=source,
            reward_script=reward_script, engine=engine, model=model)
        transaction.on_commit(lambda: enqueue_harness_check(check.pk, engine, harness.executor))
    logger.info("harness check %s of harness %s queued by %s", check.pk, harness.pk, user)
    return check


def check_tokenizer_model(model: str) -> Path:
    """The folder of the registry model `model` if it holds a tokenizer; ServiceError naming the choices otherwise."""
    folders = tokenizer_models()
    if model not in folders:
        raise ServiceError(f"model {model!r} is not a registry model with tokenizer files (available: "
                           f"{sorted(folders) or 'none'}); import one with `./lw manage models tiny`")
    return folders[model]


def tokenizer_models() -> dict[str, Path]:
    """Registry models whose folder holds a vocabulary, by name: what the scripted engine can render with."""
    folders = {info.name: Path(info.path) for info in registered_models()}
    return {name: folder for name, folder in folders.items()
            if any((folder / file).is_file() for file in VOCABULARY_FILES)}


def enqueue_harness_check(check_id: int, engine: str, executor: str = Executor.LOCAL) -> None:
    """A scripted check of a local harness is short: the control worker's queue. One on vLLM needs the runs
    worker's accelerator, and one of a kubernetes harness the runs worker's cluster access and the proxy address its
    pods reach (the web and control processes have neither in a cluster deployment)."""
    on_runs_worker = engine == CheckEngine.VLLM or executor != Executor.LOCAL
    send_task(RUN_HARNESS_CHECK, [check_id], queue="runs" if on_runs_worker else "default")


CHECK_LOST_AFTER_S = 900
"""A check still running this long past its harness's timeout lost its worker (the vLLM start fits within it)."""


def claim_harness_check(check_id: int) -> datetime | None:
    """Take a queued check for this worker: exactly one claimer wins. Returns its claim (the start time its
    finish must name), None when not claimed.

    A redelivered task (its worker died: the task acks late) takes the check again once it has been running
    longer than its harness could run, and otherwise leaves it to the worker running it.
    """
    now = timezone.now()
    timeout_s = HarnessCheck.objects.filter(pk=check_id).values_list("harness__timeout_s", flat=True).first()
    if timeout_s is None:
        return None
    lost = Q(status=CheckStatus.RUNNING, started_at__lt=now - timedelta(seconds=timeout_s + CHECK_LOST_AFTER_S))
    claimed = HarnessCheck.objects.filter(Q(status=CheckStatus.QUEUED) | lost, pk=check_id).update(
        status=CheckStatus.RUNNING, started_at=now, updated_at=now)
    return now if claimed == 1 else None


def finish_harness_check(check_id: int, claim: datetime, report: dict[str, Any] | None = None,
                         error: str = "") -> bool:
    """End the check with its report (succeeded) or the reason it could not run (failed), if `claim` (what
    claim_harness_check returned) still holds it: a worker given up on for lost cannot overwrite its successor."""
    status = CheckStatus.FAILED if error else CheckStatus.SUCCEEDED
    changed = HarnessCheck.objects.filter(pk=check_id, status=CheckStatus.RUNNING, started_at=claim).update(
        status=status, report=report or {}, error=error[:10000], finished_at=timezone.now(),
        updated_at=timezone.now())
    logger.info("harness check %s -> %s%s", check_id, status, "" if changed else " refused: taken by another worker")
    return changed == 1
