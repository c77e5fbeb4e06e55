"""Runs that outlive their worker: the heartbeat, the sweep that reclaims lost runs, and resuming from a checkpoint.

A worker that claims a run gets a generation (Run.worker_starts) and beats for it from a thread of its own. The
sweep (a Celery beat task) takes a run in starting, running or cancelling whose beat is older than
LIGHTNING_RUN_LOST_AFTER_S for lost: a cancelling one becomes cancelled, one with a checkpoint goes back to the
queue, any other fails with "worker lost". The worker that claims a re-queued run rewinds it to its checkpoint
(`prepare_resume`), loads the checkpoint and has the engine serve its weights (`restore`) before going on.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import close_old_connections, connection
from django.db.models import Max, Q
from django.utils import timezone

from catalog.models import Split
from common import errors as common_errors
from runs import selectors, services
from runs.models import RolloutStatus, Run, RunStatus
from trainer.scheduler import read_counters

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- heartbeat


class Heartbeat:
    """Writes Run.heartbeat_at every LIGHTNING_HEARTBEAT_EVERY_S from its own thread while the block runs.

    A thread, not a task on the run's event loop: a loop busy for a minute (a long CPU-bound call) must not make
    a live run look lost. It stops beating once the run is no longer held by this generation (finished, or
    reclaimed by the sweep); the orchestrator's watcher then stops the run's work in this worker.
    """

    def __init__(self, run_id: int, generation: int, every_s: float | None = None):
        self.run_id, self.generation = run_id, generation
        self.every_s = every_s or settings.LIGHTNING_HEARTBEAT_EVERY_S
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-run-{run_id}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        try:
            while not self._stop.wait(self.every_s):
                try:
                    held = services.beat_run(self.run_id, self.generation)
                except Exception:  # a database hiccup: the next beat tries again, well within the lost limit
                    logger.warning("run %s: heartbeat not written", self.run_id, exc_info=True)
                    close_old_connections()
                    continue
                if not held:
                    logger.info("run %s: generation %s no longer holds the run; heartbeat stops", self.run_id,
                                self.generation)
                    return
        finally:
            connection.close()  # this thread's own connection


# ---------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class Verdict:
    """What the sweep does with a lost run: its next status and the error it gets."""

    status: str
    error: str


def judge(status: str, has_checkpoint: bool, worker_starts: int, silent_s: float, max_starts: int) -> Verdict:
    """The sweep's decision for a run whose worker stopped beating `silent_s` seconds ago."""
    lost = f"worker lost: no heartbeat for {silent_s:.0f} s"
    if status == RunStatus.CANCELLING:
        return Verdict(RunStatus.CANCELLED, f"cancelled by its owner; {lost} before it stopped")
    if not has_checkpoint:
        return Verdict(RunStatus.FAILED, f"{lost}; it had no checkpoint to resume from")
    if worker_starts >= max_starts:
        return Verdict(RunStatus.FAILED, f"{lost}, after {worker_starts} worker starts "
                                         f"(LIGHTNING_RUN_MAX_WORKER_STARTS={max_starts}); fix the cause "
                                         "(out of memory?) and resume it by hand")
    return Verdict(RunStatus.QUEUED, "")


def _stale(cutoff: datetime) -> Q:
    # Runs claimed before heartbeats existed have none: their last update stands in.
    return Q(heartbeat_at__lt=cutoff) | Q(heartbeat_at__isnull=True, updated_at__lt=cutoff)


def sweep_lost_runs(now: datetime | None = None) -> dict[int, str]:
    """Reclaim every held run whose heartbeat is older than LIGHTNING_RUN_LOST_AFTER_S; returns {run id: status}."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.LIGHTNING_RUN_LOST_AFTER_S)
    done: dict[int, str] = {}
    for run in Run.objects.filter(_stale(cutoff), status__in=services.HELD).order_by("pk"):
        silent_s = (now - (run.heartbeat_at or run.updated_at)).total_seconds()
        verdict = judge(run.status, bool(run.checkpoint_path), run.worker_starts, silent_s,
                        settings.LIGHTNING_RUN_MAX_WORKER_STARTS)
        still_lost = _stale(cutoff) & Q(status=run.status, worker_starts=run.worker_starts)
        try:
            services.reclaim_lost_run(run.pk, verdict.status, error=verdict.error, still_lost=still_lost)
        except common_errors.InvalidTransition as exc:
            logger.debug("run %s not reclaimed: %s", run.pk, exc)  # it beat or moved on since the query
            continue
        logger.warning("run %s (%s, worker start %d): no heartbeat for %.0f s; now %s", run.pk, run.status,
                       run.worker_starts, silent_s, verdict.status)
        done[run.pk] = verdict.status
    return done


UNSENT_AFTER_S = 30
"""A queued run with no Celery task id this long after its last change never reached the queue (enqueue_run sets the
id right after the broker takes the message)."""


def requeue_unsent(now: datetime | None = None) -> list[int]:
    """Hand every queued run whose message never reached the broker to its queue again; returns the ids sent."""
    cutoff = (now or timezone.now()) - timedelta(seconds=UNSENT_AFTER_S)
    sent = []
    for run_id in Run.objects.filter(status=RunStatus.QUEUED, celery_task_id="", updated_at__lt=cutoff).order_by(
            "pk").values_list("pk", flat=True):
        if services.enqueue_run(run_id):
            logger.warning("run %s was queued with no message on the broker; handed to the queue again", run_id)
            sent.append(run_id)
    return sent


# ---------------------------------------------------------------- resuming


@dataclass(frozen=True)
class ResumePoint:
    """Where a re-queued run goes on from."""

    checkpoint: Path
    step: int
    next_group_id: int
    """The scheduler's first group id, from the checkpoint's counters: group ids (and the tasks they pick) go on
    as in an uninterrupted run."""
    lost_rollouts: int
    """The run's lost rollouts in all (by the sweep, and by the rewind)."""
    dropped_steps: tuple[int, ...]
    """Steps recorded after the checkpoint, dropped to be redone."""


