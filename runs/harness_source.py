"""The scheduler's RolloutSource for real runs: harness subprocesses behind the proxy, scored by the reward sandbox,
and the rules that say whether a finished attempt failed and why."""
from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

from django.conf import settings

from catalog import services
from catalog.models import Task
from health import services as health_services
from proxy.server import ProxyServer
from runs import disk, rollout_services
from runs.models import ModelCall, RolloutStatus, Run
from runs.reconnect import db  # the run's ORM calls outlive a PostgreSQL restart
from sandbox.executors import for_harness
from sandbox.executors.base import Attempt
from trainer import scheduler
from trainer.config import TrainerConfig
from trainer.samples import CallRecord

logger = logging.getLogger(__name__)


class HarnessSource:
    """The scheduler's RolloutSource: real harness subprocesses behind the proxy, scored by the reward sandbox."""

    def __init__(self, run: Run, config: TrainerConfig, server: ProxyServer, workdir: Path, train_ids: list[int]):
        self.run, self.config, self.server, self.workdir = run, config, server, workdir
        self.train_ids, self.executor = train_ids, for_harness(run.harness_snapshot)
        self.finished: asyncio.Queue = asyncio.Queue()
        self.running: dict[int, list[asyncio.Task]] = {}
        # At most this many harness processes of the worker's run at once (training and evaluation attempts alike):
        # an attempt waits for a slot before its rollout starts.
        self.slots = asyncio.Semaphore(settings.LIGHTNING_WORKER_MAX_HARNESSES)
        self.harnesses_running = self.harnesses_peak = 0
        self.policy_version = 0
        self.scoring = BusyTime()  # train rollouts' reward scoring, for the step's time/score
        self.stop_reason = ""  # set when the engine died: attempts cancelled from then on fail (infra) with it

    async def launch(self, group: scheduler.GroupRequest) -> None:
        task_id = random.Random(self.config.seed * 1_000_003 + group.group_id).choice(self.train_ids)
        task = await db(Task.objects.get)(pk=task_id)
        attempts = []
        for attempt in range(group.size):
            coro = self.attempt(task, "train", group.policy_version, group.group_id, attempt)
            attempts.append(asyncio.create_task(self._report(group.group_id, coro)))
        self.running[group.group_id] = attempts

    @property
    def score_seconds(self) -> float:
        """Wall seconds with at least one train rollout being scored (the scheduler's time/score)."""
        return self.scoring.seconds

    async def next_finished(self) -> scheduler.RolloutResult:
        return await self.finished.get()

    async def cancel(self, group_id: int) -> None:
        for task in self.running.pop(group_id, []):
            task.cancel()

    async def _report(self, group_id: int, coro) -> None:
        """Every launched attempt reports, even one that crashed, or its group would never complete."""
        try:
            result = await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("run %s group %s: an attempt crashed", self.run.pk, group_id)
            result = scheduler.RolloutResult(group_id, "", (), 0.0, failure_kind=scheduler.INFRA_FAILURE,
                                             error=f"{type(exc).__name__}: {exc}")
        self.finished.put_nowait(result)

    async def attempt(self, task: Task, split: str, version: int, group: int, attempt: int,
                      greedy: bool = False) -> scheduler.RolloutResult:
        """One harness run: a rollout row and key, the subprocess, the reward, the recorded calls.

        `greedy`: an evaluation attempt the proxy serves at temperature 0. It waits for one of the worker's
        LIGHTNING_WORKER_MAX_HARNESSES slots first."""
        async with self.slots:
            self.harnesses_running += 1
            self.harnesses_peak = max(self.harnesses_peak, self.harnesses_running)
            try:
                return await self._slotted(task, split, version, group, attempt, greedy)
            finally:
                self.harnesses_running -= 1

    async def _slotted(self, task: Task, split: str, version: int, group: int, attempt: int,
                       greedy: bool) -> scheduler.RolloutResult:
        rollout, secret = await db(rollout_services.create_rollout)(
            self.run, task=task, split=split, step=version, group=group, attempt=attempt, greedy=greedy,
            policy_version=version)  # self.run is as the worker loaded it: its own version is the start's
        await db(rollout_services.start_rollout)(rollout.pk)
        workdir = self.workdir / "rollouts" / str(rollout.pk)
        try:
            result = await self._attempt(task, split, version, group, rollout, secret, workdir)
        except asyncio.CancelledError:
            if not self.stop_reason:  # cancelled with its run: nothing to debug (an engine death is kept)
                disk.remove(workdir)
            raise
        # Recorded: its workdir goes, but for a failed one (kept for debugging, within the run's limits).
        await asyncio.to_thread(disk.reclaim_workdir, workdir, bool(result.failure_kind))
        return result

    async def _attempt(self, task: Task, split: str, version: int, group: int, rollout, secret: str,
                       workdir: Path) -> scheduler.RolloutResult:
        harness = self.run.harness_snapshot
        try:
            out = await self.executor.run(Attempt(
                command=harness["command"], env=harness.get("env") or {}, timeout_s=harness["timeout_s"],
                workdir=workdir, task_id=task.external_id,
                task=self.run.harness_task(task.data),
                rollout_id=str(rollout.pk), base_url=self.server.base_url(str(rollout.pk)), api_key=secret,
                read_only=tuple((harness.get("resources") or {}).get("read_only") or ()),
                run_id=str(self.run.pk), step=version))
        except asyncio.CancelledError:
            if self.stop_reason:  # cut off by the engine's death, not by its owner
                await db(rollout_services.finish_rollout)(
                    rollout.pk, status=RolloutStatus.FAILED, reward=None, reward_detail={}, exit_code=None,
                    error=self.stop_reason, failure_kind=scheduler.INFRA_FAILURE)
            else:
                await db(rollout_services.finish_rollout)(
                    rollout.pk, status=RolloutStatus.CANCELLED, reward=None, reward_detail={}, exit_code=None,
                    error="cancelled with its run")
            raise
        unstored = await asyncio.to_thread(self.server.settled, str(rollout.pk), settings.LIGHTNING_RECORD_DEADLINE_S)
        if unstored:  # the database refused some of its calls so far: its trajectory has holes
            error = (f"{unstored} of its calls were answered but not stored within "
                     f"{settings.LIGHTNING_RECORD_DEADLINE_S:g} s (the database refused them; the proxy keeps "
                     "retrying): a trajectory with holes is never trained")
            await db(rollout_services.finish_rollout)(
                rollout.pk, status=RolloutStatus.FAILED, reward=None, reward_detail={}, exit_code=out.exit_code,
                stdout_tail=out.stdout_tail, stderr_tail=out.stderr_tail, error=error,
                failure_kind=scheduler.INFRA_FAILURE)
            return scheduler.RolloutResult(group, str(rollout.pk), (), 0.0, failure_kind=scheduler.INFRA_FAILURE,
                                           error=error)
        # Every call the proxy answered or refused is stored: the calls read now are the whole trajectory.
        calls, trouble = await db(calls_of)(rollout.pk)
        with self.scoring.track() if split == "train" else nullcontext():
            reward, detail, reward_error = await self._score(task, out)
        kind, error = failure_of(out, reward_error, calls, trouble, detail.get("reward_kind", ""))
        if kind == scheduler.POLICY_FAILURE:
            detail = {**detail, "script_reward": reward}
            reward = self.config.failure_reward
        flags = await db(health_services.rollout_flags)(rollout.pk, task.data, out.outcome,
                                                        f"{out.stdout_tail}\n{out.stderr_tail}")
        await db(rollout_services.finish_rollout)(
            rollout.pk, status=RolloutStatus.FAILED if kind else RolloutStatus.SUCCEEDED, reward=reward,
            reward_detail=detail, exit_code=out.exit_code, stdout_tail=out.stdout_tail, stderr_tail=out.stderr_tail,
            error=error, failure_kind=kind, outcome=out.outcome, flags=flags)
        return scheduler.RolloutResult(group, str(rollout.pk), calls, reward or 0.0, failure_kind=kind, error=error)

    async def _score(self, task: Task, out) -> tuple[float | None, dict, str]:
        """The reward script's reward and detail, or the reason there is none."""
        if out.error and out.exit_code is None:
            return None, {}, ""  # the harness never ran: nothing to score
        script = self.run.reward_snapshot
        result = await asyncio.to_thread(services.score_reward, script["source"], task.data, out.outcome,
                                         script["timeout_s"])
        if not result.ok:
            return None, {"reward_error": result.error, "reward_output": result.output, "reward_kind": result.kind}, \
                f"reward: {result.error}"
        return result.reward, result.detail, ""


