"""Fork-heavy harnesses train correctly: a sub-agent and a compaction split one rollout into exact samples.

compacting_agent.py runs the conformance task against the scripted engine behind the recording proxy; the script
below is the model's side. The rollout makes 8 calls: the main agent reads the file (0), delegates (1) to a
sub-agent with its own system prompt (2, 3), runs the command the sub-agent named (4), has its history summarised
(5: a side request to a summariser, or inline as one more turn of the main conversation) and goes on from
[system, summary, latest turns] (6, 7). Each sample's loss mask is checked token by token against what the engine
produced, then the samples go through the trainer's packing and one real training step on the orchestrator's path
(harness source, proxy recording into the database, scheduler, stored samples); only vLLM is left out: a random
model would not follow the script.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from asgiref.sync import sync_to_async
from django.db import connections

from proxy.app import create_app
from proxy.scripted_engine import ScriptedEngine, ScriptedServer
from proxy.scripted_policy import Answer, task_command, text_of
from proxy.server import ProxyServer
from proxy.types import UpstreamConfig
from runs import rollout_services
from runs.gated_engine import GatedEngine
from runs.harness_check import CheckResult, check_harness
from runs.harness_source import HarnessSource
from runs.models import ModelCall, Rollout, Sample
from runs.orchestrator import _batch_rows, _drift_rows, _sample_rows
from runs.recorder import DjangoRecorder, cached_directory
from tests.conformance import compacting_agent as agent
from tests.conformance.conftest import CONFORMANCE_TASK, REWARD_SOURCE
from tests.trainer.test_scheduler import SpyEngine
from trainer import scheduler
from trainer.config import TrainerConfig
from trainer.packing import layout, pack
from trainer.policy import Policy

pytestmark = pytest.mark.conformance

AGENT = Path(agent.__file__)
SUMMARY = "The agent read notes.txt (status: draft), asked a sub-agent for the command and ran it."
QUESTION = "Which shell command does this task ask for? "
WRONG_COMMAND = "sed -i 's/draft/done/' notes.txt"
SUB, SUMMARY_CALL, RESTART = (2, 3), 5, 6
SIDE_SUMMARY = {"samples": [(0, 1, 4), (2, 3), (5,), (6, 7)], "builds": ["merged", "merged", "single", "merged"],
                "drift": {0: "clean", 1: "clean", 2: "fork", 3: "clean", 4: "clean", 5: "fork", 6: "fork", 7: "clean"}}
"""A summariser with its own system prompt: main before compaction, sub-agent, summary, compacted restart."""
INLINE_SUMMARY = {"samples": [(0, 1, 4, 5), (2, 3), (6, 7)], "builds": ["merged", "merged", "merged"],
                  "drift": {0: "clean", 1: "clean", 2: "fork", 3: "clean", 4: "clean", 5: "clean", 6: "fork",
                            7: "clean"}}
"""The summary asked inside the main conversation extends it, so it trains in the main sample."""
MODES = {"chat": ("chat", True, SIDE_SUMMARY), "messages": ("messages", False, SIDE_SUMMARY),
         "inline": ("chat", True, INLINE_SUMMARY)}
"""Per agent mode: the sub-agent's API, whether it streams (the main agent and the summary always stream Chat
Completions), and the samples and drift classes expected."""


class CompactingScript:
    """The model's side of the conversation, read off each request the way a model would.

    The n-th sub-agent answers with the n-th of `sub_commands` (cycling; None: the command its question names),
    so a group of rollouts can hold a right and a wrong answer.
    """

    def __init__(self, sub_commands: tuple[str | None, ...] = (None,)):
        self.sub_commands, self.sub_answers = sub_commands, 0

    def __call__(self, messages: list[dict], tools: list[dict] | None) -> Answer:
        system, last = text_of(messages[0]["content"]), messages[-1]
        if system == agent.SUMMARISER_SYSTEM:
            return Answer(SUMMARY)
        if system == agent.SUB_AGENT_SYSTEM:
            return self.sub_agent(messages)
        if text_of(last["content"]) == agent.SUMMARY_REQUEST:
            return Answer(SUMMARY)
        if last["role"] == "user":  # the task
            return shell("cat notes.txt")
        result = text_of(last["content"])
        if "status: draft" in result:
            return Answer("", (("delegate", {"question": QUESTION + text_of(messages[1]["content"])}),))
        if result.startswith("Use: "):  # the sub-agent's answer
            return shell(result.removeprefix("Use: "))
        if result.startswith("status:"):  # the edited file
            return Answer("DONE")
        return shell("cat notes.txt")

    def sub_agent(self, messages: list[dict]) -> Answer:
        if messages[-1]["role"] == "user":
            return shell("grep -n draft notes.txt")
        command = self.sub_commands[self.sub_answers % len(self.sub_commands)] or task_command(messages)
        self.sub_answers += 1
        return Answer(f"Use: {command}")


def shell(command: str) -> Answer:
    return Answer("", (("shell", {"command": command}),))


def agent_command(mode: str) -> list[str]:
    return [sys.executable, str(AGENT), "--task", "{task_file}", "--out", "{output_file}", "--workdir", "{workdir}",
            "--base-url", "{base_url}", "--api-key={api_key}", "--model", "{model}", "--mode", mode]


@pytest.fixture(scope="module")
def checked(tiny_tokenizer_dir, tmp_path_factory):
    """checked(mode) -> the harness check of one compacting rollout (run once per mode for the module)."""
    results: dict[str, CheckResult] = {}

    def get(mode: str) -> CheckResult:
        if mode not in results:
            results[mode] = check_harness(agent_command(mode), {}, 120, CONFORMANCE_TASK,
                                          workdir=tmp_path_factory.mktemp(f"fork-{mode}"),
                                          tokenizer_dir=tiny_tokenizer_dir, reward_source=REWARD_SOURCE,
                                          policy=CompactingScript(), read_only=[str(AGENT.parents[2] / "examples")])
        return results[mode]

    return get


def expected_mask(token_ids, call_seqs, prompts: dict[int, list[int]], completions: dict[int, list[int]]
                  ) -> list[int]:
    """1 exactly where a merged call's completion sits: right after that call's prompt (a clean extension)."""
    mask = [0] * len(token_ids)
    for seq in call_seqs:
        start, end = len(prompts[seq]), len(prompts[seq]) + len(completions[seq])
        assert list(token_ids[start:end]) == completions[seq], f"call {seq}'s completion is not where it ran"
        mask[start:end] = [1] * (end - start)
    return mask


def trained_runs(samples: list[tuple]) -> Counter:
    """The maximal runs of loss tokens of (token_ids, loss_mask) pairs, counted over all of them."""
    runs: Counter = Counter()
    for token_ids, loss_mask in samples:
        current: list[int] = []
        for token, m in zip([*token_ids, None], [*loss_mask, 0]):
            if m:
                current.append(token)
            elif current:
                runs[tuple(current)] += 1
                current = []
    return runs


@pytest.mark.parametrize("mode", MODES)
def test_a_sub_agent_and_a_compaction_split_the_rollout_into_exactly_masked_samples(checked, mode):
    result = checked(mode)
    assert result.harness.exit_code == 0, result.report()["harness"]
    assert (result.outcome["files"], result.outcome["final_message"]) == ({"notes.txt": "status: final\n"}, "DONE")
    assert (result.outcome["sub_agents"], result.outcome["compactions"]) == (1, 1)
    assert result.reward["reward"] == 1.0 and result.verdict == "ok", result.report()["reasons"]
    sub_api, sub_stream, expected = MODES[mode]
    calls = result.calls
    assert [(c.seq, c.api, c.stream, c.status_code) for c in calls] == [
        (seq, sub_api if seq in SUB else "chat", sub_stream if seq in SUB else True, 200) for seq in range(8)]
    # The proxy recorded exactly the ids the engine produced, call by call (the agent makes one call at a time).
    completions = {c.seq: list(c.completion_ids) for c in calls}
    prompts = {c.seq: list(c.prompt_ids) for c in calls}
    assert [completions[seq] for seq in range(8)] == result.produced
    assert result.build.drift == expected["drift"]
    samples = result.build.samples
    assert [s.call_seqs for s in samples] == expected["samples"]
    assert [s.build for s in samples] == expected["builds"]
    for sample in samples:
        last = sample.call_seqs[-1]
        assert list(sample.token_ids) == prompts[last] + completions[last]
        assert list(sample.loss_mask) == expected_mask(sample.token_ids, sample.call_seqs, prompts, completions)
    # Every engine completion is trained exactly once, and nothing else is.
    assert trained_runs([(s.token_ids, s.loss_mask) for s in samples]) == Counter(map(tuple, result.produced))
    assert result.trained_tokens == result.engine_tokens == sum(map(len, result.produced))


@pytest.mark.parametrize("mode", MODES)
def test_the_summary_and_the_kept_turns_are_context_of_the_restart_not_trained_again(checked, mode):
    result = checked(mode)
    decode, samples = result.decode, result.build.samples
    summarised = next(s for s in samples if SUMMARY_CALL in s.call_seqs)
    span = next(span for span in summarised.spans if span.call_seq == SUMMARY_CALL and span.sampled)
    assert decode(summarised.token_ids[span.start:span.end]) == SUMMARY + "<|im_end|>"
    restart = next(s for s in samples if s.call_seqs[0] == RESTART)
    context = decode([t for t, m in zip(restart.token_ids, restart.loss_mask) if not m])
    trained = decode([t for t, m in zip(restart.token_ids, restart.loss_mask) if m])
    assert f"{agent.SUMMARY_PREFIX}\n{SUMMARY}" in context
    assert "sed -i 's/draft/final/' notes.txt" in context  # the kept turn: trained in the main sample, context here
    assert "sed" not in trained and SUMMARY not in trained
    assert trained == "".join(decode(result.produced[seq]) for seq in restart.call_seqs)


def test_the_trainer_packs_exactly_the_union_of_the_sample_masks(checked):
    samples = checked("chat").build.samples
    batch = pack(samples)
    packed_mask = torch.zeros_like(batch.input_ids)  # (R, L)
    packed_mask[batch.logit_rows, batch.logit_cols + 1] = 1  # the logit at t-1 predicts the loss token at t
    union = torch.zeros_like(batch.input_ids)
    for r, row in enumerate(layout([len(s.token_ids) for s in samples])):
        offset = 0
        for k in row:
            ids, mask = samples[k].token_ids, samples[k].loss_mask
            assert batch.input_ids[r, offset:offset + len(ids)].tolist() == list(ids)
            assert mask[0] == 0  # a sample opens with its prompt: pack never has to drop a loss token
            union[r, offset:offset + len(ids)] = torch.tensor(mask)
            offset += len(ids)
    assert torch.equal(packed_mask, union)
    assert batch.targets.tolist() == [t for s in samples for t, m in zip(s.token_ids, s.loss_mask) if m]
    assert batch.behaviour.tolist() == pytest.approx([lp for s in samples for lp, m in zip(s.logprobs, s.loss_mask)
                                                      if m])
    assert batch.sample_index.tolist() == [k for k, s in enumerate(samples) for m in s.loss_mask if m]


def compacting_run(make_run, owner):
    """A run whose harness is the compacting agent and whose one train task is the conformance task."""
    run = make_run(owner)
    run.harness_snapshot = {**run.harness_snapshot, "command": agent_command("chat"), "env": {}, "timeout_s": 120,
                            # the agent imports examples/harnesses/harness_common: shown read-only in the sandbox
                            "resources": {"read_only": [str(AGENT.parents[2] / "examples")]}}
    run.reward_snapshot = {**run.reward_snapshot, "source": REWARD_SOURCE}
    run.save(update_fields=["harness_snapshot", "reward_snapshot"])
    task = run.dataset.tasks.filter(split="train").first()
    task.data = {**CONFORMANCE_TASK, "id": task.external_id, "split": "train"}
    task.save()
    return run, task


def stored(run):
    """(rollout, its calls by seq, its sample rows) of each train rollout of the run, by reward."""
    out = []
    for rollout in Rollout.objects.filter(run=run, split="train").order_by("-reward"):
        calls = {c.seq: c for c in ModelCall.objects.filter(rollout=rollout)}
        out.append((rollout, calls, list(Sample.objects.filter(rollout=rollout).order_by("index"))))
    return out


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
async def test_a_run_step_over_compacting_rollouts_trains_each_completion_once_and_moves_the_weights(
        alice, make_run, tiny_tokenizer_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, task = await sync_to_async(compacting_run)(make_run, alice)
    # One group of two attempts: the first sub-agent to answer names the task's command, the second a wrong one.
    engine = ScriptedEngine(tiny_tokenizer_dir, policy=CompactingScript(sub_commands=(None, WRONG_COMMAND)))
    config = TrainerConfig(dtype="float32", steps=1, tasks_per_step=1, group_size=2, learning_rate=1e-3)
    policy = Policy(AutoModelForCausalLM.from_pretrained(tiny_tokenizer_dir, dtype=torch.float32), config)
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}

    class Recording(scheduler.StepPhases):
        async def record(self, report: scheduler.StepReport) -> None:  # what the orchestrator stores of a step
            await sync_to_async(rollout_services.record_step)(run.pk, report.policy_version, report.policy_version,
                                                              _sample_rows(report), _drift_rows(report),
                                                              report.metrics, _batch_rows(report))

    with ScriptedServer(engine) as server:
        upstream = UpstreamConfig(base_url=server.base_url, served_model="scripted")
        proxy = ProxyServer(create_app(cached_directory(run.pk, ttl_s=0.1), DjangoRecorder(), upstream), host="127.0.0.1")
        proxy.start()
        try:
            source = HarnessSource(run, config, proxy, tmp_path / "work", [task.pk])
            reports = await scheduler.run(policy, GatedEngine(SpyEngine(), proxy), source,
                                          decode=AutoTokenizer.from_pretrained(tiny_tokenizer_dir).decode,
                                          phases=Recording())
        finally:
            proxy.stop()

    (good, good_calls, good_rows), (bad, bad_calls, bad_rows) = await sync_to_async(stored)(run)
    await sync_to_async(connections.close_all)()  # the database thread's connection: let the test database go
    report, = reports
    assert math.isfinite(report.metrics["loss/total"]) and report.metrics["train/samples"] == 8
    assert any(not torch.equal(p, before[name]) for name, p in policy.model.named_parameters())
    assert [(r.status, r.reward, r.trained_step) for r in (good, bad)] == [("succeeded", 1.0, 1), ("succeeded", 0.0, 1)]
    trained = Counter()
    for rollout, calls, rows in ((good, good_calls, good_rows), (bad, bad_calls, bad_rows)):
        assert {seq: c.drift for seq, c in calls.items()} == SIDE_SUMMARY["drift"]
        assert [tuple(row.call_seqs) for row in rows] == SIDE_SUMMARY["samples"]
        prompts = {seq: c.prompt_ids for seq, c in calls.items()}
        completions = {seq: c.completion_ids for seq, c in calls.items()}
        for row in rows:
            assert row.loss_mask == expected_mask(row.token_ids, row.call_seqs, prompts, completions)
            # The trainer measured a logprob exactly where it trained: the packed mask is the stored one.
            assert [lp is not None for lp in row.trainer_logprobs] == [bool(m) and t > 0
                                                                      for t, m in enumerate(row.loss_mask)]
        assert len({row.advantage for row in rows}) == 1  # every sample carries its rollout's advantage
        trained += trained_runs([(row.token_ids, row.loss_mask) for row in rows])
    assert good_rows[0].advantage > 0 > bad_rows[0].advantage
    assert trained == Counter(map(tuple, engine.produced))  # 16 completions, each trained once
