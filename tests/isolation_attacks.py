"""Every escape user code might try, in one list: tests/sandbox/test_isolation.py and bench/isolation_attacks.py run
each through the real sandboxes (sandbox.scoring.score for reward scripts, sandbox.executors.local.LocalExecutor for harnesses).

An attack is the source of `attack(ctx)`: it returns what it got when it escaped (a string), None when it was
stopped; an exception counts as stopped too. `ctx` (JSON) names the targets: secret files, Redis and PostgreSQL
over TCP and unix socket, a stand-in web app and every other port listening on the host's loopback, paths outside
the workdir. Some verdicts are taken outside afterwards (`after`): a file written outside the workdir, a process
left running.
"""
from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from django.conf import settings
from django.test.utils import override_settings

from common.procs import pids_matching
from sandbox.executors.base import Attempt, Outcome
from sandbox.executors.local import LocalExecutor
from sandbox.scoring import Limits, ScoreResult, score

REWARD_LIMITS = Limits(timeout_s=4, memory_mb=256, output_bytes=8192)
HARNESS_TIMEOUT_S = 4.0
HARNESS_DISK_MB = 32
ATTACK_HARNESS_MEMORY_MB = 512
"""The harnesses' memory limit while attacked (LIGHTNING_HARNESS_MEMORY_MB): the memory bomb need not fill 4 GB."""


def tmp_mount_points() -> list[str]:
    """What the sandbox's private /tmp lists before user code writes there: nothing, unless the app's venv lies
    under the host's /tmp (a checkout in /tmp): its read-only bind then needs a mount point, an empty folder."""
    prefix = Path(sys.prefix).resolve()
    return [prefix.relative_to("/tmp").parts[0]] if prefix.is_relative_to("/tmp") else []


@dataclass(frozen=True)
class Attack:
    name: str
    code: str
    """Source of `def attack(ctx):` (imports inside it)."""
    endless: bool = False
    """It runs until a limit (the timeout, the disk limit) stops it: it reports only when it got through."""
    after: Callable[[dict], str | None] | None = None
    """Outside check once the attempt is over: what escaped, or None."""


def _read(key: str) -> str:
    return f'''
def attack(ctx):
    got = []
    for path in ctx["{key}"]:
        try:
            with open(path, "rb") as handle:
                got.append(f"{{path}}: {{handle.read(64)!r}}")
        except OSError:
            pass
    return "; ".join(got) or None
'''


CONNECT = '''
def attack(ctx):
    import socket
    got = []
    for host, port in ctx["{key}"]:
        try:
            socket.create_connection((host, port), timeout=1).close()
            got.append(f"{host}:{port}")
        except OSError:
            pass
    return ", ".join(got) or None
'''

UNIX = '''
def attack(ctx):
    import socket
    got = []
    for path in ctx["sockets"]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(1)
            sock.connect(path)
            got.append(path)
        except OSError:
            pass
        finally:
            sock.close()
    return ", ".join(got) or None
'''

WRITE = '''
def attack(ctx):
    got = []
    for path in ctx["outside"]:
        try:
            with open(path, "w") as handle:
                handle.write("pwned")
            got.append(path)
        except OSError:
            pass
    return None  # a write may land in the sandbox's own tmpfs: the verdict is the host's, taken after
'''

FORK_BOMB = '''
def attack(ctx):
    import os, time
    made = 0
    try:
        while made < 3000:
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            made += 1
    except OSError:
        return None
    return f"forked {made} processes"
'''

MEMORY_BOMB = '''
def attack(ctx):
    held, chunk = [], 64 << 20
    try:
        while len(held) * 64 < ctx["memory_mb"] + 512:  # past the sandbox's limit
            block = bytearray(chunk)
            block[::4096] = b"x" * (chunk // 4096)  # touch every page: the memory is really used
            held.append(block)
    except MemoryError:
        return None
    return f"held {len(held) * 64} MB"
'''

FILL_DISK = '''
def attack(ctx):
    import os, time
    written = 0
    try:
        for i in range(400):  # 400 MB, far past every limit, slowly enough for the workdir watcher to see it
            with open(f"fill-{i}.bin", "wb") as handle:
                handle.write(os.urandom(1 << 20))
            written += 1
            time.sleep(0.01)
    except OSError:
        return None
    return f"wrote {written} MB"
'''

BIG_FILE = '''
def attack(ctx):
    written = 0
    try:
        with open("big.bin", "wb") as handle:
            for _ in range(256):
                handle.write(b"x" * (1 << 20))
                handle.flush()
                written += 1
    except OSError:
        return None
    return f"wrote one file of {written} MB"
'''

LINGER = '''
def attack(ctx):
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # " + ctx["marker"]],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    time.sleep(600)
    return None
'''

