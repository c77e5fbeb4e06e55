"""The run worker's threads carry kernel names (/proc/<pid>/task/<tid>/comm, `top -H`, bench/run_profile.py), which
Python 3.11 never sets: the proxy's, the ORM thread of the runs' async code, the trainer's and its OpenMP threads."""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from common import procs
from proxy.app import create_app
from proxy.server import ProxyServer
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig
from runs.reconnect import db
from tests.trainer.inprocess import tiny_qwen2
from tests.trainer.test_scheduler import SpyEngine, TickSource
from trainer.config import TrainerConfig
from trainer.policy import Policy
from trainer.scheduler import run


def kernel_name(tid: int | None = None) -> str:
    return Path(f"/proc/self/task/{tid or threading.get_native_id()}/comm").read_text().strip()


def kernel_names() -> list[str]:
    return sorted(kernel_name(int(tid)) for tid in os.listdir("/proc/self/task"))


def in_thread(target, name: str | None = None) -> None:
    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()


def test_name_os_thread_names_the_calling_thread_and_only_it():
    seen, main_before = {}, kernel_name()

    def named():
        procs.name_os_thread("lw-test")
        seen["given"] = kernel_name()

    def default():
        procs.name_os_thread()
        seen["default"] = kernel_name()

    in_thread(named)
    in_thread(default, name="a-long-python-thread-name")
    assert seen == {"given": "lw-test", "default": "a-long-python-t"}  # the kernel keeps 15 bytes
    assert kernel_name() == main_before


def test_the_proxy_serves_on_a_thread_named_after_its_port():
    app = create_app(InMemoryDirectory(), InMemoryRecorder(), UpstreamConfig(base_url="http://127.0.0.1:9/v1"))
    with ProxyServer(app, host="127.0.0.1") as server:
        names = kernel_names()
    assert f"proxy:{server.port}" in names


def test_the_runs_orm_calls_run_on_a_thread_named_orm():
    main_before = kernel_name()

    async def go() -> str:
        return await db(kernel_name)()

    assert asyncio.run(go()) == "orm"
    assert kernel_name() == main_before  # the caller's thread keeps its own


async def test_the_trainer_trains_on_a_thread_named_trainer():
    policy = Policy(tiny_qwen2(), TrainerConfig(tasks_per_step=1, group_size=2, steps=1, learning_rate=1e-3,
                                                dtype="float32"))
    train_step, seen = policy.train_step, []

    def spy(*args):
        seen.append(kernel_name())
        return train_step(*args)

    policy.train_step = spy
    engine = SpyEngine()
    reports = await run(policy, engine, TickSource(engine))
    assert [r.step for r in reports] == [1]
    assert seen == ["trainer_0"]
