"""A real Celery worker on the real Redis broker claims queued runs from the `runs` queue."""
import time

import pytest
from celery.contrib.testing.worker import start_worker

from catalog import services as catalog_services
from lightning_web.celery import app
from runs import services
from runs.models import Run
from runs.tasks import execute_run

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.e2e]


def wait_for(run_id, statuses, timeout=90):  # a loaded CI machine: claim and fail take seconds each
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = Run.objects.get(pk=run_id)
        if run.status in statuses:
            return run
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} stayed {run.status}")


@pytest.fixture
def worker(test_redis):
    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False, queues=["runs"],
                      loglevel="WARNING"):
        yield


def test_a_queued_run_is_claimed_and_ends_with_a_clear_message(alice, make_run, test_redis, worker, models_dir):
    run = make_run(alice)  # transactional: the on_commit enqueue really sends the message
    run = wait_for(run.pk, {"failed"})  # the registry's `tiny` here has a config but no weights
    assert run.error == f"model folder {(models_dir / 'tiny').resolve()} holds no *.safetensors weights"
    assert run.celery_task_id and run.finished_at
    assert list(run.events.values_list("payload__status", flat=True)) == ["queued", "starting", "failed"]
    assert test_redis.llen("runs") == 0


def test_a_run_cancelled_while_queued_is_not_started(alice, make_run, test_redis):
    run = make_run(alice)
    services.cancel_run(run, alice)
    assert test_redis.llen("runs") == 1
    with start_worker(app, pool="solo", concurrency=1, perform_ping_check=False, queues=["runs"], loglevel="WARNING"):
        deadline = time.monotonic() + 20
        while test_redis.llen("runs") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
    run.refresh_from_db()
    assert run.status == "cancelled" and list(run.events.values_list("payload__status", flat=True)) == [
        "queued", "cancelled"]


def test_the_task_does_nothing_for_a_run_already_claimed(alice, make_run):
    run = make_run(alice)
    services.claim_run(run.pk, "someone-else")
    assert execute_run.apply(args=[run.pk]).get() == "starting"
    assert Run.objects.get(pk=run.pk).celery_task_id == "someone-else"


def test_a_missing_run_is_ignored():
    assert execute_run.apply(args=[999999]).get() == "missing"


def test_a_kubernetes_harness_pods_cannot_reach_is_refused_with_the_fix(alice, make_dataset, make_reward, tmp_path,
                                                                        settings):
    from catalog.models import Harness

    settings.LIGHTNING_PROXY_HOST, settings.LIGHTNING_PROXY_ADVERTISE_URL = "127.0.0.1", ""  # a loopback proxy
    settings.LIGHTNING_MODELS_DIR = tmp_path  # a registry of its own holding the model folder `m`
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")  # a model folder the run accepts (issue 40.5)
    harness = catalog_services.create_harness(alice, name="pod", command=["agent"], executor="kubernetes", image="img:1")
    run = services.create_run(alice, name="k8s", model=str(tmp_path / "m"), config={}, harness=harness,
                              dataset=make_dataset(alice), reward_script=make_reward(alice))
    assert execute_run.apply(args=[run.pk]).get() == "failed"
    run.refresh_from_db()
    assert run.error.startswith("a kubernetes harness cannot reach the proxy listening on 127.0.0.1: set "
                                "LIGHTNING_PROXY_HOST=0.0.0.0 and LIGHTNING_PROXY_ADVERTISE_URL")
    assert Harness.objects.get(pk=harness.pk).executor == "kubernetes"


def test_a_library_base_exception_fails_the_run_and_the_worker_serves_the_next(alice, make_run, test_redis, worker,
                                                                                monkeypatch):
    """torch.distributed.checkpoint's CheckpointException is a BaseException: escaping the task, it crashed the
    Celery worker ("cannot unpack non-iterable ExceptionInfo object") and left the run running for good."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from runs import orchestrator

    def execute(run_id, generation):
        if Run.objects.get(pk=run_id).name == "breaks":
            raise CheckpointException("write", {0: (OSError(errno.ENOSPC, "No space left on device"), [])})
        return orchestrator_execute(run_id, generation)

    orchestrator_execute = orchestrator.execute
    monkeypatch.setattr(orchestrator, "execute", execute)
    broken = wait_for(make_run(alice, name="breaks").pk, {"failed"})
    assert broken.error.startswith("CheckpointException") and "No space left on device" in broken.error
    statuses = [s for s in broken.events.filter(kind="run.status").values_list("payload__status", flat=True)]
    assert broken.finished_at and statuses[0] == "queued" and statuses[-1] == "failed"
    # The same worker takes the next run.
    after = wait_for(make_run(alice, name="after").pk, {"failed"})
    assert "holds no *.safetensors weights" in after.error
