"""Every write of a run: its creation and clones, the state machine every status change goes through (claims, cancel,
finish, resume, continue, the sweep's reclaim), its events, metrics and checkpoints, and the rewind to a checkpoint.

Harnesses, datasets and reward scripts are written by catalog.services; rollouts, their recorded calls and training
samples by runs.rollout_services."""
from __future__ import annotations

import logging
import math
import os
from typing import Any

from django.db import transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from catalog.models import Dataset, Harness, RewardScript
from catalog.registry import UnknownModel, resolve_model
from catalog.services import HARNESS_FIELDS, check_owner
from common.errors import InUse, InvalidModel, InvalidTransition, ServiceError
from common.tasks import send_task
from health import rules as health_rules
from health.models import RunAlarm
from runs import events, pools, selectors
from runs.models import Metric, Rollout, RolloutStatus, Run, RunEvent, RunStatus, Sample
from trainer.config import ConfigError, TrainerConfig

logger = logging.getLogger(__name__)

EXECUTE_RUN = "runs.tasks.execute_run"
"""The Celery task that drives a run (runs.tasks), enqueued by name."""


# The run state machine: the one table every status change goes through. Back to QUEUED: from STARTING or
# RUNNING when the sweep re-queues a run whose worker was lost (runs.durability); from FAILED or CANCELLED when
# its owner resumes it, and from SUCCEEDED when its owner continues it for more steps (both from its checkpoint).
RUN_TRANSITIONS: dict[str, frozenset[str]] = {
    RunStatus.QUEUED: frozenset({RunStatus.STARTING, RunStatus.CANCELLED, RunStatus.FAILED}),
    RunStatus.STARTING: frozenset({RunStatus.RUNNING, RunStatus.CANCELLING, RunStatus.FAILED, RunStatus.QUEUED}),
    RunStatus.RUNNING: frozenset({RunStatus.CANCELLING, RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.QUEUED}),
    RunStatus.CANCELLING: frozenset({RunStatus.CANCELLED, RunStatus.FAILED}),
    RunStatus.SUCCEEDED: frozenset({RunStatus.QUEUED}),
    RunStatus.FAILED: frozenset({RunStatus.QUEUED}),
    RunStatus.CANCELLED: frozenset({RunStatus.QUEUED}),
}


FINISHED = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


HELD = frozenset({RunStatus.STARTING, RunStatus.RUNNING, RunStatus.CANCELLING})
"""A worker holds the run and beats for it (Run.heartbeat_at)."""


class NotHeld(InvalidTransition):
    """A worker start wrote for a run it no longer holds (the sweep took it for lost, another worker claimed it):
    the write was refused; the worker stops without touching the run."""


def held_by(generation: int | None) -> Q:
    """The runs worker start `generation` holds: its writes expect it, as its heartbeat does (None: any run)."""
    return Q() if generation is None else Q(worker_starts=generation, status__in=HELD)


ROLLOUT_FINISHED = frozenset({RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED,
                              RolloutStatus.LOST})


def emit_event(run_id: int, kind: str, payload: dict[str, Any]) -> RunEvent:
    """Write the next RunEvent of the run and publish it after commit.

    The counter update locks the run row until commit, so seqs are gapless and commit in order.
    """
    return emit_events(run_id, [(kind, payload)])[0]


def emit_events(run_id: int, items: list[tuple[str, dict[str, Any]]]) -> list[RunEvent]:
    """Write the run's next len(items) RunEvents, in order, with one counter update and one insert; publish them
    after commit in one go (the recorder's batches: one `call.recorded` event per rollout)."""
    if not items:
        return []
    with transaction.atomic(savepoint=False):  # inside a caller's transaction: all or nothing with it
        Run.objects.filter(pk=run_id).update(event_seq=F("event_seq") + len(items))
        last, owner_id = Run.objects.filter(pk=run_id).values_list("event_seq", "owner_id").get()
        first = last - len(items) + 1
        rows = RunEvent.objects.bulk_create([RunEvent(run_id=run_id, seq=first + i, kind=kind, payload=payload)
                                             for i, (kind, payload) in enumerate(items)])
        built = [events.from_row(row) for row in rows]
        transaction.on_commit(lambda: events.publish_many(built, owner_id))
    return rows


def validate_run_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """The run config as TrainerConfig accepts it (defaults filled in), its alarm thresholds checked
    (health.rules.thresholds); ConfigError otherwise."""
    full = TrainerConfig.from_dict(config).to_dict()
    health_rules.thresholds(full["health"])
    return full


