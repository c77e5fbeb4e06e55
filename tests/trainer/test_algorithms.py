"""Advantages, aggregations and the policy loss against hand-computed values and loop references."""
import math
import statistics

import pytest
import torch

from trainer.algorithms import broadcast_to_samples, compute_advantages, loss_weights, policy_loss

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 7, 7, 7, 7])


@pytest.mark.parametrize("name, expected", [
    ("grpo", [0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3), 0.5 / math.sqrt(1 / 3)]),
    ("dr_grpo", [0.5, -0.5, -0.5, 0.5]),
    ("rloo", [2 / 3, -2 / 3, -2 / 3, 2 / 3]),
])
def test_it_computes_group_advantages_by_hand(name, expected):
    advantages, metrics = compute_advantages(name, REWARDS, GROUPS, eps=0.0)
    assert advantages.tolist() == pytest.approx(expected + [0.0] * 4, abs=1e-5)
    assert metrics["advantage/zero_frac"] == pytest.approx(0.5)


def test_it_keeps_a_failed_rollout_in_its_group_baseline():
    # Rollout 1 failed (reward 0, no samples); it still lowers the baseline of rollout 0.
    advantages, _ = compute_advantages("rloo", torch.tensor([1.0, 0.0, 0.5]), torch.tensor([3, 3, 3]))
    assert advantages.tolist() == pytest.approx([0.75, -0.75, 0.0])
    samples_of = torch.tensor([0, 0, 2])  # rollout 0 split into two samples, rollout 1 produced none
    assert broadcast_to_samples(advantages, samples_of).tolist() == pytest.approx([0.75, 0.75, 0.0])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_a_step_with_every_rollout_left_out_has_finite_advantage_metrics(name):
    advantages, metrics = compute_advantages(name, torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert advantages.shape == (0,)
    assert metrics == {"advantage/mean": 0.0, "advantage/abs_mean": 0.0, "advantage/zero_frac": 1.0}


def test_it_gives_zero_advantage_to_a_group_of_one():
    for name in ("grpo", "rloo"):
        assert compute_advantages(name, torch.tensor([1.0]), torch.tensor([0]))[0].tolist() == [0.0]


EQUAL_GROUPS = [[0.1] * 3, [0.7] * 8, [0.9] * 8]  # partial credit whose float sum is inexact (repo suite)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("equal", EQUAL_GROUPS, ids=lambda r: f"{r[0]}x{len(r)}")
def test_a_group_of_equal_rewards_gets_advantage_exactly_zero(name, equal):
    """Issue 40.2: float64 as the scheduler builds them; the mean of [0.1] * 3 is 0.1 + 1.4e-17, which made grpo's
    advantages 1.4e-11 (not 0), so the step without signal still moved the weights."""
    rewards = torch.tensor(equal + [1.0, 0.0, 0.5], dtype=torch.float64)
    groups = torch.tensor([4] * len(equal) + [9, 9, 9])
    advantages, metrics = compute_advantages(name, rewards, groups)
    assert advantages[:len(equal)].tolist() == [0.0] * len(equal)
    assert advantages[len(equal):].tolist() == pytest.approx(loop_advantage(name, [1.0, 0.0, 0.5], [9] * 3, 1e-6))
    # The group's 0.5 sits exactly on its mean: 0 too.
    assert metrics["advantage/zero_frac"] == pytest.approx((len(equal) + 1) / len(rewards))


def loop_advantage(name, rewards, groups, eps):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = statistics.fmean(members)
        if name == "dr_grpo":
            out.append(r - mean)
        elif len(members) < 2:
            out.append(0.0)
        elif name == "grpo":
            out.append((r - mean) / (statistics.stdev(members) + eps))
        else:
            out.append(r - (sum(members) - r) / (len(members) - 1))
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_it_matches_the_loop_reference_on_random_groups(name):
    gen = torch.Generator().manual_seed(3)
    rewards = torch.rand(40, generator=gen, dtype=torch.float64)
    groups = torch.randint(0, 9, (40,), generator=gen)
    advantages, _ = compute_advantages(name, rewards, groups, eps=1e-6)
    assert advantages.tolist() == pytest.approx(loop_advantage(name, rewards.tolist(), groups.tolist(), 1e-6))


def test_it_rejects_unknown_names_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"valid names are \['dr_grpo', 'grpo', 'rloo'\]"):
        compute_advantages("ppo", REWARDS, GROUPS)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        loss_weights("sum", torch.ones(2), torch.zeros(2), torch.zeros(2))


# Three samples: s0 = [1, 2, 3] and s1 = [4] from rollout 0, s2 = [6, 10] from rollout 1.
FLAT_LOSS = torch.tensor([1.0, 2, 3, 4, 6, 10])
FLAT_SAMPLE = torch.tensor([0, 0, 0, 1, 2, 2])
FLAT_ROLLOUT = torch.tensor([0, 0, 0, 0, 1, 1])
PADDED_LOSS = torch.tensor([[1.0, 2, 3], [4, 99, 99], [6, 10, 99]])
PADDED_MASK = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0]])
PADDED_SAMPLE = torch.tensor([[0], [1], [2]]).expand(3, 3)
PADDED_ROLLOUT = torch.tensor([[0], [0], [1]]).expand(3, 3)
HAND = {"token_mean": 26 / 6, "seq_mean_token_mean": (2 + 4 + 8) / 3,
        "seq_mean_token_sum_norm": (6 / 4 + 4 / 4 + 16 / 4) / 3, "rollout_mean": (2.5 + 8) / 2}


