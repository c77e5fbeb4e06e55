"""Policy: packed logprobs equal unpacked ones, micro-batching equals one batch, checkpoints resume exactly."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.trainer.conftest import make_sample
from tests.trainer.inprocess import tiny_qwen2
from trainer.algorithms import compute_advantages
from trainer.config import TrainerConfig
from trainer.packing import micro_batches, pack, padded_positions
from trainer.policy import Policy, read_checkpoint_config, token_logprobs

ROOT = Path(__file__).resolve().parents[2]


def unpacked_logprobs(model, samples, temperature):
    """Reference: each sample alone through the full model, log-softmax over all logits."""
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.token_ids])).logits[0] / temperature  # (T, V)
            logp = torch.log_softmax(logits, -1)
            out += [logp[t - 1, s.token_ids[t]].item() for t in range(1, len(s.token_ids)) if s.loss_mask[t]]
    return out


def test_it_computes_packed_logprobs_equal_to_unpacked_ones(random_samples):
    model = tiny_qwen2()
    with torch.no_grad():
        logp, entropy = token_logprobs(model, pack(random_samples), temperature=0.7)
    assert logp.tolist() == pytest.approx(unpacked_logprobs(model, random_samples, 0.7), abs=1e-5)
    assert len(entropy) == sum(s.num_loss_tokens for s in random_samples)
    assert 0 < entropy.min() and entropy.max() <= torch.log(torch.tensor(64.0)) + 1e-5


def test_it_packs_first_fit_decreasing_with_loss_positions_one_before_each_loss_token():
    samples = [make_sample([5], [6]), make_sample([1, 2, 3], [4, 4]), make_sample([7, 8], [9], logprob=-2.0)]
    batch = pack(samples)
    # Rows as long as the longest sample (5): it fills row 0; the 3-token and 2-token samples share row 1.
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 4], [7, 8, 9, 5, 6]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert list(zip(batch.logit_rows.tolist(), batch.logit_cols.tolist())) == [(1, 3), (0, 2), (0, 3), (1, 1)]
    assert batch.targets.tolist() == [6, 4, 4, 9]
    assert batch.behaviour.tolist() == [-1.0, -1.0, -1.0, -2.0]
    assert batch.sample_index.tolist() == [0, 1, 1, 2]
    assert batch.num_tokens == 10
    padded = pack([make_sample([1, 2, 3], [4]), make_sample([5], [6])])
    assert padded.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]
    assert padded.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]  # padding is a segment of its own


def of_lengths(*lengths):
    return [make_sample([1] * (n - 1), [2]) for n in lengths]


@pytest.mark.parametrize("lengths, budget, expected", [
    # 5 | 3 is 2 rows x 5 = 10 <= 11; a third row for the next 3 makes 15 (real tokens would be 11).
    ((5, 3, 3), 11, [[0, 1], [2]]),
    # 4 | 4 is 8; the 6 widens every row: 6 | 4 | 4 is 18 > 14 (real tokens would be 14).
    ((4, 4, 6), 14, [[0, 1], [2]]),
    # First-fit-decreasing shares a row: 6 | 2 2 2 is 2 rows x 6 = 12.
    ((2, 2, 2, 6), 12, [[0, 1, 2, 3]]),
    # A sample longer than the budget goes alone.
    ((3, 20, 3), 10, [[0], [1], [2]]),
    ((4, 4, 10, 2, 2), 8, [[0, 1], [2], [3, 4]]),
])
def test_it_splits_micro_batches_by_padded_positions(lengths, budget, expected):
    samples = of_lengths(*lengths)
    assert micro_batches(samples, budget) == expected
    for indices in expected:
        packed = pack([samples[i] for i in indices]).input_ids
        assert packed.numel() == padded_positions([lengths[i] for i in indices])


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=25), budget=st.integers(1, 120))
def test_it_fills_each_micro_batch_greedily_up_to_its_packed_size(lengths, budget):
    samples = of_lengths(*lengths)
    batches = micro_batches(samples, budget)
    assert [i for indices in batches for i in indices] == list(range(len(samples)))  # contiguous, in order
    for indices, following in zip(batches, batches[1:] + [None]):
        assert len(indices) == 1 or pack([samples[i] for i in indices]).input_ids.numel() <= budget
        if following:  # greedy: the next sample did not fit
            assert pack([samples[i] for i in indices + following[:1]]).input_ids.numel() > budget


@pytest.mark.parametrize("loss_agg", ["token_mean", "rollout_mean", "seq_mean_token_sum_norm"])
def test_it_accumulates_micro_batches_to_the_same_update_as_one_batch(random_samples, loss_agg):
    results = []
    for budget in (10_000, 12):
        config = TrainerConfig(dtype="float32", micro_batch_tokens=budget, learning_rate=1e-2, loss_agg=loss_agg, max_grad_norm=0.5)
        policy = Policy(tiny_qwen2(), config)
        # Keep the clipped gradients for comparison (Adam's first step would amplify float noise near 0).
        policy.optimizer.step = policy.optimizer.zero_grad = lambda *a, **k: None
        metrics = policy.train_step(random_samples, [0.5 - (i % 3) for i in range(10)], [i // 3 for i in range(10)])
        results.append((metrics, torch.cat([p.grad.flatten() for p in policy.model.parameters()])))
    (one, g_one), (many, g_many) = results
    assert g_one.norm().item() == pytest.approx(0.5, rel=1e-4)  # clipped to max_grad_norm
    assert torch.allclose(g_one, g_many, atol=1e-7)
    assert many["loss/policy"] == pytest.approx(one["loss/policy"], abs=1e-6)
    assert many["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-4)
    assert many["train/loss_tokens"] == one["train/loss_tokens"] == sum(s.num_loss_tokens for s in random_samples)


def test_it_reports_loss_mismatch_and_clipping_of_an_on_policy_step(random_samples):
    policy = Policy(tiny_qwen2(), TrainerConfig(dtype="float32", learning_rate=1e-3))
    logp, _ = policy.logprobs(random_samples)
    metrics = policy.train_step(random_samples, [1.0] * 10, list(range(10)))
    # One update per step: ratio is exactly 1, nothing clipped; advantage 1 with token_mean gives -mean(tis).
    assert metrics["actor/clip_frac"] == 0.0
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0)
    tis = torch.exp(logp - (-4.0)).clamp(max=2.0)
    assert metrics["loss/policy"] == pytest.approx(-tis.mean().item(), rel=1e-5)
    assert metrics["train/logprob_mismatch_mean"] == pytest.approx((logp + 4.0).abs().mean().item(), rel=1e-5)
    assert policy.step == 1


def test_the_step_metrics_hold_the_logprob_mismatch_under_one_name_the_charts_read(random_samples):
    """Issue 40.11: one number was stored twice, as mismatch/logprob_abs and train/logprob_mismatch_mean. The one
    kept is the name the health rule reads and the run page's policy chart draws."""
    policy = Policy(tiny_qwen2(), TrainerConfig(dtype="float32"))
    metrics = policy.train_step(random_samples, [1.0] * 10, list(range(10)))
    assert "mismatch/logprob_abs" not in metrics
    assert metrics["train/logprob_mismatch_mean"] <= metrics["train/logprob_mismatch_max"]
    chart = (ROOT / "static" / "js" / "run_chart.js").read_text()
    policy_panel = chart[chart.index('id: "chart-policy"'):chart.index('id: "chart-data"')]
    drawn = set(re.findall(r'metric: "([^"]+)"', policy_panel))
    assert "train/logprob_mismatch_mean" in drawn
    assert drawn <= set(metrics), drawn - set(metrics)  # the policy panel draws only what a step stores


