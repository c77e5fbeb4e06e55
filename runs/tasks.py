"""Celery tasks: take ids, claim with a conditional update, call services and the orchestrator."""
from __future__ import annotations

import logging

from celery import shared_task

from runs import orchestrator, services
from runs.models import Run, RunStatus

logger = logging.getLogger(__name__)


@shared_task(bind=True, name="runs.tasks.execute_run", acks_late=True)
def execute_run(self, run_id: int) -> str:
    """Claim a queued run and drive it to its end; returns the final status."""
    if not services.claim_run(run_id, self.request.id or ""):
        status = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
        logger.info("run %s not claimed (status %s)", run_id, status)
        return status or "missing"
    if Run.objects.filter(pk=run_id, status=RunStatus.CANCELLING).exists():
        services.transition_run(run_id, RunStatus.CANCELLED, error="cancelled while starting")
        return RunStatus.CANCELLED
    try:
        return orchestrator.execute(run_id)
    except orchestrator.RunSetupError as exc:
        logger.warning("run %s cannot start: %s", run_id, exc)
        return _fail(run_id, str(exc))
    except Exception as exc:
        logger.exception("run %s crashed", run_id)
        return _fail(run_id, f"{type(exc).__name__}: {exc}")


def _fail(run_id: int, message: str) -> str:
    services.cancel_unfinished_rollouts(run_id, f"run failed: {message[:200]}")
    run = Run.objects.get(pk=run_id)
    if not run.is_finished:
        services.fail_run(run_id, message)
    return RunStatus.FAILED
