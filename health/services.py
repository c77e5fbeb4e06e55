"""Run health, the write side: after a step is stored, read its records, record its health/* metrics and raise its
alarms (health.rules); after an evaluation, the reward-up-validation-down rule; acknowledging an alarm.

A few queries a step (rollouts, calls, samples, metrics), never one per rollout. An alarm is one RunAlarm row per
(run, kind, step) and a `run.alarm` event: the run page's panel and the runs list's badge update live from it.
"""
from __future__ import annotations

import logging

from django.db import IntegrityError, transaction
from django.db.models import Count
from django.utils import timezone

from common.db import JsonArrayLength
from common.errors import InvalidTransition
from health import audit, rules
from health import calls as health_calls
from health.models import RunAlarm
from runs import events, services
from runs.models import Metric, ModelCall, Rollout, RolloutStatus, Run, Sample
from runs.reconnect import db
from trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

RUN_ALARM = events.RUN_ALARM
HISTORY_METRICS = ("health/tool_use_share", "health/truncated_share", "train/logprob_mismatch_mean",
                   "train/logprob_mismatch_max", "eval/pass@1", "eval/tasks", "reward/mean")
FINISHED = (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED)


CALL_FIELDS = ("api", "request__tools", "request__functions", "response", "finish_reason")
"""What a CallView is built from: the request's tools only (never its messages, the bulk of a stored call)."""


def _view(row: dict) -> health_calls.CallView:
    return health_calls.view(row["api"], {"tools": row["request__tools"], "functions": row["request__functions"]},
                             row["response"], row["finish_reason"])


def step_facts(run_id: int, step: int) -> rules.StepFacts:
    """The records of step `step`'s batch (the train rollouts sampled for it, trained or dropped) as the rules read
    them: four queries a STEP_BATCH rollouts (rollouts, calls, samples) and one for the metrics, never one per
    rollout."""
    rows = list(Rollout.objects.filter(run_id=run_id, batch_step=step, split="train", status__in=FINISHED)
                .order_by("group", "attempt", "id")
                .values("id", "group", "reward", "failure_kind", "call_count", "flags", "error", "drop_reason",
                        "outcome__commands", "outcome__format_errors", "outcome__timed_out"))
    facts = {row["id"]: rules.RolloutFacts(
        id=row["id"], group=row["group"], reward=row["reward"], failure_kind=row["failure_kind"],
        calls=row["call_count"], flags=list(row["flags"] or []), drop_reason=row["drop_reason"],
        format_errors=_count(row["outcome__format_errors"]),
        truncated=row["outcome__timed_out"] is True or "timed out" in (row["error"] or "")) for row in rows}
    for batch in services.batches(list(facts), services.STEP_BATCH):
        calls = ModelCall.objects.filter(rollout_id__in=batch).annotate(completion_tokens=JsonArrayLength(
            "completion_ids")).values("rollout_id", "completion_tokens", "constraint", *CALL_FIELDS)
        for call in calls:
            r, view = facts[call["rollout_id"]], _view(call)
            r.calls = max(r.calls, 1)
            if not call["constraint"]:  # a constrained call's tokens were forced, not sampled
                r.sampled_tokens += call["completion_tokens"] or 0
            r.offered_tools = r.offered_tools or view.offered_tools
            r.offering_calls += view.offered_tools
            r.text_tool_calls += view.text_tool_calls if view.offered_tools else 0
            r.tool_uses += len(view.tool_calls) or len(view.commands())
            r.truncated = r.truncated or call["finish_reason"] == "length"
        kept: dict[int, bool] = {}
        for rollout_id, mask in Sample.objects.filter(rollout_id__in=batch, step=step).values_list(
                "rollout_id", "loss_mask"):
            kept[rollout_id] = kept.get(rollout_id, False) or any(mask or [])
        for rollout_id, any_kept in kept.items():
            facts[rollout_id].masked_out = not any_kept
    for row in rows:
        if (commands := _count(row["outcome__commands"], None)) is not None:
            facts[row["id"]].tool_uses = commands  # the harness counted the commands it ran: that is what it did
    history = _metrics(run_id, step)
    return rules.StepFacts(step=step, rollouts=list(facts.values()), metrics=history.pop(step, {}), history=history)


def _metrics(run_id: int, step: int) -> dict[int, dict[str, float]]:
    """step -> name -> value of the metrics the rules compare, for steps up to `step`: one query."""
    by_step: dict[int, dict[str, float]] = {}
    for name, at, value in Metric.objects.filter(run_id=run_id, step__lte=step, name__in=HISTORY_METRICS) \
            .values_list("name", "step", "value"):
        by_step.setdefault(at, {})[name] = value
    return by_step