def test_it_clips_gradients_to_the_configured_norm():
    policy = Policy(tiny_qwen2(), TrainerConfig(dtype="float32", max_grad_norm=0.5))
    for p in policy.model.parameters():
        p.grad = torch.ones_like(p)
    count = sum(p.numel() for p in policy.model.parameters())
    assert policy._clip_gradients() == pytest.approx(count ** 0.5, rel=1e-5)
    clipped = torch.cat([p.grad.flatten() for p in policy.model.parameters()]).norm()
    assert clipped.item() == pytest.approx(0.5, rel=1e-4)


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_it_resumes_exactly_from_a_checkpoint(tmp_path, random_samples, kl_coef):
    config = TrainerConfig(dtype="float32", learning_rate=1e-2, kl_coef=kl_coef, updates_per_step=2)
    batches = [(random_samples, [1.0, -1.0] * 5, list(range(10))),
               (random_samples[::-1], [-0.5, 0.5] * 5, list(range(10)))]
    straight = Policy(tiny_qwen2(seed=1), config)
    for batch in batches:
        expected = straight.train_step(*batch)

    first = Policy(tiny_qwen2(seed=1), config)
    first.train_step(*batches[0])
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = Policy(tiny_qwen2(seed=2), config)  # different init: everything must come from the checkpoint
    resumed.load_checkpoint(tmp_path / "ckpt")
    got = resumed.train_step(*batches[1])

    assert resumed.step == straight.step == 2
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert got["loss/total"] == expected["loss/total"]
    assert read_checkpoint_config(tmp_path / "ckpt") == config
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["model_type"] == "qwen2"
    assert (tmp_path / "ckpt" / "model.safetensors").exists()


