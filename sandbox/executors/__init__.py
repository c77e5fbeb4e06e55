"""Harness executors: one interface (run an Attempt, return an Outcome) and the factory that picks the executor a
harness snapshot names, so the orchestrator never knows which one runs."""
from __future__ import annotations

from typing import Any

from sandbox.executors.base import KINDS, PLACEHOLDERS, Attempt, Executor, ExecutorSetupError, Outcome
from sandbox.executors.local import LocalExecutor

__all__ = ["KINDS", "PLACEHOLDERS", "Attempt", "Executor", "ExecutorSetupError", "LocalExecutor", "Outcome",
           "for_harness"]


def for_harness(snapshot: dict[str, Any]) -> Executor:
    """The executor for a harness (its run's frozen snapshot); ExecutorSetupError where it cannot run here."""
    kind = snapshot.get("executor") or "local"
    if kind == "local":
        return LocalExecutor()
    if kind == "kubernetes":
        from sandbox.executors.kubernetes import KubernetesExecutor

        return KubernetesExecutor(image=snapshot.get("image") or "", resources=snapshot.get("resources") or {})
    raise ExecutorSetupError(f"harness executor {kind!r} is unknown; known: {', '.join(KINDS)}")
