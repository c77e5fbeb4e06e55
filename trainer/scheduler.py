"""Sync and collocated-async scheduling of rollouts and policy updates over RolloutSource and Engine protocols."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from common.procs import name_os_thread
from trainer.algorithms import broadcast_to_samples, compute_advantages
from trainer.config import TrainerConfig
from trainer.model_files import copy_tokenizer
from trainer.policy import Policy
from trainer.samples import INFRA_FAILURE, POLICY_FAILURE, CallRecord, Decode, Sample, build_samples
from trainer.step_metrics import StepClock, dropped_rollouts, group_metrics, no_signal_reason, rollout_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupRequest:
    """Launch `size` attempts of one task; the source chooses the task (e.g. seeded by group_id)."""

    group_id: int
    size: int
    policy_version: int
    """Policy version at admission: staleness is counted from it."""


FAILURE_KINDS = ("", POLICY_FAILURE, INFRA_FAILURE)


@dataclass(frozen=True)
class RolloutResult:
    """A finished (or failed) rollout: its recorded calls in order and its reward."""

    group_id: int
    rollout_id: str
    calls: tuple[CallRecord, ...]
    reward: float
    failure_kind: str = ""
    """'' (finished), 'policy' (the harness timed out or exited non-zero after the model answered: its tokens
    are trained with config.failure_reward, pushing the model away from what caused it) or 'infra' (engine,
    proxy, worker or reward-script trouble: left out of the loss and of the group baseline)."""
    error: str = ""

    def __post_init__(self) -> None:
        if self.failure_kind not in FAILURE_KINDS:
            raise ValueError(f"failure_kind must be one of {list(FAILURE_KINDS)}, got {self.failure_kind!r}")

    @property
    def failed(self) -> bool:
        return bool(self.failure_kind)


class RolloutSource(Protocol):
    """Runs harnesses. Implemented by the web app (real harnesses behind the proxy) and by in-process stand-ins.

    `score_seconds` (optional) is its cumulative wall time with at least one reward being computed.
    """

    async def launch(self, group: GroupRequest) -> None:
        """Start the group's rollouts and return at once; they report through `next_finished`."""

    async def next_finished(self) -> RolloutResult:
        """Wait for the next rollout of any launched group to finish (failures included)."""

    async def cancel(self, group_id: int) -> None:
        """Stop the group's rollouts that are still running; they need not be reported."""


class Engine(Protocol):
    """The inference server that serves the policy. `busy_seconds` (optional) is its cumulative generate time."""

    @property
    def version(self) -> int:
        """Policy version now served; the engine stamps it on every call it serves."""

    async def pause(self) -> None:
        """Hold new calls (they wait) and return once the calls in flight have drained."""

    async def update_weights(self, model: nn.Module, version: int) -> None:
        """Load the trainer's weights and serve them as `version` from the next call on."""

    async def resume(self) -> None:
        """Release held and new calls."""


@dataclass(frozen=True)
class TrainedSample:
    rollout_id: str
    sample: Sample
    advantage: float
    staleness: int
    trainer_logprobs: tuple[float | None, ...] = ()
    """The trainer's logprob of each loss token before the step's update (None elsewhere); () if not measured."""


@dataclass(frozen=True)
class StepReport:
    """What one training step used and measured; the web app stores it (samples, drift, metrics)."""

    step: int
    policy_version: int
    """Version the step's update produced (served from now on)."""
    rollouts: tuple[RolloutResult, ...]
    samples: tuple[TrainedSample, ...]
    drift: dict[str, dict[int, str]]
    """rollout_id -> call seq -> 'clean' | 'realign' | 'fork'."""
    metrics: dict[str, float]
    dropped: dict[str, str] = field(default_factory=dict)
    """rollout_id -> why that rollout of the batch gave no trained sample (see dropped_rollouts)."""