class BusyTime:
    """Wall seconds with at least one tracked operation running; overlapping ones count once."""

    def __init__(self) -> None:
        self._closed, self._running, self._since = 0.0, 0, 0.0

    @property
    def seconds(self) -> float:
        return self._closed + (time.perf_counter() - self._since if self._running else 0.0)

    @contextmanager
    def track(self) -> Iterator[None]:
        if self._running == 0:
            self._since = time.perf_counter()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._closed += time.perf_counter() - self._since


def failure_of(out, reward_error: str, calls: tuple[CallRecord, ...], trouble: str,
               reward_kind: str = "") -> tuple[str, str]:
    """(failure kind, error) of a finished attempt: '' when it succeeded.

    Infrastructure: the harness could not start, the reward script crashed, or the harness failed after an engine
    or proxy error answered one of its calls. Policy: the harness timed out or exited non-zero after the model had
    answered (what the model did caused it), or the reward script declared the outcome unparseable (`reward_kind`
    'unparseable': it raised UnparseableOutcome). A harness that fails before any answer tells nothing about the
    model: infrastructure.
    """
    if out.error and out.exit_code is None:
        return scheduler.INFRA_FAILURE, out.error
    if reward_kind == "unparseable":
        if out.error and trouble:
            return scheduler.INFRA_FAILURE, f"{out.error} after {trouble}"
        if not calls:
            return scheduler.INFRA_FAILURE, f"{reward_error} before the model answered any call"
        return scheduler.POLICY_FAILURE, reward_error
    if reward_error:
        return scheduler.INFRA_FAILURE, reward_error
    if not out.error:
        return "", ""  # engine trouble the harness recovered from (a retried call) is no failure
    if trouble:
        return scheduler.INFRA_FAILURE, f"{out.error} after {trouble}"
    if calls:
        return scheduler.POLICY_FAILURE, out.error
    return scheduler.INFRA_FAILURE, f"{out.error} before the model answered any call"


