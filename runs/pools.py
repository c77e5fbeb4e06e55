"""Worker pools: a run names a pool, a pool is a Celery queue, and a pool's worker holds one run per device set.

The default pool is the `runs` queue that `manage.py up` serves; pool `X` is the queue `pool-X`, served by
`./lw worker --pool X` (runs/management/commands/worker.py). Such a worker runs as many runs at once as
LIGHTNING_DEVICE_SETS has sets; each run claims a free set in Redis (a hash per worker hostname on the broker: set
index -> holder) and runs with CUDA_VISIBLE_DEVICES naming it. A claim whose process is gone is taken over, so a
killed worker child frees its set, and so does a worker restarted under the same pid (a claim names its process by
pid and start time).
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import redis
from celery import current_app
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Count, Q

from lightning_web import redis_urls
from runs import events
from runs.models import Run, RunStatus

logger = logging.getLogger(__name__)

DEFAULT_POOL = "default"
DEFAULT_QUEUE = "runs"
"""The default pool's queue: the one `manage.py up` starts its runs worker on (and vLLM harness checks use)."""
POOL_PREFIX = "pool-"
POOL_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,99}$")
DEVICE_SET = re.compile(r"^[A-Za-z0-9-]+(,[A-Za-z0-9-]+)*$")
CLAIM_KEY = "lightning:device-sets:{worker}"
WAIT_POLL_S = 1.0


def check_pool_name(name: str) -> str:
    """`name` if it is a valid pool name (lower-case letters, digits, '-' and '_', at most 100); ValueError else."""
    if not POOL_NAME.match(name or ""):
        raise ValueError(f"{name!r} is not a pool name: use lower-case letters, digits, '-' and '_' "
                         "(starting with a letter or digit), at most 100 characters")
    return name


def known_pools() -> list[str]:
    """The pools of LIGHTNING_POOLS, the default pool first (it is always there)."""
    pools = [DEFAULT_POOL]
    for name in settings.LIGHTNING_POOLS:
        try:
            check_pool_name(name)
        except ValueError as exc:
            raise ImproperlyConfigured(f"LIGHTNING_POOLS: {exc}") from None
        if name not in pools:
            pools.append(name)
    return pools


def queued_per_pool() -> list[dict]:
    """Every known pool (and any other a queued run names) with how many runs wait in it: [{"name", "queued"}]."""
    counts = dict(Run.objects.filter(status=RunStatus.QUEUED).values_list("pool").annotate(n=Count("pk")))
    names = known_pools() + sorted(set(counts) - set(known_pools()))
    return [{"name": name, "queued": counts.get(name, 0)} for name in names]


def check_pool(name: str) -> str:
    """`name` if it names a known pool; ValueError saying which pools there are otherwise."""
    check_pool_name(name)
    pools = known_pools()
    if name not in pools:
        raise ValueError(f"unknown pool {name!r}; the pools are {pools} (LIGHTNING_POOLS)")
    return name


def queue_for(pool: str) -> str:
    return DEFAULT_QUEUE if pool == DEFAULT_POOL else POOL_PREFIX + pool


def pool_of_queue(queue: str) -> str | None:
    if queue == DEFAULT_QUEUE:
        return DEFAULT_POOL
    return queue[len(POOL_PREFIX):] if queue.startswith(POOL_PREFIX) else None


# ---------------------------------------------------------------- waiting runs


def waiting(run: Run) -> dict | None:
    """For a queued run: its pool and how many queued runs of that pool were created before it; None otherwise."""
    if run.status != RunStatus.QUEUED:
        return None
    earlier = Q(created_at__lt=run.created_at) | Q(created_at=run.created_at, pk__lt=run.pk)
    ahead = Run.objects.filter(earlier, pool=run.pool, status=RunStatus.QUEUED).count()
    return {"pool": run.pool, "ahead": ahead, "message": f"waiting for pool {run.pool} ({ahead} ahead)"}


# ---------------------------------------------------------------- device sets


def device_sets() -> list[str]:
    """LIGHTNING_DEVICE_SETS as a list of CUDA_VISIBLE_DEVICES values; [""] (one set: every device) by default."""
    sets = list(settings.LIGHTNING_DEVICE_SETS) or [""]
    if sets != [""]:
        for item in sets:
            if not DEVICE_SET.match(item):
                raise ImproperlyConfigured(f"LIGHTNING_DEVICE_SETS: {item!r} is not a device set; write sets of "
                                           "comma-separated device ids split by ';', e.g. '0,1;2,3'")
    return sets


@dataclass(frozen=True)
class DeviceClaim:
    worker: str
    index: int
    devices: str
    """CUDA_VISIBLE_DEVICES for the run; '' where the worker has one set of every visible device."""
    token: str

    def describe(self) -> str:
        return f"device set {self.index} ({'CUDA_VISIBLE_DEVICES=' + self.devices if self.devices else 'all devices'})"


