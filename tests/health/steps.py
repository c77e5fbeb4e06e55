"""Stored training steps for the health tests: rollouts with calls, samples and metrics as a real run stores them
(rollout_services.record_step writes the samples, batch_step, trained_step or drop_reason, and metrics), each fault
injectable on its own."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from runs import rollout_services
from runs.models import ModelCall, Rollout, RolloutStatus

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


@dataclass
class Attempt:
    """One rollout of a step: its reward and what its calls looked like."""

    reward: float
    tool_call: bool = True
    """The model answered with a parsed tool call (else plain text)."""
    text: str = "Let me look."
    offer_tools: bool = True
    calls: int = 2
    completion_tokens: int = 3
    finish_reason: str = "stop"
    masked: bool = False
    outcome: dict = field(default_factory=lambda: {"answer": "ok"})
    flags: list = field(default_factory=list)
    failure_kind: str = ""
    error: str = ""


def clean_attempts(groups: int = 4, size: int = 4, offset: float = 0.0) -> list[list[Attempt]]:
    """Groups whose rewards differ, every rollout calling a tool: a healthy step."""
    return [[Attempt(reward=round(0.1 * ((g + a) % 4) + offset, 3)) for a in range(size)] for g in range(groups)]


def response(attempt: Attempt) -> dict:
    message = {"role": "assistant", "content": attempt.text}
    if attempt.tool_call:
        message["tool_calls"] = [{"id": "c1", "type": "function",
                                  "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}]
    return {"choices": [{"index": 0, "message": message, "finish_reason": attempt.finish_reason}]}


def store_step(run, step: int, groups: list[list[Attempt]], metrics: dict | None = None,
               first_group: int | None = None, dropped: int = 0) -> list[Rollout]:
    """Store step `step` of `run`: its rollouts (finished, with calls), then record_step's samples, batch and metrics.

    The last `dropped` groups are those dynamic sampling dropped without signal before the step: recorded with it,
    never trained (no samples, drop_reason 'no_signal: ...'), as the scheduler reports them."""
    first_group = step * 100 if first_group is None else first_group
    batch: dict[int, str] = {}
    task = run.dataset.tasks.filter(split="train").first() if run.dataset_id else None
    rollouts, samples = [], []
    for g, attempts in enumerate(groups):
        for a, attempt in enumerate(attempts):
            rollout = rollout_services.create_rollout(run, task=task, split="train", step=step - 1,
                                                      group=first_group + g, attempt=a)[0]
            calls = [ModelCall(rollout=rollout, seq=seq, api="chat", status_code=200, finish_reason=attempt.finish_reason,
                               request={"messages": [{"role": "user", "content": "go"}],
                                        **({"tools": TOOLS} if attempt.offer_tools else {})},
                               response=response(attempt), prompt_ids=[1, 2],
                               completion_ids=list(range(attempt.completion_tokens)))
                     for seq in range(attempt.calls)]
            ModelCall.objects.bulk_create(calls)
            Rollout.objects.filter(pk=rollout.pk).update(call_count=attempt.calls)
            rollout_services.finish_rollout(
                rollout.pk, status=RolloutStatus.FAILED if attempt.failure_kind else RolloutStatus.SUCCEEDED,
                reward=attempt.reward, reward_detail={}, exit_code=0, failure_kind=attempt.failure_kind,
                error=attempt.error, outcome=attempt.outcome, flags=attempt.flags)
            rollouts.append(rollout)
            batch[rollout.pk] = f"no_signal: every attempt scored {attempt.reward:g}" if g >= len(groups) - dropped \
                else ""
            if attempt.calls and attempt.completion_tokens and not batch[rollout.pk]:
                samples.append({"rollout_id": rollout.pk, "token_ids": [1, 2, 3, 4],
                                "loss_mask": [0, 0, 0, 0] if attempt.masked else [0, 0, 1, 1],
                                "logprobs": [0.0, 0.0, -0.5, -0.5], "advantage": 0.1, "call_seqs": [0],
                                "build": "single", "policy_version": step - 1, "step": step})
    values = {"reward/mean": sum(a.reward for g in groups for a in g) / max(1, sum(len(g) for g in groups)),
              "train/logprob_mismatch_mean": 0.01, "train/logprob_mismatch_max": 0.05, **(metrics or {})}
    rollout_services.record_step(run.pk, step, step, samples, {}, values, batch)
    return rollouts
