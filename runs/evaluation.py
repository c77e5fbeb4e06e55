"""Evaluation of the served policy on the run's val tasks (eval/* metrics)."""
from __future__ import annotations

import asyncio

from asgiref.sync import sync_to_async

from runs import services
from runs.harness_source import HarnessSource
from runs.models import Run, Task
from trainer import scheduler
from trainer.config import TrainerConfig

db = sync_to_async


class Evaluator:
    """eval/pass@1 on the first `eval_tasks` val tasks, one attempt each, at the policy the engine serves."""

    def __init__(self, run: Run, config: TrainerConfig, source: HarnessSource):
        self.run, self.config, self.source = run, config, source

    async def maybe(self, step: int, force: bool = False) -> None:
        every = self.config.eval_every
        if self.config.eval_tasks == 0 or not (force or (every and step % every == 0)):
            return
        tasks = await db(lambda: list(Task.objects.filter(dataset_id=self.run.dataset_id, split="val")
                                      .order_by("index")[: self.config.eval_tasks]))()
        if not tasks:
            return
        limit = asyncio.Semaphore(max(1, self.config.tasks_per_step * self.config.group_size))

        async def one(index, task):
            async with limit:
                return await self.source.attempt(task, "val", step, index, 0)

        results = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
        # An infrastructure failure says nothing about the policy: it leaves the denominator too.
        counted = [r for r in results if r.failure_kind != scheduler.INFRA_FAILURE]
        passed = [float(r.reward >= self.config.pass_threshold and not r.failed) for r in counted]
        n = max(len(counted), 1)
        await db(services.record_metrics)(self.run.pk, step, {
            "eval/pass@1": sum(passed) / n, "eval/reward_mean": sum(r.reward for r in counted) / n,
            "eval/tasks": float(len(results)), "eval/infra_failures": float(len(results) - len(counted))})