def broker_redis() -> redis.Redis:
    """The broker's Redis (its current primary, where the broker is a Sentinel group)."""
    return redis_urls.client(current_app.conf.broker_url, settings.LIGHTNING_REDIS_SENTINEL_MASTER,
                             settings.LIGHTNING_REDIS_SENTINEL_PASSWORD)


def process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat field 22); None where unknown.

    A pid alone does not name a process: a worker restarted in the same container often gets the same pid (1 under
    a container runtime), and would then see its own old claim as held by a live process forever."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # field 22 of the whole line; fields here start at field 3 (state)
    except (OSError, IndexError, ValueError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process that wrote a claim still runs: its pid exists and, where both are known, it started at the
    same time as the claim says (so a new process that reuses the pid does not count)."""
    pid = holder["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started, now = holder.get("start"), process_start(pid)
    return started is None or now is None or started == now


_TAKE_OVER = "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then redis.call('HSET', KEYS[1], ARGV[1], " \
             "ARGV[3]) return 1 end return 0"
_RELEASE = "if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) " \
           "end return 0"


def try_claim(worker: str, run_id: int, pid: int | None = None) -> DeviceClaim | None:
    """Claim a free device set of `worker` for `run_id` held by process `pid`; None while every set is held."""
    client, key = broker_redis(), CLAIM_KEY.format(worker=worker)
    with client:
        for index, devices in enumerate(device_sets()):
            holder = pid or os.getpid()
            token = json.dumps({"run": run_id, "pid": holder, "start": process_start(holder), "since": time.time(),
                                "devices": devices})
            if client.hsetnx(key, index, token):
                return DeviceClaim(worker, index, devices, token)
            held = client.hget(key, index)
            if held is not None and not _alive(json.loads(held)) and client.eval(
                    _TAKE_OVER, 1, key, index, held, token):
                logger.warning("%s: device set %s was held by a process that is gone (%s); taken over", worker,
                               index, held.decode())
                return DeviceClaim(worker, index, devices, token)
    return None


def release(claim: DeviceClaim) -> None:
    with broker_redis() as client:
        client.eval(_RELEASE, 1, CLAIM_KEY.format(worker=claim.worker), claim.index, claim.token)


def claims(worker: str) -> dict[int, dict]:
    """The held device sets of `worker`: index -> {"run", "pid", "start", "since", "devices"}."""
    with broker_redis() as client:
        held = client.hgetall(CLAIM_KEY.format(worker=worker))
    return {int(index): json.loads(token) for index, token in sorted(held.items(), key=lambda item: int(item[0]))}


@contextmanager
def device_set(worker: str, run_id: int):
    """Hold a free device set of this worker for the run, with CUDA_VISIBLE_DEVICES naming it, until the block ends.

    A worker runs at most as many runs as it has sets, so one is free unless a process of a crashed run still
    holds it: then the run waits (and says so in the log) until that process is gone or lets go.
    """
    worker = worker or f"local@{socket.gethostname()}"
    claim, said = try_claim(worker, run_id), False
    while claim is None:
        if not said:
            logger.warning("run %s: every device set of %s is held; waiting for one", run_id, worker)
            said = True
        time.sleep(WAIT_POLL_S)
        claim = try_claim(worker, run_id)
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if claim.devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = claim.devices
    try:
        yield claim
    finally:
        if claim.devices:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
        release(claim)


def worker_note(claim: DeviceClaim, queue: str | None) -> dict:
    """What the run's "starting" event records about the worker that took it."""
    return {"worker": claim.worker, "pool": pool_of_queue(queue or "") or "", "device_set": claim.index,
            "devices": claim.devices, "where": f"{claim.worker}, {claim.describe()}"}


def started_on(run: Run) -> dict | None:
    """The worker note of the run's latest start (None before a worker took it)."""
    payload = (run.events.filter(kind=events.RUN_STATUS, payload__status=RunStatus.STARTING)
               .order_by("-seq").values_list("payload", flat=True).first())
    return payload.get("worker") if payload else None


# ---------------------------------------------------------------- the worker command


def worker_argv(pool: str, name: str = "", loglevel: str = "INFO") -> list[str]:
    """The Celery worker command of a pool: its queue, one process per device set (fresh for every run, so each
    run's CUDA_VISIBLE_DEVICES applies from the process's start), or the solo pool for one set."""
    check_pool(pool)
    sets = device_sets()
    argv = [sys.executable, "-m", "celery", "-A", "lightning_web", "worker", "-Q", queue_for(pool),
            "-n", name or f"{POOL_PREFIX}{pool}@{socket.gethostname()}", "--loglevel", loglevel]
    if len(sets) == 1:
        return argv + ["--pool", "solo"]
    return argv + ["--pool", "prefork", "--concurrency", str(len(sets)), "--max-tasks-per-child", "1"]
