"""Training memory: the micro-batch budget a memory limit allows, and a resident set that falls back after steps."""
import random

import pytest
from transformers import LlamaConfig

from tests.trainer.conftest import make_sample
from tests.trainer.inprocess import tiny_qwen2
from trainer.config import ConfigError, TrainerConfig
from trainer.memory import GB, micro_batch_positions, rss_bytes
from trainer.policy import Policy

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
SMOLLM2_PARAMS = 134_515_008
# Fixed: 0.9e9 (libraries, heap slack) + 134,515,008 x 16 (weights, gradients, AdamW) + 3 x 49,152 x 576 x 4 (head
# gradients) = 900,000,000 + 2,152,240,128 + 339,738,624 = 3,391,978,752 bytes, so 5 GB leaves 1,608,021,248.


@pytest.mark.parametrize("overrides, positions", [
    ({"dtype": "float32"}, 969),  # float32: 30 layers x 576 x 96 = 1,658,880 bytes a position; 1,608,021,248 / that = 969.3
    # bfloat16: autocast's weight copies take 2 x 134,515,008 more, leaving 1,338,991,232; 30 x 576 x 64 = 1,105,920
    # bytes a position: 1210.7, capped at micro_batch_tokens=1024 unless that is raised.
    ({"dtype": "bfloat16"}, 1024),
    ({"dtype": "bfloat16", "micro_batch_tokens": 4096}, 1210),
    ({"dtype": "float32", "gradient_checkpointing": True, "micro_batch_tokens": 4096}, 3877),  # 30 x 576 x 24 = 414,720 bytes: 3877.4
    ({"dtype": "float32", "kl_coef": 0.1}, 644),  # the reference model's 4 bytes a parameter leave 1,069,961,216: 644.99
    ({"max_train_memory_gb": 0.0, "micro_batch_tokens": 5000}, 5000),  # no limit: as configured
])
def test_it_derives_the_micro_batch_budget_from_the_memory_limit(overrides, positions):
    assert micro_batch_positions(TrainerConfig(**overrides), SMOLLM2, SMOLLM2_PARAMS) == positions


def test_it_refuses_a_memory_limit_the_model_state_alone_exceeds():
    with pytest.raises(ConfigError) as info:
        micro_batch_positions(TrainerConfig(dtype="float32", max_train_memory_gb=3.0), SMOLLM2, SMOLLM2_PARAMS)
    # 3,391,978,752 + 512 positions x 1,658,880 = 4.24 GB
    assert str(info.value).endswith("take 3.4 GB; set max_train_memory_gb above 4.2 or 0 (no limit)")


def test_it_trains_with_the_budget_its_memory_limit_allows(random_samples):
    model = tiny_qwen2()  # 2 layers, hidden 64, vocab 64: 12,288 bytes a position in float32
    params = sum(p.numel() for p in model.parameters())
    assert params == 78_400
    # 0.901 GB - 0.9e9 - 78,400 x 16 - 3 x 64 x 64 x 4 = 1,000,000 - 1,254,400 - 49,152 < 0: too small.
    with pytest.raises(ConfigError, match="max_train_memory_gb=0.901 leaves no room"):
        Policy(model, TrainerConfig(dtype="float32", max_train_memory_gb=0.901))
    # 0.902 GB leaves 2,000,000 - 1,303,552 = 696,448 bytes: 56 positions of 12,288.
    policy = Policy(model, TrainerConfig(dtype="float32", max_train_memory_gb=0.902))
    assert policy.train_step(random_samples, [1.0] * 10, list(range(10)))["train/micro_batch_positions"] == 56


@pytest.mark.slow
def test_it_returns_to_its_resting_memory_after_every_step():
    rng = random.Random(0)
    vocab = 4096
    config = TrainerConfig(dtype="float32", learning_rate=1e-4, micro_batch_tokens=2048)
    policy = Policy(tiny_qwen2(vocab_size=vocab, hidden_size=256, layers=4), config)
    resting = rss_bytes()
    after, peaks = {}, {}
    for step in range(1, 31):
        # Agent-like mix: prompts of 20 to 200 tokens, completions of 5 to 60; about 1,700 tokens a step.
        samples = [make_sample([rng.randrange(vocab) for _ in range(rng.randint(20, 200))],
                               [rng.randrange(vocab) for _ in range(rng.randint(5, 60))], logprob=-3.0)
                   for _ in range(12)]
        metrics = policy.train_step(samples, [rng.choice([-1.0, 1.0]) for _ in samples], list(range(12)))
        assert metrics["train/rss_gb"] == pytest.approx(rss_bytes() / GB, rel=0.01)
        peaks[step], after[step] = (metrics["train/peak_rss_gb"] * GB - resting, metrics["train/rss_gb"] * GB - resting)
    # A micro-batch's activations take about 200 MB; what stays is the AdamW state (30 MB) and little else.
    assert min(peaks.values()) > 100e6
    for step in after:
        assert after[step] < 0.5 * peaks[step], step
    assert rss_bytes() == pytest.approx(resting + after[5], rel=0.1)
