"""A whole run on the CPU: vLLM serving a tiny model, real harness subprocesses through the proxy, GRPO steps."""
import threading
import time
from pathlib import Path

import pytest

from catalog import services as catalog_services
from common import procs
from runs import services
from runs.models import ModelCall, Rollout, Run, Sample
from runs.tasks import execute_run
from trainer.engine import default_engine_venv

pytestmark = [
    pytest.mark.django_db(transaction=True), pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm,
    pytest.mark.skipif(not (default_engine_venv() / "bin" / "python").exists(),
                       reason=f"no engine venv at {default_engine_venv()}: run scripts/setup-engine"),
]

HARNESS = '''
import json, os, sys, urllib.request
task = json.load(open(sys.argv[1]))

def chat(messages):
    body = {"model": "anything", "messages": messages, "max_tokens": 8, "temperature": 1.0}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"]

messages = [{"role": "user", "content": task["question"]}]
first = chat(messages)
messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "RESULT: ok"}]
second = chat(messages)
json.dump({"reply": second}, open(sys.argv[2], "w"))
'''
REWARD = "def reward(task, outcome):\n    return float(len(outcome['reply']) % 2 == 0)\n"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from trainer.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("orchestrator-models") / "tiny-real", seed=0)


@pytest.fixture
def run_of(alice, tmp_path, tiny_model, settings):
    settings.LIGHTNING_RUNS_DIR = tmp_path / "runs"
    settings.LIGHTNING_MODELS_DIR = tiny_model.parent  # this module's registry: runs may load models from it only
    (tmp_path / "harness.py").write_text(HARNESS)

    def make(config):
        harness = catalog_services.create_harness(alice, name="two-turns", timeout_s=120,
                                          command=["python3", str(tmp_path / "harness.py"), "{task_file}",
                                                   "{output_file}"])
        tasks = "\n".join(f'{{"id": "t{i}", "question": "say {i}", "split": "{"val" if i < 2 else "train"}"}}'
                          for i in range(8))
        dataset = catalog_services.create_dataset(alice, name="words", content=tasks.encode(), filename="t.jsonl")
        reward = catalog_services.create_reward_script(alice, name="even", source=REWARD)
        return services.create_run(alice, name="cpu-run", model=str(tiny_model), harness=harness, dataset=dataset,
                                   reward_script=reward, config={"steps": 2, "tasks_per_step": 2, "group_size": 2,
                                                                 "max_model_len": 512, "kv_cache_gb": 0.5,
                                                                 "eval_tasks": 2, "eval_samples": 2,
                                                                 "learning_rate": 1e-4, **config})

    return make


