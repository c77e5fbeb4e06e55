"""Harness throughput through the proxy with one against two vLLM replicas of the tiny model (issue 14, part 3).

One engine is started as a run with `engine_replicas: 1` starts it, measured, stopped; then two replicas as a run
with `engine_replicas: 2` starts them (trainer.engine.serving_engine, each replica with half the cores' OpenMP
threads). The same 16 concurrent chat clients, each its own rollout, call through the proxy (which spreads the
rollouts over the replicas, proxy.replicas), ROUNDS times each after a warm-up; calls/s is the mean.

On a 2-core CPU machine the two replicas share the cores, so this measures the routing's overhead and that the
calls spread, not a speed-up; on a GPU host each replica has its own device.

`measure() -> {"replicas1_cps", "replicas2_cps", "replicas2_vs_1", "calls_per_replica"}`; as a script it prints
the figures and, last, `RESULT replicas2_vs_1=<x>`. The lead combines it into bench/scale.py.
"""
from __future__ import annotations

import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from proxy.app import create_app  # noqa: E402
from proxy.server import ProxyServer  # noqa: E402
from proxy.types import InMemoryDirectory, InMemoryRecorder, UpstreamConfig  # noqa: E402
from trainer.engine import EngineConfig, serving_engine  # noqa: E402
from trainer.models import build_tiny_model  # noqa: E402

CLIENTS = 16
CALLS_PER_CLIENT = 8
MAX_TOKENS = 32
ROUNDS = 3
ENGINE_CACHE_DIR = Path(tempfile.gettempdir()) / "lightning-test-engine-cache"  # the tests' warm compile cache


async def _clients(port: int, calls: int = CALLS_PER_CLIENT) -> float:
    """calls/s of CLIENTS concurrent clients, `calls` chat calls each, through the proxy on `port`."""
    async def client(i: int, http: httpx.AsyncClient) -> None:
        for k in range(calls):
            body = {"model": "policy", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"client {i} call {k}: count to ten"}]}
            response = await http.post(f"http://127.0.0.1:{port}/rollouts/r{i}/v1/chat/completions", json=body,
                                        headers={"authorization": "Bearer key"})
            response.raise_for_status()

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=CLIENTS)) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(i, http) for i in range(CLIENTS)))
        return CLIENTS * calls / (time.perf_counter() - started)


def _proxy(urls: list[str]) -> tuple[ProxyServer, InMemoryRecorder]:
    directory, recorder = InMemoryDirectory(), InMemoryRecorder()
    for i in range(CLIENTS):
        directory.add(f"r{i}", "key")
    upstream = UpstreamConfig(base_url=urls[0], replica_urls=tuple(urls) if len(urls) > 1 else (),
                              served_model="policy", sampling={"temperature": 0.7})
    return ProxyServer(create_app(directory, recorder, upstream), host="127.0.0.1").start(), recorder


async def _served(config: EngineConfig, work: Path, replicas: int) -> tuple[list[float], collections.Counter]:
    """calls/s of each round through a proxy over `replicas` freshly started replicas, and calls per replica."""
    started = time.perf_counter()
    async with serving_engine(config, work, replicas=replicas) as engine:
        urls = [url + "/v1" for url in getattr(engine, "base_urls", [engine.base_url])]
        print(f"{replicas} replica(s) up in {time.perf_counter() - started:.0f} s: {urls}", flush=True)
        server, recorder = _proxy(urls)
        try:
            await _clients(server.port, calls=1)  # warm-up: each rollout pinned, the engines' first batches run
            rounds = []
            for _ in range(ROUNDS):
                rounds.append(await _clients(server.port))
                print(f"{replicas} replica(s): {rounds[-1]:.1f} calls/s", flush=True)
        finally:
            await asyncio.to_thread(server.stop)
    return rounds, collections.Counter(c.replica for c in recorder.calls)


async def _measure() -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", seed=0)
        ENGINE_CACHE_DIR.mkdir(exist_ok=True)
        config = EngineConfig(model_path=str(model), max_model_len=512, kv_cache_gb=0.25,
                              cache_dir=str(ENGINE_CACHE_DIR))
        one, _ = await _served(config, Path(tmp) / "engine-1", 1)
        two, spread = await _served(config, Path(tmp) / "engine-2", 2)
    one_cps, two_cps = sum(one) / len(one), sum(two) / len(two)
    return {"replicas1_cps": round(one_cps, 2), "replicas2_cps": round(two_cps, 2),
            "replicas2_vs_1": round(two_cps / one_cps, 3),
            "calls_per_replica": {str(k): v for k, v in sorted(spread.items())}}


def measure() -> dict:
    """Start two replicas of the tiny model, measure calls/s through the proxy with 1 and with 2, stop them."""
    return asyncio.run(_measure())


if __name__ == "__main__":
    result = measure()
    print(f"{CLIENTS} clients x {CALLS_PER_CLIENT} calls of {MAX_TOKENS} tokens, {ROUNDS} rounds: "
          f"1 replica {result['replicas1_cps']} calls/s, 2 replicas {result['replicas2_cps']} calls/s; "
          f"calls per replica with 2: {result['calls_per_replica']}")
    print(f"RESULT replicas2_vs_1={result['replicas2_vs_1']}")
