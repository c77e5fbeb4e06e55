"""Celery tasks: take ids, claim with a conditional update, call services and the orchestrator."""
from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

from celery import shared_task
from django.conf import settings
from django.db import transaction

# check_tasks is imported so the workers (which load `tasks` modules only) know run_harness_check, worker_control
# so they answer the host_profile inspect command
from common import errors as common_errors
from runs import check_tasks, durability, orchestrator, pools, reconnect, rollout_services, services, worker_control  # noqa: F401
from runs.models import Run, RunStatus

logger = logging.getLogger(__name__)


@shared_task(bind=True, name="runs.tasks.execute_run", acks_late=True)
def execute_run(self, run_id: int) -> str:
    """Claim a queued run and drive it to its end on a free device set of this worker (runs.pools), beating for it
    meanwhile; returns the final status."""
    queue = (self.request.delivery_info or {}).get("routing_key")
    with pools.device_set(self.request.hostname or "", run_id) as devices:
        return _execute_run(run_id, self.request.id or "", pools.worker_note(devices, queue))


def _execute_run(run_id: int, task_id: str, worker: dict) -> str:
    generation = services.claim_run(run_id, task_id, worker)
    if not generation:
        status = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
        logger.info("run %s not claimed (status %s)", run_id, status)
        return status or "missing"
    if Run.objects.filter(pk=run_id, status=RunStatus.CANCELLING).exists():
        services.transition_run(run_id, RunStatus.CANCELLED, error="cancelled while starting")
        return RunStatus.CANCELLED
    with durability.Heartbeat(run_id, generation):
        try:
            return orchestrator.execute(run_id, generation)
        except orchestrator.RunSetupError as exc:
            logger.warning("run %s cannot start: %s", run_id, exc)
            return _fail(run_id, generation, str(exc))
        except (KeyboardInterrupt, SystemExit, GeneratorExit):  # the worker's own shutdown: the sweep resumes the run
            raise
        except BaseException as exc:  # also a library's BaseException (torch's CheckpointException was one), which
            logger.exception("run %s crashed", run_id)  # would otherwise take the whole Celery worker down
            return _fail(run_id, generation, crash_reason(exc, Path(settings.LIGHTNING_RUNS_DIR)))


@shared_task(name="runs.tasks.sweep_lost_runs")
def sweep_lost_runs() -> dict[str, str]:
    """Celery beat runs this every LIGHTNING_SWEEP_EVERY_S: reclaim runs whose worker stopped beating, and hand
    queued runs whose queue message never left (the broker was down) to the queue again."""
    swept = {str(run_id): status for run_id, status in durability.sweep_lost_runs().items()}
    for run_id in durability.requeue_unsent():
        swept.setdefault(str(run_id), "queued (handed to the queue again)")
    return swept


DISK_FULL_BELOW = 16 << 20
"""Free bytes under which the runs' disk counts as full when a run crashes."""


def crash_reason(exc: BaseException, runs_dir: Path) -> str:
    """The error a crashed run gets: the exception, led by a plain "no space left" when the disk was the cause.

    A full disk surfaces as anything (the engine dying mid-reload, a harness that cannot write its task file, a
    checkpoint cut short), so the exception chain and the disk itself are both asked."""
    message = f"{type(exc).__name__}: {exc}"
    try:
        free = shutil.disk_usage(runs_dir).free
    except OSError:
        free = None
    if _chain_has_enospc(exc) or (free is not None and free < DISK_FULL_BELOW):
        room = "" if free is None else f" ({free / 2**20:.1f} MiB free)"
        return (f"No space left on device: the disk of {runs_dir} is full{room}; free some space, then resume "
                f"the run (it goes on from its last checkpoint). {message}")
    return message


def _chain_has_enospc(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _fail(run_id: int, generation: int, message: str) -> str:
    """Fail the run and close its unfinished rollouts, unless this worker no longer holds it."""
    def fail() -> None:
        with transaction.atomic():
            services.fail_run(run_id, message, generation=generation)
            rollout_services.cancel_unfinished_rollouts(run_id, f"run failed: {message[:200]}")

    try:  # this thread's connection may have died with a PostgreSQL restart during the run
        reconnect.call_with_reconnect(fail)
    except common_errors.InvalidTransition as exc:
        logger.warning("run %s: failure not recorded: %s", run_id, exc)
        return Run.objects.filter(pk=run_id).values_list("status", flat=True).first() or "missing"
    return RunStatus.FAILED

