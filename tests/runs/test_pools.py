"""Worker pools: a run names a pool, its pool's worker (a real Celery worker) takes it on a free device set, runs of a
busy pool say how many are ahead of them, and the workers page and API list the live workers."""
import os
import subprocess
import sys
import time

import pytest
from django.utils.html import escape

from runs import pools, services, worker_control
from runs.models import Run
from tests.dashboard.test_new_run_form import config_post
from tests.workers import ROOT, Workers, wait_db
from trainer.config import TrainerConfig

POOLS = ["default", "a"]


@pytest.fixture(autouse=True)
def pool_settings(settings):
    settings.LIGHTNING_POOLS = POOLS
    settings.LIGHTNING_DEVICE_SETS = ["0,1", "2,3"]


@pytest.fixture
def make_pool_run(make_harness, make_dataset, make_reward):
    def make(owner, name, pool):
        return services.create_run(owner, name=name, model="tiny", config={}, pool=pool,
                                   harness=make_harness(owner, name=f"{name}-h"),
                                   dataset=make_dataset(owner, name=f"{name}-d"),
                                   reward_script=make_reward(owner, name=f"{name}-r"))
    return make


def run_body(alice, make_harness, make_dataset, make_reward, name="r", **extra):
    return {"name": name, "model": "tiny", "harness": make_harness(alice, name=f"{name}-h").pk,
            "dataset": make_dataset(alice, name=f"{name}-d").pk, "reward_script": make_reward(alice, name=f"{name}-r").pk,
            **extra}


# ---------------------------------------------------------------- API, form, clone


@pytest.mark.django_db
@pytest.mark.parametrize("pool, error", [
    ("gpu-a10", "unknown pool 'gpu-a10'; the pools are ['default', 'a'] (LIGHTNING_POOLS)"),
    ("GPU A", "'GPU A' is not a pool name"),
    ("a" * 101, f"'{'a' * 101}' is not a pool name"),
])
def test_it_refuses_a_pool_it_does_not_know(alice, alice_api, make_harness, make_dataset, make_reward, pool, error):
    response = alice_api.post("/api/v1/runs/", run_body(alice, make_harness, make_dataset, make_reward, pool=pool),
                              format="json")
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert list(fields) == ["pool"] and fields["pool"][0].startswith(error)
    assert not Run.objects.exists()


