"""An honest learning test: real sampling from the current policy, real rewards, real GRPO updates."""
import logging

import pytest
import torch

from tests.trainer.inprocess import SimulatedHarness, TorchEngine, tiny_qwen2
from trainer.config import TrainerConfig
from trainer.policy import Policy
from trainer.scheduler import run

VOCAB = 32
GOOD = frozenset(range(16, 24))  # a quarter of the vocabulary: a random policy scores about 0.25
MAX_STEPS = 40
logger = logging.getLogger(__name__)


def reward(task, calls):
    """Fraction of all sampled tokens (over both calls) that fall in GOOD."""
    tokens = [t for c in calls for t in c.completion_ids]
    return sum(t in GOOD for t in tokens) / len(tokens)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_it_learns_a_trivial_reward_within_a_bounded_number_of_steps(mode):
    torch.manual_seed(0)
    config = TrainerConfig(dtype="float32", steps=MAX_STEPS, tasks_per_step=4, group_size=4, learning_rate=3e-3, temperature=1.0,
                           mode=mode, seed=0)
    model = tiny_qwen2(vocab_size=VOCAB, seed=0)
    engine = TorchEngine(model, temperature=config.temperature, seed=0)
    source = SimulatedHarness(engine, reward, calls=2, max_new_tokens=4, seed=0)
    reports = await run(Policy(model, config), engine, source)

    curve = [r.metrics["reward/mean"] for r in reports]
    logger.info("%s reward curve: %s", mode, [round(x, 3) for x in curve])  # --log-cli-level=INFO shows it
    assert curve[0] < 0.45  # it starts near chance
    first = next((i for i, x in enumerate(curve) if x >= 0.9), None)
    assert first is not None and first < MAX_STEPS
    assert sum(curve[-5:]) / 5 >= 0.85  # and stays there
    assert max(r.metrics["staleness/max"] for r in reports) <= config.effective_max_staleness
