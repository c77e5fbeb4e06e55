"""Faults of user code and of the engine during one real run of the tiny model (issue 13, point 5).

One run, real Celery worker, vLLM on CPU. Its val tasks each carry a fault that the harness or the reward script
acts out at the step-0 evaluation (a harness crash, hang and flood of output; a reward script exception, timeout,
memory bomb and endless output), beside a healthy task. Its train tasks are healthy: step 1 trains despite the
faults. During step 2 the test SIGKILLs vLLM while a call is in flight: the run fails with that reason.

Every harness appends the HTTP status of each answer it got to `answers.jsonl` in its workdir; every such answer
must be a ModelCall row (no recorded call lost). Each fault must leave its rollout finished with a status and a
failure kind, and be readable on the run page (its rollouts table) and the rollout page.

The run happens once (module fixture) and is snapshotted; each fault is its own test case named `test_fault_*`
(the user-code ones parametrised by fault name), so `pytest --junitxml` counts faults passed out of total (8).
Run under the heavy lock on a shared machine:
`flock /tmp/lw-heavy.lock .venv/bin/python -m pytest tests/e2e/test_faults_user_code.py`.
"""
from __future__ import annotations

import html
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from catalog import services as catalog_services
from common.procs import all_stats, cmdline, pids_matching
from runs import services
from runs.models import ModelCall, Rollout, Run
from tests.workers import REAL_RUN_MARKS, Workers, real_run, wait_db

pytestmark = REAL_RUN_MARKS

HARNESS_TIMEOUT_S = 30
REWARD_TIMEOUT_S = 3
FLOOD_KB = 4096  # written to stdout and to stderr each: 4 MB apiece
SLOW_CALLS = 4  # long calls of a train task before its last short one

HARNESS = '''
import json, os, sys, time, urllib.error, urllib.request
task = json.load(open(sys.argv[1]))
fault = task.get("fault", "none")
answers = open("answers.jsonl", "a")  # the HTTP status of every answer this harness got, as it gets it


def chat(text, max_tokens=8):
    body = {"model": "policy", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, answer = response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, None
    answers.write(json.dumps({"status": status}) + "\\n")
    answers.flush()
    if answer is None:
        raise SystemExit(f"call answered {status}")
    return answer["choices"][0]["message"]["content"]


if fault == "slow":  # the train tasks: several long calls, so the engine can be killed during one
    open("calling", "w").close()
    for _ in range(CALLS):
        chat(task["question"], max_tokens=100)
        time.sleep(0.2)
reply = chat(task["question"])
if fault == "harness_crash":
    raise RuntimeError("harness fault: crash after the first answer")
if fault == "harness_hang":
    time.sleep(3600)
if fault == "harness_flood":
    line = "f" * 1023 + "\\n"
    for _ in range(FLOOD_KB):
        sys.stdout.write(line)
        sys.stderr.write(line)
    sys.stdout.write("FLOOD-END-OUT\\n")
    sys.stderr.write("FLOOD-END-ERR\\n")
json.dump({"reply": reply}, open(sys.argv[2], "w"))
'''.replace("FLOOD_KB", str(FLOOD_KB)).replace("CALLS", str(SLOW_CALLS))

REWARD = '''
import random
import time


def reward(task, outcome):
    fault = task.get("fault", "none")
    if fault == "reward_exception":
        raise ValueError("reward fault: exception on purpose")
    if fault == "reward_timeout":
        time.sleep(600)
    if fault == "reward_memory":
        hog = []
        while True:
            hog.append(bytearray(16 * 2 ** 20))
    if fault == "reward_memory":
        assert "memory" in rollout["error"].lower(), rollout["error"]
    if fault == "reward_output":
        while True:
            print("reward fault: endless output " * 40)
    return random.random() if "reply" in outcome else 0.0
'''

USER_CODE_FAULTS = ("harness_crash", "harness_hang", "harness_flood", "reward_exception", "reward_timeout",
                    "reward_memory", "reward_output")
VAL_FAULTS = ("none",) + USER_CODE_FAULTS
CONFIG = {"steps": 2, "tasks_per_step": 1, "group_size": 2, "checkpoint_every": 1, "max_model_len": 512,
          "kv_cache_gb": 0.5, "eval_tasks": len(VAL_FAULTS), "eval_samples": 1, "eval_greedy": False}


def _tasks() -> bytes:
    rows = [{"id": f"val-{fault}", "question": f"say {i}", "fault": fault, "split": "val"}
            for i, fault in enumerate(VAL_FAULTS)]
    rows += [{"id": f"train-{i}", "question": f"count to {i}", "fault": "slow", "split": "train"} for i in range(2)]
    return "\n".join(json.dumps(row) for row in rows).encode()


