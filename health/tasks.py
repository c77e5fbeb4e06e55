"""Celery tasks of run health: re-scoring a run's stored rollouts (health.rescoring)."""
from __future__ import annotations

from celery import shared_task

from health import rescoring


@shared_task(name=rescoring.RESCORE_TASK, acks_late=True)
def rescore(rescore_id: int) -> str:
    return rescoring.run_rescore(rescore_id)