def test_a_run_trains_on_recorded_calls_and_evaluates(run_of, tmp_path):
    run = run_of({})
    assert execute_run.apply(args=[run.pk]).get() == "succeeded"
    run.refresh_from_db()
    assert run.status == "succeeded" and run.step == 2 and run.policy_version == 2 and run.error == ""
    assert run.checkpoint_path.endswith("step-000002") and (tmp_path / "runs" / f"run-{run.pk}").is_dir()
    train = Rollout.objects.filter(run=run, split="train")
    assert train.count() == 8 and set(train.values_list("status", flat=True)) == {"succeeded"}
    assert set(train.values_list("reward", flat=True)) <= {0.0, 1.0}
    val = Rollout.objects.filter(run=run, split="val")  # 2 val tasks x (2 samples + 1 greedy), before and after
    assert val.count() == 12 and val.filter(greedy=True).count() == 4
    assert sorted(set(val.values_list("step", "attempt", "greedy"))) == [(s, a, a == 2) for s in (0, 2)
                                                                          for a in range(3)]
    greedy_calls = ModelCall.objects.filter(rollout__run=run, rollout__greedy=True)  # vLLM at temperature 0
    assert greedy_calls.count() == 8 and set(greedy_calls.values_list("status_code", flat=True)) == {200}
    assert all(len(c.logprobs) == len(c.completion_ids) > 0 for c in greedy_calls)
    calls = ModelCall.objects.filter(rollout__run=run, rollout__split="train")
    assert calls.count() == 16 and set(calls.values_list("status_code", flat=True)) == {200}
    for call in calls:
        assert call.prompt_ids and call.completion_ids and len(call.logprobs) == len(call.completion_ids)
    assert set(calls.values_list("drift", flat=True)) <= {"clean", "realign", "fork"}
    assert calls.filter(drift="clean").exists()  # the second turn extends the first
    samples = Sample.objects.filter(rollout__run=run)
    assert samples.exists()
    for sample in samples:
        assert len(sample.loss_mask) == len(sample.token_ids) == len(sample.logprobs) and sum(sample.loss_mask) > 0
        weighted = sum(len(ModelCall.objects.get(rollout=sample.rollout, seq=s).completion_ids)
                       for s in sample.call_seqs)
        assert sum(sample.loss_mask) == weighted  # loss weight on exactly the sampled tokens
    names = set(run.metrics.values_list("name", flat=True))
    assert {"reward/mean", "loss/policy", "eval/pass@1", "time/train"} <= names
    for name in ("eval/pass@1", "eval/pass@k", "eval/pass@1_greedy"):
        assert list(run.metrics.filter(name=name).values_list("step", flat=True)) == [0, 2]
    assert list(run.metrics.filter(name="reward/mean").values_list("step", flat=True)) == [1, 2]
    statuses = [e.payload["status"] for e in run.events.filter(kind="run.status")]
    assert statuses == ["queued", "starting", "running", "succeeded"]
    engine_start = [e.payload for e in run.events.filter(kind="run.phase").order_by("seq")
                    if e.payload["phase"].startswith("starting the engine: ")]  # live progress, from vLLM's log
    assert engine_start[-1] == {"phase": "starting the engine: ready", "progress": 1.0}
    assert [p["progress"] for p in engine_start] == sorted(p["progress"] for p in engine_start)
    assert ModelCall.objects.filter(rollout__run=run, policy_version=1).exists()  # served after the first sync
    for call in calls:  # sync mode: a group admitted at version v is served by v alone
        assert call.policy_version == call.rollout.step
        # The harness asks for temperature 1.0; the proxy served the run's 0.7 and kept what was asked.
        assert call.sampling_overrides == {"temperature": 1.0}
    # A rollout records the version it started under (it was the run's version when the worker started: 0).
    assert {(r.step, r.policy_version) for r in Rollout.objects.filter(run=run)} == {(0, 0), (1, 1), (2, 2)}
    assert set(Rollout.objects.filter(run=run).values_list("failure_kind", flat=True)) == {""}
    by_name = {(m.name, m.step): m.value for m in run.metrics.all()}
    assert by_name[("proxy/sampling_overridden_calls", 1)] == 8.0  # 4 rollouts x 2 calls
    # Run health (health.services) checked each step: the harness's outcome kept for re-scoring, the step's
    # health/* metrics recorded (2 calls with text in each rollout, no tools offered, none cut off by a timeout).
    for rollout in Rollout.objects.filter(run=run):  # the output file, plus the exit code and stdout tail
        assert set(rollout.outcome) == {"reply", "exit_code", "stdout"} and rollout.outcome["exit_code"] == 0
        assert isinstance(rollout.outcome["reply"], str) and rollout.flags == []
    for step in (1, 2):
        assert by_name[("health/empty_rollouts", step)] == 0.0
        assert by_name[("health/offered_tools_share", step)] == 0.0
        assert ("health/truncated_share", step) in by_name
    assert by_name[("time/generate", 1)] > 0 and by_name[("time/generate", 2)] > 0
    assert 0 < by_name[("train/logprob_mismatch_mean", 1)] <= by_name[("train/logprob_mismatch_max", 1)]
    assert by_name[("rollout/infra_failures", 1)] == by_name[("rollout/policy_failures", 1)] == 0


