"""Shared trainer fixtures: one torch thread (the CI box has two cores), tiny models, random samples."""
import random

import pytest
import torch

from trainer.samples import Sample

torch.set_num_threads(1)


def make_sample(prompt, completion, logprob=-1.0, version=0, seq=0):
    """A single-call sample: `prompt` unweighted, `completion` weighted with a constant behaviour logprob."""
    ids = tuple(prompt) + tuple(completion)
    mask = (0,) * len(prompt) + (1,) * len(completion)
    return Sample(ids, mask, tuple(logprob * m for m in mask), tuple(version if m else -1 for m in mask),
                  (), (seq,), "single")


@pytest.fixture
def random_samples():
    rng = random.Random(7)
    return [make_sample([rng.randrange(64) for _ in range(rng.randint(1, 12))],
                        [rng.randrange(64) for _ in range(rng.randint(1, 8))], logprob=-4.0, seq=i)
            for i in range(10)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A deterministic tiny Qwen2 model folder (seed 0): safetensors, tokenizer, ChatML template."""
    from trainer.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)
