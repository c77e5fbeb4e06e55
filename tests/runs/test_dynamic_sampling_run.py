"""Dynamic sampling in a whole run on the CPU: vLLM serving a tiny model, real harness subprocesses through the proxy,
a reward that is constant on some tasks. Their groups are dropped (recorded, shown, never trained) and the batch is
refilled with other tasks; the step's figures reach the metrics, the API and the step page."""
import pytest
from django.urls import reverse

from catalog import services as catalog_services
from runs import services
from runs.models import Rollout, Run, Sample
from runs.tasks import execute_run
from tests.runs.test_orchestrator import pytestmark, tiny_model  # noqa: F401 (its marks and tiny model fixture)

HARNESS = '''
import json, os, sys, urllib.request
task = json.load(open(sys.argv[1]))
body = {"model": "anything", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 6}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"]
json.dump({"reply": reply}, open(sys.argv[2], "w"))
'''
# "same" tasks score 0.5 whatever the agent did: their groups never have signal. The others score at random, so
# their attempts (almost surely) differ.
REWARD = ("import random\n\ndef reward(task, outcome):\n"
          "    return 0.5 if 'same' in task['question'] else random.random()\n")
CONSTANT = {"t2", "t3", "t4"}


def test_groups_without_signal_are_dropped_shown_and_the_batch_refilled(alice, client, tmp_path, tiny_model,  # noqa: F811
                                                                       settings):
    settings.LIGHTNING_RUNS_DIR = tmp_path / "runs"
    settings.LIGHTNING_MODELS_DIR = tiny_model.parent
    (tmp_path / "harness.py").write_text(HARNESS)
    harness = catalog_services.create_harness(alice, name="one-call", timeout_s=120,
                                      command=["python3", str(tmp_path / "harness.py"), "{task_file}", "{output_file}"])
    rows = [f'{{"id": "t{i}", "question": "{"same" if f"t{i}" in CONSTANT else "say"} {i}", '
            f'"split": "{"val" if i < 2 else "train"}"}}' for i in range(8)]
    dataset = catalog_services.create_dataset(alice, name="mixed", content="\n".join(rows).encode(), filename="t.jsonl")
    reward = catalog_services.create_reward_script(alice, name="half-constant", source=REWARD)
    config = {"steps": 2, "tasks_per_step": 2, "group_size": 2, "max_model_len": 512, "kv_cache_gb": 0.5,
              "eval_tasks": 0, "learning_rate": 1e-4, "dynamic_sampling": True, "dynamic_sampling_max_extra": 2.0}
    run = services.create_run(alice, name="dynamic", model=str(tiny_model), harness=harness, dataset=dataset,
                              reward_script=reward, config=config)

    assert execute_run.apply(args=[run.pk]).get() == "succeeded"
    run.refresh_from_db()
    assert run.status == "succeeded" and run.step == 2
    train = Rollout.objects.filter(run=run, split="train").select_related("task")
    assert set(train.values_list("status", flat=True)) == {"succeeded"}
    dropped = train.filter(drop_reason__startswith="no_signal")
    trained = train.filter(drop_reason="")
    assert dropped.exists(), "no group without signal was sampled: pick tasks so that one is"
    # Dropped: only constant tasks, whole groups, recorded with their step, never trained.
    assert {r.task.external_id for r in dropped} <= CONSTANT
    assert set(dropped.values_list("drop_reason", flat=True)) == {"no_signal: every attempt scored 0.5"}
    assert set(dropped.values_list("batch_step", flat=True)) <= {1, 2}  # sampled for a step,
    assert set(dropped.values_list("trained_step", flat=True)) == {None}  # never trained
    assert not Sample.objects.filter(rollout__in=dropped).exists()
    for group in set(dropped.values_list("group", flat=True)):
        assert train.filter(group=group).count() == 2 == dropped.filter(group=group).count()
    metrics = {(m.name, m.step): m.value for m in run.metrics.all()}
    cap = 4  # 2.0 x tasks_per_step
    for step in (1, 2):
        step_dropped = dropped.filter(batch_step=step)
        step_trained = trained.filter(trained_step=step)
        n_dropped = len(set(step_dropped.values_list("group", flat=True)))
        assert metrics[("groups/dropped_no_signal", step)] == n_dropped <= cap
        assert metrics[("groups/trained", step)] == 2.0 == len(set(step_trained.values_list("group", flat=True)))
        assert metrics[("groups/sampled", step)] == 2 + n_dropped
        assert metrics[("rollout/extra", step)] == 2.0 * n_dropped
        assert Sample.objects.filter(rollout__in=step_trained).count() == step_trained.count() == 4
        if n_dropped < cap:  # the budget lasted: every trained group had signal
            assert not {r.task.external_id for r in step_trained} & CONSTANT
            assert metrics[("groups/signal_share", step)] == 1.0
    # Every rollout sampled is in a step: the refills were trained or dropped, nothing left over.
    assert train.filter(batch_step__isnull=True).count() == 0
    assert train.count() == 2 * sum(metrics[("groups/sampled", s)] for s in (1, 2))

    client.force_login(alice)
    step = dropped.first().batch_step
    page = client.get(reverse("run-step", args=[run.pk, step])).content.decode()
    assert "no signal, not trained" in page and "dropped without signal by dynamic sampling" in page
    body = client.get(f"/api/v1/runs/{run.pk}/signal/").json()
    assert [r["groups_dropped_no_signal"] for r in body["steps"]] == [
        int(metrics[("groups/dropped_no_signal", s)]) for s in (1, 2)]
    assert Run.objects.get(pk=run.pk).config["dynamic_sampling"] is True
    # The run page's header reads the worker and the isolation live from the status events.
    running = run.events.get(kind="run.status", payload__status="running").payload
    assert running["isolation"] == run.isolation != "" and running["host"]
    assert run.events.get(kind="run.status", payload__status="starting").payload["worker"]["where"]
