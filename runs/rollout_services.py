"""Every write of rollouts: their creation and end, the calls the proxy recorded, and the samples a step trained on.

The rest of the domain's writes (runs and their state machine, events) are runs.services; these use its events and
batch size, so the recorder's writes and the run's step share one locking discipline.
"""
from __future__ import annotations

import json
import logging
import secrets

from django.db import DataError, transaction
from django.db.models import Case, F, PositiveIntegerField, Value, When
from django.db.models.functions import Greatest
from django.utils import timezone

from catalog.models import Task
from common import errors as common_errors
from proxy.auth import hash_secret
from runs import events, services
from runs.models import FailureKind, ModelCall, Rollout, RolloutStatus, Run, Sample

logger = logging.getLogger(__name__)


def create_rollout(run: Run, *, task: Task | None, split: str, step: int, group: int, attempt: int,
                   greedy: bool = False, policy_version: int | None = None) -> tuple[Rollout, str]:
    """A new rollout and its API key; only the key's hash is stored, the key is returned once.

    `greedy` marks an evaluation attempt the proxy serves at temperature 0 (runs.recorder reads it).
    `policy_version`: the version the rollout starts under (its group's at admission; an evaluation's step); the
    run's current version when not given."""
    secret = secrets.token_urlsafe(32)
    version = run.policy_version if policy_version is None else policy_version
    rollout = Rollout.objects.create(run=run, task=task, split=split, step=step, group=group, attempt=attempt,
                                     greedy=greedy, policy_version=version,
                                     secret_hash=hash_secret(secret))
    return rollout, secret


def record_calls(calls) -> None:
    """Store proxy RecordedCalls as ModelCall rows in one transaction.

    Idempotent on (rollout, seq), so the proxy may retry a batch. One `call.recorded` event per rollout.
    """
    rollout_runs = dict(Rollout.objects.filter(pk__in={int(c.rollout_id) for c in calls}).values_list("pk", "run_id"))
    rows = [_call_row(c) for c in calls if int(c.rollout_id) in rollout_runs]
    for call in calls:
        if int(call.rollout_id) not in rollout_runs:
            logger.error("rollout %s seq %s: rollout no longer exists; call dropped", call.rollout_id, call.seq)
    try:
        _store_calls(rows, rollout_runs)
    except DataError:
        # PostgreSQL refuses NUL characters in JSON text; model output may hold them. Store a safe copy.
        logger.warning("a batch of %d calls held text PostgreSQL refuses; storing it with NULs replaced", len(rows))
        for row in rows:
            row.request, row.response = _strip_nul(row.request), _strip_nul(row.response)
        _store_calls(rows, rollout_runs)


def _call_row(call) -> ModelCall:
    return ModelCall(
        rollout_id=int(call.rollout_id), seq=call.seq, api=call.api, stream=call.stream, request=call.request,
        response=call.response, prompt_ids=list(call.prompt_ids), completion_ids=list(call.completion_ids),
        logprobs=list(call.logprobs), finish_reason=call.finish_reason or "", status_code=call.status_code,
        latency_ms=call.latency_ms, policy_version=call.policy_version, error=call.error or "",
        sampling_overrides=getattr(call, "sampling_overrides", {}) or {},
        replica=getattr(call, "replica", None), retried=bool(getattr(call, "retried", False)),
        constraint=getattr(call, "constraint", "") or "", choice=getattr(call, "choice", 0) or 0)


def _store_calls(rows: list[ModelCall], rollout_runs: dict[int, int]) -> None:
    with transaction.atomic():
        ModelCall.objects.bulk_create(rows, ignore_conflicts=True)
        by_rollout: dict[int, list[ModelCall]] = {}
        for row in rows:
            by_rollout.setdefault(row.rollout_id, []).append(row)
        if not by_rollout:
            return
        # One UPDATE for all the batch's rollouts, then one counter update and one insert of events per run.
        Rollout.objects.filter(pk__in=by_rollout).update(call_count=Greatest(F("call_count"), Case(
            *[When(pk=rollout_id, then=Value(max(r.seq for r in group) + 1)) for rollout_id, group in by_rollout.items()],
            default=F("call_count"), output_field=PositiveIntegerField())))
        by_run: dict[int, list[tuple[str, dict]]] = {}
        for rollout_id, group in sorted(by_rollout.items()):
            by_run.setdefault(rollout_runs[rollout_id], []).append((events.CALL_RECORDED, {
                "rollout": rollout_id,
                "calls": [{"seq": r.seq, "api": r.api, "status": r.status_code, "latency_ms": round(r.latency_ms, 1),
                           "completion_tokens": len(r.completion_ids)} for r in sorted(group, key=lambda r: r.seq)],
            }))
        for run_id, items in sorted(by_run.items()):
            services.emit_events(run_id, items)