def test_a_full_disk_while_saving_the_optimizer_raises_the_os_error_itself(tmp_path, random_samples):
    """torch.distributed.checkpoint wraps write errors in CheckpointException, a BaseException that no
    `except Exception` catches: it took a Celery worker down when the data disk filled. The OSError comes out."""
    import errno

    from trainer.policy import OPTIMIZER_DIR

    policy = Policy(tiny_qwen2(seed=1), TrainerConfig(dtype="float32", learning_rate=1e-2))
    policy.train_step(random_samples, [1.0, -1.0] * 5, list(range(10)))
    (tmp_path / "ckpt" / OPTIMIZER_DIR).mkdir(parents=True)
    (tmp_path / "ckpt" / OPTIMIZER_DIR / "__0_0.distcp").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(OSError) as raised:
        policy.save_checkpoint(tmp_path / "ckpt")
    assert raised.value.errno == errno.ENOSPC and "No space left on device" in str(raised.value)
    assert not (tmp_path / "ckpt" / "trainer_state.json").exists()  # no checkpoint claims to be whole


def test_it_trains_under_bfloat16_autocast_close_to_float32(random_samples):
    logps = []
    for dtype in ("float32", "bfloat16"):
        policy = Policy(tiny_qwen2(), TrainerConfig(dtype=dtype, learning_rate=1e-3))
        logps.append(policy.logprobs(random_samples)[0])
        metrics = policy.train_step(random_samples, [1.0, -1.0] * 5, list(range(10)))
        assert metrics["train/loss_tokens"] == sum(s.num_loss_tokens for s in random_samples)
        assert next(policy.model.parameters()).dtype == torch.float32  # master weights stay float32
    assert (logps[0] - logps[1]).abs().max().item() < 0.1
    assert (logps[0] - logps[1]).abs().max().item() > 0  # autocast really ran in bfloat16


def test_it_clips_the_second_mini_batch_against_the_logprobs_before_the_step(random_samples):
    config = TrainerConfig(dtype="float32", updates_per_step=2, learning_rate=0.05, micro_batch_tokens=16, clip_low=0.01,
                           clip_high=0.01)
    policy = Policy(tiny_qwen2(), config)
    old = policy._old_logprobs(random_samples)
    assert torch.cat(old).tolist() == pytest.approx(policy.logprobs(random_samples)[0].tolist(), abs=1e-6)
    assert [len(t) for t in old] == [s.num_loss_tokens for s in random_samples]
    metrics = policy.train_step(random_samples, [1.0] * 10, list(range(10)))
    # The first mini-batch is on-policy (ratio 1); after a large step the second one's ratios move and clip.
    assert 0 < metrics["actor/clip_frac"] < 1
    assert metrics["actor/ratio_mean"] != pytest.approx(1.0, abs=1e-4)


def test_it_divides_dr_grpo_losses_by_the_most_completion_tokens_of_a_sample():
    # 10 prompt + 3 completion tokens, and 2 + 5: 8 loss tokens over 2 samples, each with advantage 1.
    samples = [make_sample([1] * 10, [2, 3, 4]), make_sample([5, 6], [7, 8, 9, 10, 11])]
    losses = []
    for norm in (0, 4):
        config = TrainerConfig(dtype="float32", loss_agg="seq_mean_token_sum_norm", loss_norm_tokens=norm, tis_cap=0.0)
        losses.append(Policy(tiny_qwen2(), config).train_step(samples, [1.0, 1.0], [0, 1])["loss/policy"])
    # On-policy, untruncated: every token's loss is -1, weighted 1 / (norm x 2 samples).
    assert losses[0] == pytest.approx(-8 / (5 * 2))  # the longest completion is 5 tokens (not the 13-token sample)
    assert losses[1] == pytest.approx(-8 / (4 * 2))  # a configured constant wins


def test_it_computes_the_same_gradients_with_gradient_checkpointing(random_samples):
    grads = []
    for checkpointing in (False, True):
        policy = Policy(tiny_qwen2(), TrainerConfig(dtype="float32", gradient_checkpointing=checkpointing))
        policy.optimizer.step = policy.optimizer.zero_grad = lambda *a, **k: None
        policy.train_step(random_samples, [1.0, -1.0] * 5, list(range(10)))
        assert policy.model.is_activation_checkpointing is checkpointing
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters()]))
    assert grads[0].norm() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_it_trains_in_micro_batches_of_the_configured_padded_positions(random_samples):
    policy = Policy(tiny_qwen2(), TrainerConfig(dtype="float32", micro_batch_tokens=24))
    sizes = []
    policy._backward = lambda batch, *a: (sizes.append(batch.input_ids.numel()) or {}, torch.zeros(len(batch.targets)))
    metrics = policy.train_step(random_samples, [1.0] * 10, list(range(10)))
    assert metrics["train/micro_batch_positions"] == 24
    lengths = [len(s.token_ids) for s in random_samples]
    assert sizes == [padded_positions([lengths[i] for i in indices]) for indices in micro_batches(random_samples, 24)]
    assert max(sizes) <= 24 and len(sizes) > 1


