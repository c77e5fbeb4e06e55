"""Two vLLM replicas of the tiny model in one real run, one SIGKILLed mid-step (issue 14, part 3).

One run (real Celery worker, vLLM on CPU) with `engine_replicas: 2` and three steps. Step 1's weight update reaches
both replicas (each reports weight version 1 at step 2). During step 2 the test SIGKILLs the vLLM process of the
replica that has a call being generated: the proxy retries that call on the other replica (recorded retried, and
the harness gets its 200), re-pins the rollout there, and the run goes on with one replica: steps 2 and 3 train and
sync their weights into it, and the run succeeds. The run also trains at `world_size: 2` (rank 1 spawned beside the
worker's rank 0, gone with the run), so the scaled-out shape is proven end to end in one real run.

Run under the heavy lock on a shared machine:
`flock /tmp/lw-heavy.lock .venv/bin/python -m pytest tests/e2e/test_engine_replicas.py`.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model

from catalog import services as catalog_services
from common.procs import all_stats, cmdline, pids_matching
from runs import services
from runs.models import ModelCall, Rollout, Run, RunEvent
from tests.workers import REAL_RUN_MARKS, Workers, real_run, wait_db

pytestmark = REAL_RUN_MARKS

CALLS = 4  # calls per attempt, long ones (ignore_eos): the kill lands while one is being generated
HARNESS = '''
import json, os, sys, urllib.request
task = json.load(open(sys.argv[1]))
answers = open("answers.jsonl", "a")
open("calling", "w").close()
reply = ""
for i in range(CALLS):
    body = {"model": "policy", "messages": [{"role": "user", "content": task["question"]}], "max_tokens": 120,
            "ignore_eos": True}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answers.write(json.dumps({"status": response.status}) + "\\n")
        answers.flush()
        reply = json.loads(response.read())["choices"][0]["message"]["content"]
json.dump({"reply": reply}, open(sys.argv[2], "w"))
'''.replace("CALLS", str(CALLS))
REWARD = '''
import random


def reward(task, outcome):
    return random.random() if "reply" in outcome else 0.0
'''
CONFIG = {"steps": 3, "tasks_per_step": 2, "group_size": 2, "engine_replicas": 2, "world_size": 2,
          "checkpoint_every": 0, "max_model_len": 512, "kv_cache_gb": 0.25, "eval_tasks": 0}


def _replicas(worker_pid: int) -> dict[int, int]:
    """port -> vLLM pid of each live engine replica the worker owns."""
    watchdogs = [pid for pid in pids_matching("watchdog.py", "vllm.entrypoints")
                 if f"watchdog.py {worker_pid} --" in cmdline(pid)]
    engines = [s.pid for s in all_stats() if s.ppid in watchdogs and s.running]
    return {int(re.search(r"--port (\d+)", cmdline(pid)).group(1)): pid for pid in engines}


def _trainer_ranks(worker_pid: int) -> list[int]:
    """Pids of the trainer ranks 1..N-1 the worker spawned (torch.multiprocessing spawn children)."""
    return [s.pid for s in all_stats() if s.ppid == worker_pid and s.running and "spawn_main" in cmdline(s.pid)]


def _get(port: int, path: str) -> httpx.Response | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2)
    except httpx.HTTPError:
        return None


def _requests_running(port: int) -> float:
    response = _get(port, "/metrics")
    if response is None or response.status_code != 200:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def _kill_a_replica_mid_call(workers: Workers, worker_pid: int) -> dict:
    replicas = _replicas(worker_pid)
    assert len(replicas) == 2, f"expected two vLLM replicas, found {replicas}\n{workers.tails()}"
    versions = {port: _get(port, "/weight_info").json().get("weight_version") for port in replicas}
    deadline, busy = time.monotonic() + 60, None
    while time.monotonic() < deadline and busy is None:
        busy = next((port for port in replicas if _requests_running(port) > 0), None)
        time.sleep(0.02)
    assert busy is not None, f"no call was being generated on either replica\n{workers.tails()}"
    os.kill(replicas[busy], signal.SIGKILL)
    return {"port": busy, "pid": replicas[busy], "versions": versions, "ranks": _trainer_ranks(worker_pid),
            "survivor": next(port for port in replicas if port != busy)}


def _shown_retried(owner, calls: list[dict]) -> dict:
    """What the rollout page and the API show of the first retried call (None when no call was retried)."""
    from django.test import Client
    from rest_framework.test import APIClient

    retried = next((c for c in calls if c["retried"]), None)
    if retried is None:
        return {}
    page, api = Client(), APIClient()
    page.force_login(owner)
    api.force_authenticate(owner)
    html = page.get(f"/rollouts/{retried['rollout_id']}/")
    body = api.get(f"/api/v1/rollouts/{retried['rollout_id']}/")
    call = next(c for c in body.json()["calls"] if c["seq"] == retried["seq"])
    return {"page_status": html.status_code, "page": html.content.decode(), "api_status": body.status_code,
            "api_call": {"replica": call["replica"], "retried": call["retried"]}, "replica": retried["replica"]}


@pytest.fixture(scope="module")
def replica_run(django_db_setup, django_db_blocker, tmp_path_factory):
    """The run, once, with one replica killed in step 2; returns what the tests assert on."""
    tmp = tmp_path_factory.mktemp("engine-replicas")
    tasks = "\n".join(json.dumps({"id": f"t{i}", "question": f"count to {i}", "split": "train"}) for i in range(4))
    with real_run(tmp, "tiny-replicas", HARNESS, django_db_blocker) as workers:
        owner = get_user_model().objects.create_user("replica-owner", password="pw-replicas-1")
        harness = catalog_services.create_harness(owner, name="long-calls", timeout_s=120, command=[
            "python3", str(tmp / "harness.py"), "{task_file}", "{output_file}"])
        dataset = catalog_services.create_dataset(owner, name="counting", content=tasks.encode(), filename="t.jsonl")
        reward = catalog_services.create_reward_script(owner, name="random", source=REWARD)
        run = services.create_run(owner, name="replicas", model="tiny-replicas", harness=harness,
                                  dataset=dataset, reward_script=reward, config=CONFIG)
        started = time.monotonic()
        worker = workers.start("replicas", "runs")

        def mid_step_2() -> bool:  # step 1 trained and synced, step 2's harnesses making their calls
            current = Run.objects.get(pk=run.pk)
            if current.status in services.FINISHED:
                raise AssertionError(f"the run ended before the kill: {current.status} {current.error}"
                                     f"\n{workers.tails()}")
            return current.policy_version >= 1 and any(
                (workers.runs_dir / f"run-{run.pk}" / "rollouts" / str(pk) / "calling").exists()
                for pk in Rollout.objects.filter(run=run, step=1, status="running").values_list("pk", flat=True))

        wait_db(mid_step_2, "step 2's calls", workers, timeout=400)
        killed = _kill_a_replica_mid_call(workers, worker.pid)
        wait_db(lambda: Run.objects.get(pk=run.pk).status in services.FINISHED, "the end of the run", workers,
                timeout=300)
        wait_db(lambda: _replicas(worker.pid) == {}, "the engines to go", workers, timeout=60)
        wait_db(lambda: _trainer_ranks(worker.pid) == [], "the trainer ranks to go", workers, timeout=60)
        run.refresh_from_db()
        snapshot = {
            "run": {"status": run.status, "error": run.error, "step": run.step,
                    "policy_version": run.policy_version},
            "calls": list(ModelCall.objects.filter(rollout__run=run).order_by("rollout_id", "seq").values(
                "rollout_id", "rollout__step", "seq", "status_code", "replica", "retried", "error",
                "completion_ids")),
            "rollouts": list(Rollout.objects.filter(run=run).values("pk", "step", "status", "error")),
            "answers": {p.parent.name: [json.loads(line)["status"] for line in p.read_text().splitlines()]
                        for p in Path(workers.runs_dir).glob(f"run-{run.pk}/rollouts/*/answers.jsonl")},
            "log": [e.payload.get("line", "") for e in RunEvent.objects.filter(run=run, kind="run.log")],
            "killed": killed, "seconds": time.monotonic() - started, "tails": workers.tails(),
            "engine_logs": sorted(p.name for p in (workers.runs_dir / f"run-{run.pk}" / "engine").glob("*.log")),
        }
        snapshot["shown"] = _shown_retried(owner, snapshot["calls"])
        print(f"\nrun {snapshot['run']} in {snapshot['seconds']:.0f} s; killed {killed}")
        for call in snapshot["calls"]:
            print({k: v for k, v in call.items() if k != "completion_ids"})
    return snapshot


def test_the_run_trained_at_world_size_2_and_its_rank_went_with_it(replica_run):
    assert len(replica_run["killed"]["ranks"]) == 1  # rank 1 beside the worker's rank 0, mid-run
    assert replica_run["run"]["policy_version"] == 3  # three steps trained and synced from rank 0


def test_a_weight_update_reaches_both_replicas(replica_run):
    assert replica_run["killed"]["versions"] == {port: "1" for port in replica_run["killed"]["versions"]}
    assert replica_run["engine_logs"] == ["engine-0.log", "engine-1.log"]
    before = [c for c in replica_run["calls"] if c["rollout__step"] == 0]
    assert {c["replica"] for c in before} == {0, 1}  # step 1's rollouts were spread over both


def test_calls_cut_off_by_the_killed_replica_are_retried_on_the_other_and_the_run_goes_on(replica_run):
    run, calls = replica_run["run"], replica_run["calls"]
    assert (run["status"], run["policy_version"], run["error"] or "") == ("succeeded", 3, ""), replica_run["tails"]
    retried = [c for c in calls if c["retried"]]
    assert retried, "no call was retried"
    survivor = retried[0]["replica"]
    assert all(c["replica"] == survivor and c["status_code"] == 200 and c["completion_ids"] for c in retried)
    # Every call answered; after the kill (the first retried call) only the survivor answers.
    assert all(c["status_code"] == 200 and c["error"] == "" for c in calls), calls
    assert all(c["replica"] == survivor for c in calls if c["rollout__step"] == 2)
    assert {r["status"] for r in replica_run["rollouts"]} == {"succeeded"}
    # Each harness got every answer it asked for, and each is a recorded call.
    for rollout_id, answers in replica_run["answers"].items():
        assert answers == [200] * CALLS
        assert len([c for c in calls if c["rollout_id"] == int(rollout_id)]) == CALLS
    assert any(line.startswith("engine replica ") and "died" in line for line in replica_run["log"]), \
        replica_run["log"]
    # The rollout page and the API say which replica answered the retried call, and that it was retried.
    shown = replica_run["shown"]
    assert (shown["page_status"], shown["api_status"]) == (200, 200)
    assert shown["api_call"] == {"replica": survivor, "retried": True}
    assert f'<dd class="call-replica">{survivor} (retried here after its replica died)</dd>' in shown["page"]
