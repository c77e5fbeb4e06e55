"""Advantage estimators, loss aggregations and the PPO-clip + TIS policy loss: pure tensor functions by name."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from trainer.config import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS

Metrics = dict[str, float]


def _lookup(registry: dict, kind: str, name: str):
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid names are {sorted(registry)}")
    return registry[name]


# ---- advantages -------------------------------------------------------------------------------------------

def _group_stats(rewards: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-rollout group size, group mean and unbiased group std, each (N,).

    The mean of a group whose rewards are all equal is that reward exactly: a float sum is not ([0.1] * 3 sums to
    0.30000000000000004), and r - mean of 1e-17 became a grpo advantage of 1e-11, so a group without signal still
    moved the weights. With the exact mean, such a group's advantages are exactly 0 in every estimator.
    """
    groups, inverse = torch.unique(group_index, return_inverse=True)
    count = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, rewards) / count
    low = torch.full_like(mean, torch.inf).scatter_reduce_(0, inverse, rewards, "amin")
    high = torch.full_like(mean, -torch.inf).scatter_reduce_(0, inverse, rewards, "amax")
    mean = torch.where(low == high, low, mean)  # (G,)
    sq = torch.zeros(len(groups), dtype=rewards.dtype).index_add_(0, inverse, (rewards - mean[inverse]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return count[inverse], mean[inverse], std[inverse]


def grpo_advantage(rewards: Tensor, group_index: Tensor, eps: float) -> Tensor:
    """(r - group mean) / (group std + eps); a group of one gets 0."""
    n, mean, std = _group_stats(rewards, group_index)
    usable = (n > 1) & (std + eps > 0)  # an all-equal group with eps=0 would divide 0 by 0
    return torch.where(usable, (rewards - mean) / (std + eps).clamp(min=1e-30), torch.zeros_like(rewards))


def dr_grpo_advantage(rewards: Tensor, group_index: Tensor, eps: float) -> Tensor:
    """r - group mean (Dr. GRPO drops the std, which over-weights easy and hard groups)."""
    _, mean, _ = _group_stats(rewards, group_index)
    return rewards - mean


def rloo_advantage(rewards: Tensor, group_index: Tensor, eps: float) -> Tensor:
    """r - mean of the other rollouts of the group = (r - mean) * n / (n - 1); a group of one gets 0."""
    n, mean, _ = _group_stats(rewards, group_index)
    return torch.where(n > 1, (rewards - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(rewards))


ADVANTAGES: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "grpo": grpo_advantage, "dr_grpo": dr_grpo_advantage, "rloo": rloo_advantage}
assert tuple(ADVANTAGES) == ADVANTAGE_ESTIMATORS


def compute_advantages(name: str, rewards: Tensor, group_index: Tensor, eps: float = 1e-6
                       ) -> tuple[Tensor, Metrics]:
    """Advantage per rollout (N,). Failed rollouts belong in `rewards` too: they stay in their group's baseline."""
    advantages = _lookup(ADVANTAGES, "advantage estimator", name)(rewards.double(), group_index, eps).to(rewards.dtype)
    if advantages.numel() == 0:  # every rollout of the step was left out: nothing to average (no NaN metrics)
        return advantages, {"advantage/mean": 0.0, "advantage/abs_mean": 0.0, "advantage/zero_frac": 1.0}
    metrics = {"advantage/mean": advantages.mean().item(), "advantage/abs_mean": advantages.abs().mean().item(),
               "advantage/zero_frac": (advantages == 0).double().mean().item()}
    return advantages, metrics


def broadcast_to_samples(rollout_values: Tensor, sample_rollout: Tensor) -> Tensor:
    """Each sample takes its rollout's value: (R,) indexed by (S,) -> (S,)."""
    return rollout_values[sample_rollout]


# ---- loss aggregation -------------------------------------------------------------------------------------
# Each aggregation is expressed as per-token weights (same shape as the mask) so that a step split into
# micro-batches sums exactly to the full-batch loss: loss = sum(weights * token_loss).

def _per_token_count(mask: Tensor, index: Tensor) -> tuple[Tensor, int]:
    """Loss tokens of each token's owner (sample or rollout) and the number of owners with any, (same shape,)."""
    owners, inverse = torch.unique(index, return_inverse=True)
    counts = torch.zeros(len(owners), dtype=mask.dtype).index_add_(0, inverse.flatten(), mask.flatten())
    return counts[inverse], int((counts > 0).sum())


def token_mean_weights(mask: Tensor, sample_index: Tensor, rollout_index: Tensor, norm: float) -> Tensor:
    return mask / mask.sum().clamp(min=1)


def seq_mean_token_mean_weights(mask: Tensor, sample_index: Tensor, rollout_index: Tensor, norm: float) -> Tensor:
    count, owners = _per_token_count(mask, sample_index)
    return mask / (count.clamp(min=1) * max(owners, 1))


def seq_mean_token_sum_norm_weights(mask: Tensor, sample_index: Tensor, rollout_index: Tensor,
                                    norm: float) -> Tensor:
    _, owners = _per_token_count(mask, sample_index)
    return mask / (norm * max(owners, 1))


def rollout_mean_weights(mask: Tensor, sample_index: Tensor, rollout_index: Tensor, norm: float) -> Tensor:
    """Token mean within a rollout (all its samples together), then mean over rollouts."""
    count, owners = _per_token_count(mask, rollout_index)
    return mask / (count.clamp(min=1) * max(owners, 1))


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, Tensor, float], Tensor]] = {
    "token_mean": token_mean_weights, "seq_mean_token_mean": seq_mean_token_mean_weights,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm_weights, "rollout_mean": rollout_mean_weights}
