"""Scheduler checkpoints for resuming: complete folders only, the counters a resume needs, heard of after the step."""
import json

import pytest

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer.config import TrainerConfig
from trainer.policy import STATE_FILE, Policy
from trainer.samples import CallRecord
from trainer.scheduler import SCHEDULER_STATE_FILE, RolloutResult, Scheduler, StepPhases, read_counters


def tiny_policy(**overrides) -> Policy:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    config = {"tasks_per_step": 2, "group_size": 2, "steps": 3, "learning_rate": 1e-3, "checkpoint_every": 1,
              "dtype": "float32", **overrides}
    return Policy(model, TrainerConfig(**config))


class Engine:
    version = 0

    async def pause(self):
        pass

    async def update_weights(self, model, version):
        self.version = version

    async def resume(self):
        pass


class Source:
    """Rollouts finish in launch order, except that group `slow` finishes only after `delay` later launches."""

    def __init__(self, slow: int = -1, delay: int = 0):
        self.slow, self.delay, self.queue, self.launched = slow, delay, [], []

    async def launch(self, group):
        self.launched.append(group.group_id)
        finish = len(self.launched) + (self.delay if group.group_id == self.slow else 0)
        for a in range(group.size):
            call = CallRecord(0, (1, 2 + group.group_id % 8), (3 + a, 4), (-1.0, -1.0),
                              policy_version=group.policy_version)
            result = RolloutResult(group.group_id, f"{group.group_id}/{a}", (call,), float(a % 2))
            self.queue.append((finish, group.group_id, a, result))

    async def next_finished(self):
        self.queue.sort(key=lambda item: item[:3])
        return self.queue.pop(0)[3]

    async def cancel(self, group_id):
        self.queue = [item for item in self.queue if item[1] != group_id]


async def test_it_hears_of_each_complete_checkpoint_after_that_steps_report(tmp_path):
    heard = []

    class Hearing(StepPhases):
        async def record(self, report):
            heard.append(("step", report.step))

        async def checkpoint(self, path, step):
            assert (path / STATE_FILE).is_file() and (path / SCHEDULER_STATE_FILE).is_file()
            heard.append(("checkpoint", step, path.name))

    engine = Engine()
    await Scheduler(tiny_policy(steps=2), engine, Source(), checkpoint_dir=tmp_path, phases=Hearing()).run()
    assert heard == [("step", 1), ("checkpoint", 1, "step-000001"), ("step", 2), ("checkpoint", 2, "step-000002")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]  # no .partial left
    # Step 2's groups are admitted while step 1's weights swap in, before the checkpoint: not in its weights.
    assert read_counters(tmp_path / "step-000001") == {"next_group_id": 4, "untrained_groups": [2, 3]}
    assert read_counters(tmp_path / "step-000002") == {"next_group_id": 4, "untrained_groups": []}


async def test_async_counters_name_the_groups_the_checkpoint_has_not_trained(tmp_path):
    engine = Engine()
    source = Source(slow=0, delay=3)  # group 0 lags: later groups are trained first, group 0 stays in flight
    policy = tiny_policy(mode="async", tasks_per_step=1, max_staleness=2, steps=4)
    reports = await Scheduler(policy, engine, source, checkpoint_dir=tmp_path).run()
    for report in reports:
        counters = read_counters(tmp_path / f"step-{report.step:06d}")
        trained = {r.group_id for earlier in reports[:report.step] for r in earlier.rollouts}
        launched = set(range(counters["next_group_id"]))
        assert set(counters["untrained_groups"]) == launched - trained
    first = read_counters(tmp_path / "step-000001")["untrained_groups"]
    assert 0 in first and 1 not in first  # the lagging group 0 is still in flight; 1 was trained first


async def test_a_folder_left_at_the_same_step_by_an_abandoned_trajectory_is_replaced(tmp_path):
    stale = tmp_path / "step-000001"
    stale.mkdir()
    (stale / "leftover.bin").write_bytes(b"x")
    (tmp_path / "step-000002.partial").mkdir()  # a save cut short
    await Scheduler(tiny_policy(steps=2), Engine(), Source(), checkpoint_dir=tmp_path).run()
    assert not (stale / "leftover.bin").exists() and (stale / STATE_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000002"]
    assert json.loads((stale / STATE_FILE).read_text()) == {"step": 1}


def test_a_checkpoint_from_before_counters_reads_as_none(tmp_path):
    assert read_counters(tmp_path) is None


class FinishingAt(StepPhases):
    """A run whose owner asks it to finish after `step` at a given moment: while that step records (before its
    evaluation and checkpoint), or once the next step has started generating (the web app's watcher reads the
    request up to 0.5 s late). It evaluates the last step, as runs.orchestrator.RunPhases does."""

    def __init__(self, step: int, moment: str):
        self.step, self.moment, self.steps, self.heard = step, moment, None, []

    def last_step(self, configured):
        return configured if self.steps is None else min(configured, self.steps)

    def evaluates_at(self, version):
        return version >= self.last_step(10**9)

    async def phase(self, text):
        if self.moment == "next step generates" and text == f"step {self.step + 1}: generating rollouts":
            self.steps = self.step

    async def record(self, report):
        self.heard.append(("step", report.step))
        if self.moment == "record" and report.step == self.step:
            self.steps = self.step

    async def evaluate(self, version):
        self.heard.append(("evaluate", version))

    async def checkpoint(self, path, step):
        assert (path / STATE_FILE).is_file()
        self.heard.append(("checkpoint", step, path.name))


@pytest.mark.parametrize("moment", ["record", "next step generates"])
async def test_a_finish_asked_after_the_checkpoint_decision_still_checkpoints_the_last_step(tmp_path, moment):
    phases = FinishingAt(step=2, moment=moment)
    policy = tiny_policy(steps=5, checkpoint_every=0)  # only the final step is checkpointed
    reports = await Scheduler(policy, Engine(), Source(), checkpoint_dir=tmp_path, phases=phases).run()
    assert [r.step for r in reports] == [1, 2] and policy.step == 2
    assert phases.heard == [("step", 1), ("step", 2), ("evaluate", 2), ("checkpoint", 2, "step-000002")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    assert json.loads((tmp_path / "step-000002" / STATE_FILE).read_text()) == {"step": 2}
    counters = read_counters(tmp_path / "step-000002")
    trained = {r.group_id for report in reports for r in report.rollouts}
    assert set(counters["untrained_groups"]) == set(range(counters["next_group_id"])) - trained
