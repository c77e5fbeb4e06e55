"""Disk in a whole run on the CPU (vLLM, harness subprocesses, checkpoints; issue 26.2): 3 steps leave no workdir of
a succeeded rollout, and deleting the run leaves no folder of it."""
import json
import os
from pathlib import Path

from django.conf import settings

from runs import disk, services
from runs.models import Rollout
from runs.tasks import execute_run
from tests.runs.test_orchestrator import pytestmark, run_of, tiny_model  # noqa: F401 (marks and fixtures)


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
    figures = os.environ.get("LIGHTNING_BENCH_FIGURES")  # bench/disk_reclaim.py reads them
    if figures:
        Path(figures).write_text(json.dumps({
            "disk_left_by_succeeded_rollouts_mb": left_by_succeeded / 2**20, "succeeded_rollouts": len(succeeded),
            "failed_workdirs_kept": len(left), "run_folder_mb": held / 2**20,
            "left_after_delete_mb": disk.size_of(folder) / 2**20 if folder.exists() else 0.0}))
