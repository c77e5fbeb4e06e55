"""A worker's watch on the run it drives: its owner's cancel, a finish now, and the run taken from it (lost)."""
from __future__ import annotations

import asyncio

from runs import services
from runs.models import Run, RunStatus
from runs.reconnect import db  # the run's ORM calls outlive a PostgreSQL restart

CANCEL, LOST = "cancel", "lost"
POLL_S = 0.5


class Finish:
    """The step a run ends at, lowered while it trains when its owner asks it to finish now (services.finish_run
    writes a smaller `steps` in its config; `watch` reads it up to POLL_S later): the scheduler stops after that
    step, and the run evaluates, checkpoints and succeeds as if that had been its step count, whatever phase of the
    step the request came in (trainer.scheduler checkpoints a final step whose own turn was not its last)."""

    def __init__(self) -> None:
        self.steps: int | None = None

    def last_step(self, configured: int) -> int:
        return configured if self.steps is None else min(configured, self.steps)


async def watch(run_id: int, generation: int, training: asyncio.Task, finish: Finish | None = None) -> str | None:
    """Stop the run's work when its owner cancels it (CANCEL) or this worker no longer holds it (LOST: the sweep
    took it for lost, another worker resumed it); hand a smaller step count (finish now) to `finish`."""
    while not training.done():
        status, starts, steps = await db(lambda: Run.objects.values_list(
            "status", "worker_starts", "config__steps").get(pk=run_id))()
        if finish is not None and isinstance(steps, int):
            finish.steps = steps
        reason = LOST if starts != generation or status not in services.HELD else (
            CANCEL if status == RunStatus.CANCELLING else None)
        if reason is not None:
            training.cancel()
            return reason
        await asyncio.sleep(POLL_S)
    return None
