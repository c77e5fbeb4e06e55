"""Re-scoring: a run's stored rollouts scored again with a reward script (any of its owner's, at its current
version), as a background job on the default queue (health.tasks.rescore). The run's record is never touched: each
result is a RescoredRollout beside the rollout, and the summary gives old and new reward and Pass@1 per split (val
per evaluation step, as eval/pass@1 was computed: the sampled attempts, greedy ones apart).

A rollout is scored as the run scored it: the reward script's reward(task, outcome) on its stored outcome
(Rollout.outcome) and its task with the reward-only fields; a policy failure keeps the run's failure_reward (the
script's reward is in its detail). Infrastructure failures were never scored and are left out.
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from catalog.models import RewardScript
from catalog.services import check_owner, score_reward
from common.errors import ServiceError
from common.tasks import send_task
from health.models import Rescore, RescoredRollout, RescoreScope, RescoreStatus
from runs.models import FailureKind, Rollout, RolloutStatus, Run

logger = logging.getLogger(__name__)

RESCORE_TASK = "health.tasks.rescore"
WORKERS = 4
"""Reward scripts scored at once (each its own sandboxed process)."""
PROGRESS_EVERY = 10
MAX_STEP = 2**31 - 1
"""The largest step a re-scoring takes (the step column's range); the API's serializer bounds it too."""


def start_rescore(user, run: Run, reward_script: RewardScript, scope: str = RescoreScope.ALL,
                  step: int | None = None) -> Rescore:
    """Queue a re-scoring of `run`'s rollouts in `scope` with `reward_script` as it is now; ServiceError saying why
    not (another user's script, an unknown scope, a step missing or without rollouts, nothing to score)."""
    check_owner(user, reward_script)
    if scope not in RescoreScope.values:
        raise ServiceError(f"scope must be one of {RescoreScope.values}, got {scope!r}")
    if scope == RescoreScope.STEP:
        if step is None:
            raise ServiceError("scope 'step' needs a step")
        if not 0 <= step <= MAX_STEP:  # the column's range: a larger one would be a database error, not a refusal
            raise ServiceError(f"step must be between 0 and {MAX_STEP}, got {step}")
    elif step is not None:
        raise ServiceError(f"a step is only given with scope 'step', not {scope!r}")
    total = rollouts_in_scope(run, scope, step).count()
    if total == 0:
        where = {"step": f"step {step}", "flagged": "flagged by the reward-hacking lens",
                 "all": "finished"}[scope]
        raise ServiceError(f"run {run.pk} has no scored rollouts {where} to re-score")
    snapshot = {"id": reward_script.pk, "name": reward_script.name, "version": reward_script.version,
                "source": reward_script.source, "timeout_s": reward_script.timeout_s}
    with transaction.atomic():
        rescore = Rescore.objects.create(run=run, owner=user, reward_script=reward_script, reward_snapshot=snapshot,
                                         scope=scope, step=step, total=total)
        transaction.on_commit(lambda: send_task(RESCORE_TASK, [rescore.pk], queue="default"))
    logger.info("rescore %s of run %s (%s, %s rollouts) queued by user %s", rescore.pk, run.pk, scope, total, user.pk)
    return rescore


def rollouts_in_scope(run: Run, scope: str, step: int | None = None):
    """The run's rollouts a re-scoring of `scope` scores: finished, scored (infrastructure failures were not)."""
    rollouts = Rollout.objects.filter(run=run, status__in=(RolloutStatus.SUCCEEDED, RolloutStatus.FAILED)).exclude(
        failure_kind=FailureKind.INFRA)
    if scope == RescoreScope.STEP:
        from django.db.models import Q

        rollouts = rollouts.filter(Q(split="train", batch_step=step) | Q(split="val", step=step))
    elif scope == RescoreScope.FLAGGED:
        rollouts = rollouts.exclude(flags=[])
    return rollouts.order_by("id")


def _outcome(stored: Any) -> tuple[Any, str]:
    """The outcome the reward script gets from a rollout's stored one; (None, why) when it was not kept."""
    if not isinstance(stored, dict):
        return None, "no stored outcome"
    if "_not_stored" in stored:
        return None, f"its outcome was not kept ({stored['_not_stored']})"
    if set(stored) == {"_value"}:
        return stored["_value"], ""
    return stored, ""


def score_one(rescore: Rescore, rollout: Rollout, failure_reward: float) -> RescoredRollout:
    outcome, missing = _outcome(rollout.outcome)
    result = RescoredRollout(rescore=rescore, rollout=rollout, old_reward=rollout.reward)
    if missing:
        result.error = missing
        return result
    if rollout.task is None:
        result.error = "its task is gone (the dataset was deleted)"
        return result
    script = rescore.reward_snapshot
    scored = score_reward(script["source"], rollout.task.data, outcome, script["timeout_s"])
    if not scored.ok:
        result.error = f"reward: {scored.error}"[:2000]
        result.detail = {"reward_kind": scored.kind, "reward_output": scored.output}
        return result
    result.detail = dict(scored.detail or {})
    if rollout.failure_kind == FailureKind.POLICY:  # as the run scored it: the failure reward, the script's aside
        result.detail["script_reward"] = scored.reward
        result.new_reward = failure_reward
    else:
        result.new_reward = scored.reward
    return result


def run_rescore(rescore_id: int) -> str:
    """The job's body: claim the rescore, score its rollouts, write the results and summary; the final status.

    Nothing is written until the end, then results and status in one transaction. So a worker that dies part way
    leaves the rescore `running` with no result, and the message Celery delivers again (acks_late) starts it over;
    a finished rescore is left as it is, and of two deliveries running at once the second to finish writes nothing.
    """
    with transaction.atomic():
        rescore = Rescore.objects.select_for_update().select_related("run").get(pk=rescore_id)
        if rescore.status not in (RescoreStatus.QUEUED, RescoreStatus.RUNNING):
            return rescore.status  # a message delivered again after the job finished
        rescore.status = RescoreStatus.RUNNING
        rescore.save(update_fields=["status"])
    config = rescore.run.config or {}
    try:
        rollouts = list(rollouts_in_scope(rescore.run, rescore.scope, rescore.step).select_related("task"))
        Rescore.objects.filter(pk=rescore_id).update(total=len(rollouts), done=0)
        results = []
        with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
            futures = [pool.submit(score_one, rescore, r, float(config.get("failure_reward", 0.0))) for r in rollouts]
            for index, future in enumerate(futures, 1):
                results.append(future.result())
                if index % PROGRESS_EVERY == 0:
                    Rescore.objects.filter(pk=rescore_id).update(done=index)
        summary = summarize(rollouts, results, float(config.get("pass_threshold", 1.0)))
        return _finish(rescore_id, RescoreStatus.SUCCEEDED, results=results, done=len(results), summary=summary)
    except Exception as exc:
        logger.exception("rescore %s failed", rescore_id)
        return _finish(rescore_id, RescoreStatus.FAILED, error=f"{type(exc).__name__}: {exc}")


def _finish(rescore_id: int, status: str, results: list[RescoredRollout] = (), **fields) -> str:
    """Write the outcome of a delivery unless another delivery finished the rescore first; the final status."""
    with transaction.atomic():
        rescore = Rescore.objects.select_for_update().get(pk=rescore_id)
        if rescore.status != RescoreStatus.RUNNING:
            return rescore.status
        RescoredRollout.objects.bulk_create(results, batch_size=500)
        Rescore.objects.filter(pk=rescore_id).update(status=status, finished_at=timezone.now(), **fields)
    return status


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _figures(pairs: list[tuple[float | None, float | None]], threshold: float) -> dict[str, Any]:
    """Old and new mean reward and pass rate of (old, new) pairs; a missing reward scores as no pass."""
    olds = [o if o is not None else 0.0 for o, _ in pairs]
    news = [n if n is not None else 0.0 for _, n in pairs]
    return {"rollouts": len(pairs), "old_mean": _mean(olds), "new_mean": _mean(news),
            "old_pass1": _mean([float(o >= threshold) for o in olds]),
            "new_pass1": _mean([float(n >= threshold) for n in news])}


def summarize(rollouts: list[Rollout], results: list[RescoredRollout], threshold: float) -> dict[str, Any]:
    """Changed rewards, errors, and per split the old and new mean and Pass@1; val also per evaluation step."""
    pairs: dict[str, list] = {"train": [], "val": []}
    val_steps: dict[int, list] = {}
    changed = errors = 0
    for rollout, result in zip(rollouts, results, strict=True):
        if result.error:
            errors += 1
            continue
        changed += result.changed
        pair = (result.old_reward, result.new_reward)
        pairs.setdefault(rollout.split, []).append(pair)
        if rollout.split == "val" and not rollout.greedy:
            val_steps.setdefault(rollout.step, []).append(pair)
    return {"scored": len(results) - errors, "errors": errors, "changed": changed, "pass_threshold": threshold,
            "splits": {split: _figures(p, threshold) for split, p in pairs.items() if p},
            "val_by_step": [{"step": step, **_figures(p, threshold)} for step, p in sorted(val_steps.items())]}