class StepPhases:
    """The named phases of a step that the loop hands to its caller, in order: generate -> train -> record ->
    evaluate -> checkpoint. This base does nothing beyond training (its `last_step` is the config's); the web app's
    runs.orchestrator.RunPhases stores each report, evaluates and records checkpoints."""

    def last_step(self, configured: int) -> int:
        """The step the run ends at, read before every admission and batch: `configured`, or fewer once its owner
        asked it to finish now; the loop stops once the policy reaches it, with a checkpoint of that step."""
        return configured

    def evaluates_at(self, version: int) -> bool:
        """Whether the step that produced `version` is evaluated. In sync mode its weight swap then holds the
        next step's admission: those groups start after the evaluation, never beside its load."""
        return False

    async def phase(self, text: str) -> None:
        """What the loop does now, heard when it changes ("step 3: generating rollouts", "step 3: training ...")."""

    async def record(self, report: StepReport) -> None:
        """Store the step's report (raise to stop the run); its time is `time/record` of the next step."""

    async def evaluate(self, version: int) -> None:
        """Evaluate the policy the engine serves as `version` (only where `evaluates_at(version)`). In sync mode its
        time is `time/evaluate` of the next step, outside `time/step`."""

    async def checkpoint(self, path: Path, step: int) -> None:
        """The complete checkpoint of `step` at `path`, heard after that step's record and evaluation: whoever
        resumes from it finds its step stored."""


@dataclass
class _Group:
    request: GroupRequest
    results: list[RolloutResult] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.results) >= self.request.size


