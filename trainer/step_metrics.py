"""What a training step measures: reward, failure, length, drift and group metrics of its rollouts; its time split."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Sequence

from trainer.samples import INFRA_FAILURE, POLICY_FAILURE, drop_reason

if TYPE_CHECKING:  # the scheduler's types; it imports this module
    from trainer.scheduler import Engine, RolloutResult, RolloutSource, TrainedSample


def rollout_metrics(rollouts: Sequence[RolloutResult], trained: Sequence[TrainedSample],
                    drift: dict[str, dict[int, str]], pass_threshold: float,
                    reward_of: Callable[[RolloutResult], float] = lambda r: r.reward) -> dict[str, float]:
    """Reward, pass rate, failures, lengths, staleness and drift rates of one step.

    Rewards are the trained ones (`reward_of`) over the rollouts that count: infrastructure failures are left out.
    """
    counted = [r for r in rollouts if r.failure_kind != INFRA_FAILURE]
    rewards = [reward_of(r) for r in counted] or [0.0]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
    later = [kind for calls in drift.values() for seq, kind in sorted(calls.items())[1:]]  # first call: nothing to drift from
    staleness = [t.staleness for t in trained] or [0]
    completion = [sum(len(c.completion_ids) for c in r.calls) for r in rollouts]
    context = [len(c.prompt_ids) + len(c.completion_ids) for r in rollouts for c in r.calls] or [0]
    metrics = {
        "reward/mean": mean, "reward/std": std,
        "reward/pass_rate": sum(x >= pass_threshold for x in rewards) / len(rewards),
        "rollout/failed_frac": sum(r.failed for r in rollouts) / len(rollouts),
        "rollout/policy_failures": float(sum(r.failure_kind == POLICY_FAILURE for r in rollouts)),
        "rollout/infra_failures": float(sum(r.failure_kind == INFRA_FAILURE for r in rollouts)),
        "rollout/calls_mean": sum(len(r.calls) for r in rollouts) / len(rollouts),
        "length/completion_tokens_mean": sum(completion) / len(completion),
        "length/context_tokens_mean": sum(context) / len(context),  # one call's prompt + completion
        "length/context_tokens_max": float(max(context)),
        "length/sample_tokens_mean": (sum(len(t.sample.token_ids) for t in trained) / len(trained)) if trained else 0.0,
        "staleness/mean": sum(staleness) / len(staleness), "staleness/max": max(staleness),
    }
    for kind in ("clean", "realign", "fork"):
        metrics[f"drift/{kind}_rate"] = (later.count(kind) / len(later)) if later else 0.0
        metrics[f"drift/{kind}_count"] = float(later.count(kind))
    # A group teaches GRPO something only when its counted rewards differ; a rollout with no trained sample
    # (an infrastructure failure, or nothing sampled) is dropped from the step.
    by_group: dict[int, list[float]] = {}
    for r in counted:
        by_group.setdefault(r.group_id, []).append(reward_of(r))
    metrics["groups/total"] = float(len({r.group_id for r in rollouts}))
    metrics["groups/with_signal"] = float(sum(max(v) > min(v) for v in by_group.values()))
    metrics["samples/trained"] = float(len(trained))
    metrics["samples/dropped_rollouts"] = float(len(dropped_rollouts(rollouts, trained)))
    return metrics


def group_metrics(trained_signal: Sequence[bool], dropped_sizes: Sequence[int]) -> dict[str, float]:
    """What dynamic sampling did this step, from whether each trained group had signal and the sizes of the groups
    it dropped without signal: groups sampled (trained + dropped), with signal, trained, dropped without signal,
    and the rollouts it spent beyond the batch's. `groups/signal_share` is the share of the trained groups with
    signal (what the update learns from); `groups/sampled_signal_share` the share of all sampled groups (how
    deterministic the policy has become, whatever dynamic sampling hides; a dropped group has none)."""
    with_signal, sampled = sum(trained_signal), len(trained_signal) + len(dropped_sizes)
    return {
        "groups/sampled": float(sampled), "groups/trained": float(len(trained_signal)),
        "groups/trained_with_signal": float(with_signal), "groups/dropped_no_signal": float(len(dropped_sizes)),
        "groups/signal_share": with_signal / len(trained_signal) if trained_signal else 0.0,
        "groups/sampled_signal_share": with_signal / sampled if sampled else 0.0,
        "rollout/extra": float(sum(dropped_sizes)),
    }


def dropped_rollouts(rollouts: Sequence[RolloutResult], trained: Sequence[TrainedSample]) -> dict[str, str]:
    """Why each rollout of a batch without a trained sample gave none.

    'infra_failure: <error>': left out of the loss and the baseline (it says nothing about the policy);
    'no_sampled_tokens': no call of it returned a sampled token (no call made, every call failed, or every call was constrained: see CallRecord.constrained).
    Staleness never drops a rollout: a group at the staleness bound is forced into the next batch.
    """
    kept = {t.rollout_id for t in trained}
    return {r.rollout_id: drop_reason(r.failure_kind, r.error) for r in rollouts if r.rollout_id not in kept}


def no_signal_reason(rewards: Sequence[float], size: int) -> str:
    """Why a finished group teaches a group-baseline estimator nothing ('' when it does): its counted rewards
    (infrastructure failures left out) are all equal, or fewer than two of its attempts counted."""
    if len(rewards) < 2:
        return f"no_signal: {len(rewards)} of {size} attempts counted"
    if max(rewards) > min(rewards):
        return ""
    return f"no_signal: every attempt scored {rewards[0]:g}"


class StepClock:
    """Splits wall time since the previous step into generate / train / sync / the named parts / idle.

    Generate time is the engine's own `busy_seconds` and score time the source's `score_seconds` (wall time with
    a reward being computed, which overlaps generation in a real run, so it is not taken out of idle); a part
    missing on either side reads 0. The named parts (`add`) are exclusive wall time on the step's path:
    build_samples, checkpoint and record (storing the previous step's report, which runs after its split).
    """

    PARTS = ("build_samples", "checkpoint", "record")

    def __init__(self, engine: Engine, source: RolloutSource | None = None):
        self.engine, self.source = engine, source
        self.last = time.perf_counter()
        self.last_busy, self.last_score = self.counters()
        self.parts = dict.fromkeys(self.PARTS, 0.0)
        self.excluded = 0.0

    def counters(self) -> tuple[float, float]:
        """The engine's busy seconds and the source's score seconds so far."""
        return self._counter(self.engine, "busy_seconds"), self._counter(self.source, "score_seconds")

    def exclude(self, seconds: float, since: tuple[float, float]) -> None:
        """Leave `seconds` of wall time that nothing of the step shared (a sync run's evaluation), and the engine
        and score time spent in them (counters() at their start), out of the next split; it reports them as
        `time/evaluate`."""
        busy, score = self.counters()
        self.last += seconds
        self.last_busy += busy - since[0]
        self.last_score += score - since[1]
        self.excluded += seconds

    @staticmethod
    def _counter(owner: object, name: str) -> float:
        return float(getattr(owner, name, 0.0) or 0.0)

    def add(self, part: str, seconds: float) -> None:
        """Count `seconds` of exclusive wall time as `part` of the step now running."""
        self.parts[part] += seconds

    def split(self, train: float, sync: float) -> dict[str, float]:
        now = time.perf_counter()
        busy, score = self.counters()
        wall, generate = now - self.last, busy - self.last_busy
        metrics = {"time/step": wall, "time/generate": generate, "time/train": train, "time/sync": sync,
                   "time/score": score - self.last_score, "time/evaluate": self.excluded}
        metrics.update({f"time/{part}": seconds for part, seconds in self.parts.items()})
        idle = max(0.0, wall - generate - train - sync - sum(self.parts.values()))
        metrics.update({"time/idle": idle, "time/busy_frac": 1 - idle / wall if wall > 0 else 0.0})
        self.last, self.last_busy, self.last_score = now, busy, score
        self.parts, self.excluded = dict.fromkeys(self.PARTS, 0.0), 0.0
        return metrics
