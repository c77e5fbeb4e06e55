"""Finish now in a whole run on the CPU (vLLM, real harness subprocesses, the proxy): its owner asks a 40-step run to
finish once step 1 is stored; the run trains the step in progress, evaluates it, checkpoints it and succeeds with
its config's `steps` lowered to it, so `continue` can go on from there."""
import threading
import time

from runs import services
from runs.models import Metric, Run
from runs.tasks import execute_run
from tests.runs.test_orchestrator import pytestmark, run_of, tiny_model  # noqa: F401 (marks and fixtures)


def test_a_run_asked_to_finish_trains_the_step_in_progress_evaluates_it_and_succeeds(run_of, alice):  # noqa: F811
    run = run_of({"steps": 40, "eval_every": 0, "eval_tasks": 2, "checkpoint_every": 0})
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(execute_run.apply(args=[run.pk]).get()), daemon=True)
    worker.start()
    deadline = time.monotonic() + 600
    while Run.objects.get(pk=run.pk).step < 1:
        assert worker.is_alive() and time.monotonic() < deadline, (outcome, Run.objects.get(pk=run.pk).error)
        time.sleep(0.2)
    asked = services.finish_run(Run.objects.get(pk=run.pk), alice)
    last = asked.config["steps"]
    assert 2 <= last <= 3  # the step in progress when it was asked (2, or 3 had step 2 just been stored)
    worker.join(600)
    assert outcome == ["succeeded"]

    run.refresh_from_db()
    assert run.status == "succeeded" and run.step == last == run.config["steps"] and run.error == ""
    assert run.checkpoint_path.endswith(f"step-{last:06d}")  # continue goes on from here
    evals = sorted(set(Metric.objects.filter(run=run, name="eval/pass@1").values_list("step", flat=True)))
    assert evals == [0, last]  # eval_every 0: step 0 and the step it finished at
    assert Metric.objects.filter(run=run, name="reward/mean").count() == last
    lines = [e.payload["line"] for e in run.events.filter(kind="run.log").order_by("seq")]
    assert f"finish requested by its owner: the run ends after step {last} (of 40) with an evaluation" in lines
    assert any(line.startswith(f"step {last}/{last}: reward") for line in lines)

    continued = services.continue_run(run, alice, 1)
    assert continued.status == "queued" and continued.config["steps"] == last + 1


def test_a_finish_asked_while_a_step_records_ends_the_run_with_a_checkpoint_of_that_step(
        run_of, alice, monkeypatch):  # noqa: F811
    """The scheduler took step 1's checkpoint decision (not its last step then, checkpoint_every 0: none) before
    its record phase, where its owner asks it to finish: that step is the run's last all the same, and saved."""
    from runs import rollout_services

    run = run_of({"steps": 4, "eval_every": 0, "eval_tasks": 2, "checkpoint_every": 0})
    record_step, asked = rollout_services.record_step, []

    def finish_while_recording(run_id, step, *args, **kwargs):
        if step == 1 and not asked:
            asked.append(services.finish_run(Run.objects.get(pk=run_id), alice).config["steps"])
        return record_step(run_id, step, *args, **kwargs)

    monkeypatch.setattr(rollout_services, "record_step", finish_while_recording)
    assert execute_run.apply(args=[run.pk]).get() == "succeeded"
    run.refresh_from_db()
    assert asked == [1] and run.step == 1 == run.config["steps"] and run.error == ""
    assert run.checkpoint_path.endswith("step-000001")  # continue goes on from here
    evals = sorted(set(Metric.objects.filter(run=run, name="eval/pass@1").values_list("step", flat=True)))
    assert evals == [0, 1]
    assert services.continue_run(run, alice, 1).config["steps"] == 2