class Scheduler:
    """One loop for both modes: sync is async with staleness 0 and exactly one step of groups in flight."""

    def __init__(self, policy: Policy, engine: Engine, source: RolloutSource, *, phases: StepPhases | None = None,
                 decode: Decode | None = None, checkpoint_dir: str | Path | None = None, first_group_id: int = 0,
                 model_dir: str | Path | None = None):
        """`phases` hears each step's named phases (StepPhases: a bare one only trains); `decode` proves realigns
        (see trainer.samples); checkpoints go to `checkpoint_dir`/step-NNNNNN with the tokenizer of `model_dir` (a
        model a run can start from); a resumed run passes a `first_group_id` past the ids it already used."""
        self.policy, self.engine, self.source, self.model_dir = policy, engine, source, model_dir
        self.phases = phases if phases is not None else StepPhases()
        self.config: TrainerConfig = policy.config
        self.decode, self.checkpoint_dir, self._last_phase = decode, checkpoint_dir, ""
        self.groups: dict[int, _Group] = {}  # admitted and not yet trained, in admission order
        self.no_signal: list[_Group] = []  # dropped by dynamic sampling since the last step (reported with the next)
        self.next_group_id = first_group_id
        self.reports: list[StepReport] = []
        self._evaluated: int | None = None  # the last version evaluated, and the last step checkpointed
        self._checkpointed: int | None = None
        # One thread for every step (a new one per step grew a glibc arena each time), named for the kernel too.
        self._trainer_thread = concurrent.futures.ThreadPoolExecutor(1, "trainer", initializer=name_os_thread)

    @property
    def version(self) -> int:
        return self.policy.version

    def _evaluation_holds(self, version: int) -> bool:
        """Sync mode and `version` is evaluated: the next step waits for the evaluation."""
        return self.config.effective_max_staleness == 0 and self.phases.evaluates_at(version)

    @property
    def last_step(self) -> int:
        """The step the run ends at: `config.steps`, or fewer once its owner asked it to finish."""
        return min(self.config.steps, self.phases.last_step(self.config.steps))

    async def run(self) -> list[StepReport]:
        """Train until `last_step` steps are done (resuming from the policy's step), then cancel the rest."""
        if self.policy.step == 0:  # a fresh run starts from the seed; a resumed one keeps the checkpoint's RNG
            torch.manual_seed(self.config.seed)
            random.seed(self.config.seed)
        clock = StepClock(self.engine, self.source)
        try:
            while (batch := await self._generate()) is not None:
                report = await self._train(batch, clock)
                await self._record(report, clock)
                await self._evaluate(report.policy_version, clock)
                await self._checkpoint(clock)  # decided now: a finish asked while the step recorded makes it the last
            if self.reports and self.checkpoint_dir is not None and self._checkpointed != self.policy.step:
                if self._evaluated != self.version:  # the finish was heard later (the web app polls for it)
                    await self._evaluate(self.version, clock)
                await self._checkpoint(clock, force=True)
        finally:
            for group_id in list(self.groups):
                await self.source.cancel(group_id)
            self._trainer_thread.shutdown(wait=False)
        return self.reports

    # ---- generate: admission and batching ---------------------------------------------------------------

    async def _generate(self) -> list[_Group] | None:
        """Admit groups and gather their finished rollouts until a batch is ready; None once the run is at its
        last step."""
        while self.policy.step < self.last_step:
            await self._admit()
            batch = self._ready_batch()
            if batch is not None:
                return batch
            await self._phase(f"step {self.policy.step + 1}: generating rollouts")
            result = await self.source.next_finished()
            if result.group_id in self.groups:
                group = self.groups[result.group_id]
                group.results.append(result)
                if group.complete:
                    self._drop_without_signal(group)
        return None

    async def _admit(self) -> None:
        """Launch groups while the in-flight cap, the staleness bound and the remaining steps allow."""
        c = self.config
        # A group admitted now must be trained within max_staleness steps (it is forced into a batch then);
        # more than (max_staleness + 1) steps of groups in flight would make some step exceed the bound or
        # train more than tasks_per_step groups.
        bound = (c.effective_max_staleness + 1) * c.tasks_per_step
        needed = max(0, self.last_step - self.policy.step) * c.tasks_per_step
        while len(self.groups) < min(c.effective_groups_in_flight, bound, needed):
            request = GroupRequest(self.next_group_id, c.group_size, self.version)
            self.next_group_id += 1
            self.groups[request.group_id] = _Group(request)
            await self.source.launch(request)

    def _drop_without_signal(self, group: _Group) -> None:
        """Dynamic sampling: take a finished group without signal out of the step (its place is admitted anew by
        the next `_admit`, with a new group id and so a new task) while the step's extra budget lasts."""
        if len(self.no_signal) >= self.config.extra_groups_per_step or not self.signal_reason(group):
            return
        del self.groups[group.request.group_id]
        self.no_signal.append(group)

    def signal_reason(self, group: _Group) -> str:
        """'' for a group with signal, else why it has none (see no_signal_reason)."""
        counted = [self.reward_of(r) for r in group.results if r.failure_kind != INFRA_FAILURE]
        return no_signal_reason(counted, group.request.size)

    def _ready_batch(self) -> list[_Group] | None:
        """Groups to train now: every overdue group (at the staleness bound) plus the oldest complete ones."""
        s, b = self.config.effective_max_staleness, self.config.tasks_per_step
        overdue = [g for g in self.groups.values() if self.version - g.request.policy_version >= s]
        if not all(g.complete for g in overdue):
            return None
        rest = [g for g in self.groups.values() if g.complete and g not in overdue]
        batch = overdue + rest[: max(0, b - len(overdue))]
        return batch if len(batch) >= b else None

    # ---- one training step -----------------------------------------------------------------------------

    async def _on_trainer_thread(self, clock: StepClock, part: str, fn: Callable, *args):
        """Run `fn` on the trainer thread and time it as `part` of the step.

        Sample building, training and checkpoints all run there: the loop stays free for harnesses, the proxy's
        bookkeeping and cancel (a 2 s checkpoint or sample build on the loop would stall every rollout in flight).
        """
        start = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._trainer_thread, fn, *args)
        finally:
            clock.add(part, time.perf_counter() - start)

    async def _phase(self, phase: str) -> None:
        if phase != self._last_phase:
            self._last_phase = phase
            await self.phases.phase(phase)

    async def _train(self, batch: list[_Group], clock: StepClock) -> StepReport:
        step = self.policy.step + 1
        await self._phase(f"step {step}: training on {sum(len(g.results) for g in batch)} rollouts")
        for g in batch:
            del self.groups[g.request.group_id]
        dropped_groups, self.no_signal = self.no_signal, []
        # Every rollout the step sampled: the batch's, and those of groups dropped without signal (recorded with
        # the step as dropped, never trained).
        rollouts = [r for g in batch + dropped_groups for r in g.results]
        trained, drift, rollout_index, advantage_metrics = await self._on_trainer_thread(
            clock, "build_samples", self._samples, batch, dropped_groups)
        samples = [t.sample for t in trained]
        train_start = time.perf_counter()
        # Harnesses keep generating (async mode) while the trainer works; the engine pauses only for the swap.
        metrics = await asyncio.get_running_loop().run_in_executor(
            self._trainer_thread, self.policy.train_step, samples, [t.advantage for t in trained], rollout_index)
        train_end = time.perf_counter()
        measured = getattr(self.policy, "trained_logprobs", None)
        if measured is not None and len(measured) == len(trained):
            trained = [replace(t, trainer_logprobs=tuple(lp)) for t, lp in zip(trained, measured)]
        await self.engine.pause()  # every call in flight finishes on the weights that admitted it
        drained = time.perf_counter()
        try:
            # The next groups start now, at the version the update is about to serve: their harnesses start up
            # while the weights swap, and their first calls wait at the paused engine (the proxy holds them).
            # Not when this version is evaluated in sync mode: they start after the evaluation (the loop admits).
            if not self._evaluation_holds(self.policy.version):
                await self._admit()
            admitted = time.perf_counter()
            await self._phase(f"step {step}: syncing weights to the engine")
            await self.engine.update_weights(self.policy.model, self.policy.version)
        finally:  # never leave harnesses' calls held by a paused engine, even when the update failed
            await self.engine.resume()
        sync_seconds = time.perf_counter() - admitted
        metrics.update(rollout_metrics(rollouts, trained, drift, self.config.pass_threshold, self.reward_of))
        metrics.update(group_metrics([not self.signal_reason(g) for g in batch],
                                     [len(g.results) for g in dropped_groups]))
        metrics.update(advantage_metrics)
        metrics.update(clock.split(train_end - train_start, sync_seconds))
        metrics["time/drain"] = drained - train_end
        generated = sum(len(c.completion_ids) for r in rollouts for c in r.calls)
        metrics["rollout/generated_tokens_per_s"] = generated / max(metrics["time/step"], 1e-9)
        dropped = dropped_rollouts(rollouts, trained)
        for g in dropped_groups:
            reason = self.signal_reason(g)
            dropped.update({r.rollout_id: reason for r in g.results if r.failure_kind != INFRA_FAILURE})
        report = StepReport(self.policy.step, self.policy.version, tuple(rollouts), tuple(trained), drift, metrics,
                            dropped)
        self.reports.append(report)
        return report

    # ---- after the step's split: record, evaluate, checkpoint (their time lands in the next step's) --------

    async def _checkpoint(self, clock: StepClock, force: bool = False) -> None:
        """The step's checkpoint where due or forced (time/checkpoint), written once the step is recorded and
        evaluated, then announced: whoever resumes from it finds its step stored. A run's final step always has one
        (`continue` resumes from it), also when its owner asked it to finish after that step's own turn."""
        if force or self._checkpoint_due():
            await self._phase(f"step {self.policy.step}: saving a checkpoint")
            path = await self._on_trainer_thread(clock, "checkpoint", self._write_checkpoint)
            await self.phases.checkpoint(path, self.policy.step)

    async def _record(self, report: StepReport, clock: StepClock) -> None:
        await self._phase(f"step {report.step}: recording")
        start = time.perf_counter()
        await self.phases.record(report)
        clock.add("record", time.perf_counter() - start)

    async def _evaluate(self, version: int, clock: StepClock) -> None:
        """The evaluation of `version` where due. In sync mode nothing else ran meanwhile (the swap held the next
        step's admission): its time is left out of the next split, as time/evaluate. In async mode harnesses
        generate beside it and it counts as time/record."""
        if not self.phases.evaluates_at(version):
            return
        start, counters = time.perf_counter(), clock.counters()
        await self.phases.evaluate(version)
        self._evaluated = version
        if self.config.effective_max_staleness == 0:
            clock.exclude(time.perf_counter() - start, counters)
        else:
            clock.add("record", time.perf_counter() - start)

    def _samples(self, batch: list[_Group], dropped_groups: Sequence[_Group] = ()
                 ) -> tuple[list[TrainedSample], dict[str, dict[int, str]], list[int], dict[str, float]]:
        """Samples of every rollout of the batch but infrastructure failures, with its group advantage.

        Policy failures are trained with `failure_reward`; infrastructure failures say nothing about the policy,
        so they are left out of both the loss and the group baseline. Rollouts of `dropped_groups` (no signal)
        and infrastructure failures are only classified for drift, for the inspector.
        """
        all_rollouts = [r for g in batch for r in g.results]
        untrained = [r for r in all_rollouts if r.failure_kind == INFRA_FAILURE]
        untrained += [r for g in dropped_groups for r in g.results]
        drift = {r.rollout_id: build_samples(r.calls, self.decode).drift for r in untrained}
        rollouts = [r for r in all_rollouts if r.failure_kind != INFRA_FAILURE]
        rewards = torch.tensor([self.reward_of(r) for r in rollouts], dtype=torch.float64)
        groups = torch.tensor([r.group_id for r in rollouts], dtype=torch.long)
        advantages, metrics = compute_advantages(self.config.advantage, rewards, groups, self.config.adv_eps)
        trained, owners = [], []
        for i, r in enumerate(rollouts):
            built = build_samples(r.calls, self.decode)
            drift[r.rollout_id] = built.drift
            for sample in built.samples:
                trained.append((r.rollout_id, sample))
                owners.append(i)
        sample_adv = broadcast_to_samples(advantages, torch.tensor(owners, dtype=torch.long)).tolist()
        out = [TrainedSample(rid, s, a, self.version - s.min_version) for (rid, s), a in zip(trained, sample_adv)]
        return out, drift, owners, metrics

    def reward_of(self, rollout: RolloutResult) -> float:
        """The reward a rollout is trained with: failure_reward for a policy failure."""
        return self.config.failure_reward if rollout.failure_kind == POLICY_FAILURE else rollout.reward

    def _checkpoint_due(self) -> bool:
        every, step = self.config.checkpoint_every, self.policy.step
        return self.checkpoint_dir is not None and (step == self.last_step or bool(every and step % every == 0))

    def _write_checkpoint(self) -> Path:
        """The policy's checkpoint plus the scheduler's counters and the model's tokenizer, written under a
        temporary name and renamed: a folder named step-NNNNNN is always complete."""
        step = self.policy.step
        path = Path(self.checkpoint_dir) / f"step-{step:06d}"
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.policy.save_checkpoint(partial)
        if self.model_dir is not None:
            copy_tokenizer(self.model_dir, partial)
        (partial / SCHEDULER_STATE_FILE).write_text(json.dumps(self.counters()))
        shutil.rmtree(path, ignore_errors=True)  # left by a trajectory a resume went back on
        partial.rename(path)
        self._checkpointed = step
        return path

    def counters(self) -> dict[str, int | list[int]]:
        """What a resume needs besides the policy: the next group id, and the groups admitted but not yet trained
        (their rollouts are not in the checkpoint's weights)."""
        return {"next_group_id": self.next_group_id,
                "untrained_groups": sorted([*self.groups, *(g.request.group_id for g in self.no_signal)])}


SCHEDULER_STATE_FILE = "scheduler_state.json"


def read_counters(checkpoint: str | Path) -> dict[str, int | list[int]] | None:
    """`Scheduler.counters()` as saved in a checkpoint; None for a checkpoint written before they were saved."""
    path = Path(checkpoint) / SCHEDULER_STATE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


async def run(policy: Policy, engine: Engine, source: RolloutSource, **kwargs) -> list[StepReport]:
    """Entry point: train `policy.config.steps` steps in the configured mode; returns one report per step."""
    return await Scheduler(policy, engine, source, **kwargs).run()