def _engine_processes(worker_pid: int) -> tuple[list[int], list[int]]:
    """(watchdog, vLLM) pids of the engine the worker `worker_pid` owns."""
    watchdogs = [pid for pid in pids_matching("watchdog.py", "vllm.entrypoints")
                 if f"watchdog.py {worker_pid} --" in cmdline(pid)]
    return watchdogs, [s.pid for s in all_stats() if s.ppid in watchdogs and s.running]


def _requests_running(port: int) -> float | None:
    """vLLM's gauge of requests being generated now; None where /metrics does not answer."""
    try:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
              if line.startswith("vllm:num_requests_running")]
    return sum(values) if values else None


def _kill_engine_mid_call(workers: Workers, worker_pid: int) -> dict:
    """SIGKILL vLLM (not its watchdog: as the OOM killer would) once a call is being generated."""
    _, engines = _engine_processes(worker_pid)
    assert len(engines) == 1, f"expected one vLLM process, found {engines}\n{workers.tails()}"
    port = int(re.search(r"--port (\d+)", cmdline(engines[0])).group(1))
    deadline, in_flight = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        in_flight = _requests_running(port)
        if in_flight:
            break
        time.sleep(0.05)
    os.kill(engines[0], signal.SIGKILL)
    return {"pid": engines[0], "port": port, "requests_running": in_flight}


def _answers(workdir: Path) -> list[int]:
    path = workdir / "answers.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["status"] for line in path.read_text().splitlines() if line.strip()]


def _snapshot(run: Run, workers: Workers, client: Client, killed: dict, worker_pid: int) -> dict:
    """Everything the tests assert on, read before the database is emptied."""
    run.refresh_from_db()
    rollouts = {}
    for rollout in Rollout.objects.filter(run=run).select_related("task").order_by("pk"):
        calls = list(ModelCall.objects.filter(rollout=rollout).order_by("seq").values("seq", "status_code", "error"))
        page = client.get(f"/rollouts/{rollout.pk}/")
        rollouts[rollout.pk] = {
            "fault": rollout.task.data.get("fault") if rollout.task else None, "split": rollout.split,
            "step": rollout.step, "status": rollout.status, "failure_kind": rollout.failure_kind,
            "error": rollout.error, "reward": rollout.reward, "reward_detail": rollout.reward_detail,
            "exit_code": rollout.exit_code, "stdout_tail": rollout.stdout_tail, "stderr_tail": rollout.stderr_tail,
            "calls": calls, "answers": _answers(workers.runs_dir / f"run-{run.pk}" / "rollouts" / str(rollout.pk)),
            "page_status": page.status_code, "page": page.content.decode(),
        }
    run_page = client.get(f"/runs/{run.pk}/")
    table = client.get(f"/runs/{run.pk}/rollouts/", {"page_size": 100})
    return {
        "run": {"status": run.status, "error": run.error, "step": run.step, "policy_version": run.policy_version,
                "checkpoint_path": run.checkpoint_path},
        "metrics": list(run.metrics.values_list("name", "step")),
        "rollouts": rollouts, "run_page_status": run_page.status_code, "run_page": run_page.content.decode(),
        "table_status": table.status_code, "table": table.json() if table.status_code == 200 else {},
        "killed": killed, "engines_left": _engine_processes(worker_pid),
        "harnesses_left": pids_matching(str(workers.runs_dir)), "tails": workers.tails(),
    }


