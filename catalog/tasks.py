"""Celery tasks of the catalog: model imports; reward_tests is imported so the workers (which load `tasks` modules
only) know run_reward_test."""
from __future__ import annotations

from celery import shared_task

from catalog import model_imports, reward_tests  # noqa: F401


@shared_task(name="catalog.tasks.import_model", acks_late=True)
def import_model(name: str, import_id: str) -> str:
    """Build or import a registry model the dashboard asked for (catalog.model_imports); returns its final state."""
    return model_imports.run_import(name, import_id).get("state", "missing")