REWARD_ERROR = "reward: "
"""How the error of a rollout whose reward script failed begins (HarnessSource._score)."""


def reward_script_counts(rollouts) -> dict[str, float]:
    """A step's reward script failures (RolloutResults): `reward/script_errors`, the script's own exceptions
    (infrastructure failures, left out of the loss), and `reward/unparseable`, outcomes it declared unparseable
    (UnparseableOutcome: the policy's failures)."""
    errors = sum(r.failure_kind == scheduler.INFRA_FAILURE and r.error.startswith(REWARD_ERROR) for r in rollouts)
    unparseable = sum(r.failure_kind == scheduler.POLICY_FAILURE and
                      r.error.startswith(REWARD_ERROR + "UnparseableOutcome") for r in rollouts)
    return {"reward/script_errors": float(errors), "reward/unparseable": float(unparseable)}


def _script_raised(rollout) -> bool:
    """The rollout's reward script raised an exception of its own ('reward: KeyError: ... (line 3)'), rather than
    running out of time or memory, being killed or refused, which the machine may cause."""
    rest = rollout.error.removeprefix(REWARD_ERROR)
    return (rollout.failure_kind == scheduler.INFRA_FAILURE and rollout.error.startswith(REWARD_ERROR)
            and re.match(r"[A-Za-z_]\w*: ", rest) is not None and not rest.startswith("MemoryError"))


def reward_script_bug(rollouts, step: int) -> str:
    """'' unless the reward script raised an exception on every rollout of the step: then the run's error, naming
    the most frequent one. An exception on every outcome is the script's own bug, not the policy's garbage."""
    if not rollouts or not all(_script_raised(r) for r in rollouts):
        return ""
    errors = Counter(r.error.removeprefix(REWARD_ERROR) for r in rollouts)
    error, times = errors.most_common(1)[0]
    return (f"the reward script raised on all {len(rollouts)} rollouts of step {step} ({times} times: {error}): "
            "a bug in the script, not in the outcomes. Try it on a task in the reward script's test panel, fix it, "
            "then clone the run. (An outcome it cannot parse should raise UnparseableOutcome: that scores as the "
            "policy's failure.)")


ENGINE_TROUBLE = (429, 500, 502, 503, 504)
"""Statuses of calls the engine or the proxy could not serve (a 499 is the harness hanging up: its own doing)."""


def calls_of(rollout_id: int) -> tuple[tuple[CallRecord, ...], str]:
    """Calls the trainer may learn from (delivered, with complete token capture), and the first engine trouble."""
    rows = list(ModelCall.objects.filter(rollout_id=rollout_id).order_by("seq")
                .only("seq", "status_code", "error", "prompt_ids", "completion_ids", "logprobs", "finish_reason",
                      "policy_version", "constraint", "choice"))
    trouble = next((f"engine or proxy error on call {c.seq}: {c.error or c.status_code}" for c in rows
                    if c.status_code in ENGINE_TROUBLE), "")
    return trainable_calls(rows), trouble


def trainable_calls(rows) -> tuple[CallRecord, ...]:
    """The calls the trainer may learn from (delivered, with complete token capture) as CallRecords, in the given
    order. `rows` are ModelCall rows or the proxy's RecordedCalls (the harness check's): both carry these fields."""
    return tuple(CallRecord(seq=c.seq, prompt_ids=tuple(c.prompt_ids), completion_ids=tuple(c.completion_ids),
                            logprobs=tuple(c.logprobs), finish_reason=c.finish_reason or "stop",
                            policy_version=c.policy_version, constrained=bool(getattr(c, "constraint", "")),
                            choice=getattr(c, "choice", 0) or 0)
                 for c in rows if c.status_code == 200 and not c.error and c.completion_ids
                 and len(c.logprobs) == len(c.completion_ids))