@pytest.mark.django_db
def test_it_creates_a_run_in_a_pool_and_says_what_it_waits_for(alice, alice_api, make_harness, make_dataset,
                                                                make_reward, make_pool_run):
    make_pool_run(alice, "earlier", "a")
    make_pool_run(alice, "other pool", "default")
    response = alice_api.post("/api/v1/runs/", run_body(alice, make_harness, make_dataset, make_reward, pool="a"),
                              format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["pool"] == "a" and Run.objects.get(pk=body["id"]).pool == "a"
    assert body["waiting"] == {"pool": "a", "ahead": 1, "message": "waiting for pool a (1 ahead)"}
    default = alice_api.post("/api/v1/runs/", run_body(alice, make_harness, make_dataset, make_reward,
                                                       name="plain"), format="json").json()
    assert default["pool"] == "default" and default["waiting"]["message"] == "waiting for pool default (1 ahead)"


@pytest.mark.django_db
def test_the_run_page_shows_the_wait_while_queued_and_not_once_started(alice, client, make_pool_run):
    client.force_login(alice)
    first, second = make_pool_run(alice, "first", "a"), make_pool_run(alice, "second", "a")
    page = client.get(f"/runs/{second.pk}/").content.decode()
    assert '<span id="run-waiting">waiting for pool a (1 ahead)</span>' in page
    assert '<dd id="run-pool">a</dd>' in page and '<dd id="run-worker">not started yet</dd>' in page
    services.claim_run(first.pk, "task", {"worker": "pool-a@h", "pool": "a", "device_set": 1, "devices": "2,3",
                                          "where": "pool-a@h, device set 1 (CUDA_VISIBLE_DEVICES=2,3)"})
    assert '<span id="run-waiting">waiting for pool a (0 ahead)</span>' in client.get(f"/runs/{second.pk}/").content.decode()
    page = client.get(f"/runs/{first.pk}/").content.decode()
    assert '<span id="run-waiting" hidden></span>' in page and "waiting for pool" not in page
    assert '<dd id="run-worker">pool-a@h, device set 1 (CUDA_VISIBLE_DEVICES=2,3)</dd>' in page


@pytest.mark.django_db
def test_the_workers_page_counts_the_queued_runs_of_each_pool(alice, bob, client, make_pool_run, test_redis):
    make_pool_run(alice, "one", "a"), make_pool_run(bob, "two", "a")
    started = make_pool_run(alice, "three", "default")
    services.claim_run(started.pk, "task")
    client.force_login(alice)
    page = client.get("/workers/")
    assert page.status_code == 200
    html = page.content.decode()
    assert '<code>default</code> <span class="pool-queued" data-pool="default">(0 queued)</span>' in html
    assert '<code>a</code> <span class="pool-queued" data-pool="a">(2 queued)</span>' in html  # bob's run counts too


@pytest.mark.django_db
def test_a_clone_keeps_its_pool_or_takes_another(alice, alice_api, make_pool_run):
    run = make_pool_run(alice, "orig", "a")
    kept = alice_api.post(f"/api/v1/runs/{run.pk}/clone/", {}, format="json")
    moved = alice_api.post(f"/api/v1/runs/{run.pk}/clone/", {"pool": "default"}, format="json")
    typo = alice_api.post(f"/api/v1/runs/{run.pk}/clone/", {"pool": "b"}, format="json")
    assert (kept.status_code, kept.json()["pool"], moved.status_code, moved.json()["pool"]) == (
        201, "a", 201, "default")
    assert typo.status_code == 400 and list(typo.json()["error"]["fields"]) == ["pool"]
    assert sorted(Run.objects.values_list("pool", flat=True)) == ["a", "a", "default"]


@pytest.mark.django_db
def test_the_new_run_form_offers_the_pools_and_clone_fills_it(alice, client, make_pool_run):
    client.force_login(alice)
    run = make_pool_run(alice, "orig", "a")
    page = client.get(f"/runs/new/?clone={run.pk}").content.decode()
    assert '<option value="a" selected>a</option>' in page and '<option value="default">default</option>' in page
    fields = {"name": "from form", "model": "tiny", "harness": run.harness_id, "dataset": run.dataset_id,
              "reward_script": run.reward_script_id, **config_post(TrainerConfig().to_dict())}
    response = client.post("/runs/new/", {**fields, "pool": "a"})
    assert response.status_code == 302, response.context["form"].errors
    created = Run.objects.get(name="from form")
    assert response.status_code == 302 and created.pool == "a"
    refused = client.post("/runs/new/", {**fields, "name": "typo", "pool": "b"})
    assert refused.status_code == 200
    assert "Select a valid choice. b is not one of the available choices." in refused.content.decode()
    assert not Run.objects.filter(name="typo").exists()


@pytest.mark.django_db
def test_the_workers_api_needs_a_login():
    from rest_framework.test import APIClient

    assert APIClient().get("/api/v1/workers/").status_code == 401


# ---------------------------------------------------------------- device sets


@pytest.mark.django_db
def test_a_run_holds_a_free_device_set_with_cuda_visible_devices_and_gives_it_back(test_redis, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    held = pools.try_claim("pool-a@unit", run_id=1)
    with pools.device_set("pool-a@unit", 2) as claim:
        assert (claim.index, claim.devices, os.environ["CUDA_VISIBLE_DEVICES"]) == (1, "2,3", "2,3")
        assert pools.try_claim("pool-a@unit", run_id=3) is None  # both sets held
        assert {i: c["run"] for i, c in pools.claims("pool-a@unit").items()} == {0: 1, 1: 2}
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert {i: c["run"] for i, c in pools.claims("pool-a@unit").items()} == {0: 1}
    pools.release(held)
    assert pools.claims("pool-a@unit") == {}


@pytest.mark.django_db
def test_a_set_held_by_a_process_that_is_gone_is_taken_over(test_redis):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    pools.try_claim("pool-a@unit", run_id=1, pid=gone.pid)
    pools.try_claim("pool-a@unit", run_id=2, pid=gone.pid)
    claim = pools.try_claim("pool-a@unit", run_id=3)
    assert claim.index == 0 and pools.claims("pool-a@unit")[0]["pid"] == os.getpid()


@pytest.mark.django_db
def test_a_worker_restarted_under_the_same_pid_takes_back_its_own_old_set(test_redis):
    """In a container a restarted worker often gets its old pid back (1 under the runtime): the claim its previous
    life left names that pid, so only the start time tells the dead holder from the live one."""
    import json

    import redis

    old_life = {"run": 1, "pid": os.getpid(), "start": pools.process_start(os.getpid()) - 1, "since": 0.0,
                "devices": "0,1"}
    with redis.Redis.from_url(pools.current_app.conf.broker_url) as client:
        client.hset(pools.CLAIM_KEY.format(worker="pool-a@unit"), 0, json.dumps(old_life))
    claim = pools.try_claim("pool-a@unit", run_id=2)
    assert claim.index == 0
    assert pools.claims("pool-a@unit")[0] == {**json.loads(claim.token), "run": 2}
    assert pools.claims("pool-a@unit")[0]["start"] == pools.process_start(os.getpid())
    # the live holder of set 0 (this process, same start) keeps it: the next claim gets set 1
    assert pools.try_claim("pool-a@unit", run_id=3).index == 1


# ---------------------------------------------------------------- real workers


@pytest.fixture
def workers(tmp_path, test_redis, settings, models_dir):
    pool = Workers(tmp_path)
    pool.env.update(LIGHTNING_MODELS_DIR=str(models_dir), LIGHTNING_POOLS=",".join(POOLS))
    settings.LIGHTNING_RUNS_DIR = pool.runs_dir
    yield pool
    pool.stop()


def start_pool_worker(workers: Workers, pool: str, name: str, device_sets: str) -> subprocess.Popen:
    """`./lw worker --pool NAME` as a user starts it (the management command the script runs)."""
    log = open(workers.logs / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "manage.py", "worker", "--pool", pool, "--name", name],
                            cwd=ROOT, env={**workers.env, "LIGHTNING_DEVICE_SETS": device_sets},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    workers.procs.append(proc)
    return proc


def poll(read, what: str, workers: Workers, timeout: float = 60):
    """`read()` until it returns something truthy; on timeout fail with the workers' log tails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{workers.tails()}")


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_pool_run_goes_to_its_pool_worker_only_on_a_free_device_set(alice, alice_api, client, make_pool_run,
                                                                      workers, test_redis):
    no_one = alice_api.get("/api/v1/workers/")
    assert no_one.status_code == 200 and (no_one.json()["answered"], no_one.json()["workers"]) == (False, [])
    client.force_login(alice)
    assert "No workers answered within" in client.get("/workers/").content.decode()

    workers.start("plain", "runs")  # the default pool's worker, as `./lw up` starts it
    in_a = make_pool_run(alice, "in a", "a")  # transactional: the on_commit enqueue really sends the message
    in_default = make_pool_run(alice, "in default", "default")
    wait_db(lambda: Run.objects.get(pk=in_default.pk).status == "failed", "the default run to end", workers, 60)
    # The default worker took the later run of its own queue and left the pool's run alone.
    assert Run.objects.get(pk=in_a.pk).status == "queued" and test_redis.llen("pool-a") == 1
    assert alice_api.get(f"/api/v1/runs/{in_a.pk}/").json()["waiting"]["message"] == "waiting for pool a (0 ahead)"
    started = Run.objects.get(pk=in_default.pk).events.get(payload__status="starting").payload["worker"]
    assert (started["worker"], started["pool"], started["device_set"]) == ("plain@test", "default", 0)

    # Both device sets of the pool's worker are held (as by processes of a crashed run still alive): the run waits.
    blockers = [pools.try_claim("pool-a@test", run_id=0) for _ in range(2)]
    start_pool_worker(workers, "a", "pool-a@test", "0,1;2,3")

    def pool_worker_holding_the_run():
        listed = {w["name"]: w for w in alice_api.get("/api/v1/workers/").json()["workers"]}
        worker = listed.get("pool-a@test")
        holding = worker and [t["run"] for t in worker["active"]] == [in_a.pk]
        return listed if holding and worker["heartbeat_age_s"] is not None else None

    listed = poll(pool_worker_holding_the_run, "the pool's worker to hold the run", workers)
    mine, plain = listed["pool-a@test"], listed["plain@test"]
    assert (mine["queues"], mine["pools"], mine["concurrency"]) == (["pool-a"], ["a"], 2)
    assert mine["heartbeat_age_s"] is not None and 0 <= mine["heartbeat_age_s"] < 30
    assert mine["active"][0]["run_name"] == "in a" and mine["active"][0]["task"] == "runs.tasks.execute_run"
    assert (plain["queues"], plain["pools"], plain["concurrency"], plain["active"]) == (["runs"], ["default"], 1, [])
    here = worker_control.profile()["summary"]  # the workers run on this machine, with this process's environment
    assert here.startswith("CPU: ") and mine["host"] == plain["host"] == here
    page = client.get("/workers/").content.decode()
    assert f'<td class="worker-host">{escape(here)}</td>' in page
    assert 'data-worker="pool-a@test"' in page and f'<a href="/runs/{in_a.pk}/">run {in_a.pk} in a</a>' in page
    assert '<td class="worker-queues">pool-a</td>' in page and '<td class="worker-pools">a</td>' in page

    pools.release(blockers[1])  # set 1 is free: the run takes it
    wait_db(lambda: Run.objects.get(pk=in_a.pk).status == "failed", "the pool's run to end", workers, 60)
    run = Run.objects.get(pk=in_a.pk)
    assert run.error.endswith("holds no *.safetensors weights")  # the registry's `tiny` has no weights
    assert run.events.get(payload__status="starting").payload["worker"] == {
        "worker": "pool-a@test", "pool": "a", "device_set": 1, "devices": "2,3",
        "where": "pool-a@test, device set 1 (CUDA_VISIBLE_DEVICES=2,3)"}
    assert test_redis.llen("pool-a") == 0
    assert poll(lambda: list(pools.claims("pool-a@test")) == [0], "the run's set to be given back", workers)
    pools.release(blockers[0])