def _strip_nul(value):
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [_strip_nul(v) for v in value]
    if isinstance(value, dict):
        return {_strip_nul(k): _strip_nul(v) for k, v in value.items()}
    return value


def report_harness_reward(rollout_id: int, reward: float, detail: dict) -> None:
    """A reward the harness reported itself (POST .../v1/reward); kept beside the reward script's."""
    with transaction.atomic():
        rollout = Rollout.objects.select_for_update().get(pk=rollout_id)
        rollout.reward_detail = {**rollout.reward_detail, "harness": {"reward": float(reward), "detail": detail}}
        rollout.save(update_fields=["reward_detail"])
        services.emit_event(rollout.run_id, events.ROLLOUT_STATUS,
                            {"rollout": rollout_id, "harness_reward": float(reward)})


def start_rollout(rollout_id: int) -> None:
    """Pending -> running; a `rollout.status` event lets the run page's table show it at once."""
    with transaction.atomic():
        started = Rollout.objects.filter(pk=rollout_id, status=RolloutStatus.PENDING).update(
            status=RolloutStatus.RUNNING, started_at=timezone.now())
        if started:
            row = Rollout.objects.values("run_id", "split", "step", "group", "attempt").get(pk=rollout_id)
            services.emit_event(row.pop("run_id"), events.ROLLOUT_STATUS,
                                {"rollout": rollout_id, "status": RolloutStatus.RUNNING, **row})


def finish_rollout(rollout_id: int, *, status: str, reward: float | None, reward_detail: dict, exit_code: int | None,
                   stdout_tail: str = "", stderr_tail: str = "", error: str = "", failure_kind: str = "",
                   outcome=None, flags: list | None = None) -> Rollout:
    """Close a rollout with its reward and harness output; its calls are refused from now on (409).

    `failure_kind` (FailureKind) says whose fault a failure was: "policy" or "infra"; "" when it did not fail.
    `outcome` is what the harness reported (kept for re-scoring, up to OUTCOME_LIMIT_BYTES), `flags` the
    reward-hacking lens's findings (health.audit).
    """
    if failure_kind not in FailureKind.values:
        raise common_errors.ServiceError(f"failure_kind must be one of {FailureKind.values}, got {failure_kind!r}")
    with transaction.atomic():
        rollout = Rollout.objects.select_for_update().get(pk=rollout_id)
        rollout.status, rollout.reward, rollout.exit_code = status, reward, exit_code
        rollout.failure_kind = failure_kind
        # A harness's output (and a reward script's detail) may hold NUL characters, which PostgreSQL refuses in
        # text and JSON: the rollout would stay `running` for good. They are stored as U+FFFD.
        rollout.reward_detail = _strip_nul({**rollout.reward_detail, **reward_detail})
        rollout.stdout_tail, rollout.stderr_tail, rollout.error = (
            _strip_nul(stdout_tail[-16384:]), _strip_nul(stderr_tail[-16384:]), _strip_nul(error))
        if outcome is not None:
            rollout.outcome = stored_outcome(outcome)
        if flags is not None:
            rollout.flags = _strip_nul(list(flags))
        rollout.finished_at = timezone.now()
        rollout.save()
        services.emit_event(rollout.run_id, events.ROLLOUT_STATUS, {
            "rollout": rollout.pk, "status": status, "reward": reward, "split": rollout.split, "step": rollout.step,
            "group": rollout.group, "attempt": rollout.attempt, "error": rollout.error[:500],
            "failure_kind": failure_kind})
    return rollout


OUTCOME_LIMIT_BYTES = 1_000_000
"""The largest harness outcome (as JSON) a rollout keeps; a larger one is recorded by its size only."""


def stored_outcome(outcome) -> dict:
    """The outcome as a rollout keeps it: a dict (any other JSON value as {"_value": ...}), NULs as U+FFFD, or a note
    of its size when it is over OUTCOME_LIMIT_BYTES (it cannot be re-scored then)."""
    try:
        size = len(json.dumps(outcome))
    except (TypeError, ValueError):
        return {"_not_stored": "not JSON"}
    if size > OUTCOME_LIMIT_BYTES:
        return {"_not_stored": f"{size} bytes, over the {OUTCOME_LIMIT_BYTES} kept"}
    return _strip_nul(outcome if isinstance(outcome, dict) else {"_value": outcome})


def cancel_unfinished_rollouts(run_id: int, error: str) -> int:
    return Rollout.objects.filter(run_id=run_id, status__in=(RolloutStatus.PENDING, RolloutStatus.RUNNING)).update(
        status=RolloutStatus.CANCELLED, error=error, finished_at=timezone.now())


