"""`manage.py up`'s console shows what a user acts on: the sweep of lost runs prints only when it reclaims a run."""
import json
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from common.procs import kill_groups
from lightning_web.management.commands import up
from runs import services
from runs.models import Run
from tests.e2e.test_up import ROOT
from tests.workers import workers  # noqa: F401  (the workers fixture)

PER_SWEEP_LINES = ("Sending due task sweep-lost-runs", "Task runs.tasks.sweep_lost_runs[")
"""What beat and the worker printed for every sweep before: three lines every LIGHTNING_SWEEP_EVERY_S (beat's send,
the task received, the task succeeded), finding nothing or not."""


def test_up_holds_the_per_task_beat_and_request_loggers_of_its_children_at_warning():
    env = up.child_env()
    assert env["LIGHTNING_QUIET_LOGGERS"] == ",".join(up.QUIET_LOGGERS)
    assert {"celery.app.trace", "celery.worker.strategy", "celery.beat", "httpx"} <= set(up.QUIET_LOGGERS)
    names = [*up.QUIET_LOGGERS, "runs.services", "runs.durability", "celery.worker.consumer.connection"]
    probe = ("import django, json, logging; django.setup(); "
             f"print(json.dumps({{n: logging.getLogger(n).getEffectiveLevel() for n in {names!r}}}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    levels = json.loads(out.stdout.strip().splitlines()[-1])
    # Runs starting and ending, a reclaimed run, a lost broker connection: still at INFO.
    assert levels == {**dict.fromkeys(up.QUIET_LOGGERS, 30), "runs.services": 20, "runs.durability": 20,
                      "celery.worker.consumer.connection": 20}


def test_up_leaves_a_quiet_loggers_setting_of_its_own_alone(monkeypatch):
    monkeypatch.setenv("LIGHTNING_QUIET_LOGGERS", "")  # set but empty: every line, as before
    assert up.child_env()["LIGHTNING_QUIET_LOGGERS"] == ""


def wait_for_line(path, text, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not printed; output:\n{content}")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_control_worker_as_up_starts_it_prints_a_sweep_only_when_it_reclaims_a_run(
        workers, alice, make_run, tmp_path):
    run = make_run(alice, name="lost")
    services.claim_run(run.pk, "task")  # a worker took it, then stopped beating (no checkpoint: it fails)
    Run.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    log = tmp_path / "control.log"
    # The control worker with beat exactly as `up` runs it, on the tests' database and broker, sweeping every 1 s.
    env = {**workers.env, "LIGHTNING_QUIET_LOGGERS": up.child_env()["LIGHTNING_QUIET_LOGGERS"]}
    with open(log, "wb") as out:
        proc = subprocess.Popen(up.child_argvs("127.0.0.1", 0)["control"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        printed = wait_for_line(log, f"run {run.pk} (starting, worker start 1): no heartbeat for ", proc)
        assert Run.objects.get(pk=run.pk).status == "failed"
    finally:
        kill_groups([proc.pid], grace_s=30)
        proc.wait()
    reclaimed = [line for line in printed.splitlines() if f"run {run.pk} (starting, worker start 1)" in line]
    assert len(reclaimed) == 1 and "WARNING" in reclaimed[0] and reclaimed[0].endswith("now failed")
    assert [line for line in printed.splitlines() if any(noise in line for noise in PER_SWEEP_LINES)] == []
    assert "[tasks]" not in printed and "[config]" not in printed  # no banner (--quiet)
