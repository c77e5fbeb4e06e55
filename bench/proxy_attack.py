"""Proxy under attack: a well-behaved rollout's latency with and without hostile clients, side by side.

One fake engine and one proxy (each its own process, started as bench/proxy_overhead.py starts them). Rounds
alternate a quiet phase and an attacked phase; in both, `--good` rollouts make sequential chat calls. The
attack, from other rollouts: slowloris connections stalled in their headers, bodies that stall after two
bytes, a loop of hostile bodies (over the limit, not JSON, nested too deep, a gzip bomb, a lone surrogate)
and streams cut after their first bytes. Every hostile request must get a 4xx or a clean close; the
proxy's resident memory is read from /proc before and after.

    .venv/bin/python bench/proxy_attack.py            # last line: RESULT good_p50_ratio=... attack_cases=...
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.proxy_overhead import start, stop, wait_ready  # noqa: E402
from common.procs import free_port, tree_rss_bytes  # noqa: E402

MB = 1024 * 1024
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


def hostile_bodies() -> list[tuple[str, bytes, dict[str, str], int]]:
    """(name, body, extra headers, expected status): each over a limit or outside what the proxy accepts."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(packer.compress(bytes(MB)) for _ in range(1024)) + packer.flush()  # 1 GiB inflated
    return [
        ("declared over 32 MB", b"x" * (33 * MB), {}, 413),
        ("not JSON, 8 MB", b"{" + b"a" * (8 * MB), {}, 400),
        ("nested 4M deep", b"[" * (4 * MB), {}, 400),
        ("nested 200 deep", json.dumps({**CHAT, "metadata": [[[]]]}).replace("[[[]]]", "[" * 200 + "]" * 200)
         .encode(), {}, 400),
        ("gzip bomb", bomb, {"content-encoding": "gzip"}, 415),
        ("lone surrogate", json.dumps(CHAT).encode().replace(b"hi", b"\\ud800"), {}, 400),
        ("invalid UTF-8", json.dumps(CHAT).encode().replace(b"hi", b"\xff\xfe"), {}, 400),
    ]


class Attack:
    """Hostile clients on rollouts r<first>..r<first+3>, counting cases and anything not a 4xx or a clean close."""

    def __init__(self, base: str, slow: int, first: int) -> None:
        self.base, self.slow, self.ids = base, slow, [first + k for k in range(4)]
        self.host, self.port = base.split("//")[1].split(":")[0], int(base.rsplit(":", 1)[1])
        self.cases, self.bad = 0, []
        self.bodies = hostile_bodies()

    def url(self, i: int, path: str) -> str:
        return f"{self.base}/rollouts/r{self.ids[i % 4]}/v1{path}"

    def key(self, i: int) -> dict[str, str]:
        return {"authorization": f"Bearer secret-{self.ids[i % 4]}"}

    async def stall(self, i: int, body_started: bool) -> asyncio.StreamWriter:
        """A connection left stalled in its headers, or after two bytes of a promised 1 MB body."""
        _, writer = await asyncio.open_connection(self.host, self.port)
        head = (f"POST /rollouts/r{self.ids[i % 4]}/v1/messages HTTP/1.1\r\nhost: p\r\n"
                f"x-api-key: secret-{self.ids[i % 4]}\r\ncontent-length: {MB}\r\n")
        writer.write((head + "\r\n{\"").encode() if body_started else head.encode()[: 20 + i % 40])
        await writer.drain()
        self.cases += 1
        return writer

    async def bodies_loop(self, client: httpx.AsyncClient, until: float) -> None:
        i = 0
        while time.monotonic() < until:
            name, body, extra, want = self.bodies[i % len(self.bodies)]
            i += 1
            try:
                r = await client.post(self.url(i, "/chat/completions"), content=body,
                                      headers={"content-type": "application/json", **self.key(i), **extra})
                got = r.status_code
            except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
                got = 0  # the proxy closed on us: a clean close
            self.cases += 1
            if got not in (want, 0):
                self.bad.append(f"{name}: {got}")

    async def hang_up_loop(self, client: httpx.AsyncClient, until: float) -> None:
        i = 0
        while time.monotonic() < until:
            i += 1
            async with client.stream("POST", self.url(i, "/chat/completions"), json={**CHAT, "stream": True},
                                     headers=self.key(i)) as r:
                if r.status_code != 200:
                    self.bad.append(f"stream to cut: {r.status_code}")
                async for _ in r.aiter_raw():
                    break
            self.cases += 1

    async def run(self, seconds: float) -> None:
        writers = [await self.stall(i, body_started=i % 2 == 1) for i in range(self.slow)]
        until = time.monotonic() + seconds
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(self.bodies_loop(c, until), self.bodies_loop(c, until), self.hang_up_loop(c, until))
        for writer in writers:
            writer.close()


