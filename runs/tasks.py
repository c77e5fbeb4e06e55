"""Celery tasks: take ids, claim with a conditional update, call services."""
from __future__ import annotations

import logging

from celery import shared_task

from runs import services
from runs.models import Run, RunStatus

logger = logging.getLogger(__name__)

NOT_YET = ("run orchestration is not available in this build yet: the run was validated and claimed by a worker, "
           "but executing harnesses and training lands with the orchestration issue")


@shared_task(bind=True, name="runs.tasks.execute_run", acks_late=True)
def execute_run(self, run_id: int) -> str:
    """Claim a queued run and drive it through its states; returns the final status."""
    if not services.claim_run(run_id, self.request.id or ""):
        status = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
        logger.info("run %s not claimed (status %s)", run_id, status)
        return status or "missing"
    try:
        return _drive(run_id)
    except Exception as exc:
        logger.exception("run %s crashed", run_id)
        run = Run.objects.get(pk=run_id)
        if not run.is_finished:
            services.fail_run(run_id, f"{type(exc).__name__}: {exc}")
        return RunStatus.FAILED


def _drive(run_id: int) -> str:
    run = Run.objects.get(pk=run_id)
    if run.status == RunStatus.CANCELLING:
        services.transition_run(run_id, RunStatus.CANCELLED, error="cancelled while starting")
        return RunStatus.CANCELLED
    services.fail_run(run_id, NOT_YET)
    return RunStatus.FAILED