assert tuple(AGGREGATIONS) == LOSS_AGGREGATIONS


def loss_weights(name: str, mask: Tensor, sample_index: Tensor, rollout_index: Tensor, norm: float = 1.0) -> Tensor:
    """Per-token weights of aggregation `name`; all token tensors share one shape (padded (B, T) or flat (N,))."""
    return _lookup(AGGREGATIONS, "loss aggregation", name)(mask.double(), sample_index, rollout_index, norm)


# ---- policy loss ------------------------------------------------------------------------------------------

def policy_loss(logprobs: Tensor, old_logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor,
                weights: Tensor, *, clip_low: float, clip_high: float, tis_cap: float = 0.0,
                ref_logprobs: Tensor | None = None, kl_coef: float = 0.0) -> tuple[Tensor, Metrics]:
    """PPO-clip with asymmetric bounds, truncated importance sampling and an optional k3 KL penalty.

    Every argument is a (M,) tensor over loss tokens: `old_logprobs` are the trainer's (detached) logprobs
    before this step's updates, `behaviour_logprobs` the engine's. `weights` come from `loss_weights`; the
    returned loss is sum(weights * token_loss), so micro-batch losses add up to the step's loss.
    """
    old_logprobs, behaviour_logprobs = old_logprobs.detach(), behaviour_logprobs.detach()
    ratio = torch.exp(logprobs - old_logprobs)  # (M,)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    pg = torch.maximum(unclipped, clipped)  # (M,)
    log_is = old_logprobs - behaviour_logprobs  # (M,) trainer vs engine for the same sampled token
    is_weight = torch.exp(log_is)
    tis = is_weight.clamp(max=tis_cap) if tis_cap > 0 else torch.ones_like(is_weight)
    pg = pg * tis
    kl = torch.zeros_like(pg)
    if ref_logprobs is not None and kl_coef > 0:
        delta = ref_logprobs.detach() - logprobs
        kl = torch.exp(delta) - delta - 1  # k3 estimator of KL(pi || ref), (M,)
    loss = (weights * (pg + kl_coef * kl)).sum()
    metrics = _loss_metrics(weights, pg, kl, ratio, clipped > unclipped, is_weight, tis, log_is)
    return loss, metrics


def _loss_metrics(weights: Tensor, pg: Tensor, kl: Tensor, ratio: Tensor, clipped: Tensor, is_weight: Tensor,
                  tis: Tensor, log_is: Tensor) -> Metrics:
    """Additive parts (loss/*) are partial sums; the rest are plain means over this tensor's tokens."""
    with torch.no_grad():
        mean = lambda t: t.double().mean().item() if t.numel() else 0.0  # noqa: E731
        return {
            "loss/policy": (weights * pg).sum().item(),
            "loss/kl": (weights * kl).sum().item(),
            "actor/clip_frac": mean(clipped),
            "actor/ratio_mean": mean(ratio),
            "is/weight_mean": mean(is_weight),
            "is/weight_max": is_weight.max().item() if is_weight.numel() else 0.0,
            "is/weight_min": is_weight.min().item() if is_weight.numel() else 0.0,
            "is/truncated_frac": mean(tis < is_weight),
            # |trainer - engine| logprob of the sampled tokens: ~0.02 when both use one distribution. One name only
            # (it was also stored as mismatch/logprob_abs): the health rule and the run page's chart read this one.
            "train/logprob_mismatch_mean": mean(log_is.abs()),
            "train/logprob_mismatch_max": log_is.abs().max().item() if log_is.numel() else 0.0,
            # k3 estimate of KL(engine || trainer) from samples drawn by the engine.
            "mismatch/kl": mean(torch.exp(log_is) - log_is - 1),
        }