def create_run(owner, *, name: str, model: str, config: dict[str, Any] | None, harness: Harness,
               dataset: Dataset, reward_script: RewardScript, cloned_from: Run | None = None,
               pool: str = pools.DEFAULT_POOL) -> Run:
    for obj in (harness, dataset, reward_script):
        check_owner(owner, obj)
    try:
        pools.check_pool(pool)
    except ValueError as exc:
        raise ServiceError(f"pool: {exc}") from exc
    try:
        full_config = validate_run_config(config)
    except ConfigError as exc:
        raise ServiceError(f"config: {exc}") from exc
    try:
        model_info = resolve_model(model, owner)
    except UnknownModel as exc:
        raise InvalidModel(str(exc)) from exc
    if dataset.train_count == 0:
        raise ServiceError(f"dataset '{dataset.name}' has no train tasks; upload tasks with split 'train'")
    with transaction.atomic():
        run = Run.objects.create(
            owner=owner, name=name, model=model, model_info=model_info, config=full_config, harness=harness,
            dataset=dataset,
            reward_script=reward_script, cloned_from=cloned_from, pool=pool,
            harness_snapshot=_snapshot(harness, HARNESS_FIELDS + ("version",)),
            dataset_snapshot={**_snapshot(dataset, ("name", "version", "content_sha256", "train_count", "val_count")),
                              "hidden_fields": dataset.reward_only_fields},
            reward_snapshot=_snapshot(reward_script, ("name", "source", "timeout_s", "version")),
        )
        emit_event(run.pk, events.RUN_STATUS, {"status": run.status, "error": ""})
        transaction.on_commit(lambda: enqueue_run(run.pk))
    logger.info("run %s created by %s", run.pk, owner)
    return run


def clone_run(run: Run, owner, name: str | None = None, pool: str | None = None) -> Run:
    """A new queued run with the same settings, on the current versions of its harness, dataset and script."""
    check_owner(owner, run)
    missing = [label for label, obj in (("harness", run.harness), ("dataset", run.dataset),
                                        ("reward script", run.reward_script)) if obj is None]
    if missing:
        raise ServiceError(f"cannot clone run {run.pk}: its {', '.join(missing)} was deleted")
    return create_run(owner, name=name or f"{run.name} (clone)", model=run.model, config=run.config,
                      harness=run.harness, dataset=run.dataset, reward_script=run.reward_script,
                      cloned_from=run, pool=pool or run.pool)


def _snapshot(obj, names: tuple[str, ...]) -> dict[str, Any]:
    return {"id": obj.pk, **{name: getattr(obj, name) for name in names}}


def enqueue_run(run_id: int) -> bool:
    """Hand a queued run to its pool's queue; False (and a line in the run's log) when the broker cannot be reached.

    The run stays queued without a task id then, and the sweep (runs.durability.requeue_unsent) hands it over again
    once the broker answers: a run is never left queued with no message behind it."""
    pool = Run.objects.filter(pk=run_id).values_list("pool", flat=True).first() or pools.DEFAULT_POOL
    try:
        result = send_task(EXECUTE_RUN, [run_id], queue=pools.queue_for(pool))
    except Exception as exc:  # kombu.exceptions.OperationalError and friends, after Celery's publish retries
        logger.warning("run %s: could not reach the queue (%s); the sweep queues it again", run_id, exc)
        emit_event(run_id, events.RUN_LOG, {"line": f"could not reach the run queue ({type(exc).__name__}: "
                                                    f"{str(exc)[:300]}); it is handed over again once it answers"})
        return False
    Run.objects.filter(pk=run_id, celery_task_id="").update(celery_task_id=result.id or "")
    return True


