"""The alarm rules: what one training step's records show that a healthy run does not. Pure functions of StepFacts
(health.services gathers them from the database after the step is stored) and the run's thresholds.

Each rule returns the alarm of its kind for the step, or None. The thresholds are the run config's `health` dict
over DEFAULTS. bench/health_alarms.py checks the defaults on real tiny-model runs: each injected fault caught within
a step, its clean run (the demo config's shape) silent.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from trainer.config import ConfigError

DEFAULTS: dict[str, float] = {
    "tool_use_min_share": 0.05,
    "tool_use_before_share": 0.5,
    "unparsed_tool_text_share": 0.1,
    "empty_share": 0.0,
    "no_signal_share": 0.75,
    "min_rollouts": 4,
    "logprob_mismatch_max": 0.5,
    "logprob_mismatch_jump": 4.0,
    "logprob_mismatch_floor": 0.05,
    "val_drop": 0.05,
    "reward_rise": 0.05,
    "min_eval_tasks": 10,
    "truncation_share": 0.25,
    "truncation_rise": 0.2,
    "flagged_share": 0.0,
}
"""Alarm thresholds (run config `health`: any subset of these names):

- tool_use_min_share: a step where at most this share of rollouts used a tool (a tool call or a shell command)
  alarms when the calls offered tools or, before, at least tool_use_before_share of a step's rollouts used one;
- unparsed_tool_text_share: a step where more than this share of calls that offered tools answered with a tool
  call written as text (and no parsed one), or of rollouts whose harness refused replies as malformed;
- empty_share: more than this share of the step's rollouts had no call, no sampled token or a fully masked sample;
- no_signal_share: more than this share of the groups the step trained on had every reward equal (min_rollouts
  rollouts at least; the groups dynamic sampling dropped are not counted: they were replaced, not trained);
- logprob_mismatch_max / _jump / _floor: train/logprob_mismatch_mean above max, or above floor and jump times the
  median of the earlier steps (a weight sync gone wrong);
- val_drop / reward_rise: over the last two evaluations, eval/pass@1 fell by val_drop while the train reward rose by
  reward_rise; an evaluation of fewer than min_eval_tasks val tasks (eval/tasks) is too noisy to tell;
- truncation_share / truncation_rise: the share of rollouts cut off (a call stopped at its length limit, or a
  timeout) reached truncation_share and rose by truncation_rise over the earlier steps' mean;
- flagged_share: more than this share of the step's rollouts flagged by the reward-hacking lens (health.audit).
The reward-collapse rule (every counted rollout of the step the same reward, min_rollouts at least) has no knob.
"""
HISTORY = 3
"""Earlier steps a rising share is compared with."""


def thresholds(config_health: Any) -> dict[str, float]:
    """DEFAULTS overridden by a run config's `health` dict; ConfigError naming the field when it is malformed."""
    if config_health in (None, {}):
        return dict(DEFAULTS)
    if not isinstance(config_health, dict):
        raise ConfigError(f"health must be an object of alarm thresholds, got {type(config_health).__name__}")
    unknown = sorted(set(config_health) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"health: unknown threshold(s) {unknown}; valid ones are {sorted(DEFAULTS)}")
    merged = dict(DEFAULTS)
    for name, value in config_health.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"health.{name} must be a number >= 0, got {value!r}")
        merged[name] = float(value)
    return merged


@dataclass
class RolloutFacts:
    id: int
    group: int
    reward: float | None
    failure_kind: str = ""
    calls: int = 0
    sampled_tokens: int = 0
    tool_uses: int = 0
    """Tool calls parsed by the engine, shell blocks in its text, or the commands its harness reported running."""
    offered_tools: bool = False
    text_tool_calls: int = 0
    offering_calls: int = 0
    format_errors: int = 0
    truncated: bool = False
    masked_out: bool = False
    flags: list[dict[str, Any]] = field(default_factory=list)
    drop_reason: str = ""
    """Why its step gave it no trained sample (Rollout.drop_reason); '' when trained."""

    @property
    def counted(self) -> bool:
        return self.failure_kind != "infra"

    @property
    def dropped_without_signal(self) -> bool:
        """Its group was dropped by dynamic sampling (trainer.step_metrics.no_signal_reason): sampled, never trained."""
        return self.drop_reason.startswith("no_signal")

    @property
    def empty(self) -> str:
        """Why the rollout gave the trainer nothing to learn from ('' when it did)."""
        if self.calls == 0:
            return "no calls"
        if self.sampled_tokens == 0:
            return "no sampled tokens"
        if self.masked_out:
            return "every sample fully masked"
        return ""


@dataclass
class StepFacts:
    step: int
    rollouts: list[RolloutFacts]
    metrics: dict[str, float] = field(default_factory=dict)
    history: dict[int, dict[str, float]] = field(default_factory=dict)
    """Earlier steps -> their metrics (health/* among them)."""
    extra_groups: int = 0
    """The groups without signal dynamic sampling may drop a step (TrainerConfig.extra_groups_per_step); 0: off."""


@dataclass
class Finding:
    kind: str
    message: str
    evidence: dict[str, Any]
    rollout_ids: list[int]
    severity: str = "warning"