UNMOUNT = '''
def attack(ctx):
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    got = []
    for path in ctx["hidden_dirs"]:
        if libc.umount2(path.encode(), 2) == 0 and os.listdir(path):
            got.append(path)
    if libc.unshare(0x10000000 | 0x00020000) == 0:  # CLONE_NEWUSER | CLONE_NEWNS: caps in a fresh namespace
        got.append("a new user namespace")
    return ", ".join(got) or None
'''


def _written_outside(ctx: dict) -> str | None:
    found = [path for path in ctx["outside"] if os.path.exists(path)]
    return ", ".join(found) or None


def _left_running(ctx: dict) -> str | None:
    deadline = time.monotonic() + 5
    while (left := pids_matching(ctx["marker"])) and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"processes {left} outlived the attempt" if left else None


ATTACKS: tuple[Attack, ...] = (
    Attack("read the secret key", _read("secret_key")),
    Attack("read the admin password", _read("admin_password")),
    Attack("read the SQLite database", _read("sqlite")),
    Attack("read a file planted in the data dir", _read("planted")),
    Attack("read another rollout's folder", _read("other_rollout")),
    Attack("read the source tree's settings file", _read("source")),
    Attack("reach Redis over TCP", CONNECT.replace("{key}", "redis")),
    Attack("reach PostgreSQL over TCP", CONNECT.replace("{key}", "postgres")),
    Attack("reach the web app", CONNECT.replace("{key}", "web")),
    Attack("reach any other listening port on 127.0.0.1", CONNECT.replace("{key}", "listening")),
    Attack("reach PostgreSQL and Redis over unix sockets", UNIX),
    Attack("unmount what hides the app / make a user namespace", UNMOUNT),
    Attack("write outside the workdir", WRITE, after=_written_outside),
    Attack("fork-bomb", FORK_BOMB, after=_left_running),
    Attack("exhaust memory (a memory bomb)", MEMORY_BOMB),
    Attack("fill the disk with many files", FILL_DISK, endless=True),
    Attack("fill the disk with one file", BIG_FILE),
    Attack("keep a child running after the timeout", LINGER, endless=True, after=_left_running),
)


# ---- the targets

def _listening() -> list[tuple[str, int]]:
    """(host, port) of every TCP socket listening on the host's loopback or all addresses."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                address, state = fields[1], fields[3]
                host, port = address.rsplit(":", 1)
                if state == "0A" and set(host) <= {"0", "1", "7", "F"}:  # listening on 0.0.0.0, ::, 127.0.0.1, ::1
                    found.add(("127.0.0.1", int(port, 16)))
    return sorted(found)


class _Web(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"ok": True, "path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def http_server() -> Iterator[int]:
    """A small HTTP server on 127.0.0.1 (the web app's stand-in, or a proxy's): its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Web)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _plant(path: Path, text: str, made: list[Path]) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        made.append(path)
    return path


@contextlib.contextmanager
def targets(tmp: Path) -> Iterator[dict[str, Any]]:
    """The attack context: secrets (planted where missing, removed after), a web app, a fake proxy, a rollout
    workdir under the runs dir beside another rollout's folder. Yields ctx plus "workdir" and "proxy_url"."""
    data, made = Path(settings.DATA_DIR), []
    tag = uuid.uuid4().hex[:10]
    run_dir = Path(settings.LIGHTNING_RUNS_DIR) / f"isolation-{tag}"
    workdir = run_dir / "rollouts" / "1"
    workdir.mkdir(parents=True)
    other = _plant(run_dir / "rollouts" / "2" / "output.json", '{"secret": "other rollout"}', made)
    planted = _plant(data / f"isolation-planted-{tag}", "planted secret", made)
    for name, text in (("secret_key", "stand-in secret key"), ("admin_password", "stand-in password"),
                       ("db.sqlite3", "SQLite format 3\0 stand-in")):
        _plant(data / name, text, made)
    redis = urlsplit(settings.REDIS_URL)
    db = settings.DATABASES["default"]
    sockets = [str(p) for p in (*Path("/var/run/postgresql").glob(".s.PGSQL.*"), *Path("/run/redis").glob("*.sock"),
                                *Path("/var/run/redis").glob("*.sock"), *data.glob("**/*.sock")) if p.exists()]
    sockets.append("/var/run/postgresql/.s.PGSQL.5432")
    outside = [Path(settings.BASE_DIR) / f"isolation-pwned-{tag}", data / f"isolation-pwned-{tag}",
               workdir.parent / f"isolation-pwned-{tag}", Path("/var/tmp") / f"isolation-pwned-{tag}",
               Path.home() / f"isolation-pwned-{tag}", tmp / f"isolation-pwned-{tag}",
               Path("/tmp") / f"isolation-pwned-{tag}"]
    try:
        with override_settings(LIGHTNING_HARNESS_MEMORY_MB=ATTACK_HARNESS_MEMORY_MB), http_server() as web, \
                http_server() as proxy:
            ctx = {
                "secret_key": [str(data / "secret_key")], "admin_password": [str(data / "admin_password")],
                "sqlite": [str(data / "db.sqlite3")], "planted": [str(planted)], "other_rollout": [str(other)],
                "source": [str(Path(settings.BASE_DIR) / "lightning_web" / "settings.py")],
                "redis": [[redis.hostname or "127.0.0.1", redis.port or 6379]],
                "postgres": [[db.get("HOST") or "127.0.0.1", int(db.get("PORT") or 5432)]],
                "web": [["127.0.0.1", web]],
                "listening": [[h, p] for h, p in _listening() if p != proxy],
                "sockets": sorted(set(sockets)), "outside": [str(p) for p in outside],
                "hidden_dirs": [str(data), str(settings.BASE_DIR), str(Path.home())],
                "marker": f"isolation-linger-{tag}",
                # The larger of the two sandboxes' memory limits: the bomb goes past both.
                "memory_mb": max(ATTACK_HARNESS_MEMORY_MB, REWARD_LIMITS.memory_mb),
                "workdir": str(workdir), "proxy_url": f"http://127.0.0.1:{proxy}/rollouts/1/v1",
            }
            yield ctx
    finally:
        for path in made:
            path.unlink(missing_ok=True)
        for path in outside:
            with contextlib.suppress(OSError):
                path.unlink()
        shutil.rmtree(run_dir, ignore_errors=True)