def transition_run(run_id: int, to: str, *, error: str | None = None, expect: Q | None = None,
                   note: dict[str, Any] | None = None, **fields) -> Run:
    """Move a run to `to` if the table allows it from its current status; InvalidTransition otherwise.

    `expect` narrows the conditional update further (e.g. the worker generation that holds the run): a run that
    changed meanwhile is refused rather than overwritten. `note` adds keys to the status event's payload.
    """
    allowed_from = [status for status, targets in RUN_TRANSITIONS.items() if to in targets]
    updates: dict[str, Any] = {"status": to, "updated_at": timezone.now(), **fields}
    if error is not None:
        updates["error"] = error[:10000]
    if to == RunStatus.RUNNING:  # a resumed run keeps its first start
        updates.setdefault("started_at", Coalesce(F("started_at"), Value(timezone.now())))
    if to in FINISHED:
        updates.setdefault("finished_at", timezone.now())
    with transaction.atomic():
        changed = Run.objects.filter(expect or Q(), pk=run_id, status__in=allowed_from).update(**updates)
        if changed != 1:
            current = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
            if current is None:
                raise InvalidTransition(f"run {run_id} does not exist")
            if current in allowed_from:
                raise InvalidTransition(f"run {run_id} changed meanwhile (it is {current}); not moved to {to}")
            raise InvalidTransition(f"run {run_id} cannot go from {current} to {to}")
        emit_event(run_id, events.RUN_STATUS, {"status": to, "error": updates.get("error", ""), **(note or {})})
    logger.info("run %s -> %s", run_id, to)
    return Run.objects.get(pk=run_id)


def claim_run(run_id: int, task_id: str, worker: dict[str, Any] | None = None) -> int | None:
    """Take a queued run for this worker: exactly one claimer wins.

    Returns the worker generation (Run.worker_starts after the claim) that this worker's heartbeats and final
    writes must match, so a worker the sweep gave up on can no longer change the run; None if not claimed.
    `worker` (runs.pools.worker_note: its name, pool and device set) goes into the "starting" event.
    """
    try:
        run = transition_run(run_id, RunStatus.STARTING, celery_task_id=task_id, heartbeat_at=timezone.now(),
                             worker_starts=F("worker_starts") + 1, note={"worker": worker} if worker else None)
    except InvalidTransition:
        return None
    return run.worker_starts


def cancel_run(run: Run, user) -> Run:
    """Queued runs end at once; starting or running ones go to cancelling and the worker stops them."""
    check_owner(user, run)
    run.refresh_from_db(fields=["status"])
    if run.status == RunStatus.QUEUED:
        try:
            return transition_run(run.pk, RunStatus.CANCELLED, error="cancelled before it started")
        except InvalidTransition:
            run.refresh_from_db(fields=["status"])  # a worker claimed it meanwhile: cancel cooperatively
    if run.status in (RunStatus.STARTING, RunStatus.RUNNING):
        return transition_run(run.pk, RunStatus.CANCELLING)
    raise InvalidTransition(f"run {run.pk} is {run.status}; only queued, starting or running runs can be cancelled")


def delete_run(run: Run, user) -> None:
    """Delete a finished run: its rows, then (once that commits) its folder, checkpoints and the served model
    folders staged from them (runs.disk.delete_run_files). Refused (InUse) while another run's model is one of its
    checkpoints."""
    from runs import disk

    check_owner(user, run)
    run.refresh_from_db(fields=["status"])
    if not run.is_finished:
        raise InvalidTransition(f"run {run.pk} is {run.status}; cancel it before deleting")
    run_id = run.pk
    with transaction.atomic():
        _check_checkpoints_unused(run_id, disk.run_folder(run_id))
        run.delete()
        transaction.on_commit(lambda: disk.delete_run_files(run_id))


def _check_checkpoints_unused(run_id: int, folder: os.PathLike) -> None:
    """InUse naming the runs whose model is one of run `run_id`'s checkpoints: they load it at every start, resume
    and continue, so it stays while they do."""
    users = list(selectors.runs_with_models_in(folder).exclude(pk=run_id).order_by("pk")
                 .values_list("pk", "name", "model_info__path")[:6])
    if not users:
        return
    names = sorted({os.path.basename(path) for _, _, path in users})
    shown = ", ".join(f"#{pk} {name!r}" for pk, name, _ in users[:5]) + (" and more" if len(users) > 5 else "")
    checkpoints = (f"its checkpoint {names[0]} is the model of" if len(names) == 1
                   else f"its checkpoints {', '.join(names)} are the models of")
    runs = f"run {shown}; delete that run first" if len(users) == 1 else f"runs {shown}; delete those runs first"
    raise InUse(f"run {run_id} cannot be deleted: {checkpoints} {runs}")