@pytest.mark.parametrize("updates", [1, 2])
def test_it_keeps_the_trainers_logprob_of_every_loss_token_before_the_update(random_samples, updates):
    policy = Policy(tiny_qwen2(), TrainerConfig(dtype="float32", micro_batch_tokens=24, updates_per_step=updates, learning_rate=0.05))
    before, _ = policy.logprobs(random_samples)  # (M,) loss tokens in sample order, under the weights before
    policy.train_step(random_samples, [1.0, -1.0] * 5, list(range(10)))
    kept = policy.trained_logprobs
    assert [len(row) for row in kept] == [len(s.token_ids) for s in random_samples]
    for row, sample in zip(kept, random_samples):
        assert [v is not None for v in row] == [bool(m) and t > 0 for t, m in enumerate(sample.loss_mask)]
    flat = [v for row in kept for v in row if v is not None]
    assert torch.allclose(torch.tensor(flat), before, atol=1e-5)
    after, _ = policy.logprobs(random_samples)
    assert not torch.allclose(after, before, atol=1e-3)  # it did train: the kept values are the ones before


def test_a_step_without_signal_does_not_move_the_weights(random_samples):
    """Every advantage 0 (no group had signal) and no KL term: the gradient is 0, and the step must not move the
    policy. AdamW would: its momentum from the last step with signal keeps pushing the weights the same way (a
    mini-SWE-agent run with 0 groups with signal for 8 steps drifted into replies of nothing but backticks)."""
    policy = Policy(tiny_qwen2(), TrainerConfig(learning_rate=1e-3, dtype="float32"))
    n = len(random_samples)
    policy.train_step(random_samples, [1.0 if i % 2 else -1.0 for i in range(n)], list(range(n)))
    before = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    state = {k: v["exp_avg"].clone() for k, v in zip(range(3), policy.optimizer.state.values())}
    metrics = policy.train_step(random_samples, [0.0] * n, list(range(n)))
    assert metrics["actor/grad_norm"] == 0.0 and metrics["train/optimizer_skipped"] == 1.0
    assert all(torch.equal(before[name], p) for name, p in policy.model.named_parameters())
    assert all(torch.equal(state[k], v["exp_avg"]) for k, v in zip(range(3), policy.optimizer.state.values()))
    assert policy.step == 2  # the step still counts
    moved = policy.train_step(random_samples, [1.0 if i % 2 else -1.0 for i in range(n)], list(range(n)))
    assert moved["train/optimizer_skipped"] == 0.0
    assert any(not torch.equal(before[name], p) for name, p in policy.model.named_parameters())


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("equal", [[0.1] * 3, [0.7] * 8, [0.9] * 8], ids=lambda r: f"{r[0]}x{len(r)}")
def test_groups_of_equal_partial_credit_do_not_move_the_weights_or_the_optimizer(random_samples, name, equal):
    """Issue 40.2: equal rewards whose float64 sum is inexact (as the scheduler builds them) gave advantages of
    1e-11, not 0: the gradient was not 0 and AdamW's momentum moved the weights on a step without signal."""
    policy = Policy(tiny_qwen2(), TrainerConfig(learning_rate=1e-3, dtype="float32"))
    samples = (random_samples * 2)[:len(equal)]
    policy.train_step(samples, [1.0 if i % 2 else -1.0 for i in range(len(samples))], list(range(len(samples))))
    before = {key: p.detach().clone() for key, p in policy.model.named_parameters()}
    state = copy.deepcopy(policy.optimizer.state_dict())
    rewards = torch.tensor(equal, dtype=torch.float64)  # as the scheduler builds them
    advantages, _ = compute_advantages(name, rewards, torch.zeros(len(equal), dtype=torch.long))
    metrics = policy.train_step(samples, advantages.tolist(), list(range(len(samples))))
    assert metrics["actor/grad_norm"] == 0.0 and metrics["train/optimizer_skipped"] == 1.0
    assert all(torch.equal(before[key], p) for key, p in policy.model.named_parameters())
    after = policy.optimizer.state_dict()
    assert after["state"].keys() == state["state"].keys()
    assert all(torch.equal(torch.as_tensor(state["state"][k][field]), torch.as_tensor(v[field]))
               for k, v in after["state"].items() for field in v)
    assert policy.step == 2
