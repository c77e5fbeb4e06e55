"""Evaluation of the served policy on the run's val tasks: k sampled attempts and a greedy one per task (eval/*)."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from catalog.models import Task
from runs import services
from runs.harness_source import HarnessSource
from runs.models import Run
from runs.reconnect import db  # the run's ORM calls outlive a PostgreSQL restart
from trainer import scheduler
from trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

PHASE_EVERY_S = 2.0
"""Seconds between two progress writes: an evaluation is hundreds of attempts, each would be a write and an event."""


@dataclass(frozen=True)
class EvalAttempt:
    """One finished evaluation attempt, as the metrics see it."""

    task: int  # index of the val task in this evaluation
    greedy: bool
    reward: float
    failure_kind: str = ""  # as scheduler.RolloutResult: '', 'policy' or 'infra'

    def passed(self, threshold: float) -> bool:
        """A pass: finished without failure and rewarded at least `threshold` (policy failures never pass)."""
        return not self.failure_kind and self.reward >= threshold


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k attempts passes, from n attempts of which c passed (unbiased; needs n >= k).

    The estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k); with n == k it is 1 if any attempt passed.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(attempts: Sequence[EvalAttempt], samples: int, threshold: float) -> dict[str, float]:
    """eval/* metrics of one evaluation: every task weighs the same, whatever it lost to infrastructure.

    - eval/pass@1: mean over tasks of the fraction of its sampled attempts that passed;
    - eval/pass@k: mean over tasks of pass_at_k(n, c, k=samples), over the tasks whose k attempts all count
      (n == k, so the fraction of tasks with at least one pass); a task that lost an attempt is left out;
    - eval/pass@1_greedy: fraction of tasks whose greedy attempt passed (only when there were greedy attempts);
    - eval/reward_mean: mean over tasks of the mean reward of its sampled attempts;
    - eval/tasks: tasks evaluated; eval/infra_failures: attempts (greedy included) left out as infrastructure
      failures, which say nothing about the policy.

    A rate with nothing to average over (every attempt lost) is left out rather than written as 0, which
    would read as a collapse of the policy.
    """
    counted = [a for a in attempts if a.failure_kind != scheduler.INFRA_FAILURE]
    sampled: dict[int, list[EvalAttempt]] = {}
    for a in counted:
        if not a.greedy:
            sampled.setdefault(a.task, []).append(a)
    greedy = [a for a in counted if a.greedy]
    metrics = {"eval/tasks": float(len({a.task for a in attempts})),
               "eval/infra_failures": float(len(attempts) - len(counted))}
    if sampled:
        metrics["eval/pass@1"] = _mean([_mean([a.passed(threshold) for a in tries]) for tries in sampled.values()])
        metrics["eval/reward_mean"] = _mean([_mean([a.reward for a in tries]) for tries in sampled.values()])
    whole = [tries for tries in sampled.values() if len(tries) >= samples]
    if whole:
        metrics["eval/pass@k"] = _mean([pass_at_k(len(tries), sum(a.passed(threshold) for a in tries), samples)
                                        for tries in whole])
    if greedy:
        metrics["eval/pass@1_greedy"] = _mean([a.passed(threshold) for a in greedy])
    return metrics


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class Progress:
    """Writes 'evaluating step N: done/total' as the run's phase: at the start, at the end, and between at most
    every `every_s` seconds of `clock`."""

    def __init__(self, run_id: int, step: int, total: int, every_s: float = PHASE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.run_id, self.step, self.total, self.every_s, self.clock = run_id, step, total, every_s, clock
        self.done, self.last = 0, -math.inf

    async def advance(self, count: int = 0) -> None:
        """`count` more attempts finished; the phase is written if the last write is old enough or all are done."""
        self.done += count
        now = self.clock()
        if self.done < self.total and now - self.last < self.every_s:
            return
        self.last = now
        await db(services.set_run_phase)(self.run_id, f"evaluating step {self.step}: {self.done}/{self.total}",
                                         self.done / self.total if self.total else 1.0)


class Evaluator:
    """eval/* on the first `eval_tasks` val tasks at the policy the engine serves: `eval_samples` attempts per
    task at the run's sampling and, with `eval_greedy`, one more at temperature 0.

    Each attempt is a Rollout row (split 'val', step, group = the task's index in the evaluation, attempt = the
    sample's index, the greedy one last with greedy=True): the per-task, per-attempt record behind
    selectors.validation_grid. Attempts run `eval_concurrency` at a time, outside the scheduler's queue, so a
    training step never sees them.
    """

    def __init__(self, run: Run, config: TrainerConfig, source: HarnessSource,
                 clock: Callable[[], float] = time.monotonic):
        self.run, self.config, self.source, self.clock = run, config, source, clock

    def due(self, step: int, force: bool = False) -> bool:
        every = self.config.eval_every
        return self.config.eval_tasks > 0 and (force or bool(every and step % every == 0))

    async def maybe(self, step: int, force: bool = False) -> dict[str, float] | None:
        """Evaluate if step `step` is due (or `force`); returns the metrics it recorded, None if it did not run."""
        if not self.due(step, force):
            return None
        tasks = await db(lambda: list(Task.objects.filter(dataset_id=self.run.dataset_id, split="val")
                                      .order_by("index")[: self.config.eval_tasks]))()
        if not tasks:
            return None
        started = time.perf_counter()
        c = self.config
        # Task-major order: a task's attempts run side by side, so the engine's prefix cache shares their prompt.
        plan = [(i, task, attempt, attempt == c.eval_samples) for i, task in enumerate(tasks)
                for attempt in range(c.eval_samples + int(c.eval_greedy))]
        progress = Progress(self.run.pk, step, len(plan), clock=self.clock)
        await progress.advance()
        limit = asyncio.Semaphore(c.eval_concurrency)

        async def one(index: int, task: Task, attempt: int, greedy: bool) -> EvalAttempt:
            async with limit:
                result = await self._attempt(task, step, index, attempt, greedy)
            await progress.advance(1)
            return EvalAttempt(index, greedy, result.reward, result.failure_kind)

        attempts = await asyncio.gather(*(one(*item) for item in plan))
        metrics = eval_metrics(attempts, c.eval_samples, c.pass_threshold)
        metrics["eval/seconds"] = time.perf_counter() - started
        await db(services.record_metrics)(self.run.pk, step, metrics)
        return metrics

    async def _attempt(self, task: Task, step: int, index: int, attempt: int, greedy: bool) -> scheduler.RolloutResult:
        """One attempt; one that crashed counts as an infrastructure failure instead of ending the evaluation."""
        try:
            return await self.source.attempt(task, "val", step, index, attempt, greedy=greedy)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("run %s step %s: evaluation attempt %s of val task %s crashed", self.run.pk, step,
                             attempt, task.pk)
            return scheduler.RolloutResult(index, "", (), 0.0, failure_kind=scheduler.INFRA_FAILURE,
                                           error=f"{type(exc).__name__}: {exc}")
