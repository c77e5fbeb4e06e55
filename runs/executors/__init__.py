"""Harness executors: one interface (run an Attempt, return an Outcome) and the factory that picks the executor a
harness snapshot names, so the orchestrator never knows which one runs."""
from __future__ import annotations

from typing import Any, Protocol

from runs.executor import PLACEHOLDERS, Attempt, LocalExecutor, Outcome

__all__ = ["KINDS", "PLACEHOLDERS", "Attempt", "Executor", "ExecutorSetupError", "LocalExecutor", "Outcome",
           "for_harness"]

KINDS = ("local", "kubernetes")
"""The executors a harness may name (runs.models.Executor)."""


class ExecutorSetupError(Exception):
    """The executor a harness names cannot run here: unknown, or its cluster or proxy address is not set up. The
    message names the fix."""


class Executor(Protocol):
    async def run(self, attempt: Attempt) -> Outcome:
        """Run one harness attempt to its end and say how it went. Cancelling it stops the harness."""
        ...


def for_harness(snapshot: dict[str, Any]) -> Executor:
    """The executor for a harness (its run's frozen snapshot); ExecutorSetupError where it cannot run here."""
    kind = snapshot.get("executor") or "local"
    if kind == "local":
        return LocalExecutor()
    if kind == "kubernetes":
        from runs.executors.kubernetes import KubernetesExecutor

        return KubernetesExecutor(image=snapshot.get("image") or "", resources=snapshot.get("resources") or {})
    raise ExecutorSetupError(f"harness executor {kind!r} is unknown; known: {', '.join(KINDS)}")
