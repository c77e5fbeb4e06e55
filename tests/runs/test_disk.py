"""Disk reclaimed (issue 26.2): rollout workdirs after recording, a deleted run's folders, `manage.py disk`."""
import json
import os
import time
from io import StringIO

import pytest
from django.core.management import call_command

from runs import disk, rollout_services, services
from runs.models import Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def dirs(tmp_path, settings):
    settings.LIGHTNING_RUNS_DIR = tmp_path / "runs"
    settings.LIGHTNING_ENGINE_CACHE_DIR = tmp_path / "engine-cache"
    settings.LIGHTNING_FAILED_WORKDIRS_KEPT = 2
    settings.LIGHTNING_FAILED_WORKDIRS_MAX_AGE_H = 24
    return tmp_path


def filled(path, mb=1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "blob").write_bytes(b"x" * (mb << 20))
    return path


def served(dirs, name, source):
    folder = filled(dirs / "engine-cache" / "models" / name)
    (folder / ".served-from.json").write_text(json.dumps({"source": str(source)}))
    return folder


def test_a_succeeded_workdir_goes_and_failed_ones_are_kept_within_the_limits(dirs):
    rollouts = dirs / "runs" / "run-1" / "rollouts"
    disk.reclaim_workdir(filled(rollouts / "1"), failed=False)
    assert not (rollouts / "1").exists()
    for i, age_h in ((2, 30), (3, 3), (4, 2), (5, 1)):  # 2 is past the age limit; 3 is the oldest beyond 2 kept
        (filled(rollouts / str(i), mb=0) / disk.FAILED_MARK).touch()
        then = time.time() - age_h * 3600
        os.utime(rollouts / str(i), (then, then))
    for i, age_h in ((7, 40), (8, 3), (9, 0)):  # attempts still running (not marked failed): never counted
        filled(rollouts / str(i), mb=0)
        then = time.time() - age_h * 3600
        os.utime(rollouts / str(i), (then, then))
    disk.reclaim_workdir(filled(rollouts / "6", mb=0), failed=True)
    assert sorted(p.name for p in rollouts.iterdir()) == ["5", "6", "7", "8", "9"]
    assert (rollouts / "6" / disk.FAILED_MARK).is_file() and not (rollouts / "7" / disk.FAILED_MARK).exists()


def test_deleting_a_run_removes_its_folder_and_the_served_folders_of_its_checkpoints(dirs, alice, alice_api,
                                                                                   make_run,
                                                                                   django_capture_on_commit_callbacks):
    run = make_run(alice)
    other = make_run(alice, name="other")
    folder = dirs / "runs" / f"run-{run.pk}"
    filled(folder / "rollouts" / "7")
    filled(folder / "checkpoints" / "step-000002")
    filled(folder / "engine" / "weights")
    own = served(dirs, "step-000002-abc", folder / "checkpoints" / "step-000002")
    shared = served(dirs, "tiny-def", dirs / "models" / "tiny")
    kept = filled(dirs / "runs" / f"run-{other.pk}" / "checkpoints")
    services.transition_run(run.pk, "cancelled")
    with django_capture_on_commit_callbacks(execute=True):
        response = alice_api.delete(f"/api/v1/runs/{run.pk}/")
    assert response.status_code == 204 and not Run.objects.filter(pk=run.pk).exists()
    assert not folder.exists() and not own.exists()
    assert shared.exists() and kept.exists()  # another run's files and a registry model's served folder stay


def test_only_the_owner_deletes_and_a_running_run_is_refused(dirs, alice, bob_api, alice_api, make_run):
    run = make_run(alice)
    filled(dirs / "runs" / f"run-{run.pk}")
    assert bob_api.delete(f"/api/v1/runs/{run.pk}/").status_code == 404
    assert alice_api.delete(f"/api/v1/runs/{run.pk}/").status_code == 409  # queued: cancel it first
    assert (dirs / "runs" / f"run-{run.pk}").exists() and Run.objects.filter(pk=run.pk).exists()


def test_the_disk_command_reports_then_frees_what_the_rules_allow(dirs, alice, make_run):
    run = make_run(alice)
    services.transition_run(run.pk, "failed", error="x")
    done, _ = rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=0)
    bad, _ = rollout_services.create_rollout(run, task=None, split="train", step=0, group=0, attempt=1)
    from runs.models import Rollout

    Rollout.objects.filter(pk=done.pk).update(status="succeeded")
    Rollout.objects.filter(pk=bad.pk).update(status="failed")
    folder = dirs / "runs" / f"run-{run.pk}"
    filled(folder / "rollouts" / str(done.pk), mb=2)  # left by an older version
    filled(folder / "rollouts" / str(bad.pk))  # failed, within the limits: kept
    filled(folder / "checkpoints" / "step-000001")
    filled(folder / "engine" / "weights")
    orphan = filled(dirs / "runs" / "run-999999", mb=3)
    gone = served(dirs, "deleted-abc", dirs / "models" / "deleted")
    in_use = served(dirs, "tiny-abc", filled(dirs / "models" / "tiny"))

    out = StringIO()
    call_command("disk", stdout=out)
    report = out.getvalue()
    assert f"run-{run.pk}" in report and "run-999999" in report
    assert "its run was deleted" in report and "workdir of a succeeded rollout" in report
    assert "engine weights of a finished run" in report and "served folder of a model that is gone" in report
    assert "would free 7.0 MB" in report  # 3 orphan + 2 workdir + 1 weights + 1 served
    assert orphan.exists()  # a report deletes nothing

    out = StringIO()
    call_command("disk", "--free", stdout=out)
    assert "freed 7.0 MB" in out.getvalue()
    assert not orphan.exists() and not (folder / "rollouts" / str(done.pk)).exists() and not gone.exists()
    assert not (folder / "engine" / "weights").exists()
    assert (folder / "rollouts" / str(bad.pk)).exists() and (folder / "checkpoints").exists() and in_use.exists()
