"""Proxy overhead benchmark: one load through direct, our recording proxy and a LiteLLM proxy, side by side."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from common.procs import free_port, group_cpu_seconds, kill_group  # noqa: E402

LITELLM_VENV = ROOT / ".venv-litellm"
LITELLM_SPEC = "litellm[proxy]==1.110.2"
MASTER_KEY = "sk-bench-master"
MESSAGES = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "List the files in the repository and explain what each one does."}]


# --- servers (each runs in its own process: `proxy_overhead.py --serve fake|proxy`) ---------------------


def serve(kind: str, port: int, upstream: str, clients: int, latency_s: float, chunk_delay_s: float) -> None:
    import uvicorn

    if kind == "fake":
        from tests.proxy.fake_upstream import FakeVLLM

        app = FakeVLLM(latency_s=latency_s, chunk_delay_s=chunk_delay_s, chunk_bytes=8)
    else:
        from proxy.app import create_app
        from proxy.types import InMemoryDirectory, UpstreamConfig

        directory, recorder = InMemoryDirectory(), CountingRecorder()
        for i in range(clients):
            directory.add(f"r{i}", f"secret-{i}")
        proxy = create_app(directory, recorder, UpstreamConfig(base_url=upstream, served_model="served-model"))

        async def app(scope, receive, send):  # the proxy plus one bench-only route reporting what it recorded
            if scope["type"] == "http" and scope["path"] == "/bench/recorded":
                body = json.dumps({"recorded": recorder.recorded, "with_token_ids": recorder.with_token_ids}).encode()
                headers = [(b"content-type", b"application/json")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await proxy(scope, receive, send)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")


class CountingRecorder:
    """Checks each record as the proxy hands it over and keeps counts, not the record: like the run's recorder, which
    writes records to the database and lets them go. (proxy.types.InMemoryRecorder keeps every record, so each full
    garbage collection walks all of them: about a tenth of the unchanged proxy's CPU per call in this bench, a cost
    of the test recorder, not of the proxy.)"""

    def __init__(self) -> None:
        self.recorded = 0
        self.with_token_ids = 0  # 200s with prompt and completion ids, and one logprob per completion id

    async def record(self, call) -> None:
        self.recorded += 1
        self.with_token_ids += bool(call.status_code == 200 and call.prompt_ids and call.completion_ids
                                    and len(call.logprobs) == len(call.completion_ids))

    async def report_reward(self, rollout_id: str, reward: float, detail: dict) -> None:
        pass


def start(argv: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    kill_group(process.pid, grace_s=10)
    process.wait()


def wait_ready(url: str, process: subprocess.Popen, what: str, timeout_s: float, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it was ready")
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f}s at {url}")


def proxy_requirements(requirements: list[str]) -> list[str]:
    """litellm's `proxy` extra without the litellm-proxy wheel, companion litellm-* pins relaxed."""
    out = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if not re.search(r"extra == ['\"]proxy['\"]", marker) or spec.startswith("litellm-proxy"):
            continue
        marker = re.sub(r"\s*(and )?extra == ['\"]proxy['\"]", "", marker).strip()
        spec = re.sub(r"^(litellm-[a-z-]+)\s*==.*$", r"\1", spec.strip())
        out.append(f"{spec} ; {marker}" if marker else spec)
    return out


def ensure_litellm_venv() -> Path:
    """LiteLLM's proxy lives in its own venv (its pins clash with ours); created on first use."""
    python, litellm = LITELLM_VENV / "bin" / "python", LITELLM_VENV / "bin" / "litellm"
    if litellm.exists() and subprocess.run([str(python), "-c", "import fastapi, backoff, apscheduler"]).returncode == 0:
        return litellm
    print(f"creating {LITELLM_VENV} with {LITELLM_SPEC} (first run only)...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if subprocess.run(pip + [LITELLM_SPEC]).returncode != 0:
        # The [proxy] extra pins companion wheels (litellm-proxy, litellm-enterprise) that a registry mirror may
        # lack; the proxy server itself ships inside litellm, so install litellm and the extra's other packages.
        print("falling back to litellm plus its [proxy] packages without the litellm-proxy wheel", flush=True)
        subprocess.run(pip + [LITELLM_SPEC.replace("[proxy]", "")], check=True)
        show = "from importlib.metadata import requires; print(*requires('litellm'), sep='\\n')"
        listed = subprocess.run([str(python), "-c", show], check=True, capture_output=True, text=True)
        subprocess.run(pip + proxy_requirements(listed.stdout.splitlines()), check=True)
    return litellm


# --- load -------------------------------------------------------------------------------------------------


@dataclass
class PathResult:
    name: str
    latencies: list[float]
    wall_s: float
    errors: int

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies) / self.wall_s

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