def prepare_resume(run: Run, checkpoint: Path, step: int) -> ResumePoint:
    """Rewind the run's rows to the checkpoint of `step` (in `checkpoint`) before the worker resumes from it.

    Lost: train rollouts of groups the checkpoint had not trained (admitted later, or still in flight when it
    was saved), evaluation rollouts of later steps, and whatever was left unfinished. Metrics of later steps are
    dropped; the resumed run records them again. Checkpoint folders of later steps belong to the abandoned
    trajectory and are deleted.
    """
    counters = read_counters(checkpoint)
    if counters is None:  # written before counters were saved: every finished group was trained
        last = run.rollouts.filter(split=Split.TRAIN).aggregate(last=Max("group"))["last"]
        counters = {"next_group_id": 0 if last is None else last + 1, "untrained_groups": []}
    untrained = Q(group__gte=counters["next_group_id"]) | Q(group__in=counters["untrained_groups"])
    lost = (Q(split=Split.TRAIN) & untrained) | Q(split=Split.VAL, step__gt=step) | \
        Q(status__in=(RolloutStatus.PENDING, RolloutStatus.RUNNING))
    rewound = services.rewind_run(run.pk, step, lost, f"lost: the run resumed from the checkpoint of step {step}, "
                                                      "which this rollout is not part of")
    _delete_later_checkpoints(checkpoint.parent, step)
    return ResumePoint(checkpoint, step, first_group_id(counters), rewound["lost_rollouts"],
                       tuple(rewound["dropped_steps"]))


def first_group_id(counters: dict) -> int:
    """The group id a resumed scheduler starts from.

    The scheduler admits the next step's groups before it saves a checkpoint (their harnesses start while the
    weights swap), so in sync mode the untrained groups are the last ids issued: they are launched again under
    the same ids, picking the same tasks. Untrained groups scattered among trained ones (async mode) are skipped.
    """
    nxt, untrained = int(counters["next_group_id"]), sorted(counters["untrained_groups"])
    return untrained[0] if untrained and untrained == list(range(untrained[0], nxt)) else nxt


async def restore(policy, engine, point: ResumePoint) -> None:
    """Load the checkpoint into the policy (weights, optimizer, RNG, step) and serve its weights as its version.

    The engine restarted on the registry's weights; one weight update, the same path as every step's sync (so a
    tied head is written untied, see trainer.engine.sync.untie), makes it serve the checkpoint's before any call.
    """
    await asyncio.to_thread(policy.load_checkpoint, point.checkpoint)
    if policy.step != point.step:
        raise RuntimeError(f"checkpoint {point.checkpoint} holds step {policy.step}, the run recorded {point.step}")
    await engine.pause()
    try:
        await engine.update_weights(policy.model, policy.version)
    finally:
        await engine.resume()


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint folder named step-NNNNNN."""
    name = Path(path).name
    if not name.startswith("step-") or not name[5:].isdigit():
        raise ValueError(f"{path} is not a checkpoint folder (step-NNNNNN)")
    return int(name[5:])


def prune_checkpoints(folder: Path, keep: int | None = None) -> list[Path]:
    """Delete all but the newest `keep` (LIGHTNING_CHECKPOINTS_KEPT) complete checkpoints, never one that another
    run uses as its model (it loads it at every start, resume or continue); returns the deleted.

    A SmolLM2-135M checkpoint is about 1.6 GB (weights and AdamW state): a long run must not fill the disk.
    """
    keep = keep or settings.LIGHTNING_CHECKPOINTS_KEPT
    complete = sorted(_checkpoints(folder), key=checkpoint_step)
    in_use = set(selectors.runs_with_models_in(folder).values_list("model_info__path", flat=True))
    doomed = [path for path in complete[:-keep] if os.path.realpath(path) not in in_use]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _checkpoints(folder: Path) -> list[Path]:
    return [p for p in folder.glob("step-*") if p.is_dir() and p.name[5:].isdigit()] if folder.is_dir() else []


def _delete_later_checkpoints(folder: Path, step: int) -> None:
    for path in _checkpoints(folder):
        if checkpoint_step(path) > step:
            shutil.rmtree(path, ignore_errors=True)
    for path in folder.glob("step-*.partial"):
        shutil.rmtree(path, ignore_errors=True)