def finish_run(run: Run, user) -> Run:
    """Finish a starting or running run early: the step it trains now (or its next, while it starts) becomes its
    last; it then evaluates, checkpoints and succeeds as if that had been its step count (its config's `steps`
    says so, and `continue` can add more later). Its worker reads the new count within a second
    (runs.watch.Finish)."""
    check_owner(user, run)
    with transaction.atomic():
        current = Run.objects.select_for_update().get(pk=run.pk)
        if current.status not in (RunStatus.STARTING, RunStatus.RUNNING):
            raise InvalidTransition(f"run {run.pk} is {current.status}; only starting or running runs can be "
                                    "finished early")
        configured = int(current.config.get("steps", 0))
        last = min(configured, current.step + 1)
        if last < configured:
            current.config = {**current.config, "steps": last}
            current.save(update_fields=["config", "updated_at"])
            emit_event(run.pk, events.RUN_LOG, {"line": f"finish requested by its owner: the run ends after step "
                                                        f"{last} (of {configured}) with an evaluation",
                                                "steps": last})
    logger.info("run %s: finish after step %s requested", run.pk, last)
    return current


def set_run_phase(run_id: int, phase: str, progress: float | None = None) -> None:
    """Say what the run is doing now (shown on the run page), e.g. 'starting the engine: loading weights'.

    `progress` in [0, 1] where the phase has a measurable fraction done; None where it has not.
    """
    with transaction.atomic():
        Run.objects.filter(pk=run_id).update(phase=phase[:300])
        emit_event(run_id, events.RUN_PHASE, {"phase": phase[:300], "progress": progress})


def fail_run(run_id: int, error: str, generation: int | None = None) -> Run:
    """Fail the run; with `generation`, only while that worker generation still holds it."""
    return transition_run(run_id, RunStatus.FAILED, error=error, expect=_held_by(generation))


def _held_by(generation: int | None) -> Q | None:
    return None if generation is None else Q(worker_starts=generation)


def beat_run(run_id: int, generation: int) -> bool:
    """The heartbeat of the worker holding the run; False once that worker no longer holds it."""
    return Run.objects.filter(held_by(generation), pk=run_id).update(heartbeat_at=timezone.now()) == 1


def record_checkpoint(run_id: int, generation: int, path: str, step: int) -> bool:
    """Remember the run's newest complete checkpoint: a lost worker's run resumes from it."""
    changed = Run.objects.filter(pk=run_id, worker_starts=generation).update(checkpoint_path=path)
    if changed:
        emit_event(run_id, events.RUN_LOG, {"line": f"checkpoint of step {step} saved"})
    return changed == 1


def reclaim_lost_run(run_id: int, to: str, *, error: str, still_lost: Q) -> Run:
    """End or re-queue a run whose worker stopped beating; its unfinished rollouts are lost with that worker.

    `still_lost` is the sweep's condition (same status, generation and stale heartbeat): a worker that beat
    meanwhile keeps its run (InvalidTransition).
    """
    fields = {"celery_task_id": "", "finished_at": None} if to == RunStatus.QUEUED else {}
    with transaction.atomic():
        run = transition_run(run_id, to, error=error, expect=still_lost, **fields)
        lose_rollouts(run_id, Q(status__in=(RolloutStatus.PENDING, RolloutStatus.RUNNING)),
                      f"lost with its worker ({error or 'the run was re-queued'})")
        if to == RunStatus.QUEUED:
            transaction.on_commit(lambda: enqueue_run(run_id))
    logger.warning("run %s: worker lost; the run is now %s", run_id, to)
    return run


def resume_run(run: Run, user) -> Run:
    """A failed or cancelled run goes back to the queue and goes on from its last checkpoint."""
    check_owner(user, run)
    run.refresh_from_db(fields=["status", "checkpoint_path", "config"])
    resumable = (RunStatus.FAILED, RunStatus.CANCELLED)
    if run.status not in resumable:
        hint = "; continue it for more steps instead" if run.status == RunStatus.SUCCEEDED else ""
        raise InvalidTransition(f"run {run.pk} is {run.status}; only failed or cancelled runs can be resumed{hint}")
    return _requeue(run, resumable, f"resumed by its owner from {_checkpoint_name(run)}")


def continue_run(run: Run, user, steps: int) -> Run:
    """A succeeded run goes back to the queue to train `steps` more steps from its final checkpoint."""
    check_owner(user, run)
    if steps < 1:  # the API and the page check too; this is the one write path
        raise ServiceError(f"steps must be at least 1, got {steps}")
    run.refresh_from_db(fields=["status", "checkpoint_path", "config"])
    if run.status != RunStatus.SUCCEEDED:
        hint = "; resume it instead" if run.status in (RunStatus.FAILED, RunStatus.CANCELLED) else ""
        raise InvalidTransition(f"run {run.pk} is {run.status}; only succeeded runs can be continued{hint}")
    total = int(run.config.get("steps", 0)) + steps
    try:
        config = validate_run_config({**run.config, "steps": total})
    except ConfigError as exc:
        raise ServiceError(f"steps: {exc}") from exc
    return _requeue(run, (RunStatus.SUCCEEDED,), f"continued by its owner to {total} steps", config=config)


