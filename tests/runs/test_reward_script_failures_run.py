"""A reward script's failures in a whole run on the CPU (vLLM, real harness subprocesses, the sandbox): one that
raises on every rollout of a step is the script's bug, and the run fails saying so after that step instead of
training on nothing for its whole length; the step's counts are stored (issue 26.4)."""
from runs.models import Metric, Run
from runs.tasks import execute_run
from tests.runs.test_orchestrator import pytestmark, run_of, tiny_model  # noqa: F401 (marks and fixtures)

BROKEN = "def reward(task, outcome):\n    return float(outcome['answer'])\n"  # the harness writes 'reply'


def test_a_reward_script_that_raises_on_every_rollout_fails_the_run_after_that_step(run_of):  # noqa: F811
    run = run_of({"steps": 5, "eval_tasks": 0})
    Run.objects.filter(pk=run.pk).update(reward_snapshot={**run.reward_snapshot, "source": BROKEN})
    assert execute_run.apply(args=[run.pk]).get() == "failed"
    run.refresh_from_db()
    assert run.status == "failed" and run.step == 1  # stopped after the first step, not 5 steps of nothing
    assert run.error.startswith("the reward script raised on all 4 rollouts of step 1 (4 times: KeyError: 'answer' "
                                "(line 2)): a bug in the script")
    metrics = dict(Metric.objects.filter(run=run, step=1).values_list("name", "value"))
    assert metrics["reward/script_errors"] == 4.0 and metrics["reward/unparseable"] == 0.0
    assert metrics["rollout/infra_failures"] == 4.0
    scored = run.rollouts.filter(split="train", batch_step=1)  # step 1's (later ones were cancelled with the run)
    assert scored.count() == 4 and set(scored.values_list("failure_kind", flat=True)) == {"infra"}
