"""Disk in a whole run on the CPU (vLLM, harness subprocesses, checkpoints; issue 26.2): 3 steps leave no workdir of
a succeeded rollout, and deleting the run leaves no folder of it; failed attempts beside 32 in flight take no live
attempt's workdir with them (issue 40.1).

With LIGHTNING_BENCH_FIGURES set, each test adds its figures to that JSON file (bench/disk_reclaim.py reads them)."""
import json
import os
from pathlib import Path

from django.conf import settings

from runs import disk, services
from runs.models import Rollout
from runs.tasks import execute_run
from tests.runs.test_orchestrator import pytestmark, run_of, tiny_model  # noqa: F401 (marks and fixtures)


def add_figures(**values) -> None:
    """Adds `values` to the bench's figures file, when a bench asked for one."""
    path = os.environ.get("LIGHTNING_BENCH_FIGURES")
    if path:
        figures = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        Path(path).write_text(json.dumps({**figures, **values}))


def test_three_steps_leave_no_succeeded_workdir_and_deleting_the_run_leaves_no_folder(run_of, alice):  # noqa: F811
    run = run_of({"steps": 3, "checkpoint_every": 1})
    assert execute_run.apply(args=[run.pk]).get() == "succeeded"
    folder = Path(settings.LIGHTNING_RUNS_DIR) / f"run-{run.pk}"
    rollouts = Rollout.objects.filter(run=run)
    succeeded = {str(pk) for pk in rollouts.filter(status="succeeded").values_list("pk", flat=True)}
    failed = {str(pk) for pk in rollouts.filter(status="failed").values_list("pk", flat=True)}
    assert len(succeeded) >= 12  # 3 steps of 2 x 2, and the evaluations
    left = {p.name for p in (folder / "rollouts").iterdir()} if (folder / "rollouts").exists() else set()
    assert left <= failed and not left & succeeded
    assert (folder / "checkpoints").is_dir()  # what the run needs stays
    left_by_succeeded = sum(disk.size_of(folder / "rollouts" / name) for name in left & succeeded)
    held = disk.size_of(folder)

    run.refresh_from_db()
    services.delete_run(run, alice)
    assert not folder.exists()
    add_figures(disk_left_by_succeeded_rollouts_mb=left_by_succeeded / 2**20, succeeded_rollouts=len(succeeded),
                failed_workdirs_kept=len(left), run_folder_mb=held / 2**20,
                left_after_delete_mb=disk.size_of(folder) / 2**20 if folder.exists() else 0.0)


FAILING_HARNESS = '''
import json, os, sys, time, urllib.request
task = json.load(open(sys.argv[1]))
rollout = int(os.environ["LIGHTNING_ROLLOUT_ID"])

def chat(messages):
    body = {"model": "anything", "messages": messages, "max_tokens": 8}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                              "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["message"]["content"]

first = chat([{"role": "user", "content": task["question"]}])
if rollout % 5 == 0:  # injected: every fifth attempt fails after the model answered (a policy failure), half by timeout
    json.dump({"reply": first}, open(sys.argv[2], "w"))
    time.sleep(300) if rollout % 10 == 0 else sys.exit(3)
time.sleep(1 + rollout % 4)  # the others are still running while those fail
json.dump({"reply": first, "files": sorted(os.listdir("."))}, open(sys.argv[2], "w"))
'''


def test_injected_failures_beside_32_attempts_in_flight_lose_no_live_workdir(run_of, tmp_path, settings):  # noqa: F811
    """Issue 40.1, at run level: 8 groups of 4 (and 8 val tasks x 4) in flight, every fifth attempt failing by exit
    or timeout. On main a failure's clean-up pruned every folder under rollouts/ but the newest 20, live ones
    included, and their harnesses failed on missing files. Every attempt not injected to fail succeeds here."""
    settings.LIGHTNING_FAILED_WORKDIRS_KEPT = 4  # below the attempts in flight, as 20 is below a real run's 32
    (tmp_path / "harness.py").write_text(FAILING_HARNESS)
    run = run_of({"steps": 2, "tasks_per_step": 8, "group_size": 4, "eval_tasks": 2, "eval_samples": 16,
                  "eval_greedy": False, "eval_concurrency": 32})
    run.harness_snapshot = {**run.harness_snapshot, "timeout_s": 45}  # a live attempt's call may wait on a busy host
    run.save(update_fields=["harness_snapshot"])
    status = execute_run.apply(args=[run.pk]).get()
    run.refresh_from_db()
    assert (status, run.error) == ("succeeded", "")
    rollouts = list(Rollout.objects.filter(run=run).values_list("pk", "status", "failure_kind", "error", "outcome"))
    injected = [r for r in rollouts if r[0] % 5 == 0]
    live = [r for r in rollouts if r[0] % 5 != 0]
    lost = [r for r in live if r[1] != "succeeded" or "task.json" not in r[4].get("files", ())]
    assert [(pk, status, error) for pk, status, _, error, _ in lost] == []
    assert len(rollouts) == 2 * 32 + 2 * 32  # two steps of 8 x 4, two evaluations of 2 x 16
    assert injected and all((status, kind) == ("failed", "policy") for _, status, kind, _, _ in injected)
    add_figures(live_workdirs_lost=len(lost), live_attempts=len(live), injected_failures=len(injected))