def _requeue(run: Run, from_statuses: tuple[str, ...], note: str, **fields) -> Run:
    if not run.checkpoint_path:
        raise InvalidTransition(f"run {run.pk} has no checkpoint to go on from (it stopped before saving one); "
                                "clone it to start again")
    with transaction.atomic():
        run = transition_run(run.pk, RunStatus.QUEUED, error="", expect=Q(status__in=from_statuses),
                             celery_task_id="", finished_at=None, **fields)
        emit_event(run.pk, events.RUN_LOG, {"line": note})
        transaction.on_commit(lambda: enqueue_run(run.pk))
    logger.info("run %s re-queued: %s", run.pk, note)
    return run


def _checkpoint_name(run: Run) -> str:
    return f"checkpoint {run.checkpoint_path.rstrip('/').rsplit('/', 1)[-1]}" if run.checkpoint_path else "nothing"


def lose_rollouts(run_id: int, which: Q, error: str) -> int:
    """Mark the run's rollouts matching `which` lost (cancelled and lost ones stay as they are).

    Their recorded calls stay for the inspector; their samples and training step are deleted: a lost rollout is not
    part of the policy the run goes on with, and a Sample row (or a batch_step, a trained_step) says it was trained
    on, or that its step's page lists it.
    """
    rollouts = Rollout.objects.filter(which, run_id=run_id).exclude(
        status__in=(RolloutStatus.CANCELLED, RolloutStatus.LOST))
    with transaction.atomic():
        ids = list(rollouts.values_list("pk", flat=True))
        for batch in batches(ids, STEP_BATCH):
            Sample.objects.filter(rollout_id__in=batch).delete()
            Rollout.objects.filter(pk__in=batch).update(
                status=RolloutStatus.LOST, finished_at=Coalesce(F("finished_at"), timezone.now()), batch_step=None,
                trained_step=None, drop_reason="")
            Rollout.objects.filter(pk__in=batch, error="").update(error=error[:10000])
    return len(ids)


def rewind_run(run_id: int, step: int, lost: Q, reason: str) -> dict[str, Any]:
    """Go back to the checkpoint of `step` before resuming from it.

    Rollouts matching `lost` (not trained into that checkpoint) become lost, and metrics and health alarms of later
    steps are deleted: the resumed run trains and evaluates those steps again, so no metric step is written twice.
    """
    with transaction.atomic():
        lose_rollouts(run_id, lost, reason)
        later = Metric.objects.filter(run_id=run_id, step__gt=step)
        dropped = sorted(set(later.values_list("step", flat=True)))
        later.delete()
        RunAlarm.objects.filter(run_id=run_id, step__gt=step).delete()  # the redone steps raise theirs again
        Run.objects.filter(pk=run_id).update(step=step, policy_version=step, updated_at=timezone.now())
        # All of the run's lost rollouts, those the sweep marked when the worker died included.
        lost_count = Rollout.objects.filter(run_id=run_id, status=RolloutStatus.LOST).count()
        payload = {"step": step, "lost_rollouts": lost_count, "dropped_steps": dropped}
        emit_event(run_id, events.RUN_RESUMED, payload)
    return payload


def record_metrics(run_id: int, step: int, values: dict[str, float]) -> None:
    """Store a step's metrics. A NaN or infinite value (a diverged loss) is not a number JSON or SQLite can hold:
    it is left out of the rows and named in the event's `non_finite`, so the run goes on and the page says so."""
    finite = {n: float(v) for n, v in values.items() if math.isfinite(float(v))}
    non_finite = sorted(set(values) - set(finite))
    if non_finite:
        logger.warning("run %s step %s: non-finite metrics left out: %s", run_id, step, ", ".join(non_finite))
    with transaction.atomic():
        Metric.objects.bulk_create([Metric(run_id=run_id, step=step, name=n, value=v) for n, v in finite.items()])
        payload = {"step": step, "values": finite}
        if non_finite:
            payload["non_finite"] = non_finite
        emit_event(run_id, events.RUN_METRICS, payload)


STEP_BATCH = 200  # rows per transaction in record_step and lose_rollouts: a few hundred keeps each lock short


def batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]