# ---- running them

@dataclass(frozen=True)
class Verdict:
    attack: str
    where: str  # reward | harness
    escaped: str | None
    """What got out (None: stopped)."""
    detail: str = ""


REWARD_WRAP = '''
def reward(task, outcome):
    try:
        got = attack(task)
    except Exception as exc:
        got = None
    return {"reward": 0.0, "escaped": got}
'''

HARNESS_WRAP = '''
import json, sys
ctx = json.load(open(sys.argv[1]))
try:
    got = attack(ctx)
except Exception as exc:
    got = None
json.dump({"escaped": got}, open(sys.argv[2], "w"))
'''


def run_reward(attack: Attack, ctx: dict) -> Verdict:
    result: ScoreResult = score(attack.code + REWARD_WRAP, ctx, {}, REWARD_LIMITS)
    escaped = result.detail.get("escaped") if result.ok else None
    if escaped is None and attack.after is not None:
        escaped = attack.after(ctx)
    return Verdict(attack.name, "reward", escaped, result.error or "ok")


def run_harness(attack: Attack, ctx: dict, script_dir: Path) -> Verdict:
    script = script_dir / f"attack-{uuid.uuid4().hex[:8]}.py"
    script.write_text(attack.code + HARNESS_WRAP)
    workdir = Path(ctx["workdir"])
    out = asyncio.run(LocalExecutor().run(harness_attempt(
        ["python3", str(script), "{task_file}", "{output_file}"], ctx, workdir)))
    escaped = out.outcome.get("escaped")
    if escaped is None and attack.after is not None:
        escaped = attack.after(ctx)
    for leftover in workdir.iterdir():  # the next attack starts from an empty workdir
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    return Verdict(attack.name, "harness", escaped, out.error or "ok")


def harness_attempt(command: list[str], ctx: dict, workdir: Path) -> Attempt:
    return Attempt(command=command, env={}, timeout_s=HARNESS_TIMEOUT_S, workdir=workdir, task_id="attack",
                   task=ctx, rollout_id="1", base_url=ctx["proxy_url"], api_key="key-1", disk_mb=HARNESS_DISK_MB)


BENIGN_REWARD = "def reward(task, outcome):\n    return 1.0\n"
BENIGN_HARNESS = "import json, sys\njson.dump({'fine': True}, open(sys.argv[2], 'w'))\n"


def still_works(ctx: dict, script_dir: Path) -> tuple[bool, bool]:
    """(a reward script scores, a harness runs) right after an attack."""
    scored = score(BENIGN_REWARD, {}, {}, REWARD_LIMITS)
    script = script_dir / "benign.py"
    script.write_text(BENIGN_HARNESS)
    out: Outcome = asyncio.run(LocalExecutor().run(harness_attempt(
        ["python3", str(script), "{task_file}", "{output_file}"], ctx, Path(ctx["workdir"]))))
    return scored.ok and scored.reward == 1.0, out.exit_code == 0 and out.outcome.get("fine") is True
