"""The trainer's logprobs follow the run's sampling transform (temperature, top-k) as vLLM's processed logprobs do."""
import math

import pytest
import torch

from tests.trainer.conftest import make_sample
from tests.trainer.inprocess import tiny_qwen2
from trainer.config import ConfigError, TrainerConfig
from trainer.policy import Policy, sampling_logits


def test_sampling_logits_scale_by_temperature_and_keep_the_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert sampling_logits(logits, 0.5).tolist() == [[4.0, 2.0, 0.0, -2.0]]
    top2 = sampling_logits(logits, 0.5, top_k=2)
    assert top2[0, :2].tolist() == [4.0, 2.0] and top2[0, 2:].tolist() == [-math.inf, -math.inf]
    assert torch.equal(sampling_logits(logits, 1.0, top_k=-1), logits)  # -1 and 0 mean off
    assert torch.equal(sampling_logits(logits, 1.0, top_k=0), logits)


def test_policy_logprobs_are_those_of_the_top_k_distribution_at_the_runs_temperature():
    torch.manual_seed(0)
    model = tiny_qwen2()
    sample = make_sample([3, 4, 5], [6, 7, 8, 9])
    plain, _ = Policy(model, TrainerConfig(dtype="float32", temperature=0.7)).logprobs([sample])
    topk, entropy = Policy(model, TrainerConfig(dtype="float32", temperature=0.7, top_k=8)).logprobs([sample])
    with torch.no_grad():  # reference: the whole sequence through the model, then the transform by hand
        logits = model(torch.tensor([sample.token_ids])).logits[0, 2:-1] / 0.7  # (4, V) predicting tokens 3..6
    targets = torch.tensor(sample.token_ids[3:])
    expected_plain = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    kth = logits.topk(8, -1).values[:, -1:]
    masked = torch.log_softmax(logits.masked_fill(logits < kth, -math.inf), -1)
    expected_topk = masked.gather(1, targets[:, None])[:, 0].clamp(min=-50.0)
    assert plain.tolist() == pytest.approx(expected_plain.tolist(), abs=1e-5)
    assert topk.tolist() == pytest.approx(expected_topk.tolist(), abs=1e-5)
    assert torch.isfinite(entropy).all() and (entropy <= math.log(8) + 1e-5).all()


def test_the_config_refuses_what_the_trainer_cannot_reproduce():
    with pytest.raises(ConfigError, match="top_p=0.9 is not supported.*set top_p=1.0"):
        TrainerConfig(top_p=0.9)
    with pytest.raises(ConfigError, match="top_k must be -1 or 0"):
        TrainerConfig(top_k=-2)
    assert TrainerConfig(temperature=0.6, top_k=40).sampling == {"temperature": 0.6, "top_p": 1.0, "top_k": 40}
    assert TrainerConfig.from_dict({"failure_reward": -1}).failure_reward == -1.0
