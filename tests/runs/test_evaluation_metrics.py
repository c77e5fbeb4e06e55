"""The arithmetic of eval/*: pass@1 as the mean over k attempts, unbiased pass@k, the greedy pass, and progress."""
import itertools

import pytest
from asgiref.sync import sync_to_async

from runs.evaluation import EvalAttempt, Progress, eval_metrics, pass_at_k
from runs.models import Run
from trainer.config import ConfigError, TrainerConfig


def reference_pass_at_k(n: int, c: int, k: int) -> float:
    """The definition: the fraction of all k-subsets of the n attempts that hold at least one pass."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (4, 0, 4, 0.0), (4, 1, 4, 1.0), (4, 3, 4, 1.0),  # n == k: did any attempt pass
    (4, 1, 1, 0.25), (4, 3, 1, 0.75),  # k == 1: the pass fraction
    (10, 3, 4, 1 - 35 / 210),
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_matches_the_subset_definition_everywhere_small():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(reference_pass_at_k(n, c, k)), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (4, 5, 2), (4, 1, 0), (4, -1, 2)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def sampled(task, rewards, kinds=None):
    kinds = kinds or [""] * len(rewards)
    return [EvalAttempt(task, False, r, kind) for r, kind in zip(rewards, kinds)]


def test_eval_metrics_weigh_every_task_the_same_and_leave_infrastructure_out():
    attempts = [
        *sampled(0, [1, 1, 0, 1]), EvalAttempt(0, True, 1.0),
        *sampled(1, [0, 0, 0, 0], ["", "", "infra", ""]), EvalAttempt(1, True, 0.0, "infra"),
        *sampled(2, [0, -0.5, 1, 0], ["", "policy", "", ""]), EvalAttempt(2, True, 0.0),
        *sampled(3, [0, 0, 0, 0]), EvalAttempt(3, True, 1.0),
    ]
    metrics = eval_metrics(attempts, samples=4, threshold=1.0)
    assert metrics == pytest.approx({
        "eval/pass@1": (3 / 4 + 0 / 3 + 1 / 4 + 0 / 4) / 4,  # task 1 counts over its 3 attempts that count
        "eval/pass@k": 2 / 3,  # tasks 0, 2 and 3 have all 4 attempts; 0 and 2 passed at least once
        "eval/pass@1_greedy": 2 / 3,  # task 1's greedy attempt was lost to infrastructure
        "eval/reward_mean": (0.75 + 0 + (0 - 0.5 + 1 + 0) / 4 + 0) / 4,
        "eval/tasks": 4.0, "eval/infra_failures": 2.0,
    })


def test_a_policy_failure_never_passes_whatever_its_reward():
    assert not EvalAttempt(0, False, 1.0, "policy").passed(1.0)
    assert EvalAttempt(0, False, 1.0).passed(1.0) and not EvalAttempt(0, False, 0.99).passed(1.0)
    assert eval_metrics(sampled(0, [1.0, 1.0], ["policy", ""]), 2, 1.0)["eval/pass@1"] == 0.5


def test_one_attempt_per_task_is_the_old_pass_at_1_and_pass_at_k_equals_it():
    metrics = eval_metrics(sampled(0, [1]) + sampled(1, [0]) + sampled(2, [1]), samples=1, threshold=1.0)
    assert metrics["eval/pass@1"] == metrics["eval/pass@k"] == pytest.approx(2 / 3)
    assert "eval/pass@1_greedy" not in metrics  # no greedy attempts, no greedy metric


def test_rates_with_nothing_to_average_are_left_out_not_written_as_zero():
    lost = [EvalAttempt(0, False, 0.0, "infra"), EvalAttempt(0, True, 0.0, "infra")]
    assert eval_metrics(lost, samples=1, threshold=1.0) == {"eval/tasks": 1.0, "eval/infra_failures": 2.0}


class FakeClock:
    def __init__(self, times):
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


@pytest.mark.django_db(transaction=True)
async def test_progress_is_written_at_the_start_at_most_every_2_s_and_at_the_end(alice, make_run):
    run = await sync_to_async(make_run)(alice)
    progress = Progress(run.pk, step=7, total=5, every_s=2.0, clock=FakeClock([0.0, 0.5, 1.9, 2.0, 3.0, 3.1]))
    await progress.advance()
    for _ in range(5):
        await progress.advance(1)

    run = await sync_to_async(Run.objects.get)(pk=run.pk)
    assert run.phase == "evaluating step 7: 5/5"
    events = await sync_to_async(lambda: [e.payload for e in run.events.filter(kind="run.phase").order_by("seq")])()
    assert events == [{"phase": "evaluating step 7: 0/5", "progress": 0.0},
                      {"phase": "evaluating step 7: 3/5", "progress": 0.6},  # 2.0 s after the first write
                      {"phase": "evaluating step 7: 5/5", "progress": 1.0}]  # the end, only 1.1 s later


def test_the_eval_fields_default_to_4_samples_a_greedy_attempt_and_32_at_a_time():
    config = TrainerConfig()
    assert (config.eval_samples, config.eval_greedy, config.eval_concurrency) == (4, True, 32)
    assert TrainerConfig.from_dict({"eval_samples": 8, "eval_greedy": False}).to_dict()["eval_samples"] == 8


@pytest.mark.parametrize("data, message", [
    ({"eval_samples": 0}, "eval_samples must be at least 1, got 0; set eval_samples >= 1"),
    ({"eval_concurrency": 0}, "eval_concurrency must be at least 1, got 0; set eval_concurrency >= 1"),
    ({"eval_greedy": "yes"}, "eval_greedy must be bool, got str 'yes'"),
    ({"eval_samples": 2.5}, "eval_samples must be int, got float 2.5"),
])
def test_impossible_eval_fields_are_refused_naming_the_fix(data, message):
    with pytest.raises(ConfigError) as error:
        TrainerConfig.from_dict(data)
    assert str(error.value) == message