def step_metrics(facts: StepFacts) -> dict[str, float]:
    """The health/* metrics of the step (recorded with the step's others: the rules compare later steps with them)."""
    counted = [r for r in facts.rollouts if r.counted] or []
    n = len(counted)
    offering = sum(r.offering_calls for r in counted)
    return {
        "health/tool_use_share": sum(r.tool_uses > 0 for r in counted) / n if n else 0.0,
        "health/offered_tools_share": sum(r.offered_tools for r in counted) / n if n else 0.0,
        "health/text_tool_call_share": sum(r.text_tool_calls for r in counted) / offering if offering else 0.0,
        "health/format_error_share": sum(r.format_errors > 0 for r in counted) / n if n else 0.0,
        "health/empty_rollouts": float(sum(bool(r.empty) for r in counted)),
        "health/truncated_share": sum(r.truncated for r in counted) / n if n else 0.0,
        "health/flagged_rollouts": float(sum(bool(r.flags) for r in counted)),
    }


def _examples(rollouts, limit: int = 5) -> list[int]:
    return [r.id for r in rollouts][:limit]


def _earlier(facts: StepFacts, name: str) -> list[float]:
    return [values[name] for step, values in sorted(facts.history.items()) if step < facts.step and name in values]


def no_tool_calls(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    counted = [r for r in facts.rollouts if r.counted and r.calls]
    if len(counted) < t["min_rollouts"] or m["health/tool_use_share"] > t["tool_use_min_share"]:
        return None
    before = _earlier(facts, "health/tool_use_share")
    offered = m["health/offered_tools_share"] > 0.5
    if not offered and not (before and max(before) >= t["tool_use_before_share"]):
        return None
    why = "the calls offered tools" if offered else f"earlier steps used them (up to {max(before):.0%} of rollouts)"
    return Finding("no_tool_calls", f"{m['health/tool_use_share']:.0%} of this step's {len(counted)} rollouts called a "
                   f"tool or ran a command, while {why}: the policy may have stopped acting and only talks.",
                   {"tool_use_share": m["health/tool_use_share"], "earlier_max": max(before, default=None),
                    "offered_tools_share": m["health/offered_tools_share"]},
                   _examples(counted), "critical")


def unparsed_tool_text(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    counted = [r for r in facts.rollouts if r.counted]
    text_share, format_share = m["health/text_tool_call_share"], m["health/format_error_share"]
    if len(counted) < t["min_rollouts"] or max(text_share, format_share) <= t["unparsed_tool_text_share"]:
        return None
    hits = [r for r in counted if r.text_tool_calls or r.format_errors]
    return Finding("unparsed_tool_text", f"{text_share:.0%} of the calls that offered tools answered with a tool call "
                   f"written as text that nothing executed, and {format_share:.0%} of rollouts had replies their "
                   "harness refused as malformed: check the engine's tool parser and the chat template.",
                   {"text_tool_call_share": text_share, "format_error_share": format_share}, _examples(hits))


def empty_rollouts(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    counted = [r for r in facts.rollouts if r.counted]
    empty = [r for r in counted if r.empty]
    if not counted or len(empty) / len(counted) <= t["empty_share"]:
        return None
    reasons = dict(Counter(r.empty for r in empty))
    return Finding("empty_rollouts", f"{len(empty)} of {len(counted)} rollouts gave the trainer nothing: "
                   + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) + ".",
                   {"empty": len(empty), "rollouts": len(counted), "reasons": reasons}, _examples(empty), "critical")


def _groups(facts: StepFacts) -> dict[int, list[RolloutFacts]]:
    groups: dict[int, list[RolloutFacts]] = {}
    for r in facts.rollouts:
        if r.counted and r.reward is not None:
            groups.setdefault(r.group, []).append(r)
    return groups


def no_signal(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    """Groups the step trained on whose counted rewards are all equal; the advice follows the run's settings."""
    sampled = _groups(facts)
    dropped = sum(any(r.dropped_without_signal for r in rs) for rs in sampled.values())
    groups = {g: rs for g, rs in sampled.items() if len(rs) >= 2 and not any(r.dropped_without_signal for r in rs)}
    if sum(len(rs) for rs in groups.values()) < t["min_rollouts"] or not groups:
        return None
    flat = [rs for rs in groups.values() if max(r.reward for r in rs) == min(r.reward for r in rs)]
    share = len(flat) / len(groups)
    if share <= t["no_signal_share"]:
        return None
    if facts.extra_groups:
        advice = (f"Dynamic sampling is on (at most {facts.extra_groups} groups dropped a step: "
                  f"dynamic_sampling_max_extra x tasks_per_step) and dropped {dropped} this step; these came once its "
                  "budget was spent: raise dynamic_sampling_max_extra, or temperature or group_size.")
    else:
        advice = "Raise temperature or group_size, or turn on dynamic_sampling."
    return Finding("no_signal", f"{share:.0%} of the {len(groups)} groups this step trained on scored every attempt "
                   f"the same: GRPO learns nothing from them. {advice}",
                   {"share": share, "groups": len(groups), "flat_groups": len(flat), "dropped_groups": dropped,
                    "dynamic_sampling": bool(facts.extra_groups)},
                   _examples([rs[0] for rs in flat]))


def reward_collapse(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    scored = [r for rs in _groups(facts).values() for r in rs]
    if len(scored) < t["min_rollouts"] or len({r.reward for r in scored}) != 1:
        return None
    return Finding("reward_collapse", f"every one of this step's {len(scored)} rollouts got reward "
                   f"{scored[0].reward:g}: the reward no longer tells attempts apart (a constant or broken reward "
                   "script, or a policy that collapsed to one answer).",
                   {"reward": scored[0].reward, "rollouts": len(scored)}, _examples(scored), "critical")


def logprob_mismatch(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    value = facts.metrics.get("train/logprob_mismatch_mean")
    if value is None:
        return None
    before = sorted(_earlier(facts, "train/logprob_mismatch_mean"))
    median = before[len(before) // 2] if before else None
    jumped = median is not None and value > t["logprob_mismatch_floor"] and value > t["logprob_mismatch_jump"] * max(
        median, 1e-6)
    if value <= t["logprob_mismatch_max"] and not jumped:
        return None
    earlier = f"earlier steps' median {median:.3f}" if median is not None else "no earlier step"
    return Finding("logprob_mismatch", f"the trainer's logprobs of the sampled tokens differ from the engine's by "
                   f"{value:.3f} on average ({earlier}): the engine may serve other weights than the trainer holds "
                   "(a weight sync gone wrong, a dtype or a chat template mismatch).",
                   {"mean": value, "earlier_median": median, "max": facts.metrics.get("train/logprob_mismatch_max")},
                   [], "critical")


def reward_up_val_down(facts: StepFacts, t: dict[str, float]) -> Finding | None:
    """After an evaluation (health.services.check_evaluation), from the metrics alone."""
    series = {**facts.history, facts.step: facts.metrics}
    evals = [(step, v["eval/pass@1"]) for step, v in sorted(series.items()) if "eval/pass@1" in v]
    if len(evals) < 2 or evals[-1][0] != facts.step:
        return None
    (a, val_a), (b, val_b) = evals[-2], evals[-1]
    if min(series[a].get("eval/tasks", math.inf), series[b].get("eval/tasks", math.inf)) < t["min_eval_tasks"]:
        return None
    rewards = [(step, v["reward/mean"]) for step, v in sorted(series.items()) if "reward/mean" in v and a <= step <= b]
    if len(rewards) < 2 or val_a - val_b < t["val_drop"]:
        return None
    rise = rewards[-1][1] - rewards[0][1]
    if rise < t["reward_rise"]:
        return None
    return Finding("reward_up_val_down", f"between steps {a} and {b} the train reward rose by {rise:+.3f} while "
                   f"validation Pass@1 fell from {val_a:.3f} to {val_b:.3f}: the policy may be over-fitting the train "
                   "templates or exploiting the reward.",
                   {"from_step": a, "to_step": b, "val_before": val_a, "val_after": val_b, "reward_rise": rise}, [])


def truncation_rising(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    counted = [r for r in facts.rollouts if r.counted]
    share = m["health/truncated_share"]
    before = _earlier(facts, "health/truncated_share")[-HISTORY:]
    if not before:  # nothing to rise from: a model that is cut off from its first step on says so in its metrics
        return None
    base = sum(before) / len(before)
    if len(counted) < t["min_rollouts"] or share < t["truncation_share"] or share - base < t["truncation_rise"]:
        return None
    return Finding("truncation_rising", f"{share:.0%} of this step's rollouts were cut off (a call at its length "
                   f"limit, or a timeout), against {base:.0%} before: answers are growing past the limits.",
                   {"share": share, "earlier_mean": base}, _examples([r for r in counted if r.truncated]))


def reward_hacking(facts: StepFacts, t: dict[str, float], m: dict[str, float]) -> Finding | None:
    counted = [r for r in facts.rollouts if r.counted]
    flagged = [r for r in counted if r.flags]
    if not counted or len(flagged) / len(counted) <= t["flagged_share"]:
        return None
    kinds = dict(Counter(kind for r in flagged for kind in {f.get("kind", "") for f in r.flags}))
    return Finding("reward_hacking", f"{len(flagged)} of {len(counted)} rollouts did what an honest solution does not "
                   "need: " + ", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in sorted(kinds.items()))
                   + ". Check them before trusting the reward.", {"flagged": len(flagged), "kinds": kinds},
                   _examples(flagged), "critical")


STEP_RULES = (no_tool_calls, unparsed_tool_text, empty_rollouts, no_signal, reward_collapse, logprob_mismatch,
              truncation_rising, reward_hacking)
"""The rules of a stored step; reward_up_val_down runs after an evaluation instead."""


def evaluate(facts: StepFacts, t: dict[str, float] | None = None) -> tuple[list[Finding], dict[str, float]]:
    """The step's alarms (STEP_RULES) and its health/* metrics."""
    t = t or dict(DEFAULTS)
    m = step_metrics(facts)
    return [found for rule in STEP_RULES if (found := rule(facts, t, m)) is not None], m