def test_a_running_run_is_cancelled_and_leaves_nothing_running(run_of, alice):
    run = run_of({"steps": 50})
    finished = {}
    worker = threading.Thread(target=lambda: finished.update(status=execute_run.apply(args=[run.pk]).get()))
    worker.start()
    deadline = time.monotonic() + 300
    while Run.objects.get(pk=run.pk).step < 1 and time.monotonic() < deadline and worker.is_alive():
        time.sleep(0.5)
    assert Run.objects.get(pk=run.pk).step >= 1
    services.cancel_run(Run.objects.get(pk=run.pk), alice)
    worker.join(timeout=120)
    assert not worker.is_alive() and finished["status"] == "cancelled"
    run.refresh_from_db()
    assert run.status == "cancelled" and run.error == "cancelled by its owner" and run.step < 50
    assert not Rollout.objects.filter(run=run, status__in=("pending", "running")).exists()


SLEEPER = "import sys, time\ntime.sleep(600)\n"


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live (non-zombie) processes that mention `text`."""
    return [procs.cmdline(pid) for pid in procs.pids_matching(text)]


def cancel_when(run, alice, ready, timeout=300):
    """Start the run on a thread, cancel it once `ready()` holds; returns (final status, seconds to cancelled)."""
    finished = {}
    worker = threading.Thread(target=lambda: finished.update(status=execute_run.apply(args=[run.pk]).get()))
    worker.start()
    deadline = time.monotonic() + timeout
    while not ready() and time.monotonic() < deadline and worker.is_alive():
        time.sleep(0.2)
    assert ready(), f"never got there; run is {Run.objects.get(pk=run.pk).status}"
    services.cancel_run(Run.objects.get(pk=run.pk), alice)
    asked = time.monotonic()
    while Run.objects.get(pk=run.pk).status != "cancelled" and time.monotonic() - asked < 60:
        time.sleep(0.1)
    landed = time.monotonic() - asked
    worker.join(timeout=60)
    assert not worker.is_alive() and finished["status"] == "cancelled"
    return landed


def engine_processes(model: Path) -> list[str]:
    """Command lines of the live vLLM servers of `model` (they serve its shared folder in the engine cache)."""
    from django.conf import settings

    from trainer.config import TrainerConfig
    from trainer.engine.folders import served_folder

    dtype = TrainerConfig().for_this_host().engine_dtype  # the served folder is the engine dtype's: `auto` here
    served = served_folder(model, settings.LIGHTNING_ENGINE_CACHE_DIR / "models", dtype)
    return [c for c in processes_mentioning(str(served)) if "vllm.entrypoints" in c]


def test_a_cancel_during_engine_start_lands_within_10_s_and_stops_the_engine(run_of, alice, tmp_path, tiny_model):
    run = run_of({})
    run_dir = str(tmp_path / "runs" / f"run-{run.pk}")

    def engine_starting():
        return bool(engine_processes(tiny_model)) and Run.objects.get(pk=run.pk).status == "starting"

    landed = cancel_when(run, alice, engine_starting)
    print(f"\nCANCEL during engine start landed in {landed:.1f} s")
    assert landed < 10
    run.refresh_from_db()
    assert run.status == "cancelled" and run.error == "cancelled by its owner"
    assert processes_mentioning(run_dir) == [] and engine_processes(tiny_model) == []
    assert not Rollout.objects.filter(run=run).exists()


def test_a_cancel_during_the_step_0_evaluation_lands_within_10_s_and_kills_the_harnesses(run_of, alice, tmp_path):
    run = run_of({})
    (tmp_path / "harness.py").write_text(SLEEPER)  # every attempt hangs: the step-0 evaluation never ends

    def evaluating():
        return Rollout.objects.filter(run=run, split="val", status="running").count() == 6  # 2 tasks x (2 + greedy)

    landed = cancel_when(run, alice, evaluating)
    print(f"\nCANCEL during the step-0 evaluation landed in {landed:.1f} s")
    assert landed < 10
    run.refresh_from_db()
    assert run.status == "cancelled" and run.step == 0
    assert set(Rollout.objects.filter(run=run).values_list("split", "status")) == {("val", "cancelled")}
    assert processes_mentioning(str(tmp_path / "harness.py")) == []
    assert processes_mentioning(str(tmp_path / "runs" / f"run-{run.pk}")) == []
