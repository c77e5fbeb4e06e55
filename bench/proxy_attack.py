"""Proxy under attack: well-behaved rollouts' latency with and without hostile clients, side by side in one run.

A fake engine (bench/proxy_overhead.py --serve fake), the proxy (tests/proxy/proxy_process.py: ProxyServer, as a
run serves it, with a 2 s request deadline) and the attackers, each its own process, so the well-behaved clients
measured here share no event loop with the attack. Rounds alternate a quiet and an attacked
phase; in both, `--good` rollouts call the four APIs in turn (one API each, streamed and not, alternately). The
attack, each kind from its own rollout, all at once:

- slowloris: `--slow` connections trickling their head or body a byte every 0.5 s, reopened when the proxy
  closes them at the deadline;
- hostile bodies over the four APIs: declared over 32 MB, chunked over 32 MB, 8 MB not JSON, nested 4M deep,
  8 MB of empty arrays (a parse bomb), a 1 GiB gzip bomb, a lone surrogate, invalid UTF-8;
- harnesses hanging up mid-stream (after the first bytes) and before the first byte (after the engine has the
  call), over the four APIs.

Every hostile request must get a 4xx, a 503 (no room for its body: retry later) or a clean close; a call whose
harness hung up must be recorded 499, never 200. The proxy's peak resident memory is read from /proc (VmHWM).

    flock /tmp/lw-heavy.lock .venv/bin/python bench/proxy_attack.py
    # last line: RESULT good_p50_ratio=... good_p99_ratio=... proxy_rss_mb_max=... attack_5xx=... ...
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.proxy_overhead import start, stop, wait_ready  # noqa: E402
from common.procs import free_port, status_kib  # noqa: E402
from tests.proxy import proxy_process  # noqa: E402

MB = 1024 * 1024
PATHS = ["/chat/completions", "/completions", "/responses", "/messages"]
BODIES = {"/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
          "/completions": {"model": "m", "prompt": "hi", "max_tokens": 16},
          "/responses": {"model": "m", "input": "hi", "max_output_tokens": 16},
          "/messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}}
LONG_PROMPT = "Please repeat this back to me word for word: " + "lorem ipsum " * 8
STREAMED = {"/chat/completions": {"model": "m", "messages": [{"role": "user", "content": LONG_PROMPT}], "stream": True},
            "/completions": {"model": "m", "prompt": LONG_PROMPT, "stream": True},
            "/responses": {"model": "m", "input": LONG_PROMPT, "stream": True},
            "/messages": {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": LONG_PROMPT}],
                          "stream": True}}
REQUEST_TIMEOUT_S = 2.0


def hostile_bodies() -> list[tuple[str, bytes, dict[str, str], set[int]]]:
    """(name, body, extra headers, statuses it may get): each over a limit or outside what the proxy accepts.
    A 503 is allowed where the body is large: the budget for all bodies may be taken by others at that moment."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(packer.compress(bytes(MB)) for _ in range(1024)) + packer.flush()  # 1 GiB inflated
    chat = json.dumps(BODIES["/chat/completions"])
    return [
        ("declared over 32 MB", b"x" * (33 * MB), {}, {413}),
        ("chunked over 32 MB", b"x" * (33 * MB), {"transfer-encoding": "chunked"}, {413, 503}),
        ("not JSON, 8 MB", b"{" + b"a" * (8 * MB), {}, {400, 503}),
        ("nested 4M deep", b"[" * (4 * MB), {}, {413}),
        ("8 MB of empty arrays", b"[" + b"[]," * (8 * MB // 3) + b"[]]", {}, {413}),
        ("nested 200 deep", chat.replace('"max_tokens"', '"metadata": ' + "[" * 200 + "]" * 200 + ', "max_tokens"')
         .encode(), {}, {400}),
        ("gzip bomb", bomb, {"content-encoding": "gzip"}, {415}),
        ("lone surrogate", chat.encode().replace(b"hi", b"\\ud800"), {}, {400}),
        ("invalid UTF-8", chat.encode().replace(b"hi", b"\xff\xfe"), {}, {400}),
    ]


async def _chunked(content: bytes, size: int = 256 * 1024):
    for i in range(0, len(content), size):
        yield content[i:i + size]


class Attack:
    """Hostile clients, one rollout per kind: slowloris, hostile bodies, mid-stream and pre-first-byte hang-ups."""

    def __init__(self, base: str, port: int, slow: int, first: int) -> None:
        self.base, self.port, self.slow = base, port, slow
        self.rollout = {kind: first + k for k, kind in enumerate(("slow", "bodies", "mid", "pre"))}
        self.statuses: Counter[int] = Counter()  # hostile bodies' answers (0: a clean close)
        self.wrong: list[str] = []  # answers outside what each may get
        self.cases: Counter[str] = Counter()
        self.bodies = hostile_bodies()

    def head(self, kind: str, path: str, length: int, extra: str = "") -> bytes:
        r = self.rollout[kind]
        return (f"POST /rollouts/r{r}/v1{path} HTTP/1.1\r\nhost: p\r\nauthorization: Bearer secret-{r}\r\n"
                f"x-api-key: secret-{r}\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n{extra}"
                "\r\n").encode()

    async def slowloris(self, i: int, until: float) -> None:
        """One connection trickling a byte every 0.5 s, reopened each time the proxy closes it."""
        while time.monotonic() < until:
            body = json.dumps(BODIES["/messages"]).encode()
            request = self.head("slow", "/messages", len(body)) + body
            if i % 2:  # half send the head at once and trickle the body
                start_at = request.index(b"\r\n\r\n") + 4
            else:
                start_at = 0
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(request[:start_at])
            ended = asyncio.create_task(reader.read(1024))
            k = start_at
            try:
                while time.monotonic() < until and not ended.done() and k < len(request) - 1:
                    writer.write(request[k:k + 1])
                    k += 1
                    await asyncio.wait({ended}, timeout=0.5)
                if ended.done():
                    got = ended.result()
                    self.cases["slowloris closed by the proxy" if got == b"" else "slowloris answered"] += 1
                    if got:
                        self.wrong.append(f"slowloris answered: {got[:40]!r}")
            except (ConnectionResetError, BrokenPipeError):
                self.cases["slowloris closed by the proxy"] += 1
            finally:
                ended.cancel()
                writer.close()

    async def bodies_loop(self, client: httpx.AsyncClient, until: float, offset: int) -> None:
        i = offset
        r = self.rollout["bodies"]
        while time.monotonic() < until:
            name, body, extra, allowed = self.bodies[i % len(self.bodies)]
            path = PATHS[(i // len(self.bodies)) % 4]
            i += 1
            content = _chunked(body) if "transfer-encoding" in extra else body
            try:
                got = (await client.post(f"{self.base}/rollouts/r{r}/v1{path}", content=content, headers={
                    "content-type": "application/json", "authorization": f"Bearer secret-{r}",
                    "x-api-key": f"secret-{r}", **extra})).status_code
            except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError):
                got = 0  # the proxy closed on us: a clean close
            self.statuses[got] += 1
            self.cases["hostile body"] += 1
            if got not in allowed | {0}:
                self.wrong.append(f"{name} on {path}: {got}")

    async def mid_stream_loop(self, client: httpx.AsyncClient, until: float) -> None:
        i, r = 0, self.rollout["mid"]
        while time.monotonic() < until:
            path = PATHS[i % 4]
            i += 1
            async with client.stream("POST", f"{self.base}/rollouts/r{r}/v1{path}", json=STREAMED[path],
                                     headers={"authorization": f"Bearer secret-{r}", "x-api-key": f"secret-{r}"}) as s:
                if s.status_code != 200:
                    self.wrong.append(f"stream to cut on {path}: {s.status_code}")
                async for _ in s.aiter_raw():
                    break  # first bytes seen: leave, closing the connection
            self.cases["hang-up mid-stream"] += 1

    async def pre_first_byte_loop(self, until: float, engine_latency_s: float) -> None:
        i = 0
        while time.monotonic() < until:
            path = PATHS[i % 4]
            i += 1
            body = json.dumps(STREAMED[path]).encode()
            _, writer = await asyncio.open_connection("127.0.0.1", self.port)
            writer.write(self.head("pre", path, len(body)) + body)
            await writer.drain()
            await asyncio.sleep(engine_latency_s / 2)  # the call is with the engine, its answer not yet back
            writer.close()
            self.cases["hang-up before the first byte"] += 1

    async def run(self, seconds: float, engine_latency_s: float) -> None:
        until = time.monotonic() + seconds
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(self.slowloris(i, until) for i in range(self.slow)),
                                 self.bodies_loop(c, until, 0), self.bodies_loop(c, until, 5),
                                 self.mid_stream_loop(c, until), self.pre_first_byte_loop(until, engine_latency_s))


async def good_load(base: str, rollouts: int, seconds: float) -> list[float]:
    """Latencies (s) of `rollouts` well-behaved rollouts, one API each, calling in a loop; any failure raises."""
    latencies: list[float] = []
    until = time.monotonic() + seconds

    async def rollout(i: int) -> None:
        path = PATHS[i % 4]
        url = f"{base}/rollouts/r{i}/v1{path}"
        async with httpx.AsyncClient(headers={"authorization": f"Bearer secret-{i}", "x-api-key": f"secret-{i}"},
                                     timeout=60) as c:
            k = 0
            while time.monotonic() < until:
                k += 1
                t0 = time.perf_counter()
                async with c.stream("POST", url, json={**BODIES[path], "stream": k % 2 == 0}) as r:
                    body = await r.aread()
                if r.status_code != 200 or not body:
                    raise RuntimeError(f"good rollout r{i} got {r.status_code} on {path}: {body[:200]!r}")
                latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(rollout(i) for i in range(rollouts)))
    return latencies


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def attacker(args) -> None:
    """The attack process: builds its bodies, says `ready`, runs the attack on each `go` line, reports at EOF."""
    attack = Attack(args.base, args.proxy_port, args.slow, first=args.good)
    print("ready", flush=True)
    for line in sys.stdin:
        asyncio.run(attack.run(float(line.split()[1]), args.latency))
        print("done", flush=True)
    print(json.dumps({"cases": attack.cases, "statuses": attack.statuses, "wrong": attack.wrong}), flush=True)


def start_attacker(base: str, port: int, args) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, __file__, "--attacker", "--base", base, "--proxy-port", str(port),
                              "--slow", str(args.slow), "--good", str(args.good), "--latency", str(args.latency)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError(f"attacker did not start (exit {child.wait()})")
    return child


async def measure(base: str, port: int, proxy_pid: int, child: subprocess.Popen, args) -> dict:
    quiet, attacked = [], []
    await good_load(base, args.good, 2)  # warm-up
    rss_before = status_kib("VmRSS", proxy_pid) / 1024
    for _ in range(args.rounds):
        quiet += await good_load(base, args.good, args.seconds)
        child.stdin.write(f"go {args.seconds}\n")
        child.stdin.flush()
        attacked += await good_load(base, args.good, args.seconds)
        done = await asyncio.to_thread(child.stdout.readline)
        if done.strip() != "done":
            raise RuntimeError(f"attacker failed: {done!r}")
    child.stdin.close()
    summary = json.loads(await asyncio.to_thread(child.stdout.readline))
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(100):  # the last hung-up calls finish with the engine and are recorded
            state = (await c.get(f"{base}/test/state")).json()
            if state["in_flight"] == 0:
                break
            await asyncio.sleep(0.1)
    return {"quiet": quiet, "attacked": attacked, "attack": summary, "state": state, "rss_before_mb": rss_before,
            "rss_max_mb": status_kib("VmHWM", proxy_pid) / 1024, "rss_after_mb": status_kib("VmRSS", proxy_pid) / 1024}


def report(result: dict, first: int) -> None:
    quiet, attacked, attack, state = result["quiet"], result["attacked"], result["attack"], result["state"]
    rollout = {kind: f"r{first + k}" for k, kind in enumerate(("slow", "bodies", "mid", "pre"))}  # as Attack names them
    print(f"{'phase':10} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for name, values in (("quiet", quiet), ("attacked", attacked)):
        print(f"{name:10} {len(values):6d} {pct(values, 50) * 1000:8.1f} {pct(values, 99) * 1000:8.1f}")
    for case, n in sorted(attack["cases"].items()):
        print(f"  {case:32} {n:6d}")
    statuses = {int(s): n for s, n in attack["statuses"].items()}
    print(f"hostile body answers: {dict(sorted(statuses.items()))} (0: clean close)")
    records = Counter((call[0], call[1], call[2]) for call in state["calls"])
    for kind in ("mid", "pre"):
        print(f"  records of {kind:3} hang-ups: " + ", ".join(f"{s} {e or ''}: {n}" for (r, s, e), n
                                                              in sorted(records.items()) if r == rollout[kind]))
    print(f"proxy RSS before {result['rss_before_mb']:.0f} MB, peak {result['rss_max_mb']:.0f} MB, "
          f"after {result['rss_after_mb']:.0f} MB; bodies refused for want of room: {state['refused']}")
    pre_200 = sum(n for (r, s, _), n in records.items() if r == rollout["pre"] and s == 200)
    mid = [n for (r, s, _), n in records.items() if r == rollout["mid"]]
    mid_499 = sum(n for (r, s, _), n in records.items() if r == rollout["mid"] and s == 499)
    if attack["wrong"]:
        print(f"answered outside what each may get: {len(attack['wrong'])} {attack['wrong'][:10]}")
    print(f"RESULT good_p50_ratio={pct(attacked, 50) / pct(quiet, 50):.2f} "
          f"good_p99_ratio={pct(attacked, 99) / pct(quiet, 99):.2f} "
          f"good_p50_ms={pct(quiet, 50) * 1000:.1f}/{pct(attacked, 50) * 1000:.1f} "
          f"proxy_rss_mb_max={result['rss_max_mb']:.0f} attack_5xx={sum(n for s, n in statuses.items() if s >= 500)} "
          f"attack_503_no_room={statuses.get(503, 0)} attack_wrong={len(attack['wrong'])} "
          f"attack_cases={sum(attack['cases'].values())} "
          f"slowloris_closed={attack['cases'].get('slowloris closed by the proxy', 0)} "
          f"pre_first_byte_recorded_200={pre_200} mid_stream_recorded_499={mid_499}/{sum(mid)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--good", type=int, default=4, help="well-behaved rollouts calling in a loop (API i %% 4)")
    parser.add_argument("--slow", type=int, default=128, help="slowloris connections held open")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each quiet and attacked phase")
    parser.add_argument("--rounds", type=int, default=2, help="quiet/attacked phase pairs, interleaved")
    parser.add_argument("--latency", type=float, default=0.05, help="fake engine seconds before the answer")
    parser.add_argument("--attacker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--proxy-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attacker:
        attacker(args)
        return

    logs = Path(tempfile.mkdtemp(prefix="proxy-attack-"))
    fake_port = free_port()
    fake_url = f"http://127.0.0.1:{fake_port}/v1"
    fake = start([sys.executable, str(ROOT / "bench" / "proxy_overhead.py"), "--serve", "fake", "--port",
                  str(fake_port), "--latency", str(args.latency), "--chunk-delay", "0.01"], log=logs / "fake.log")
    proxy = child = None
    try:
        wait_ready(fake_url + "/models", fake, "fake engine", 60)
        proxy, port = proxy_process.start(fake_url, "--rollouts", str(args.good + 4), "--request-timeout-s",
                                          str(REQUEST_TIMEOUT_S))
        base = f"http://127.0.0.1:{port}"
        child = start_attacker(base, port, args)  # builds its bodies (a 1 GiB gzip bomb) before any timing
        result = asyncio.run(measure(base, port, proxy.pid, child, args))
    finally:
        for process in (child, proxy, fake):
            if process is not None:
                stop(process)
    print(f"logs in {logs}")
    report(result, args.good)
    if result["attack"]["wrong"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
