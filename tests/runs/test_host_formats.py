"""Real runs on the tiny model pick their number formats from the worker's host: `auto` resolves where the worker
runs (its ISA limits included), the run records the host and the dtypes, vLLM serves and the trainer computes in
them, and the engine-vs-trainer logprob mismatch stays small in either format."""
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from catalog import services as catalog_services
from runs import services
from runs.models import Run
from tests.workers import REAL_RUN_MARKS, Workers, wait_db
from trainer.host import ISA_LIMITS, detect, resolve

pytestmark = REAL_RUN_MARKS

HARNESS = '''
import json, os, sys, urllib.request
task = json.load(open(sys.argv[1]))
body = {"model": "policy", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 16}
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                          "Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"]
json.dump({"reply": reply}, open(sys.argv[2], "w"))
'''
# One call per rollout: its sample's context is exactly the engine's prompt, so the mismatch measures the number
# formats alone (a second turn re-tokenized differently is realigned, and the random tiny model's logprobs under
# the other tokenization are nats apart in any format).
REWARD = "def reward(task, outcome):\n    return float(len(outcome['reply']) % 2 == 0)\n"
CONFIG = {"steps": 2, "tasks_per_step": 2, "group_size": 2, "max_model_len": 512, "kv_cache_gb": 0.5,
          "eval_tasks": 0, "learning_rate": 1e-3}
MAX_MISMATCH = {"float32": 0.03, "bfloat16": 0.1}
"""Mean |engine - trainer| logprob per trained token. The random tiny model's logits are sharper than a trained
model's, so bfloat16's rounding moves them more: 0.066 seen here (transformers alone, bf16 weights against bf16
autocast: 0.086). SmolLM2 stays within 0.03 in both formats (bench/cpu_speed.py measures it)."""


@pytest.fixture
def workers(tmp_path, test_redis, settings):
    # The tiny model in a registry of its own, the engine's compile caches warm across sessions, the harness written.
    pool, registry = Workers.for_real_run(tmp_path, "tiny-real", HARNESS)
    for variable in ISA_LIMITS["avx2"]:  # this test says which limits the worker gets
        pool.env.pop(variable, None)
    settings.LIGHTNING_MODELS_DIR = registry
    settings.LIGHTNING_RUNS_DIR = pool.runs_dir
    yield pool
    pool.stop()


def run_on_worker(alice, tmp_path, workers, env: dict) -> Run:
    harness = catalog_services.create_harness(alice, name="one-call", timeout_s=120, command=[
        "python3", str(tmp_path / "harness.py"), "{task_file}", "{output_file}"])
    tasks = "\n".join(f'{{"id": "t{i}", "question": "say {i}", "split": "train"}}' for i in range(4))
    dataset = catalog_services.create_dataset(alice, name="words", content=tasks.encode(), filename="t.jsonl")
    reward = catalog_services.create_reward_script(alice, name="even", source=REWARD)
    model = str(Path(workers.env["LIGHTNING_MODELS_DIR"]) / "tiny-real")
    run = services.create_run(alice, name="formats", model=model, harness=harness, dataset=dataset,
                              reward_script=reward, config=CONFIG)
    workers.env.update(env)
    workers.start("runs", "runs")
    wait_db(lambda: Run.objects.get(pk=run.pk).status in ("succeeded", "failed"), "the end of the run", workers,
            timeout=600)
    run.refresh_from_db()
    assert (run.status, run.step, run.error) == ("succeeded", 2, ""), workers.tails()
    return run


def assert_ran_in(run: Run, workers: Workers, engine_dtype: str, trainer_dtype: str) -> None:
    formats = run.host["formats"]
    assert (formats["engine_dtype"], formats["trainer_dtype"]) == (engine_dtype, trainer_dtype)
    assert run.config["dtype"] == run.config["engine_dtype"] == "auto"  # the setting stays; clones resolve again
    assert run.host["summary"].endswith(f"-> engine {engine_dtype}, trainer {trainer_dtype} ({formats['reason']})")
    logs = list(run.events.filter(kind="run.log").values_list("payload__line", flat=True))
    assert f"host: {run.host['summary']}" in logs
    running = run.events.get(kind="run.status", payload__status="running").payload
    assert running["host"] == run.host["summary"]  # the open run page's header updates from this event
    engine_log = (workers.runs_dir / f"run-{run.pk}" / "engine" / "engine.log").read_text()
    assert f"dtype=torch.{engine_dtype}" in engine_log  # what vLLM says it serves in
    weights = workers.runs_dir / f"run-{run.pk}" / "engine" / "weights" / "model.safetensors"
    with safe_open(weights, "pt") as f:  # the last sync wrote the engine's own dtype
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {
            {"bfloat16": "BF16", "float32": "F32"}[engine_dtype]}
    by_name = {(m.name, m.step): m.value for m in run.metrics.all()}
    for step in (1, 2):
        assert 0 < by_name[("train/logprob_mismatch_mean", step)] <= MAX_MISMATCH[engine_dtype], by_name


def test_a_run_resolves_auto_on_its_workers_host(alice, tmp_path, workers):
    run = run_on_worker(alice, tmp_path, workers, {})
    here = detect()  # this test's process: no limit, the same machine as the worker
    expected = resolve(here)
    assert run.host["torch_capability"] == here.torch_capability and run.host["cpu_flags"] == list(here.cpu_flags)
    assert run.host["native_bf16"] is here.native_bf16 and run.host["isa_limit"] == ""
    assert_ran_in(run, workers, expected.engine_dtype, expected.trainer_dtype)


def test_a_worker_limited_to_avx2_runs_in_float32(alice, tmp_path, workers):
    run = run_on_worker(alice, tmp_path, workers, ISA_LIMITS["avx2"])
    assert run.host["torch_capability"] == "AVX2" and run.host["native_bf16"] is False
    assert run.host["isa_limit"] == "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"
    assert run.host["summary"].startswith("CPU: AVX2, no native bf16")
    assert run.host["formats"]["reason"] == "auto (engine and trainer): the CPU has no native bf16"
    assert_ran_in(run, workers, "float32", "float32")
    assert json.loads(json.dumps(run.host)) == run.host  # stored as plain JSON