def rollout_flags(rollout_id: int, task: dict, outcome, output: str = "") -> list[dict]:
    """The reward-hacking lens's flags of a finished rollout (health.audit) from its recorded calls, one query."""
    if not isinstance(task, dict) or not isinstance(task.get("files"), dict):
        return []  # not a repository task: nothing to audit, no query
    views = [_view(row) for row in ModelCall.objects.filter(rollout_id=rollout_id).order_by("seq").values(*CALL_FIELDS)]
    return audit.audit(task, outcome, views, output)


def _count(value, default: int | None = 0) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else default


async def in_run(check, run_id: int, step: int) -> None:
    """A running run's check of a step (check_step, check_evaluation) off its loop; a failure of the check is logged,
    never the run's end: the alarms watch the run, they must not stop it."""
    try:
        await db(check)(run_id, step)
    except Exception:  # noqa: BLE001
        logger.exception("run %s step %s: health check %s failed", run_id, step, check.__name__)


def check_step(run_id: int, step: int) -> list[RunAlarm]:
    """Record step `step`'s health/* metrics and raise its alarms; returns the alarms raised now."""
    facts = step_facts(run_id, step)
    config = _config(run_id)
    facts.extra_groups = TrainerConfig.from_dict(config).extra_groups_per_step
    findings, metrics = rules.evaluate(facts, rules.thresholds(config.get("health")))
    if facts.rollouts:
        stored = set(Metric.objects.filter(run_id=run_id, step=step, name__in=list(metrics))
                     .values_list("name", flat=True))
        fresh = {k: v for k, v in metrics.items() if k not in stored}
        if fresh:
            services.record_metrics(run_id, step, fresh)
    return raise_alarms(run_id, step, findings)


def check_evaluation(run_id: int, step: int) -> list[RunAlarm]:
    """After step `step`'s evaluation: train reward rising while validation Pass@1 falls (metrics only)."""
    history = _metrics(run_id, step)
    facts = rules.StepFacts(step=step, rollouts=[], metrics=history.pop(step, {}), history=history)
    found = rules.reward_up_val_down(facts, _thresholds(run_id))
    return raise_alarms(run_id, step, [found] if found else [])


def _config(run_id: int) -> dict:
    return Run.objects.values_list("config", flat=True).get(pk=run_id) or {}


def _thresholds(run_id: int) -> dict[str, float]:
    return rules.thresholds(_config(run_id).get("health"))


def raise_alarms(run_id: int, step: int, findings: list[rules.Finding]) -> list[RunAlarm]:
    """One RunAlarm and one `run.alarm` event per finding not raised for this step before."""
    raised = []
    for found in findings:
        try:
            with transaction.atomic():
                alarm = RunAlarm.objects.create(run_id=run_id, step=step, kind=found.kind, severity=found.severity,
                                                message=found.message, evidence=_plain(found.evidence),
                                                rollout_ids=found.rollout_ids)
                services.emit_event(run_id, RUN_ALARM, alarm_payload(alarm))
        except IntegrityError:  # raised for this step already (a step redone after a resume)
            continue
        logger.warning("run %s step %s: alarm %s: %s", run_id, step, found.kind, found.message)
        raised.append(alarm)
    return raised


def _plain(value):
    """Evidence as JSON holds it: non-finite floats as None."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def alarm_payload(alarm: RunAlarm) -> dict:
    return {"id": alarm.pk, "step": alarm.step, "kind": alarm.kind, "label": alarm.get_kind_display(),
            "severity": alarm.severity, "message": alarm.message, "evidence": alarm.evidence,
            "rollout_ids": alarm.rollout_ids, "acknowledged": alarm.acknowledged_at is not None}


def acknowledge(alarm: RunAlarm, user) -> RunAlarm:
    """Mark an alarm seen: it stays listed, no longer counted in the runs list's badge. Twice is refused."""
    with transaction.atomic():
        alarm = RunAlarm.objects.select_for_update().get(pk=alarm.pk)
        if alarm.acknowledged_at is not None:
            raise InvalidTransition(f"alarm {alarm.pk} was acknowledged at {alarm.acknowledged_at.isoformat()}")
        alarm.acknowledged_at, alarm.acknowledged_by = timezone.now(), user
        alarm.save(update_fields=["acknowledged_at", "acknowledged_by"])
        services.emit_event(alarm.run_id, RUN_ALARM, alarm_payload(alarm))
    return alarm


def open_counts(run_ids) -> dict[int, int]:
    """run id -> alarms not acknowledged (the runs list's badge), one query."""
    return dict(RunAlarm.objects.filter(run_id__in=list(run_ids), acknowledged_at__isnull=True)
                .values("run_id").annotate(n=Count("id")).values_list("run_id", "n"))

