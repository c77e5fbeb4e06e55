"""Distributed trainer (gloo on CPU): world size 2 takes world size 1's steps, checkpoints cross world sizes,
and no rank outlives its trainer."""
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2ForCausalLM

from tests.trainer.conftest import make_sample
from tests.trainer.inprocess import tiny_qwen2
from trainer.config import TrainerConfig
from trainer.distributed import DistributedPolicy, TrainerRankFailed, make_policy, shard
from trainer.policy import OPTIMIZER_DIR, OPTIMIZER_FILE, Policy

# Several micro-batches per rank, two optimizer steps per training step (the second clips against the logprobs
# before the step), a reference model, a per-sequence loss aggregation and active gradient clipping: every place
# where a rank's share must be weighted by the whole batch.
CONFIG = TrainerConfig(dtype="float32", learning_rate=1e-3, micro_batch_tokens=24, updates_per_step=2, kl_coef=0.1,
                       loss_agg="seq_mean_token_mean", max_grad_norm=0.5)
TOLERANCE = 1e-5


def batches(samples):
    return [(samples, [1.0, -0.5] * 5, [i // 2 for i in range(10)]),
            (samples[::-1], [-1.0, 0.25] * 5, list(range(10)))]


def weights(policy):
    return {name: t.detach().clone() for name, t in policy.model.state_dict().items()}


def assert_same_weights(got, expected):
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=TOLERANCE, rtol=0), \
            f"{name}: max diff {(got[name] - expected[name]).abs().max().item():.2e}"


def running(pid):
    """Whether `pid` is a live process (a zombie awaiting its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone(pids):
    assert pids and not any(running(pid) for pid in pids)
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, random_samples_module):
    """World size 1: weights after each of the two steps, their metrics and a checkpoint after the first."""
    policy = Policy(tiny_qwen2(seed=1), CONFIG)
    after, metrics = [], []
    for k, batch in enumerate(batches(random_samples_module)):
        metrics.append(policy.train_step(*batch))
        after.append(weights(policy))
        if k == 0:
            checkpoint = policy.save_checkpoint(tmp_path_factory.mktemp("ws1") / "step-000001")
            logprobs = policy.trained_logprobs
    return {"weights": after, "metrics": metrics, "checkpoint": checkpoint, "trained_logprobs": logprobs}


@pytest.fixture(scope="module")
def random_samples_module():
    """The conftest's random_samples, for module-scoped fixtures."""
    rng = random.Random(7)
    return [make_sample([rng.randrange(64) for _ in range(rng.randint(1, 12))],
                        [rng.randrange(64) for _ in range(rng.randint(1, 8))], logprob=-4.0, seq=i)
            for i in range(10)]


def test_it_cuts_a_batch_into_contiguous_shards_of_near_equal_tokens():
    assert shard([4, 4, 4, 4], 2) == [range(0, 2), range(2, 4)]
    assert shard([10, 1, 1, 1, 1, 6], 2) == [range(0, 1), range(1, 6)]
    assert shard([5], 2) == [range(0, 1), range(1, 1)]  # fewer samples than ranks: one rank trains none
    assert shard([], 3) == [range(0, 0)] * 3
    assert shard([3, 3, 3], 1) == [range(0, 3)]


def test_it_takes_world_size_1s_steps_at_world_size_2_and_its_checkpoint_resumes_at_world_size_1(
        tmp_path, random_samples_module, reference):
    first, second = batches(random_samples_module)
    # Rank 0 starts from seed 1; rank 1 builds a seed-0 model that rank 0's weights must overwrite.
    with DistributedPolicy(tiny_qwen2(seed=1), CONFIG, world_size=2) as policy:
        pids = policy.pids
        assert len(pids) == 1 and running(pids[0])
        metrics = policy.train_step(*first)
        assert_same_weights(weights(policy), reference["weights"][0])
        expected = reference["metrics"][0]
        assert metrics["train/loss_tokens"] == expected["train/loss_tokens"] == sum(s.num_loss_tokens for s in first[0])
        assert metrics["train/tokens"] == expected["train/tokens"]
        assert metrics["loss/policy"] == pytest.approx(expected["loss/policy"], abs=1e-6)
        assert metrics["actor/grad_norm"] == pytest.approx(expected["actor/grad_norm"], rel=1e-5)
        # Each rank kept the logprobs of the samples it trained; rank 0 reports every sample's.
        got = [v for row in policy.trained_logprobs for v in row]
        want = [v for row in reference["trained_logprobs"] for v in row]
        assert [v is None for v in got] == [v is None for v in want]
        assert [v for v in got if v is not None] == pytest.approx([v for v in want if v is not None], abs=1e-5)

        checkpoint = policy.save_checkpoint(tmp_path / "step-000001")
        policy.train_step(*second)  # rank 1 trains its shard with its own weights: they must still be equal
        assert_same_weights(weights(policy), reference["weights"][1])
        assert policy.step == policy.version == 2
    assert_gone(pids)

    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / OPTIMIZER_DIR / ".metadata").is_file()
    resumed = Policy(tiny_qwen2(seed=2), CONFIG)  # a different init: everything comes from the checkpoint
    resumed.load_checkpoint(checkpoint)
    assert resumed.step == 1
    resumed.train_step(*second)
    assert_same_weights(weights(resumed), reference["weights"][1])


