"""Every write of the catalog: harnesses, reward scripts and datasets (created, versioned, deleted when unused),
and scoring a reward script in the sandbox."""
from __future__ import annotations

import hashlib
import logging
from typing import Any

from django.conf import settings
from django.db import transaction

from catalog.datasets import SEED_MAX, SEED_MIN, UploadOptions, field_names, parse_tasks
from catalog.models import Dataset, Harness, RewardScript, Task
from common.errors import DatasetRejected, InUse, NotOwned, ServiceError
from runs.models import Run
from sandbox.scoring import Limits, ScoreResult, score

logger = logging.getLogger(__name__)


def check_owner(user, obj) -> None:
    """Users act only on their own objects; staff act on all."""
    if obj is not None and not user.is_staff and obj.owner_id != user.pk:
        raise NotOwned(f"{type(obj).__name__} {obj.pk} does not belong to you")


HARNESS_FIELDS = ("name", "description", "command", "env", "executor", "image", "resources", "timeout_s")


REWARD_FIELDS = ("name", "description", "source", "timeout_s")


def create_harness(owner, **fields) -> Harness:
    return Harness.objects.create(owner=owner, **_pick(fields, HARNESS_FIELDS))


def update_harness(harness: Harness, **fields) -> Harness:
    return _update_versioned(harness, _pick(fields, HARNESS_FIELDS))


def create_reward_script(owner, **fields) -> RewardScript:
    return RewardScript.objects.create(owner=owner, **_pick(fields, REWARD_FIELDS))


def update_reward_script(script: RewardScript, **fields) -> RewardScript:
    return _update_versioned(script, _pick(fields, REWARD_FIELDS))


def delete_harness(harness: Harness, user) -> None:
    """Delete a harness no run references (runs link to it for clones and filters); ServiceError otherwise."""
    _delete_unused(harness, user, "harness")


def delete_reward_script(script: RewardScript, user) -> None:
    """Delete a reward script no run references; ServiceError otherwise."""
    _delete_unused(script, user, "reward script")


def _delete_unused(obj, user, label: str) -> None:
    check_owner(user, obj)
    with transaction.atomic():
        used = obj.runs.count()
        if used:
            raise InUse(f"{label} '{obj.name}' is used by {used} run(s) and cannot be deleted; "
                               f"edit it instead (runs keep the version they started with)")
        pk = obj.pk
        obj.delete()
    logger.info("%s %s deleted by %s", label, pk, user)


def score_reward(source: str, task: Any, outcome: Any, timeout_s: float) -> ScoreResult:
    limits = Limits(timeout_s=min(timeout_s, settings.LIGHTNING_REWARD_TIMEOUT_S * 6),
                    memory_mb=settings.LIGHTNING_REWARD_MEMORY_MB,
                    output_bytes=settings.LIGHTNING_REWARD_OUTPUT_BYTES)
    return score(source, task, outcome, limits)


def _pick(fields: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    unknown = set(fields) - set(allowed)
    if unknown:
        raise ServiceError(f"unknown field(s): {sorted(unknown)}")
    return fields


def _update_versioned(obj, changes: dict[str, Any]):
    """Apply changes; the version goes up when anything a run would snapshot changed."""
    changed = [name for name, value in changes.items() if getattr(obj, name) != value]
    for name in changed:
        setattr(obj, name, changes[name])
    if any(name not in ("name", "description") for name in changed):
        obj.version += 1
    obj.save()
    return obj


def create_dataset(owner, *, name: str, content: bytes, filename: str = "", description: str = "",
                   split_field: str = "", val_ratio: float = 0.0, seed: int = 0,
                   required_fields: tuple[str, ...] = (), hidden_fields: list[str] | tuple[str, ...] = ()) -> Dataset:
    """Create a dataset from an uploaded file: all tasks are saved, or none and DatasetRejected says why.

    `hidden_fields` extend the reward-only defaults (catalog.datasets.DEFAULT_HIDDEN_FIELDS); no harness sees them.
    """
    try:
        hidden_fields = field_names(list(hidden_fields))
    except ValueError as exc:
        raise ServiceError(f"hidden_fields: {exc}") from exc
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ServiceError(f"seed: {seed} is out of range; give an integer from {SEED_MIN} to {SEED_MAX}")
    if len(content) > settings.LIGHTNING_DATASET_MAX_BYTES:
        raise DatasetRejected([{"line": 0, "error": f"the file is {len(content)} bytes, over the limit of "
                                                    f"{settings.LIGHTNING_DATASET_MAX_BYTES} bytes"}])
    options = UploadOptions(split_field=split_field, val_ratio=val_ratio, seed=seed,
                            required_fields=tuple(required_fields),
                            max_line_bytes=settings.LIGHTNING_DATASET_MAX_LINE_BYTES)
    parsed = parse_tasks(content, filename, options)
    if parsed.errors:
        raise DatasetRejected(parsed.errors)
    with transaction.atomic():
        dataset = Dataset.objects.create(
            owner=owner, name=name, description=description, source_filename=filename[:500],
            content_sha256=hashlib.sha256(content).hexdigest(), split_field=split_field,
            val_ratio=val_ratio, seed=seed, hidden_fields=hidden_fields,
            train_count=sum(t.split == "train" for t in parsed.tasks),
            val_count=sum(t.split == "val" for t in parsed.tasks),
        )
        Task.objects.bulk_create(
            [Task(dataset=dataset, index=i, external_id=t.external_id, split=t.split, data=t.data)
             for i, t in enumerate(parsed.tasks)],
            batch_size=1000,
        )
    logger.info("dataset %s created with %d train and %d val tasks", dataset.pk, dataset.train_count,
                dataset.val_count)
    return dataset


def delete_dataset(dataset: Dataset, user) -> None:
    """Delete a dataset and its tasks, refused while any run references it (a run's rollouts point at its tasks)."""
    check_owner(user, dataset)
    with transaction.atomic():
        runs = list(Run.objects.filter(dataset=dataset).order_by("pk").values_list("pk", flat=True)[:6])
        if runs:
            shown = ", ".join(f"#{pk}" for pk in runs[:5]) + (" and more" if len(runs) > 5 else "")
            raise InUse(f"dataset {dataset.name!r} is used by run(s) {shown}; "
                               "delete those runs first, or keep the dataset")
        dataset_id = dataset.pk
        dataset.delete()
    logger.info("dataset %s deleted by user %s", dataset_id, user.pk)