async def good_load(base: str, rollouts: int, seconds: float) -> list[float]:
    """Latencies (s) of `rollouts` well-behaved rollouts calling in a loop for `seconds`; any failure raises."""
    latencies: list[float] = []
    until = time.monotonic() + seconds

    async def rollout(i: int) -> None:
        async with httpx.AsyncClient(headers={"authorization": f"Bearer secret-{i}"}, timeout=60) as c:
            while time.monotonic() < until:
                t0 = time.perf_counter()
                r = await c.post(f"{base}/rollouts/r{i}/v1/chat/completions", json=CHAT)
                if r.status_code != 200:
                    raise RuntimeError(f"good rollout r{i} got {r.status_code}: {r.text[:200]}")
                latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(rollout(i) for i in range(rollouts)))
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


async def measure(base: str, proxy_pid: int, args) -> dict:
    quiet, attacked = [], []
    attack = Attack(base, args.slow, first=args.good)  # builds the bodies (a 1 GiB gzip bomb) before timing
    await good_load(base, args.good, 2)  # warm-up
    rss_before = tree_rss_bytes(proxy_pid)
    for _ in range(args.rounds):
        quiet += await good_load(base, args.good, args.seconds)
        got = await asyncio.gather(good_load(base, args.good, args.seconds), attack.run(args.seconds))
        attacked += got[0]
    rss_after = tree_rss_bytes(proxy_pid)
    return {"quiet": quiet, "attacked": attacked, "attack": attack,
            "rss_growth_mb": (rss_after - rss_before) / MB, "rss_after_mb": rss_after / MB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--good", type=int, default=4, help="well-behaved rollouts calling in a loop")
    parser.add_argument("--slow", type=int, default=128, help="stalled (slowloris) connections held open")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each quiet and attacked phase")
    parser.add_argument("--rounds", type=int, default=2, help="quiet/attacked phase pairs, interleaved")
    parser.add_argument("--latency", type=float, default=0.05, help="fake engine seconds before the answer")
    args = parser.parse_args()

    logs = Path(tempfile.mkdtemp(prefix="proxy-attack-"))
    overhead = [sys.executable, str(ROOT / "bench" / "proxy_overhead.py"), "--clients", str(args.good + 4),
                "--latency", str(args.latency), "--chunk-delay", "0.01"]
    fake_port, proxy_port = free_port(), free_port()
    fake_url, base = f"http://127.0.0.1:{fake_port}/v1", f"http://127.0.0.1:{proxy_port}"
    processes = []
    try:
        processes.append(start(overhead + ["--serve", "fake", "--port", str(fake_port)], log=logs / "fake.log"))
        wait_ready(fake_url + "/models", processes[-1], "fake engine", 60)
        processes.append(start(overhead + ["--serve", "proxy", "--port", str(proxy_port), "--upstream", fake_url],
                               log=logs / "proxy.log"))
        wait_ready(base + "/bench/recorded", processes[-1], "proxy", 60)
        result = asyncio.run(measure(base, processes[-1].pid, args))
    finally:
        for process in processes:
            stop(process)

    quiet, attacked, attack = result["quiet"], result["attacked"], result["attack"]
    print(f"{'phase':10} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for name, values in (("quiet", quiet), ("attacked", attacked)):
        print(f"{name:10} {len(values):6d} {pct(values, 50) * 1000:8.1f} {pct(values, 99) * 1000:8.1f}")
    print(f"attack cases {attack.cases}, not 4xx or clean close: {len(attack.bad)} {attack.bad[:5]}")
    print(f"proxy RSS after {result['rss_after_mb']:.0f} MB, growth {result['rss_growth_mb']:.1f} MB; logs in {logs}")
    if attack.bad:
        sys.exit(f"hostile requests answered wrongly: {attack.bad[:10]}")
    print(f"RESULT good_p50_ratio={pct(attacked, 50) / pct(quiet, 50):.2f} "
          f"good_p99_ratio={pct(attacked, 99) / pct(quiet, 99):.2f} rss_growth_mb={result['rss_growth_mb']:.1f} "
          f"attack_cases={attack.cases}")


if __name__ == "__main__":
    main()