def aggregate(name, token_loss, mask, sample_index, rollout_index, norm=1.0):
    """The step's loss as trainer.policy forms it: sum(weights * token_loss), and the weights."""
    weights = loss_weights(name, mask, sample_index, rollout_index, norm).to(token_loss.dtype)
    return (weights * token_loss).sum(), weights


@pytest.mark.parametrize("name", sorted(HAND))
def test_it_aggregates_by_hand_in_flat_and_padded_layouts(name):
    flat, weights = aggregate(name, FLAT_LOSS, torch.ones(6), FLAT_SAMPLE, FLAT_ROLLOUT, norm=4)
    padded, _ = aggregate(name, PADDED_LOSS, PADDED_MASK, PADDED_SAMPLE, PADDED_ROLLOUT, norm=4)
    assert flat.item() == pytest.approx(HAND[name])
    assert padded.item() == pytest.approx(HAND[name])
    # Means weigh to 1 in total; Dr. GRPO's constant divisor weighs 6 tokens / (4 * 3 samples).
    assert weights.sum().item() == pytest.approx(0.5 if name == "seq_mean_token_sum_norm" else 1.0)


def test_it_weighs_each_rollout_the_same_however_many_samples_it_split_into():
    # Rollout 0 split into samples s0 (3 tokens) and s1 (1 token); rollout 1 is one sample of 2 tokens.
    weights = loss_weights("rollout_mean", torch.ones(6), FLAT_SAMPLE, FLAT_ROLLOUT)
    assert weights.tolist() == pytest.approx([1 / 8] * 4 + [1 / 4] * 2)


@pytest.mark.parametrize("name", sorted(HAND))
def test_it_sums_micro_batches_to_the_full_batch_loss(name):
    weights = loss_weights(name, torch.ones(6), FLAT_SAMPLE, FLAT_ROLLOUT, norm=4)
    parts = [(weights[a:b] * FLAT_LOSS[a:b]).sum().item() for a, b in [(0, 3), (3, 4), (4, 6)]]
    assert sum(parts) == pytest.approx(HAND[name])


def loop_aggregate(name, losses, samples, rollouts, norm):
    """Reference: lists of per-sample token losses, grouped by rollout."""
    per_sample = [[l for l, s in zip(losses, samples) if s == k] for k in sorted(set(samples))]
    if name == "token_mean":
        return sum(losses) / len(losses)
    if name == "seq_mean_token_mean":
        return statistics.fmean(statistics.fmean(s) for s in per_sample)
    if name == "seq_mean_token_sum_norm":
        return statistics.fmean(sum(s) / norm for s in per_sample)
    per_rollout = [[l for l, r in zip(losses, rollouts) if r == k] for k in sorted(set(rollouts))]
    return statistics.fmean(statistics.fmean(r) for r in per_rollout)


@pytest.mark.parametrize("name", sorted(HAND))
def test_it_matches_the_loop_reference_on_random_batches(name):
    gen = torch.Generator().manual_seed(5)
    sample_rollout = torch.randint(0, 4, (10,), generator=gen)
    sample_index = torch.randint(0, 10, (200,), generator=gen)
    losses = torch.randn(200, generator=gen, dtype=torch.float64)
    rollout_index = sample_rollout[sample_index]
    got, _ = aggregate(name, losses, torch.ones(200), sample_index, rollout_index, norm=50)
    want = loop_aggregate(name, losses.tolist(), sample_index.tolist(), rollout_index.tolist(), 50)
    assert got.item() == pytest.approx(want)


def test_it_clips_asymmetrically_and_truncates_importance_weights_by_hand():
    old = torch.tensor([-1.0, -1.0, -1.0])
    logp = (old + torch.log(torch.tensor([1.5, 0.5, 1.0]))).requires_grad_()
    behaviour = old - torch.log(torch.tensor([1.0, 3.0, 0.5]))  # pi_old / pi_behaviour = 1, 3, 0.5
    advantages = torch.tensor([1.0, -1.0, 1.0])
    loss, metrics = policy_loss(logp, old, behaviour, advantages, torch.full((3,), 1 / 3),
                                clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    # Token 0 clipped at 1.28, token 1 clipped at 0.8 with weight min(3, 2), token 2 unclipped with 0.5.
    assert loss.item() == pytest.approx((-1.28 + 0.8 * 2 - 1.0 * 0.5) / 3)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.5 / 3])
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 3)
    assert metrics["is/truncated_frac"] == pytest.approx(1 / 3)
    assert metrics["is/weight_max"] == pytest.approx(3.0)
    assert metrics["train/logprob_mismatch_mean"] == pytest.approx((math.log(3) + math.log(2)) / 3)
    assert metrics["mismatch/kl"] == pytest.approx((3 - math.log(3) - 1 + 0.5 + math.log(2) - 1) / 3)


def test_it_adds_the_k3_kl_to_the_reference():
    logp = torch.tensor([-2.0, -1.0])
    ref = logp + torch.log(torch.tensor([2.0, 1.0]))
    loss, metrics = policy_loss(logp, logp, logp, torch.zeros(2), torch.full((2,), 0.5),
                                clip_low=0.2, clip_high=0.2, ref_logprobs=ref, kl_coef=0.1)
    k3 = 2 - math.log(2) - 1
    assert metrics["loss/kl"] == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(0.1 * k3 / 2)