def test_it_resumes_a_world_size_1_checkpoint_at_world_size_2_and_stops_when_a_rank_dies(
        random_samples_module, reference):
    _, second = batches(random_samples_module)
    threads = torch.get_num_threads()
    policy = make_policy(tiny_qwen2(seed=2), TrainerConfig(**{**CONFIG.to_dict(), "world_size": 2}))
    try:
        assert isinstance(policy, DistributedPolicy) and policy.world_size == 2
        # On CPU the two ranks split this process's cores instead of each taking all of them.
        assert policy.rank_threads == torch.get_num_threads() == max(1, threads // 2)
        policy.load_checkpoint(reference["checkpoint"])
        assert policy.step == 1
        policy.train_step(*second)
        assert_same_weights(weights(policy), reference["weights"][1])

        pids = policy.pids
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(TrainerRankFailed, match="rank 1"):
            policy.train_step(*second)
        assert_gone(pids)
        with pytest.raises(RuntimeError, match="closed"):
            policy.train_step(*second)
    finally:
        policy.close()
    assert not dist.is_initialized()
    assert torch.get_num_threads() == threads  # rank 0's share goes back when the group closes


def test_it_still_loads_checkpoints_with_the_optimizer_in_one_file(tmp_path, random_samples_module, reference):
    first, second = batches(random_samples_module)
    policy = Policy(tiny_qwen2(seed=1), CONFIG)
    policy.train_step(*first)
    old = policy.save_checkpoint(tmp_path / "old")
    torch.save(policy.optimizer.state_dict(), old / OPTIMIZER_FILE)  # the format before OPTIMIZER_DIR
    for f in (old / OPTIMIZER_DIR).iterdir():
        f.unlink()
    (old / OPTIMIZER_DIR).rmdir()
    resumed = Policy(tiny_qwen2(seed=2), CONFIG)
    resumed.load_checkpoint(old)
    resumed.train_step(*second)
    assert_same_weights(weights(resumed), reference["weights"][1])


def test_it_resumes_a_checkpoint_saved_before_the_first_optimizer_step(tmp_path, random_samples_module):
    first, _ = batches(random_samples_module)
    fresh = Policy(tiny_qwen2(seed=1), CONFIG)
    fresh.save_checkpoint(tmp_path / "step-000000")
    assert not (tmp_path / "step-000000" / OPTIMIZER_DIR).exists()
    resumed = Policy(tiny_qwen2(seed=2), CONFIG)
    resumed.load_checkpoint(tmp_path / "step-000000")
    assert not resumed.optimizer.state
    for policy in (fresh, resumed):
        policy.train_step(*first)
    assert_same_weights(weights(resumed), weights(fresh))


def test_it_validates_the_world_size():
    assert TrainerConfig(world_size=4).world_size == 4
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        TrainerConfig(world_size=0)
    assert isinstance(make_policy(tiny_qwen2(), TrainerConfig(dtype="float32")), Policy)


ORPHAN_SCRIPT = """
import time
from tests.trainer.inprocess import tiny_qwen2
from trainer.config import TrainerConfig
from trainer.distributed import DistributedPolicy
policy = DistributedPolicy(tiny_qwen2(), TrainerConfig(dtype="float32"), world_size=3)
print(*policy.pids, flush=True)
time.sleep(600)
"""


def test_its_ranks_exit_when_the_process_that_spawned_them_is_killed():
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT], cwd=root, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(running(pid) for pid in pids)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30  # a liveness bound, not a timing: they go within a second
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids)


async def test_the_scheduler_trains_and_checkpoints_a_distributed_policy_as_a_single_one(tmp_path):
    """Steps and checkpoints run on the scheduler's trainer thread, the policy was built on another one."""
    import asyncio

    from tests.trainer.test_scheduler_checkpoints import Engine, Source, tiny_policy
    from trainer.scheduler import Scheduler

    single = tiny_policy(steps=2)
    await Scheduler(single, Engine(), Source(), checkpoint_dir=tmp_path / "ws1").run()
    reference = tiny_policy(steps=2)
    policy = await asyncio.to_thread(DistributedPolicy, reference.model, reference.config, 2)
    try:
        engine = Engine()
        reports = await Scheduler(policy, engine, Source(), checkpoint_dir=tmp_path / "ws2").run()
        assert [r.policy_version for r in reports] == [1, 2] and engine.version == 2
        assert_same_weights(weights(policy), weights(single))
        assert sorted(p.name for p in (tmp_path / "ws2").iterdir()) == ["step-000001", "step-000002"]
    finally:
        await asyncio.to_thread(policy.close)
    resumed = Policy(tiny_qwen2(seed=3, hidden_size=32, layers=1), single.config)
    resumed.load_checkpoint(tmp_path / "ws2" / "step-000002")
    assert resumed.step == 2
    assert_same_weights(weights(resumed), weights(single))


class BuildsOnlyInTheMainProcess(Qwen2ForCausalLM):
    """A model a spawned rank cannot build (as when its device is out of memory)."""

    def __init__(self, config):
        if multiprocessing.parent_process() is not None:
            raise MemoryError("no room for the model on this rank")
        super().__init__(config)


def test_a_rank_that_fails_to_start_is_named_with_its_error_and_nothing_is_left_running():
    model = tiny_qwen2()
    model.__class__ = BuildsOnlyInTheMainProcess
    with pytest.raises(TrainerRankFailed, match="(?s)start failed: rank 1: .*MemoryError: no room for the model"):
        DistributedPolicy(model, CONFIG, world_size=2)
    assert not dist.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("trainer-rank-")]