@pytest.fixture(scope="module")
def fault_run(django_db_setup, django_db_blocker, tmp_path_factory):
    """The run, once, with its faults; returns the snapshot of its rows, pages and processes."""
    tmp = tmp_path_factory.mktemp("faults-user-code")
    with real_run(tmp, "tiny-faults", HARNESS, django_db_blocker) as workers:
        owner = get_user_model().objects.create_user("fault-owner", password="pw-faults-1")
        harness = catalog_services.create_harness(owner, name="faulty", timeout_s=HARNESS_TIMEOUT_S, command=[
            "python3", str(tmp / "harness.py"), "{task_file}", "{output_file}"])
        dataset = catalog_services.create_dataset(owner, name="faults", content=_tasks(), filename="faults.jsonl")
        reward = catalog_services.create_reward_script(owner, name="faulty", source=REWARD, timeout_s=REWARD_TIMEOUT_S)
        run = services.create_run(owner, name="faults", model="tiny-faults", harness=harness, dataset=dataset,
                                  reward_script=reward, config=CONFIG)
        worker = workers.start("faults", "runs")

        def mid_step_2():  # step 1 trained and checkpointed, step 2's harnesses making their calls
            current = Run.objects.get(pk=run.pk)
            if current.status in services.FINISHED:
                raise AssertionError(f"the run ended before the engine kill: {current.status} {current.error}"
                                     f"\n{workers.tails()}")
            return current.checkpoint_path.endswith("step-000001") and any(
                (workers.runs_dir / f"run-{run.pk}" / "rollouts" / str(pk) / "calling").exists()
                for pk in Rollout.objects.filter(run=run, split="train", step=1, status="running")
                .values_list("pk", flat=True))

        wait_db(mid_step_2, "step 2's calls", workers, timeout=900)
        killed = _kill_engine_mid_call(workers, worker.pid)
        wait_db(lambda: Run.objects.get(pk=run.pk).status in services.FINISHED, "the end of the run", workers,
                timeout=300)
        # The worker closes the run's harnesses and engine on its way out of the run.
        wait_db(lambda: not pids_matching(str(workers.runs_dir)) and _engine_processes(worker.pid) == ([], []),
                "the run's processes to go", workers, timeout=60)
        client = Client()
        client.force_login(owner)
        snapshot = _snapshot(run, workers, client, killed, worker.pid)
        print(f"\nrun {snapshot['run']['status']}: {snapshot['run']['error'].splitlines()[0]}\nkilled {killed}")
        for pk, r in snapshot["rollouts"].items():
            print(f"rollout {pk} {r['split']} step {r['step']} {r['fault']}: {r['status']} "
                  f"{r['failure_kind'] or '-'} calls {[c['status_code'] for c in r['calls']]} "
                  f"answers {r['answers']} {r['error'].splitlines()[0] if r['error'] else ''}")
    return snapshot


def _of(snapshot: dict, fault: str) -> list[dict]:
    rows = [r | {"pk": pk} for pk, r in snapshot["rollouts"].items() if r["fault"] == fault]
    assert rows, f"no rollout of the {fault!r} task\n{snapshot['tails']}"
    return rows


def _assert_no_lost_call(rollout: dict) -> None:
    """Every answer the harness got is a ModelCall row: its 200s one for one, and no fewer rows than answers."""
    answered_ok = [s for s in rollout["answers"] if s == 200]
    recorded_ok = [c for c in rollout["calls"] if c["status_code"] == 200]
    assert len(recorded_ok) == len(answered_ok), (rollout["pk"], rollout["answers"], rollout["calls"])
    for status in set(rollout["answers"]):
        recorded = [c for c in rollout["calls"] if c["status_code"] == status]
        assert len(recorded) >= rollout["answers"].count(status), (rollout["pk"], rollout["answers"], rollout["calls"])


def _assert_visible(snapshot: dict, rollout: dict, *texts: str) -> None:
    """The rollout page shows its status, failure kind and `texts`; the run page's rollouts table lists it."""
    page = rollout["page"]
    assert rollout["page_status"] == 200
    assert f'class="status status-{rollout["status"]}">{rollout["status"]}<' in page
    assert f"<dt>Failure kind</dt><dd>{rollout['failure_kind'] or '–'}</dd>" in page
    for text in texts:
        assert html.escape(text) in page, (text, rollout["pk"])
    assert snapshot["table_status"] == 200
    row = next(r for r in snapshot["table"]["results"] if r["id"] == rollout["pk"])
    assert (row["status"], row["failure_kind"]) == (rollout["status"], rollout["failure_kind"])
    assert rollout["error"].startswith(row["error"])  # the table shows the start of the error


EXPECTED = {
    # fault: (status, failure kind, error start)
    "harness_crash": ("failed", "policy", "harness exited with code 1"),
    "harness_hang": ("failed", "policy", f"harness timed out after {HARNESS_TIMEOUT_S} s"),
    "harness_flood": ("succeeded", "", ""),
    "reward_exception": ("failed", "infra", "reward: ValueError: reward fault: exception on purpose"),
    "reward_timeout": ("failed", "infra", f"reward: the reward script timed out after {REWARD_TIMEOUT_S} s"),
    "reward_memory": ("failed", "infra", "reward: "),  # a MemoryError, or a kill at the sandbox's limit
    "reward_output": ("failed", "infra", "reward: the reward script printed more than"),
}