async def one_call(session, url: str, headers: dict, stream: bool) -> bool:
    body = {"model": "bench-model", "messages": MESSAGES, "max_tokens": 256, "stream": stream}
    async with session.post(url, json=body, headers=headers) as r:
        if not stream:
            data = await r.json()
            return r.status == 200 and bool(data["choices"][0]["message"]["content"])
        done = False
        async for line in r.content:
            done = done or line.strip() == b"data: [DONE]"
        return r.status == 200 and done


async def run_load(name: str, url_for, headers_for, clients: int, calls: int, stream: bool) -> PathResult:
    """`clients` concurrent clients, each making `calls` calls in a row after one warm-up call."""
    # The load generator: cheaper per call than httpx, so it measures the servers. Imported here, not at the top:
    # the servers (this file with --serve) would otherwise carry its 10,000 objects through every full collection.
    import aiohttp

    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=clients + 8)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(one_call(session, url_for(i), headers_for(i), stream) for i in range(clients)))

        async def worker(i: int) -> None:
            nonlocal errors
            for _ in range(calls):
                t0 = time.perf_counter()
                try:
                    ok = await one_call(session, url_for(i), headers_for(i), stream)
                except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                    ok = False
                latencies.append(time.perf_counter() - t0)
                errors += not ok

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return PathResult(name, latencies, wall, errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--calls", type=int, default=4, help="calls per client per mode and round (plus one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all paths, interleaved")
    # The engine's pace sets the offered load: 64 clients at 0.3 s per answer offer about 200 calls/s, more than
    # a real engine serving 64 agents, and well past what one LiteLLM worker sustains.
    parser.add_argument("--latency", type=float, default=0.3, help="fake engine seconds before the answer")
    parser.add_argument("--chunk-delay", type=float, default=0.015, help="fake engine seconds between stream chunks")
    parser.add_argument("--skip-litellm", action="store_true", help="measure direct and our proxy only")
    parser.add_argument("--serve", choices=["fake", "proxy"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.upstream, args.clients, args.latency, args.chunk_delay)
        return

    logs = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--clients", str(args.clients), "--latency", str(args.latency), "--chunk-delay", str(args.chunk_delay)]
    fake_port, proxy_port, litellm_port = free_port(), free_port(), free_port()
    fake_url = f"http://127.0.0.1:{fake_port}/v1"
    processes = []
    try:
        fake = start(me + common + ["--serve", "fake", "--port", str(fake_port)], log=logs / "fake.log")
        processes.append(fake)
        wait_ready(fake_url + "/models", fake, "fake engine", 60)
        ours = start(me + common + ["--serve", "proxy", "--port", str(proxy_port), "--upstream", fake_url],
                     log=logs / "proxy.log")
        processes.append(ours)
        wait_ready(f"http://127.0.0.1:{proxy_port}/bench/recorded", ours, "our proxy", 60)
        paths = {
            "direct": (lambda i: fake_url + "/chat/completions", lambda i: {}),
            "ours": (lambda i: f"http://127.0.0.1:{proxy_port}/rollouts/r{i}/v1/chat/completions",
                     lambda i: {"authorization": f"Bearer secret-{i}"}),
        }
        if not args.skip_litellm:
            litellm = ensure_litellm_venv()
            config = logs / "litellm.yaml"
            config.write_text(json.dumps({
                "model_list": [{"model_name": "bench-model", "litellm_params": {
                    "model": "openai/served-model", "api_base": fake_url, "api_key": "none"}}],
                "litellm_settings": {"drop_params": True},
            }))
            env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOG": "ERROR"}
            lite = start([str(litellm), "--config", str(config), "--port", str(litellm_port), "--host", "127.0.0.1",
                          "--num_workers", "1"], env=env, log=logs / "litellm.log")
            processes.append(lite)
            auth = {"authorization": f"Bearer {MASTER_KEY}"}
            wait_ready(f"http://127.0.0.1:{litellm_port}/health/liveliness", lite, "LiteLLM proxy", 300)
            paths["litellm"] = (lambda i: f"http://127.0.0.1:{litellm_port}/v1/chat/completions", lambda i: auth)

        print(f"load: {args.clients} concurrent clients, {args.rounds} rounds x {args.calls} calls each, streaming and "
              f"not, paths interleaved; fake engine latency {args.latency}s, {args.chunk_delay}s between chunks; "
              f"logs in {logs}", flush=True)
        servers = {"direct": fake, "ours": ours, **({"litellm": lite} if "litellm" in paths else {})}
        results: dict[str, list[PathResult]] = {name: [] for name in paths}
        cpu: dict[tuple[str, bool], float] = {(name, stream): 0.0 for name in paths for stream in (False, True)}
        for _ in range(args.rounds):  # interleaved, so a change in background load hits every path alike
            for name, (url_for, headers_for) in paths.items():
                for stream in (False, True):
                    before = group_cpu_seconds(servers[name].pid)
                    load = run_load(name, url_for, headers_for, args.clients, args.calls, stream)
                    results[name].append(asyncio.run(load))
                    cpu[name, stream] += group_cpu_seconds(servers[name].pid) - before

        for name, runs in results.items():
            for stream in (False, True):
                mine = [r for r, s in zip(runs, itertools.cycle((False, True))) if s == stream]
                merged = PathResult(name, [x for r in mine for x in r.latencies], sum(r.wall_s for r in mine),
                                    sum(r.errors for r in mine))
                per_call = 1000 * cpu[name, stream] / (args.rounds * args.clients * (args.calls + 1))
                print(f"{name:8s} {'stream' if stream else 'whole ':6s}  p50 {merged.pct(0.5):7.1f} ms  "
                      f"p99 {merged.pct(0.99):7.1f} ms  {merged.calls_per_s:7.1f} calls/s  "
                      f"server CPU {per_call:5.2f} ms/call  errors {merged.errors}")

        def throughput(name: str) -> float:  # calls/s over both modes together
            runs = results[name]
            return sum(len(r.latencies) for r in runs) / sum(r.wall_s for r in runs)

        per_path = 2 * args.rounds * args.clients * (args.calls + 1)  # both modes, warm-up calls included
        for name in results:
            note = " (the fake engine itself)" if name == "direct" else " (proxy process; the fake engine not counted)"
            print(f"{name:8s} total {throughput(name):7.1f} calls/s; "
                  f"server CPU {1000 * (cpu[name, False] + cpu[name, True]) / per_path:6.2f} ms/call{note}")
        recorded = httpx.get(f"http://127.0.0.1:{proxy_port}/bench/recorded").json()
        errors = sum(r.errors for runs in results.values() for r in runs)
        vs_direct = throughput("ours") / throughput("direct")
        vs_litellm = throughput("ours") / throughput("litellm") if "litellm" in results else float("nan")
        print(f"ours/direct {vs_direct:.2f}x (target >= 0.8); ours/litellm {vs_litellm:.2f}x (target >= 3)")
        print(f"sent through our proxy {per_path}; recorded {recorded['recorded']}, with complete token ids "
              f"{recorded['with_token_ids']}; failed calls on all paths {errors}")
        equal = recorded["recorded"] == per_path == recorded["with_token_ids"]
        # Our proxy's CPU per call over the fake engine's, both stream modes together (target <= 2).
        cpu_vs_engine = sum(cpu["ours", s] for s in (False, True)) / sum(cpu["direct", s] for s in (False, True))
        print(f"RESULT vs_direct={vs_direct:.2f} vs_litellm={vs_litellm:.2f} recorded_equals_sent={str(equal).lower()} "
              f"cpu_vs_engine={cpu_vs_engine:.2f}")
    finally:
        for process in reversed(processes):
            stop(process)


if __name__ == "__main__":
    main()