def fail_unfinished_rollouts(run_id: int, error: str) -> int:
    """Fail the run's pending and running rollouts as infrastructure failures (their engine died under them)."""
    return Rollout.objects.filter(run_id=run_id, status__in=(RolloutStatus.PENDING, RolloutStatus.RUNNING)).update(
        status=RolloutStatus.FAILED, failure_kind=FailureKind.INFRA, error=error, finished_at=timezone.now())


def record_step(run_id: int, step: int, policy_version: int, samples: list[dict], drift: dict[int, dict[int, str]],
                metrics: dict[str, float], batch: dict[int, str] | None = None, *,
                generation: int | None = None) -> None:
    """Store one training step: its samples, the drift class of every call it read, metrics, step and version.

    `batch` maps every rollout of the step's batch to why it gave no trained sample ('' when it gave one): they
    get `batch_step`, `trained_step` where trained, and `drop_reason` (the step page lists the groups and what was
    dropped).

    A few queries per STEP_BATCH rows (runs.services; never one per rollout or call), each write batch its own
    short transaction, so the proxy's recorder, writing ModelCall rows meanwhile, never waits long. The run's
    step, version and metrics come last in one transaction: a crash part way keeps the batches written but not
    the run's step. Called again (runs.reconnect retries it after a dropped connection) it writes nothing twice:
    a sample's index is its place among its rollout's samples, the drift and batch updates set the same values,
    and the last transaction is skipped once the run's step has reached `step`.

    With `generation`, the worker start recording the step: each transaction checks that it still holds the run
    before it commits (NotHeld otherwise, and that write is rolled back), holding the run's row until then so that
    a claim by another worker waits for it rather than slipping in between.
    """
    counts: dict[int, int] = {}
    rows = []
    for sample in samples:
        index = counts.get(sample["rollout_id"], 0)
        counts[sample["rollout_id"]] = index + 1
        rows.append(Sample(index=index, **sample))
    for chunk in services.batches(rows, services.STEP_BATCH):
        with transaction.atomic():
            Sample.objects.bulk_create(chunk, ignore_conflicts=True)  # a retry finds its rows there: kept as they are
            _check_held(run_id, generation)
    _store_drift(drift, run_id, generation)
    _store_batch(run_id, step, batch or {}, generation)
    with transaction.atomic():
        done = Run.objects.filter(services.held_by(generation), pk=run_id, step__lt=step).update(
            step=step, policy_version=policy_version, updated_at=timezone.now())
        if not done:
            _check_held(run_id, generation)
            return  # recorded by the call this one retries
        services.record_metrics(run_id, step, metrics)


def _check_held(run_id: int, generation: int | None) -> None:
    """NotHeld unless worker start `generation` (None: any caller) still holds the run. Called last in a write's
    transaction: the run's row stays locked until the commit, taken after the rows written, in the order the
    proxy's recorder locks them (rollouts, then the run for its events)."""
    if generation is None:
        return
    if not Run.objects.select_for_update(no_key=True).filter(services.held_by(generation), pk=run_id).order_by() \
            .values_list("pk"):
        raise services.NotHeld(f"run {run_id} is no longer held by worker start {generation}: not recorded")


def _store_batch(run_id: int, step: int, batch: dict[int, str], generation: int | None = None) -> None:
    """batch_step, trained_step and drop_reason of the step's rollouts: one update per distinct reason and
    STEP_BATCH rows."""
    by_reason: dict[str, list[int]] = {}
    for rollout_id, reason in batch.items():
        by_reason.setdefault(reason[:500], []).append(int(rollout_id))
    for reason, ids in by_reason.items():
        for chunk in services.batches(sorted(ids), services.STEP_BATCH):
            with transaction.atomic():
                Rollout.objects.filter(run_id=run_id, pk__in=chunk).update(
                    batch_step=step, trained_step=None if reason else step, drop_reason=reason)
                _check_held(run_id, generation)


def _store_drift(drift: dict[int, dict[int, str]], run_id: int, generation: int | None = None) -> None:
    """Set ModelCall.drift: one read per STEP_BATCH rollouts, one bulk update per STEP_BATCH changed calls."""
    wanted = {int(rollout_id): {int(seq): kind for seq, kind in by_seq.items()}
              for rollout_id, by_seq in drift.items() if by_seq}
    changed = []
    for ids in services.batches(sorted(wanted), services.STEP_BATCH):
        for call in ModelCall.objects.filter(rollout_id__in=ids).only("pk", "rollout_id", "seq", "drift"):
            kind = wanted[call.rollout_id].get(call.seq)
            if kind is not None and kind != call.drift:
                call.drift = kind
                changed.append(call)
    for batch in services.batches(changed, services.STEP_BATCH):
        with transaction.atomic():
            ModelCall.objects.bulk_update(batch, ["drift"])
            _check_held(run_id, generation)