@pytest.mark.parametrize("fault", USER_CODE_FAULTS)
def test_fault_of_user_code_fails_only_its_rollout_visibly_and_loses_no_call(fault_run, fault):
    (rollout,) = _of(fault_run, fault)  # one attempt per val task in the step-0 evaluation
    status, kind, error = EXPECTED[fault]
    assert (rollout["split"], rollout["step"]) == ("val", 0)
    assert (rollout["status"], rollout["failure_kind"]) == (status, kind), rollout | {"page": ""}
    assert rollout["error"].startswith(error), rollout["error"]
    assert rollout["answers"] and rollout["answers"][0] == 200  # the model answered before the fault
    _assert_no_lost_call(rollout)
    _assert_visible(fault_run, rollout, rollout["error"])
    if fault.startswith("reward_"):
        assert rollout["reward"] is None and rollout["exit_code"] == 0
        assert rollout["reward_detail"]["reward_error"] == rollout["error"].removeprefix("reward: ")
    if fault == "reward_memory":
        assert "memory" in rollout["error"].lower(), rollout["error"]
    if fault == "reward_output":
        assert len(rollout["reward_detail"]["reward_output"]) <= 4096
        assert "reward fault: endless output" in rollout["reward_detail"]["reward_output"]
    if fault == "harness_crash":
        assert rollout["exit_code"] == 1 and "harness fault: crash after the first answer" in rollout["stderr_tail"]
        _assert_visible(fault_run, rollout, "RuntimeError: harness fault: crash after the first answer")
    if fault == "harness_hang":
        assert rollout["exit_code"] == -signal.SIGKILL and len(rollout["answers"]) == 1
    if fault == "harness_flood":  # MBs of output: only the tails are kept, the ends of both streams among them
        assert rollout["exit_code"] == 0 and rollout["reward"] is not None
        assert rollout["stdout_tail"].endswith("FLOOD-END-OUT\n") and len(rollout["stdout_tail"]) <= 16384
        assert rollout["stderr_tail"].endswith("FLOOD-END-ERR\n") and len(rollout["stderr_tail"]) <= 16384
        _assert_visible(fault_run, rollout, "FLOOD-END-OUT", "FLOOD-END-ERR")
    # The run went on: step 1 trained on the healthy train tasks after this evaluation.
    assert fault_run["run"]["step"] >= 1 and ("reward/mean", 1) in fault_run["metrics"]


def test_fault_engine_killed_mid_call_fails_the_run_with_the_reason_and_loses_no_call(fault_run):
    run, killed = fault_run["run"], fault_run["killed"]
    assert killed["requests_running"], f"no call was in flight when vLLM was killed: {killed}"
    assert run["status"] == "failed", run
    assert run["error"].startswith("EngineDied: the engine (vLLM) died mid-run"), run["error"]
    assert "[watchdog] vLLM killed by SIGKILL" in run["error"]  # the engine log's tail says how
    assert (run["step"], run["policy_version"]) == (1, 1) and run["checkpoint_path"].endswith("step-000001")
    # Step 2's rollouts were cut off: infrastructure failures (never trained on) that say why.
    cut = [r | {"pk": pk} for pk, r in fault_run["rollouts"].items() if r["split"] == "train" and r["step"] == 1]
    assert len(cut) == 2
    for rollout in cut:
        assert (rollout["status"], rollout["failure_kind"]) == ("failed", "infra"), rollout | {"page": ""}
        assert "engine" in rollout["error"], rollout["error"]
        _assert_no_lost_call(rollout)
        _assert_visible(fault_run, rollout, rollout["error"].splitlines()[0])
    # The call in flight was answered 502 by the proxy and recorded as such.
    failed_calls = [c for r in cut for c in r["calls"] if c["status_code"] == 502]
    assert failed_calls and all("engine unreachable" in c["error"] for c in failed_calls), failed_calls
    assert fault_run["run_page_status"] == 200
    assert html.escape(run["error"].splitlines()[0]) in fault_run["run_page"]
    assert 'class="status status-failed">failed<' in fault_run["run_page"]
    assert fault_run["engines_left"] == ([], []) and fault_run["harnesses_left"] == []


def test_the_faulty_run_is_coherent_every_rollout_finished_and_no_call_is_lost(fault_run):
    rollouts = fault_run["rollouts"]
    statuses = {(r["status"], r["failure_kind"]) for r in rollouts.values()}
    assert statuses <= {("succeeded", ""), ("failed", "policy"), ("failed", "infra")}, statuses
    assert all(r["status"] == "succeeded" or r["error"] for r in rollouts.values())
    for pk, rollout in rollouts.items():
        _assert_no_lost_call(rollout | {"pk": pk})
    (healthy,) = _of(fault_run, "none")
    assert (healthy["status"], healthy["failure_kind"], healthy["error"]) == ("succeeded", "", "")
    trained = [r for r in rollouts.values() if r["split"] == "train" and r["step"] == 0]
    assert [(r["status"], r["error"], len(r["answers"])) for r in trained] == [("succeeded", "", SLOW_CALLS + 1)] * 2
    assert fault_run["table"]["count"] == len(rollouts)
